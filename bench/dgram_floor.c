/* The kernel's floor for one sbus hop on this machine: CPU per packet of
 * sendmmsg(2) and recvmmsg(2) on an AF_UNIX SOCK_SEQPACKET pair (the sockets
 * sbusd and its clients use), full batches, no poll, no user-space work.
 *
 *     dgram_floor [COUNT] [SIZE]
 *
 * A child receives 64 packets per recvmmsg while the parent sends 256 per
 * sendmmsg; each prints its CPU per packet, and the parent one JSON line:
 * {"packets": N, "size": S, "send_us": X, "send_sys_us": X, "recv_us": Y, ...}.
 * bench/bench_bridge.py runs it beside its rows: every sbus hop of a bridged
 * message pays at least send_us + recv_us, whatever the processes do.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define SEND_BATCH 256
#define RECV_BATCH 64

static void cpu(double *total, double *sys)
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    *sys = r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
    *total = r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + *sys;
}

int main(int argc, char **argv)
{
    long count = argc > 1 ? atol(argv[1]) : 1000000;
    int size = argc > 2 ? atoi(argv[2]) : 78;
    int sv[2], pipefd[2], status;
    double t, s;
    if (count < 1 || size < 1 || socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) < 0 || pipe(pipefd) < 0) {
        perror("dgram_floor");
        return 2;
    }
    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        return 2;
    }
    if (child == 0) {
        char *area = malloc((size_t)RECV_BATCH * size);
        struct iovec iov[RECV_BATCH];
        struct mmsghdr h[RECV_BATCH];
        long got = 0, calls = 0;
        char line[128];
        close(sv[0]);
        memset(h, 0, sizeof h);
        for (int i = 0; i < RECV_BATCH; i++) {
            iov[i].iov_base = area + (size_t)i * size;
            iov[i].iov_len = size;
            h[i].msg_hdr.msg_iov = &iov[i];
            h[i].msg_hdr.msg_iovlen = 1;
        }
        while (got < count) {
            /* Blocking for whole batches (the floor), and for no more than
             * are still to come: recvmmsg(2) without MSG_WAITFORONE waits
             * until it has them all. */
            int want = count - got < RECV_BATCH ? (int)(count - got) : RECV_BATCH;
            int n = recvmmsg(sv[1], h, want, 0, NULL);
            if (n <= 0)
                break;
            got += n;
            calls++;
        }
        cpu(&t, &s);
        snprintf(line, sizeof line, "%.4f %.4f %.1f %ld", t * 1e6 / count, s * 1e6 / count,
                 calls ? (double)got / calls : 0.0, got);
        if (write(pipefd[1], line, strlen(line) + 1) < 0)
            return 1;
        return got == count ? 0 : 1;
    }
    close(sv[1]);
    char *buf = calloc(1, size);
    struct iovec iov[SEND_BATCH];
    struct mmsghdr h[SEND_BATCH];
    long sent = 0;
    memset(h, 0, sizeof h);
    for (int i = 0; i < SEND_BATCH; i++) {
        iov[i].iov_base = buf;
        iov[i].iov_len = size;
        h[i].msg_hdr.msg_iov = &iov[i];
        h[i].msg_hdr.msg_iovlen = 1;
    }
    while (sent < count) {
        int n = sendmmsg(sv[0], h, count - sent < SEND_BATCH ? count - sent : SEND_BATCH, 0);
        if (n <= 0) {
            perror("sendmmsg");
            return 1;
        }
        sent += n;
    }
    cpu(&t, &s);
    char line[128] = "";
    if (read(pipefd[0], line, sizeof line - 1) < 0 || waitpid(child, &status, 0) < 0
            || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "dgram_floor: the receiver failed\n");
        return 1;
    }
    double rt, rs, per_call;
    long got;
    if (sscanf(line, "%lf %lf %lf %ld", &rt, &rs, &per_call, &got) != 4)
        return 1;
    printf("{\"packets\": %ld, \"size\": %d, \"send_us\": %.4f, \"send_sys_us\": %.4f, "
           "\"recv_us\": %.4f, \"recv_sys_us\": %.4f, \"recv_per_call\": %.1f}\n",
           count, size, t * 1e6 / count, s * 1e6 / count, rt, rs, per_call);
    return 0;
}
