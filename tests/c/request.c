/* An asker written from docs/requests.md alone, with plain send(2) and
 * recv(2): request SOCKET KEY BODY. It asks once, prints the reply's body
 * and a newline, and exits 0 for an OK reply, 1 for an ERR reply (its text
 * on stderr) or any failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX 409600

static char buf[MAX + 1];
static char packet[MAX];

static void say(int fd, const char *p, size_t len)
{
	if (send(fd, p, len, 0) != (ssize_t)len) {
		perror("send");
		exit(1);
	}
}

int main(int argc, char *argv[])
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	char reply_key[512];
	ssize_t n;
	int fd, len;

	if (argc != 4)
		return 2;
	fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
	strncpy(addr.sun_path, argv[1], sizeof(addr.sun_path) - 1);
	if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof(addr))) {
		perror("connect");
		return 1;
	}
	/* 1. whoami: "CMSG !/cred/whoami\0!/cred/G/U/P" */
	say(fd, "CMSG !/cred/whoami", 18);
	n = recv(fd, buf, MAX, 0);
	if (n <= 19 || strncmp(buf, "CMSG !/cred/whoami", 19))
		return 1;
	buf[n] = 0;
	/* 2. SUB the inbox, 3. MSG KEY\0REQ REPLYKEY\nBODY */
	len = snprintf(packet, sizeof(packet), "SUB %.200s/reply/c%ld/", buf + 19, (long)getpid());
	say(fd, packet, (size_t)len);
	snprintf(reply_key, sizeof(reply_key), "%.200s/reply/c%ld/1", buf + 19, (long)getpid());
	len = snprintf(packet, sizeof(packet), "MSG %s%cREQ %s\n%s", argv[2], 0, reply_key, argv[3]);
	say(fd, packet, (size_t)len);
	for (;;) {
		char *payload;

		n = recv(fd, buf, MAX, 0);
		if (n <= 0)
			return 1;
		buf[n] = 0;
		if (strncmp(buf, "MSG ", 4) || strcmp(buf + 4, reply_key))
			continue;
		payload = buf + 4 + strlen(buf + 4) + 1;
		if (!strncmp(payload, "OK\n", 3)) {
			printf("%s\n", payload + 3);
			return 0;
		}
		if (!strncmp(payload, "ERR\n", 4))
			fprintf(stderr, "%s\n", payload + 4);
		return 1;
	}
}
