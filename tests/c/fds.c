/* Both sides of docs/fds.md written from the docs alone, with plain
 * sendmsg(2) and recvmsg(2):
 *
 *   fds give FDSOCKET RECEIVER NOTE TEXT
 *       puts TEXT in a sealed memfd, offers it to RECEIVER (!/cred/G/U/P)
 *       and prints the ticket;
 *   fds take BUS FDSOCKET
 *       prints its own !/cred/ address, waits on the bus for a notification,
 *       claims the ticket and prints "GIVER NOTE CONTENT" (the first fd's);
 *   fds wait FDSOCKET
 *       the same without the bus: WAIT for the next offer to this process.
 *
 * Exit 0 on success, 1 on any failure (an ERR answer's text on stderr). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX 409600

static char buf[MAX + 1];

static int connect_to(const char *path)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

	strncpy(addr.sun_path, path, sizeof(addr.sun_path) - 1);
	if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof(addr))) {
		perror(path);
		exit(1);
	}
	return fd;
}

/* One packet with n fds (n may be 0). */
static void send_fds(int sock, const char *p, size_t len, const int *fds, int n)
{
	union {
		struct cmsghdr h;
		char space[CMSG_SPACE(253 * sizeof(int))];
	} u;
	struct iovec iov = {(void *)p, len};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};

	if (n > 0) {
		m.msg_control = u.space;
		m.msg_controllen = CMSG_SPACE(n * sizeof(int));
		u.h.cmsg_level = SOL_SOCKET;
		u.h.cmsg_type = SCM_RIGHTS;
		u.h.cmsg_len = CMSG_LEN(n * sizeof(int));
		memcpy(CMSG_DATA(&u.h), fds, n * sizeof(int));
	}
	if (sendmsg(sock, &m, 0) != (ssize_t)len) {
		perror("sendmsg");
		exit(1);
	}
}

/* One packet into buf (NUL-terminated); the fds that came with it. */
static ssize_t recv_fds(int sock, int *fds, int *n)
{
	union {
		struct cmsghdr h;
		char space[CMSG_SPACE(253 * sizeof(int))];
	} u;
	struct iovec iov = {buf, MAX};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1,
			   .msg_control = u.space, .msg_controllen = sizeof(u.space)};
	struct cmsghdr *c;
	ssize_t len = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);

	*n = 0;
	if (len <= 0)
		return len;
	buf[len] = 0;
	for (c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			int k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);

			memcpy(fds + *n, CMSG_DATA(c), k * sizeof(int));
			*n += k;
		}
	return len;
}

static int give(char **argv)
{
	char packet[4352];
	int sock = connect_to(argv[0]), memfd, n, got[253];
	size_t len, text = strlen(argv[3]);

	memfd = memfd_create("payload", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (memfd < 0 || write(memfd, argv[3], text) != (ssize_t)text ||
	    fcntl(memfd, F_ADD_SEALS, F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE)) {
		perror("memfd");
		return 1;
	}
	/* OFFER !/cred/G/U/P \0 NOTE, the memfd as SCM_RIGHTS */
	len = (size_t)snprintf(packet, sizeof(packet), "OFFER %s%c%s", argv[1], 0, argv[2]);
	send_fds(sock, packet, len, &memfd, 1);
	if (recv_fds(sock, got, &n) <= 0)
		return 1;
	if (strncmp(buf, "TICKET ", 7)) {
		fprintf(stderr, "%s\n", buf);
		return 1;
	}
	printf("%s\n", buf + 7);
	return 0;
}

/* The answer FDS TICKET GIVER \0 NOTE with its fds: "GIVER NOTE CONTENT". */
static int print_fds(int sock)
{
	int fds[253], n;
	ssize_t len = recv_fds(sock, fds, &n);
	char *note;

	if (len <= 0 || strncmp(buf, "FDS ", 4) || n < 1) {
		fprintf(stderr, "%s\n", len > 0 ? buf : "no answer");
		return 1;
	}
	note = buf + strlen(buf) + 1;
	printf("%s %.*s ", buf + 4 + 33, (int)(buf + len - note), note);
	len = pread(fds[0], buf, MAX, 0);
	if (len < 0)
		return 1;
	printf("%.*s\n", (int)len, buf);
	return 0;
}

static int take(char **argv)
{
	char creds[256], inbox[300], claim[64], *ticket;
	int bus = connect_to(argv[0]), sock, fds[253], n;
	size_t inbox_len;
	ssize_t len;

	/* whoami: "CMSG !/cred/whoami\0!/cred/G/U/P" */
	send_fds(bus, "CMSG !/cred/whoami", 18, NULL, 0);
	len = recv_fds(bus, fds, &n);
	if (len <= 19 || strncmp(buf, "CMSG !/cred/whoami", 19))
		return 1;
	snprintf(creds, sizeof(creds), "%.200s", buf + 19);
	inbox_len = (size_t)snprintf(inbox, sizeof(inbox), "SUB %s/fds/", creds);
	send_fds(bus, inbox, inbox_len, NULL, 0);
	/* a whoami answered after the SUB: subscribed before anyone is told */
	send_fds(bus, "CMSG !/cred/whoami", 18, NULL, 0);
	if (recv_fds(bus, fds, &n) <= 0)
		return 1;
	printf("%s\n", creds);
	fflush(stdout);
	for (;;) {		/* MSG !/cred/G/U/P/fds/TICKET \0 N GIVER \0 NOTE */
		len = recv_fds(bus, fds, &n);
		if (len <= 0)
			return 1;
		if (!strncmp(buf, "MSG ", 4) && !strncmp(buf + 4, inbox + 4, inbox_len - 4))
			break;
	}
	ticket = buf + 4 + inbox_len - 4;
	snprintf(claim, sizeof(claim), "CLAIM %.32s", ticket);
	sock = connect_to(argv[1]);
	send_fds(sock, claim, strlen(claim), NULL, 0);
	return print_fds(sock);
}

/* The bus-less way: WAIT for the next offer to this very process. */
static int wait_offer(char **argv)
{
	int sock = connect_to(argv[0]);

	printf("!/cred/%ld/%ld/%ld\n", (long)getegid(), (long)geteuid(), (long)getpid());
	fflush(stdout);
	send_fds(sock, "WAIT", 4, NULL, 0);
	return print_fds(sock);
}

int main(int argc, char *argv[])
{
	if (argc == 6 && !strcmp(argv[1], "give"))
		return give(argv + 2);
	if (argc == 4 && !strcmp(argv[1], "take"))
		return take(argv + 2);
	if (argc == 3 && !strcmp(argv[1], "wait"))
		return wait_offer(argv + 2);
	fprintf(stderr, "usage: fds give FDSOCKET RECEIVER NOTE TEXT | fds take BUS FDSOCKET | fds wait FDSOCKET\n");
	return 2;
}
