/* A consumer of `sbus queue` written from docs/queues.md alone, with plain
 * send(2) and recv(2): queue_consumer SOCKET PATTERN COUNT. It takes COUNT
 * jobs, prints "KEY PAYLOAD DELIVERIES" for each, acknowledges each, says
 * bye and exits 0. (It takes less than a lease, so it does not renew.) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX 409600

static char buf[MAX + 1];

static void say(int fd, const char *packet, size_t len)
{
	if (send(fd, packet, len, 0) != (ssize_t)len) {
		perror("send");
		exit(1);
	}
}

static void publish(int fd, const char *key, const char *payload)
{
	static char packet[MAX];
	int len = snprintf(packet, sizeof(packet), "MSG %s%c%s", key, 0, payload);
	say(fd, packet, (size_t)len);
}

int main(int argc, char *argv[])
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	char inbox[256], hello[1024], key[512], token[64] = "", control[256] = "", ack[512];
	long want, done = 0;
	ssize_t n;
	int fd;

	if (argc != 4)
		return 2;
	want = atol(argv[3]);
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
	snprintf(inbox, sizeof(inbox), "%.200s/queue/c%ld/", buf + 19, (long)getpid());
	/* 2. SUB INBOX, 3. hello */
	n = snprintf(hello, sizeof(hello), "SUB %s", inbox);
	say(fd, hello, (size_t)n);
	snprintf(hello, sizeof(hello), "1 %s %s", inbox, argv[2]);
	publish(fd, "sbus/queue/hello", hello);
	while (done < want) {
		char *payload, *rest, *job_key;
		long tag, deliveries;

		n = recv(fd, buf, MAX, 0);
		if (n <= 0)
			return 1;
		buf[n] = 0;
		if (strncmp(buf, "MSG ", 4))
			continue;
		payload = buf + 4 + strlen(buf + 4) + 1;
		snprintf(key, sizeof(key), "%swelcome", inbox);
		if (!strcmp(buf + 4, key)) {
			/* 4. "TOKEN LEASE CONTROL" */
			if (sscanf(payload, "%63s %*s %255s", token, control) != 2)
				return 1;
			continue;
		}
		snprintf(key, sizeof(key), "%sjob", inbox);
		if (strcmp(buf + 4, key) || !*token)
			continue;
		/* 5. "TAG DELIVERIES KEY\0PAYLOAD" */
		tag = strtol(payload, &rest, 10);
		deliveries = strtol(rest + 1, &rest, 10);
		job_key = rest + 1;
		printf("%s %s %ld\n", job_key, job_key + strlen(job_key) + 1, deliveries);
		fflush(stdout);
		snprintf(ack, sizeof(ack), "ack %s %ld", token, tag);
		publish(fd, control, ack);
		done++;
	}
	/* 7. bye */
	snprintf(ack, sizeof(ack), "bye %s", token);
	publish(fd, control, ack);
	close(fd);
	return 0;
}
