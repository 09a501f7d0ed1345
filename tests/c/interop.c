/* Interoperability check: a C client written against the original libsbus
 * API shape (libsbus_compat.h) drives a real sbusd, started the way the
 * original C test suite started it.
 *
 * usage: interop SBUSD abstract        sbusd -fa/dev/unix/abstract; SIGINT ends it
 *        interop SBUSD abstract -c     sbusd -cfa/dev/unix/abstract; closing ends it
 *        interop SBUSD path PATH       sbusd -fa PATH -cr; closing ends it
 *
 * Prints "interop: ok" and exits 0 if everything behaved; otherwise says
 * what did not on stderr and exits 1 (or dies of SIGALRM if sbusd hangs).
 */
#include "libsbus_compat.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define ABSTRACT_PREFIX "/dev/unix/abstract/"
#define MESSAGES 100

static pid_t sbusd_pid = -1;

static void
fail(const char *what)
{
	fprintf(stderr, "interop: %s\n", what);
	if (sbusd_pid > 0)
		kill(sbusd_pid, SIGKILL);
	exit(1);
}

static void
fail_errno(const char *what)
{
	char text[256];
	snprintf(text, sizeof(text), "%s: %s", what, strerror(errno));
	fail(text);
}

static int
hexval(int c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* Start sbusd with stdout on a pipe; return everything it printed before
 * closing stdout (its readiness signal). alarm(1): start-up must be quick. */
static size_t
start_sbusd(char *const argv[], char *out, size_t size)
{
	int fds[2];
	size_t got = 0;
	ssize_t r;
	if (pipe(fds))
		fail_errno("pipe");
	sbusd_pid = fork();
	if (sbusd_pid < 0)
		fail_errno("fork");
	if (!sbusd_pid) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);   /* never outlive a failed test */
		close(fds[0]);
		if (dup2(fds[1], STDOUT_FILENO) < 0)
			_exit(127);
		close(fds[1]);
		execv(argv[0], argv);
		_exit(127);
	}
	close(fds[1]);
	alarm(1);
	while ((r = read(fds[0], &out[got], size - 1 - got)) != 0) {
		if (r < 0) {
			if (errno == EINTR)
				continue;
			fail_errno("read sbusd's stdout");
		}
		got += (size_t)r;
		if (got == size - 1)
			fail("sbusd printed too much");
	}
	alarm(0);
	close(fds[0]);
	out[got] = '\0';
	return got;
}

static void
expect_exit_0(void)
{
	int status;
	alarm(5);
	if (waitpid(sbusd_pid, &status, 0) != sbusd_pid)
		fail_errno("waitpid");
	alarm(0);
	sbusd_pid = -1;
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		char text[64];
		snprintf(text, sizeof(text), "sbusd ended with wait status %#x, not exit 0", status);
		fail(text);
	}
}

