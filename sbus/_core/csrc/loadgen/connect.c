/* Talking to the broker: connecting, sending, and proving that it has
 * processed what a set of clients sent (sync_clients). */
#include "loadgen.h"

void
set_timeout(int fd, double seconds)
{
	struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (time_t)seconds) * 1e6)};
	if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)))
		die("setsockopt SO_RCVTIMEO:");
}

static const char ABSTRACT_PREFIX[] = "/dev/unix/abstract/";

/* An abstract name as sbus spells it: the whole sun_path in hex, from its NUL. */
static void
abstract_name(struct sockaddr_un *sa, const char *hex)
{
	size_t n = strlen(hex);
	if (n % 2 || n / 2 > sizeof(sa->sun_path) || strncmp(hex, "00", 2))
		die("bad abstract address: %s", address);
	for (size_t i = 0; i < n / 2; i++) {
		unsigned byte;
		if (sscanf(hex + 2 * i, "%2x", &byte) != 1)
			die("bad abstract address: %s", address);
		sa->sun_path[i] = (char)byte;
	}
}

int
connect_bus(void)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (!strncmp(address, ABSTRACT_PREFIX, sizeof(ABSTRACT_PREFIX) - 1))
		abstract_name(&sa, address + sizeof(ABSTRACT_PREFIX) - 1);
	else if (strlen(address) >= sizeof(sa.sun_path))
		die("address too long: %s", address);
	else
		strcpy(sa.sun_path, address);
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0)
		die("socket:");
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)))
		die("connect %s:", address);
	set_timeout(fd, 10.0);
	return fd;
}

void
send_packet(int fd, const void *buf, size_t len)
{
	ssize_t r;
	do
		r = send(fd, buf, len, 0);
	while (r < 0 && errno == EINTR);
	if (r < 0)
		die("send:");
}

/* Sends "VERB arg" (without a NUL), or "MSG arg\0" when verb is MSG. */
void
send_cmd(int fd, const char *verb, const char *arg)
{
	char buf[512];
	int n = snprintf(buf, sizeof(buf), "%s %s", verb, arg);
	if (!strcmp(verb, "MSG"))
		buf[n++] = '\0';
	send_packet(fd, buf, n);
}

static void
sync_tag(char *buf, size_t size, int n)
{
	snprintf(buf, size, "sy%dx%d/s", (int)getpid(), n);
}

/* Proves that the broker has processed everything these clients sent so far:
 * each subscribes to a key of its own, publishes on it, waits for the echo and
 * unsubscribes again.  Done in waves so only a few sync patterns exist at once. */
void
sync_clients(const int *fds, int n, int tag_base)
{
	char tag[64], want[80], buf[256];
	for (int w = 0; w < n; w += SYNC_WAVE) {
		int end = w + SYNC_WAVE < n ? w + SYNC_WAVE : n;
		for (int i = w; i < end; i++) {
			sync_tag(tag, sizeof(tag), tag_base + i);
			send_cmd(fds[i], "SUB", tag);
			send_cmd(fds[i], "MSG", tag);
		}
		for (int i = w; i < end; i++) {
			sync_tag(tag, sizeof(tag), tag_base + i);
			int wl = snprintf(want, sizeof(want), "MSG %s", tag) + 1;
			for (;;) {
				ssize_t r = recv(fds[i], buf, sizeof(buf), 0);
				if (r < 0 && errno == EINTR)
					continue;
				if (r < 0)
					die("waiting for the broker to echo %s:", tag);
				if (r == 0)
					die("broker closed the connection during setup");
				if (r == wl && !memcmp(buf, want, wl))
					break;
			}
			send_cmd(fds[i], "UNSUB", tag);
		}
	}
}

void
raise_fd_limit(long need)
{
	struct rlimit rl;
	getrlimit(RLIMIT_NOFILE, &rl);
	if (rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	if ((long)rl.rlim_cur < need)
		die("need %ld file descriptors, RLIMIT_NOFILE allows %ld", need, (long)rl.rlim_cur);
}

/* The packet "MSG key\0" + payload, with seq 0 and 'x' filler. */
size_t
build_packet(char *buf, const char *key)
{
	size_t h = (size_t)sprintf(buf, "MSG %s", key) + 1;
	memset(buf + h, 'x', payload_size);
	memset(buf + h, 0, payload_size < SEQ_BYTES ? payload_size : SEQ_BYTES);
	return h + payload_size;
}

int *
hold_idle_clients(int n, int pats)
{
	int *fds = calloc(n ? n : 1, sizeof(int));
	char pat[128];
	for (int c = 0; c < n; c++) {
		fds[c] = connect_bus();
		for (int j = 0; j < pats; j++) {
			if (wild_idle)	/* '*' in the first segment: no first-segment shortcut */
				switch (j % 3) {
				case 0: snprintf(pat, sizeof(pat), "*/i%dx%d", c, j); break;
				case 1: snprintf(pat, sizeof(pat), "*/*/i%dx%d", c, j); break;
				default: snprintf(pat, sizeof(pat), "*/i%dx%d/", c, j); break;
				}
			else
				switch (j % 3) {
				case 0: snprintf(pat, sizeof(pat), "i%dx%d", c, j); break;
				case 1: snprintf(pat, sizeof(pat), "i%dx%d/*", c, j); break;
				default: snprintf(pat, sizeof(pat), "i%dx%d/a/", c, j); break;
				}
			send_cmd(fds[c], "SUB", pat);
		}
	}
	sync_clients(fds, n, 0);
	return fds;
}
