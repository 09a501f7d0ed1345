/* A client written against the original libsbus API that stays connected
 * through live upgrades of sbusd: it subscribes to "c/", says "ready" on
 * stdout, then receives "c/0", "c/1", ... in order until "c/end", failing on
 * EOF, an error, or a message out of order.
 *
 *   upgrade_client ADDRESS      a socket path
 *
 * Prints "upgrade_client: ok N" (N messages before c/end) on success.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "libsbus_compat.h"

static char buf[LIBSBUS_BUFFER_SIZE];

int main(int argc, char **argv)
{
	struct sockaddr_un sa;
	union libsbus_packet packet;
	char want[64];
	long n = 0;
	int fd;

	if (argc != 2 || strlen(argv[1]) >= sizeof(sa.sun_path)) {
		fprintf(stderr, "usage: upgrade_client ADDRESS\n");
		return 2;
	}
	memset(&sa, 0, sizeof(sa));
	sa.sun_family = AF_UNIX;
	strcpy(sa.sun_path, argv[1]);
	fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		printf("upgrade_client: connect: %s\n", strerror(errno));
		return 1;
	}
	if (libsbus_subscribe(fd, "c/", 0, buf) < 0) {
		printf("upgrade_client: subscribe: %s\n", strerror(errno));
		return 1;
	}
	printf("ready\n");
	fflush(stdout);
	for (;;) {
		if (libsbus_receive(fd, 0, buf, &packet) < 0) {
			printf("upgrade_client: receive after %ld: %s\n", n, strerror(errno));
			return 1;
		}
		if (packet.type != LIBSBUS_MESSAGE)
			continue;
		if (!strcmp(packet.message.key, "c/end"))
			break;
		snprintf(want, sizeof(want), "c/%ld", n);
		if (strcmp(packet.message.key, want)) {
			printf("upgrade_client: got %s, wanted %s\n", packet.message.key, want);
			return 1;
		}
		n++;
	}
	printf("upgrade_client: ok %ld\n", n);
	return 0;
}
