/* hold: many connected clients, then many patterns, for the caller to
 * measure the broker's memory at each phase. */
#include "loadgen.h"

static void
wait_line(void)
{
	char line[64];
	if (!fgets(line, sizeof(line), stdin))
		exit(0);
}

int
hold(void)
{
	raise_fd_limit(n_clients + 64);
	double t0 = now();
	int *fds = hold_idle_clients(n_clients, 0);
	printf("{\"phase\":\"connected\",\"clients\":%d,\"seconds\":%.3f}\n", n_clients, now() - t0);
	fflush(stdout);
	wait_line();
	if (n_pats > 0) {
		char pat[128];
		t0 = now();
		for (int k = 0; k < n_pats; k++) {
			int c = k % n_clients;
			/* distinct and mixed in shape: literal, wildcard, trailing '/' */
			switch (k % 4) {
			case 0: snprintf(pat, sizeof(pat), "svc%d/node%d/cpu", c, k); break;
			case 1: snprintf(pat, sizeof(pat), "svc%d/*/evt%d", c, k); break;
			case 2: snprintf(pat, sizeof(pat), "svc%d/node%d/", c, k); break;
			default: snprintf(pat, sizeof(pat), "log%d/*/x%d/*", k % 97, k); break;
			}
			send_cmd(fds[c], "SUB", pat);
		}
		sync_clients(fds, n_clients, 5000000);
		printf("{\"phase\":\"subscribed\",\"patterns\":%d,\"seconds\":%.3f}\n", n_pats, now() - t0);
		fflush(stdout);
	}
	while (fgetc(stdin) != EOF)
		;
	return 0;
}
