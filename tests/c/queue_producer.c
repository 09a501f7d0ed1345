/* A producer of `sbus queue` jobs in batches, written from docs/queues.md
 * ("Producers' batches") alone, with plain send(2): queue_producer SOCKET
 * KEY PAYLOAD... It sends the PAYLOADs as jobs on KEY in one packet,
 * "MSG KEY/.sbus-jobs\0" then a record "SIZE PAYLOAD" for each, then asks
 * the broker whoami (answered once the batch was handled) and exits 0. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX 409600

static char packet[MAX];

int main(int argc, char *argv[])
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	size_t len;
	int fd, i;

	if (argc < 4)
		return 2;
	fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
	strncpy(addr.sun_path, argv[1], sizeof(addr.sun_path) - 1);
	if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof(addr))) {
		perror("connect");
		return 1;
	}
	len = (size_t)snprintf(packet, sizeof(packet), "MSG %s/.sbus-jobs", argv[2]) + 1;
	for (i = 3; i < argc; i++) {
		size_t size = strlen(argv[i]);
		int head = snprintf(packet + len, sizeof(packet) - len, "%zu ", size);

		if (head < 0 || len + (size_t)head + size > sizeof(packet))
			return 1;
		memcpy(packet + len + (size_t)head, argv[i], size);
		len += (size_t)head + size;
	}
	if (send(fd, packet, len, 0) != (ssize_t)len) {
		perror("send");
		return 1;
	}
	if (send(fd, "CMSG !/cred/whoami", 18, 0) != 18 || recv(fd, packet, MAX, 0) <= 0)
		return 1;
	close(fd);
	return 0;
}
