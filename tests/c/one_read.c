/* A launcher that reads sbusd's stdout ONCE, as the original sbusd's own
 * test suite (and many C launchers) do: fork/exec sbusd -f -a ADDRESS with
 * stdout on a pipe, one read(2) at once, then connect to what it said.
 *
 *   one_read SBUSD RUNS abstract      sbusd -f -a /dev/unix/abstract: the one
 *                                     read returns the whole address line,
 *                                     newline included
 *   one_read SBUSD RUNS PATH          sbusd -f -a PATH: the one read returns
 *                                     EOF (nothing printed), and PATH listens
 *
 * Each run ends sbusd with SIGTERM and wants exit status 0. Prints
 * "one_read: ok" after RUNS good runs; otherwise says which run failed how.
 */
#include <errno.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <fcntl.h>

#define PREFIX "/dev/unix/abstract/"
#define HEX_DIGITS (2 * sizeof(((struct sockaddr_un *)0)->sun_path))

static int fail(int run, const char *what, const char *got, ssize_t n)
{
	printf("one_read: run %d: %s (read returned %zd: %.*s)\n", run, what, n,
	       n > 0 ? (int)n : 0, got ? got : "");
	return 1;
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	return -1;
}

/* Connect to the address line (without its newline); 0 on success. */
static int try_connect(const char *addr, size_t len)
{
	struct sockaddr_un sa;
	socklen_t salen;
	size_t i;
	int fd, r;

	memset(&sa, 0, sizeof(sa));
	sa.sun_family = AF_UNIX;
	if (len > strlen(PREFIX) && !strncmp(addr, PREFIX, strlen(PREFIX))) {
		addr += strlen(PREFIX);
		len -= strlen(PREFIX);
		if (len != HEX_DIGITS)
			return -1;
		for (i = 0; i < len / 2; i++) {
			int hi = hexval(addr[2 * i]), lo = hexval(addr[2 * i + 1]);
			if (hi < 0 || lo < 0)
				return -1;
			sa.sun_path[i] = (char)(hi * 16 + lo);
		}
		salen = sizeof(sa);
	} else {
		if (len >= sizeof(sa.sun_path))
			return -1;
		memcpy(sa.sun_path, addr, len);
		salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + 1);
	}
	fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
	if (fd < 0)
		return -1;
	r = connect(fd, (struct sockaddr *)&sa, salen);
	close(fd);
	return r;
}

static int one_run(int run, const char *sbusd, const char *where)
{
	int abstract = !strcmp(where, "abstract");
	const char *address = abstract ? "/dev/unix/abstract" : where;
	char buf[4096];
	int fds[2], status, devnull;
	ssize_t n;
	pid_t pid;

	if (pipe(fds) < 0)
		return fail(run, "pipe", NULL, -1);
	pid = fork();
	if (pid < 0)
		return fail(run, "fork", NULL, -1);
	if (!pid) {
		close(fds[0]);
		dup2(fds[1], STDOUT_FILENO);
		close(fds[1]);
		devnull = open("/dev/null", O_WRONLY);
		dup2(devnull, STDERR_FILENO);   /* its log records: not ours to judge */
		execl(sbusd, sbusd, "-f", "-a", address, "--log-level", "warning", (char *)NULL);
		_exit(127);
	}
	close(fds[1]);
	do
		n = read(fds[0], buf, sizeof(buf));
	while (n < 0 && errno == EINTR);
	close(fds[0]);
	if (abstract) {
		if (n <= 0 || buf[n - 1] != '\n')
			return kill(pid, SIGKILL), fail(run, "no whole line in one read", buf, n);
		if (try_connect(buf, (size_t)n - 1) < 0)
			return kill(pid, SIGKILL), fail(run, "cannot connect to the line", buf, n);
	} else {
		if (n != 0)
			return kill(pid, SIGKILL), fail(run, "printed something for a path", buf, n);
		if (try_connect(where, strlen(where)) < 0)
			return kill(pid, SIGKILL), fail(run, "path not listening at EOF", buf, n);
	}
	kill(pid, SIGTERM);
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status))
		return fail(run, "sbusd did not exit 0 on SIGTERM", NULL, 0);
	return 0;
}

int main(int argc, char *argv[])
{
	int runs, i;

	if (argc != 4) {
		fprintf(stderr, "usage: one_read SBUSD RUNS abstract|PATH\n");
		return 2;
	}
	runs = atoi(argv[2]);
	for (i = 1; i <= runs; i++)
		if (one_run(i, argv[1], argv[3]))
			return 1;
	printf("one_read: ok\n");
	return 0;
}