int
main(int argc, char *argv[])
{
	static char buf[LIBSBUS_BUFFER_SIZE];
	char out[1024], key[64], payload[64], expected[128], cred[128];
	char *sbusd_argv[5];
	struct sockaddr_un addr;
	union libsbus_packet packet;
	int fd, i, auto_close = 0;
	size_t n, j, plen;
	ssize_t r;

	if (argc < 3)
		fail("usage: interop SBUSD abstract [-c] | interop SBUSD path PATH");
	memset(&addr, 0, sizeof(addr));
	addr.sun_family = AF_UNIX;
	sbusd_argv[0] = argv[1];
	if (!strcmp(argv[2], "abstract")) {
		auto_close = argc > 3 && !strcmp(argv[3], "-c");
		sbusd_argv[1] = auto_close ? "-cfa/dev/unix/abstract" : "-fa/dev/unix/abstract";
		sbusd_argv[2] = NULL;
		n = start_sbusd(sbusd_argv, out, sizeof(out));
		/* "/dev/unix/abstract/" + hex of the whole sun_path + "\n" */
		if (n != strlen(ABSTRACT_PREFIX) + 2 * sizeof(addr.sun_path) + 1 ||
		    strncmp(out, ABSTRACT_PREFIX, strlen(ABSTRACT_PREFIX)) || out[n - 1] != '\n')
			fail("sbusd did not print /dev/unix/abstract/<216 hex digits>\\n");
		for (j = 0; j < sizeof(addr.sun_path); j++) {
			const char *h = &out[strlen(ABSTRACT_PREFIX) + 2 * j];
			if (hexval(h[0]) < 0 || hexval(h[1]) < 0)
				fail("non-hex digit in the printed address");
			addr.sun_path[j] = (char)(hexval(h[0]) << 4 | hexval(h[1]));
		}
		if (addr.sun_path[0])
			fail("the printed address is not abstract (first byte not NUL)");
	} else if (!strcmp(argv[2], "path") && argc > 3) {
		auto_close = 1;
		if (strlen(argv[3]) >= sizeof(addr.sun_path))
			fail("path too long");
		strcpy(addr.sun_path, argv[3]);
		sbusd_argv[1] = "-fa";
		sbusd_argv[2] = argv[3];
		sbusd_argv[3] = "-cr";
		sbusd_argv[4] = NULL;
		if (start_sbusd(sbusd_argv, out, sizeof(out)))
			fail("sbusd printed something for a filesystem address");
	} else {
		fail("unknown mode");
	}

	fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
	if (fd < 0)
		fail_errno("socket");
	if (connect(fd, (const struct sockaddr *)&addr, sizeof(addr)))
		fail_errno("connect");

	if (libsbus_subscribe(fd, "test/", 0, buf))
		fail_errno("libsbus_subscribe test/");
	if (libsbus_subscribe(fd, "discard", 0, buf))
		fail_errno("libsbus_subscribe discard");
	if (libsbus_unsubscribe(fd, "discard", 0, buf))
		fail_errno("libsbus_unsubscribe discard");
	if (libsbus_publish(fd, "discard", "must not arrive", 15, 0, buf))
		fail_errno("libsbus_publish discard");

	/* A control message: its reply comes after anything "discard" produced. */
	if (send(fd, "CMSG !/cred/whoami", 18, 0) != 18)
		fail_errno("send CMSG !/cred/whoami");
	if (libsbus_receive(fd, 0, buf, &packet) < 0)
		fail_errno("libsbus_receive (whoami)");
	if (packet.type != LIBSBUS_CONTROL_MESSAGE || strcmp(packet.message.key, "!/cred/whoami"))
		fail("expected the !/cred/whoami reply first (did \"discard\" arrive?)");
	snprintf(cred, sizeof(cred), "!/cred/%u/%u/%u",
	         (unsigned)getgid(), (unsigned)getuid(), (unsigned)getpid());
	if (packet.message.n != strlen(cred) || memcmp(packet.message.msg, cred, strlen(cred)))
		fail("whoami reply does not carry our gid/uid/pid");

	for (i = 0; i < MESSAGES; i++) {
		snprintf(key, sizeof(key), "test/%i", i);
		plen = (size_t)snprintf(payload, sizeof(payload), "payload %i", i);
		payload[plen++] = '\0';    /* binary-safe: a NUL inside the payload */
		payload[plen++] = 'z';
		if (libsbus_publish(fd, key, payload, plen, 0, buf))
			fail_errno("libsbus_publish test/N");
	}
	for (i = 0; i < MESSAGES; i++) {
		snprintf(key, sizeof(key), "test/%i", i);
		plen = (size_t)snprintf(payload, sizeof(payload), "payload %i", i);
		payload[plen++] = '\0';
		payload[plen++] = 'z';
		alarm(5);
		r = libsbus_receive(fd, 0, buf, &packet);
		alarm(0);
		if (r < 0)
			fail_errno("libsbus_receive");
		if (packet.type != LIBSBUS_MESSAGE || strcmp(packet.message.key, key) ||
		    packet.message.n != plen || memcmp(packet.message.msg, payload, plen)) {
			snprintf(expected, sizeof(expected), "message %i: wrong packet (expected key %s)", i, key);
			fail(expected);
		}
	}
	if (libsbus_receive(fd, MSG_DONTWAIT, buf, &packet) >= 0)
		fail("an extra packet arrived after the 100 messages");
	if (errno != EAGAIN && errno != EWOULDBLOCK)
		fail_errno("MSG_DONTWAIT receive failed, but not with EAGAIN");

	if (auto_close) {
		close(fd);          /* the last client leaves: -c ends sbusd */
		expect_exit_0();
	} else {
		if (kill(sbusd_pid, SIGINT))
			fail_errno("kill SIGINT");
		expect_exit_0();
		close(fd);
	}
	if (!strcmp(argv[2], "path") && access(argv[3], F_OK) == 0)
		fail("sbusd left its socket file behind");
	printf("interop: ok\n");
	return 0;
}
