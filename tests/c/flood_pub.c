/* flood_pub: publish numbered messages to an sbus broker as fast as it takes them.
 *
 *   flood_pub ADDRESS COUNT KEY SIZES [FIRST [LINGER]]
 *
 * Connects a SOCK_SEQPACKET socket to ADDRESS (a filesystem path) and sends
 * COUNT packets "MSG KEY\0" + a 10-digit sequence number (FIRST, FIRST+1, ...)
 * padded with 'x' to the packet sizes listed in SIZES (comma-separated,
 * cycled). Sends block: a broker that stops reading stalls us. With LINGER=1
 * the socket stays open after the last send until stdin reaches EOF, so the
 * broker never sees a hang-up with data still unread. Prints the number of
 * packets sent; exits 0 when all went out, 2 on a send error.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_SIZES 16

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: flood_pub ADDRESS COUNT KEY SIZES [FIRST [LINGER]]\n");
        return 1;
    }
    const char *address = argv[1];
    unsigned long long count = strtoull(argv[2], NULL, 10);
    const char *key = argv[3];
    unsigned long long first = argc > 5 ? strtoull(argv[5], NULL, 10) : 0;
    int linger = argc > 6 ? atoi(argv[6]) : 0;

    size_t sizes[MAX_SIZES];
    int nsizes = 0;
    char *list = strdup(argv[4]);
    for (char *tok = strtok(list, ","); tok && nsizes < MAX_SIZES; tok = strtok(NULL, ","))
        sizes[nsizes++] = strtoul(tok, NULL, 10);
    free(list);

    size_t head = 4 + strlen(key) + 1;          /* "MSG " key NUL */
    size_t largest = head + 10;
    for (int i = 0; i < nsizes; i++) {
        if (sizes[i] < head + 10) {
            fprintf(stderr, "flood_pub: size %zu is below the minimum %zu\n", sizes[i], head + 10);
            return 1;
        }
        if (sizes[i] > largest)
            largest = sizes[i];
    }
    char *buf = malloc(largest);
    memcpy(buf, "MSG ", 4);
    memcpy(buf + 4, key, strlen(key) + 1);
    memset(buf + head + 10, 'x', largest - head - 10);

    int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    strncpy(sa.sun_path, address, sizeof sa.sun_path - 1);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        fprintf(stderr, "flood_pub: connect %s: %s\n", address, strerror(errno));
        return 1;
    }

    unsigned long long sent = 0;
    int rc = 0;
    char digits[11];
    for (unsigned long long i = 0; i < count; i++) {
        snprintf(digits, sizeof digits, "%010llu", first + i);
        memcpy(buf + head, digits, 10);
        size_t n = sizes[i % nsizes];
        ssize_t r;
        do {
            r = send(fd, buf, n, MSG_NOSIGNAL);
        } while (r < 0 && errno == EINTR);
        if (r < 0) {
            fprintf(stderr, "flood_pub: send #%llu: %s\n", i, strerror(errno));
            rc = 2;
            break;
        }
        sent++;
    }
    printf("%llu\n", sent);
    fflush(stdout);
    if (linger) {
        char c;
        while (read(0, &c, 1) > 0)
            ;
    }
    close(fd);
    return rc;
}
