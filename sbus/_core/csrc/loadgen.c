/*
 * loadgen: drives a broker that speaks the sbus protocol (sbusd, or
 * bench/relay) and prints one line of JSON on stdout.  The one load generator
 * of `sbus bench` and `make bench`: compiled into the package as
 * sbus._core.loadgen (run with `python -m sbus.cli.loadgen`), or on its own with
 * -DLOADGEN_STANDALONE.
 *
 *   loadgen flood   -a ADDRESS [-s SIZE] [-n SUBS] [-i IDLE] [-p PATS] [-W] [-S SLOW]
 *                   [-d SECONDS] [-m COUNT] [-w WINDOW] [-P SERVER_PID]
 *   loadgen manypubs -a ADDRESS [-s SIZE] [-N PUBS] [-G PROCS] [-r RATE] [-n SUBS]
 *                   [-d SECONDS] [-m COUNT] [-w WINDOW] [-P SERVER_PID]
 *   loadgen latency -a ADDRESS [-s SIZE] [-d SECONDS] [-m COUNT] [-P SERVER_PID]
 *   loadgen hold    -a PATH [-c CLIENTS] [-p PATS]
 *   loadgen wake    [-s SIZE] [-d SECONDS] [-C CPU]
 *
 * flood: one publisher (this process) and SUBS subscriber processes.  The
 * publisher keeps at most WINDOW messages in flight toward the slowest
 * subscriber; subscribers publish their progress in shared memory and wake a
 * sleeping publisher through a futex, so nobody spins.  Every payload carries
 * a sequence number; subscribers count lost and out-of-order messages.  IDLE
 * extra connections each hold PATS patterns that never match (manysubs); with
 * -W every one of them has '*' as its first segment (manywild).  SLOW
 * subscribers ask for `blocking/soft/discard` and then never read; they are
 * left out of the flow control and of the figures.
 *
 * manypubs: PUBS publisher connections spread over PROCS processes, and SUBS
 * subscriber processes in `blocking/hard/block` mode (nothing is dropped).
 * Each publisher has its own sequence numbers; the payload carries the
 * sequence number, the publisher's index and the time it was sent, and
 * subscribers count loss and order per publisher and time each delivery.
 * Without -r every process sends one message on each of its connections in
 * turn as fast as the window allows (saturation); with -r RATE the
 * publishers together offer RATE messages per second, spread evenly, and no
 * window applies: the latency shows whether the broker keeps up.
 *
 * -m COUNT ends a flood after COUNT messages and a latency run after COUNT
 * round trips (after the warm-up), whichever of it and -d comes first; with
 * -m and no -d only the count ends it.  ADDRESS is a socket path or
 * /dev/unix/abstract/HEX (an abstract name, HEX beginning with 00).
 *
 * latency: a pinger (this process) and an echo process; one message in flight;
 * the pinger times each round trip (ping -> broker -> echo -> broker -> pong)
 * with blocking receives.
 *
 * wake: no broker.  Two processes bounce one packet over a socketpair, the
 * echo process pinned to CPU (default: where this one runs); prints the round
 * trip percentiles.  Across cores this is the machine's floor for waking a
 * sleeping process on the other core twice: an echo through a broker on the
 * other core crosses four times.
 *
 * hold: connects CLIENTS clients, proves each is served with a round trip,
 * prints {"phase":"connected"}, waits for a line on stdin, subscribes PATS
 * distinct patterns spread over the clients, prints {"phase":"subscribed"}
 * and exits at end of input.  The caller measures the broker's memory.
 *
 * Keys and patterns differ in their first segment wherever a delivery must
 * not happen, so the first-segment-only relay routes them correctly too.
 */
#ifndef _GNU_SOURCE	/* Python.h defines it when this is built into the package */
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <sched.h>
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum {
	BATCH = 64,
	MAX_SUBS = 512,
	MAX_PUBS = 4096,
	MAX_PUB_PROCS = 64,
	PUB_HEADER = 20,	/* manypubs payload: seq (8), publisher (4), sent at ns (8) */
	LAT_SAMPLES = 1 << 22,
	SYNC_WAVE = 100,
	SEQ_BYTES = 8,
};

static const char BENCH_KEY[] = "bench/k";
static const char PING_KEY[] = "ping/lat";
static const char PONG_KEY[] = "pong/lat";

struct sub_slot {
	_Atomic uint64_t next;	/* next sequence number expected: flow-control progress */
	uint64_t received, lost, reordered, bad;
	uint64_t tail;		/* of lost: never arrived within a second of the end */
	double t_last;		/* CLOCK_MONOTONIC seconds of the last receipt */
	int eof, finished;
	double p50_us, p99_us, max_us;	/* manypubs: publish-to-delivery latency */
} __attribute__((aligned(64)));

struct shared {
	_Atomic uint64_t sent;
	_Atomic uint64_t total;
	_Atomic int done;	/* total is final */
	_Atomic int finish;	/* everyone may exit now */
	_Atomic int ready;
	_Atomic uint32_t pub_waiting __attribute__((aligned(64)));
	_Atomic uint32_t wake;
	_Atomic int go;		/* manypubs: every client is connected; publishers start */
	_Atomic int stalled;
	double t0;		/* manypubs: when go was given */
	struct sub_slot sub[MAX_SUBS];
	uint64_t pub_sent[MAX_PUBS];	/* manypubs: messages each publisher sent, final at done */
};

static const char *address = NULL;
static size_t payload_size = 64;
static int n_pubs = 256, n_pub_procs = 1;
static double offered_rate = 0;	/* manypubs -r: messages/s over all publishers; 0: saturation */
static int n_subs = 1, n_idle = 0, n_pats = 10, n_slow = 0, n_clients = 1, wild_idle = 0;
static double duration = 2.0;
static uint64_t max_count = 0;	/* -m: 0 means no limit */
static uint64_t window = 256;
static long server_pid = 0;
static int echo_cpu = -1;
static struct shared *sh;

static void
die(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "loadgen[%d]: ", getpid());
	vfprintf(stderr, fmt, ap);
	if (fmt[0] && fmt[strlen(fmt) - 1] == ':')
		fprintf(stderr, " %s", strerror(errno));
	fputc('\n', stderr);
	va_end(ap);
	if (sh)
		atomic_store(&sh->finish, 1);
	exit(1);
}

static double
now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static long
futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *timeout)
{
	return syscall(SYS_futex, (uint32_t *)addr, op, val, timeout, NULL, 0);
}

/* CPU time of every thread of the server, in seconds, or -1.  schedstat is in
 * nanoseconds, far finer than the clock ticks of /proc/PID/stat. */
static double
server_cpu(void)
{
	char path[64], line[256];
	double total = 0;
	int found = 0;
	if (!server_pid)
		return -1;
	snprintf(path, sizeof(path), "/proc/%ld/task", server_pid);
	DIR *d = opendir(path);
	if (!d)
		return -1;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (e->d_name[0] == '.')
			continue;
		char p[384];
		snprintf(p, sizeof(p), "%s/%s/schedstat", path, e->d_name);
		FILE *f = fopen(p, "r");
		if (!f)
			continue;
		unsigned long long ns;
		if (fgets(line, sizeof(line), f) && sscanf(line, "%llu", &ns) == 1) {
			total += ns * 1e-9;
			found = 1;
		}
		fclose(f);
	}
	closedir(d);
	return found ? total : -1;
}

static double
own_cpu(void)
{
	struct rusage self, kids;
	getrusage(RUSAGE_SELF, &self);
	getrusage(RUSAGE_CHILDREN, &kids);
	return self.ru_utime.tv_sec + self.ru_utime.tv_usec * 1e-6 + self.ru_stime.tv_sec +
	       self.ru_stime.tv_usec * 1e-6 + kids.ru_utime.tv_sec + kids.ru_utime.tv_usec * 1e-6 +
	       kids.ru_stime.tv_sec + kids.ru_stime.tv_usec * 1e-6;
}

static void
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

static int
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

static void
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
static void
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
static void
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

static void
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
static size_t
build_packet(char *buf, const char *key)
{
	size_t h = (size_t)sprintf(buf, "MSG %s", key) + 1;
	memset(buf + h, 'x', payload_size);
	memset(buf + h, 0, payload_size < SEQ_BYTES ? payload_size : SEQ_BYTES);
	return h + payload_size;
}

static uint64_t
min_progress(void)
{
	uint64_t lo = UINT64_MAX;
	for (int i = 0; i < n_subs; i++) {
		uint64_t v = atomic_load_explicit(&sh->sub[i].next, memory_order_acquire);
		if (v < lo)
			lo = v;
	}
	return lo;
}

/* ------------------------------------------------------------------ flood */

static void
subscriber(int idx, int slow)
{
	struct sub_slot *slot = &sh->sub[idx];
	int fd = connect_bus();
	char pkt_template[256];
	size_t hdr = (size_t)sprintf(pkt_template, "MSG %s", BENCH_KEY) + 1;
	size_t pkt_len = hdr + payload_size;

	send_cmd(fd, "SUB", BENCH_KEY);
	if (slow) {
		static const char discard[] = "CMSG blocking/soft/discard";
		send_packet(fd, discard, sizeof(discard) - 1);
	}
	sync_clients(&fd, 1, 1000000 + idx);
	atomic_fetch_add(&sh->ready, 1);

	if (slow) {
		while (!atomic_load(&sh->finish))
			usleep(20000);
		_exit(0);
	}

	size_t bufsize = pkt_len + 64;
	char *bufs = malloc(bufsize * BATCH);
	struct iovec iov[BATCH];
	struct mmsghdr msgs[BATCH];
	for (int i = 0; i < BATCH; i++) {
		iov[i].iov_base = bufs + i * bufsize;
		iov[i].iov_len = bufsize;
		memset(&msgs[i], 0, sizeof(msgs[i]));
		msgs[i].msg_hdr.msg_iov = &iov[i];
		msgs[i].msg_hdr.msg_iovlen = 1;
	}
	set_timeout(fd, 0.1);

	uint64_t next = 0;
	double idle_since = 0;
	for (;;) {
		int n = recvmmsg(fd, msgs, BATCH, MSG_WAITFORONE, NULL);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno != EAGAIN && errno != EWOULDBLOCK)
				die("recvmmsg:");
			if (atomic_load(&sh->finish))
				break;
			if (atomic_load(&sh->done)) {
				uint64_t total = atomic_load(&sh->total);
				if (next >= total)
					break;
				if (!idle_since)
					idle_since = now();
				else if (now() - idle_since > 1.0) {
					/* The tail never came: the broker stalled or dropped it. */
					slot->lost += total - next;
					slot->tail += total - next;
					next = total;
					break;
				}
			}
			continue;
		}
		idle_since = 0;
		for (int i = 0; i < n; i++) {
			const char *p = iov[i].iov_base;
			if (msgs[i].msg_len == 0) {
				slot->eof = 1;
				goto out;
			}
			if (msgs[i].msg_len != pkt_len || (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) ||
			    memcmp(p, pkt_template, hdr)) {
				slot->bad++;
				continue;
			}
			uint64_t seq;
			memcpy(&seq, p + hdr, sizeof(seq));
			slot->received++;
			if (seq == next)
				next++;
			else if (seq > next) {
				slot->lost += seq - next;
				next = seq + 1;
			} else
				slot->reordered++;
		}
		slot->t_last = now();
		atomic_store_explicit(&slot->next, next, memory_order_seq_cst);
		if (atomic_load(&sh->pub_waiting) &&
		    atomic_load_explicit(&sh->sent, memory_order_relaxed) - next <= window / 2) {
			atomic_fetch_add(&sh->wake, 1);
			futex(&sh->wake, FUTEX_WAKE, INT_MAX, NULL);
		}
		if (atomic_load(&sh->done) && next >= atomic_load(&sh->total))
			break;
	}
out:
	slot->finished = 1;
	atomic_store(&slot->next, UINT64_MAX / 2);	/* never hold the publisher back again */
	_exit(0);
}

static int *
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

static void
print_common(const char *mode, double seconds, double cpu)
{
	printf("{\"mode\":\"%s\",\"payload\":%zu,\"seconds\":%.6f,\"server_cpu\":%.6f,"
	       "\"loadgen_cpu\":%.6f",
	       mode, payload_size, seconds, cpu, own_cpu());
}

static int
flood(void)
{
	if (n_subs < 1 || n_subs + n_slow > MAX_SUBS)
		die("1..%d subscribers", MAX_SUBS);
	raise_fd_limit(n_idle + 64);
	int *idle = hold_idle_clients(n_idle, n_pats);

	pid_t pids[MAX_SUBS];
	for (int i = 0; i < n_subs + n_slow; i++) {
		pids[i] = fork();
		if (pids[i] < 0)
			die("fork:");
		if (pids[i] == 0)
			subscriber(i, i >= n_subs);
	}

	int fd = connect_bus();
	double t_wait = now();
	while (atomic_load(&sh->ready) < n_subs + n_slow) {
		if (atomic_load(&sh->finish) || now() - t_wait > 30)
			die("subscribers did not get ready");
		usleep(1000);
	}

	char *bufs = malloc(BATCH * (payload_size + 128));
	struct iovec iov[BATCH];
	struct mmsghdr msgs[BATCH];
	size_t hdr = (size_t)snprintf(NULL, 0, "MSG %s", BENCH_KEY) + 1;
	for (int i = 0; i < BATCH; i++) {
		char *b = bufs + i * (payload_size + 128);
		iov[i].iov_base = b;
		iov[i].iov_len = build_packet(b, BENCH_KEY);
		memset(&msgs[i], 0, sizeof(msgs[i]));
		msgs[i].msg_hdr.msg_iov = &iov[i];
		msgs[i].msg_hdr.msg_iovlen = 1;
	}

	double cpu0 = server_cpu();
	double t0 = now(), deadline = t0 + duration, last_progress = t0;
	uint64_t sent = 0, last_lo = 0, waits = 0;
	int stalled = 0;
	for (;;) {
		if (now() >= deadline || (max_count && sent >= max_count))
			break;
		uint64_t lo = min_progress();
		if (lo != last_lo) {
			last_lo = lo;
			last_progress = now();
		}
		uint64_t inflight = sent - (lo < sent ? lo : sent);
		if (inflight + window / 4 > window) {
			/* Sleep until a subscriber has drained to half the window. */
			atomic_store(&sh->pub_waiting, 1);
			uint32_t v = atomic_load(&sh->wake);
			lo = min_progress();
			if (sent - (lo < sent ? lo : sent) + window / 4 > window) {
				struct timespec ts = {0, 100 * 1000 * 1000};
				futex(&sh->wake, FUTEX_WAIT, v, &ts);
				waits++;
			}
			atomic_store(&sh->pub_waiting, 0);
			if (now() - last_progress > 5.0) {
				stalled = 1;
				break;
			}
			continue;
		}
		uint64_t room = window - inflight;
		if (max_count && room > max_count - sent)
			room = max_count - sent;
		int n = room < BATCH ? (int)room : BATCH;
		for (int i = 0; i < n; i++) {
			uint64_t seq = sent + i;
			if (payload_size >= SEQ_BYTES)
				memcpy((char *)iov[i].iov_base + hdr, &seq, sizeof(seq));
		}
		int done = 0;
		while (done < n) {
			int r = sendmmsg(fd, msgs + done, n - done, 0);
			if (r < 0) {
				if (errno == EINTR)
					continue;
				die("sendmmsg:");
			}
			done += r;
		}
		sent += n;
		atomic_store_explicit(&sh->sent, sent, memory_order_release);
	}
	atomic_store(&sh->total, sent);
	atomic_store(&sh->done, 1);

	for (int i = 0; i < n_subs; i++) {
		int st;
		while (waitpid(pids[i], &st, 0) < 0 && errno == EINTR)
			;
	}
	double cpu1 = server_cpu();
	atomic_store(&sh->finish, 1);
	for (int i = n_subs; i < n_subs + n_slow; i++)
		waitpid(pids[i], NULL, 0);

	double t_end = t0;
	uint64_t received = 0, lost = 0, reordered = 0, bad = 0, tail = 0;
	int eof = 0, unfinished = 0;
	for (int i = 0; i < n_subs; i++) {
		struct sub_slot *s = &sh->sub[i];
		if (s->t_last > t_end)
			t_end = s->t_last;
		received += s->received;
		lost += s->lost;
		reordered += s->reordered;
		bad += s->bad;
		tail += s->tail;
		eof += s->eof;
		unfinished += !s->finished;
	}
	double seconds = t_end - t0;
	double cpu = cpu0 >= 0 && cpu1 >= 0 ? cpu1 - cpu0 : -1;
	print_common("flood", seconds, cpu);
	printf(",\"subscribers\":%d,\"slow\":%d,\"idle_clients\":%d,\"idle_patterns\":%d,"
	       "\"window\":%llu,\"messages\":%llu,\"deliveries\":%llu,\"expected_deliveries\":%llu,"
	       "\"lost\":%llu,\"tail_lost\":%llu,\"reordered\":%llu,\"bad\":%llu,\"eof\":%d,\"unfinished\":%d,"
	       "\"stalled\":%s,\"publisher_waits\":%llu,\"msgs_per_s\":%.1f,\"deliveries_per_s\":%.1f,"
	       "\"server_cpu_us_per_delivery\":%.4f,\"server_cpu_us_per_msg\":%.4f}\n",
	       n_subs, n_slow, n_idle, n_idle ? n_pats : 0, (unsigned long long)window,
	       (unsigned long long)sent, (unsigned long long)received,
	       (unsigned long long)sent * n_subs, (unsigned long long)lost, (unsigned long long)tail,
	       (unsigned long long)reordered, (unsigned long long)bad, eof, unfinished,
	       stalled ? "true" : "false", (unsigned long long)waits,
	       seconds > 0 ? sent / seconds : 0, seconds > 0 ? received / seconds : 0,
	       cpu >= 0 && received ? cpu * 1e6 / received : -1, cpu >= 0 && sent ? cpu * 1e6 / sent : -1);
	fflush(stdout);
	for (int i = 0; i < n_idle; i++)
		close(idle[i]);
	return stalled || lost || reordered || bad || eof || unfinished ? 2 : 0;
}

/* ---------------------------------------------------------------- latency */

static int
cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* Ends the JSON line print_common began: round-trip count and percentiles. */
static void
print_percentiles(double *rtt, size_t n)
{
	qsort(rtt, n, sizeof(double), cmp_double);
	double sum = 0;
	for (size_t i = 0; i < n; i++)
		sum += rtt[i];
#define PCT(p) (n ? rtt[(size_t)((p) / 100.0 * (n - 1) + 0.5)] : 0)
	printf(",\"round_trips\":%zu,\"mean_us\":%.2f,\"p50_us\":%.2f,\"p90_us\":%.2f,"
	       "\"p99_us\":%.2f,\"p999_us\":%.2f,\"max_us\":%.2f}\n",
	       n, n ? sum / n : 0, PCT(50), PCT(90), PCT(99), PCT(99.9), n ? rtt[n - 1] : 0);
#undef PCT
	fflush(stdout);
}

static void
echoer(void)
{
	int fd = connect_bus();
	send_cmd(fd, "SUB", PING_KEY);
	sync_clients(&fd, 1, 2000000);
	atomic_fetch_add(&sh->ready, 1);
	size_t size = payload_size + 256;
	char *buf = malloc(size);
	set_timeout(fd, 0.1);
	size_t klen = strlen(PONG_KEY);
	for (;;) {
		ssize_t r = recv(fd, buf, size, 0);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN && !atomic_load(&sh->finish))
				continue;
			break;
		}
		if (r == 0)
			break;
		memcpy(buf + 4, PONG_KEY, klen);
		send_packet(fd, buf, r);
	}
	_exit(0);
}

static int
latency(void)
{
	pid_t pid = fork();
	if (pid < 0)
		die("fork:");
	if (pid == 0)
		echoer();
	int fd = connect_bus();
	send_cmd(fd, "SUB", PONG_KEY);
	sync_clients(&fd, 1, 3000000);
	while (atomic_load(&sh->ready) < 1) {
		if (atomic_load(&sh->finish))
			die("echo process failed");
		usleep(1000);
	}
	set_timeout(fd, 5.0);

	char *ping = malloc(payload_size + 128), *buf = malloc(payload_size + 256);
	size_t len = build_packet(ping, PING_KEY);
	size_t hdr = len - payload_size;
	size_t cap = 2000000, n = 0;
	double *rtt = malloc(cap * sizeof(double));
	uint64_t lost = 0, bad = 0;
	/* A short counted run warms up for a tenth of its count, at most 2000. */
	int warmup = max_count && max_count < 20000 ? (int)(max_count / 10) : 2000;
	double cpu0 = 0, t0 = 0, deadline = 0;
	for (uint64_t seq = 0;; seq++) {
		if (seq == (uint64_t)warmup) {
			cpu0 = server_cpu();
			t0 = now();
			deadline = t0 + duration;
		}
		if (seq > (uint64_t)warmup && (n >= cap || now() >= deadline ||
					       (max_count && n >= max_count)))
			break;
		if (payload_size >= SEQ_BYTES)
			memcpy(ping + hdr, &seq, sizeof(seq));
		double a = now();
		send_packet(fd, ping, len);
		ssize_t r;
		do
			r = recv(fd, buf, payload_size + 256, 0);
		while (r < 0 && errno == EINTR);
		double b = now();
		if (r < 0) {
			if (errno == EAGAIN) {
				lost++;
				continue;
			}
			die("recv:");
		}
		uint64_t got = UINT64_MAX;
		if ((size_t)r == len && !memcmp(buf + 4, PONG_KEY, strlen(PONG_KEY)))
			memcpy(&got, buf + hdr, sizeof(got));
		if (payload_size >= SEQ_BYTES && got != seq) {
			bad++;
			continue;
		}
		if (seq >= (uint64_t)warmup)
			rtt[n++] = (b - a) * 1e6;
	}
	double seconds = now() - t0;
	double cpu1 = server_cpu();
	atomic_store(&sh->finish, 1);
	close(fd);
	waitpid(pid, NULL, 0);

	double cpu = cpu0 >= 0 && cpu1 >= 0 ? cpu1 - cpu0 : -1;
	print_common("latency", seconds, cpu);
	printf(",\"lost\":%llu,\"bad\":%llu,\"server_cpu_us_per_delivery\":%.4f",
	       (unsigned long long)lost, (unsigned long long)bad, cpu >= 0 && n ? cpu * 1e6 / (2.0 * n) : -1);
	print_percentiles(rtt, n);
	return lost || bad ? 2 : 0;
}

/* --------------------------------------------------------------- manypubs */

static uint64_t
mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static double
percentile(const float *v, size_t n, double p)
{
	return n ? v[(size_t)(p / 100.0 * (n - 1) + 0.5)] : 0;
}

static int
cmp_float(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return x < y ? -1 : x > y;
}

/* A manypubs subscriber: counts loss and order per publisher and times each
 * delivery from the publisher's send.  Its progress (slot->next) is the sum
 * of every publisher's next expected sequence number. */
static void
pubs_subscriber(int idx)
{
	static const char block[] = "CMSG blocking/hard/block";
	struct sub_slot *slot = &sh->sub[idx];
	int fd = connect_bus();
	char pkt_template[256];
	size_t hdr = (size_t)sprintf(pkt_template, "MSG %s", BENCH_KEY) + 1;
	size_t pkt_len = hdr + payload_size;
	uint64_t *next = calloc(n_pubs, sizeof(uint64_t));
	float *lat = malloc(LAT_SAMPLES * sizeof(float));
	size_t nlat = 0;
	if (!next || !lat)
		die("out of memory");

	send_cmd(fd, "SUB", BENCH_KEY);
	send_packet(fd, block, sizeof(block) - 1);
	sync_clients(&fd, 1, 1000000 + idx);
	atomic_fetch_add(&sh->ready, 1);

	size_t bufsize = pkt_len + 64;
	char *bufs = malloc(bufsize * BATCH);
	struct iovec iov[BATCH];
	struct mmsghdr msgs[BATCH];
	for (int i = 0; i < BATCH; i++) {
		iov[i].iov_base = bufs + i * bufsize;
		iov[i].iov_len = bufsize;
		memset(&msgs[i], 0, sizeof(msgs[i]));
		msgs[i].msg_hdr.msg_iov = &iov[i];
		msgs[i].msg_hdr.msg_iovlen = 1;
	}
	set_timeout(fd, 0.1);

	uint64_t progress = 0;
	double idle_since = 0;
	for (;;) {
		int n = recvmmsg(fd, msgs, BATCH, MSG_WAITFORONE, NULL);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno != EAGAIN && errno != EWOULDBLOCK)
				die("recvmmsg:");
			if (atomic_load(&sh->finish))
				break;
			if (atomic_load(&sh->done)) {
				if (progress >= atomic_load(&sh->total))
					break;
				if (!idle_since)
					idle_since = now();
				else if (now() - idle_since > 1.0) {
					/* The tails never came: the broker stalled or dropped them. */
					for (int p = 0; p < n_pubs; p++)
						if (next[p] < sh->pub_sent[p]) {
							slot->lost += sh->pub_sent[p] - next[p];
							slot->tail += sh->pub_sent[p] - next[p];
						}
					break;
				}
			}
			continue;
		}
		idle_since = 0;
		uint64_t t_now = mono_ns();
		for (int i = 0; i < n; i++) {
			const char *p = iov[i].iov_base;
			if (msgs[i].msg_len == 0) {
				slot->eof = 1;
				goto out;
			}
			uint64_t seq, sent_ns;
			uint32_t pub;
			if (msgs[i].msg_len != pkt_len || (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) ||
			    memcmp(p, pkt_template, hdr)) {
				slot->bad++;
				continue;
			}
			memcpy(&seq, p + hdr, 8);
			memcpy(&pub, p + hdr + 8, 4);
			memcpy(&sent_ns, p + hdr + 12, 8);
			if (pub >= (uint32_t)n_pubs) {
				slot->bad++;
				continue;
			}
			slot->received++;
			if (seq == next[pub]) {
				next[pub]++;
				progress++;
			} else if (seq > next[pub]) {
				slot->lost += seq - next[pub];
				progress += seq + 1 - next[pub];
				next[pub] = seq + 1;
			} else
				slot->reordered++;
			if (nlat < LAT_SAMPLES)
				lat[nlat++] = t_now > sent_ns ? (t_now - sent_ns) * 1e-3f : 0;
		}
		slot->t_last = now();
		atomic_store_explicit(&slot->next, progress, memory_order_seq_cst);
		if (atomic_load(&sh->pub_waiting) &&
		    atomic_load_explicit(&sh->sent, memory_order_relaxed) - progress <= window / 2) {
			atomic_fetch_add(&sh->wake, 1);
			futex(&sh->wake, FUTEX_WAKE, INT_MAX, NULL);
		}
		if (atomic_load(&sh->done) && progress >= atomic_load(&sh->total))
			break;
	}
out:
	qsort(lat, nlat, sizeof(float), cmp_float);
	slot->p50_us = percentile(lat, nlat, 50);
	slot->p99_us = percentile(lat, nlat, 99);
	slot->max_us = nlat ? lat[nlat - 1] : 0;
	slot->finished = 1;
	atomic_store(&slot->next, UINT64_MAX / 2);	/* never hold the publishers back again */
	_exit(0);
}

/* Waits until the window has room for `chunk` more messages; 0 when the
 * subscribers made no progress for 5 s (stalled). */
static int
wait_window(uint64_t chunk)
{
	double since = now();
	uint64_t last = min_progress();
	for (;;) {
		uint64_t sent = atomic_load(&sh->sent), lo = min_progress();
		if (sent - (lo < sent ? lo : sent) + chunk <= window)
			return 1;
		if (lo != last) {
			last = lo;
			since = now();
		} else if (now() - since > 5.0)
			return 0;
		atomic_fetch_add(&sh->pub_waiting, 1);
		uint32_t v = atomic_load(&sh->wake);
		sent = atomic_load(&sh->sent);
		lo = min_progress();
		if (sent - (lo < sent ? lo : sent) + chunk > window) {
			struct timespec ts = {0, 100 * 1000 * 1000};
			futex(&sh->wake, FUTEX_WAIT, v, &ts);
		}
		atomic_fetch_sub(&sh->pub_waiting, 1);
	}
}

/* Publishers first..first+count-1 of a manypubs run, all in this process:
 * one message on each connection in turn, paced by the window or by the
 * offered rate. */
static void
pub_proc(int first, int count, uint64_t quota)
{
	int *fds = malloc(count * sizeof(int));
	uint64_t *seq = calloc(count, sizeof(uint64_t));
	char *pkt = malloc(payload_size + 128);
	if (!fds || !seq || !pkt)
		die("out of memory");
	for (int i = 0; i < count; i++)
		fds[i] = connect_bus();
	sync_clients(fds, count, 4000000 + first);
	size_t len = build_packet(pkt, BENCH_KEY), hdr = len - payload_size;
	atomic_fetch_add(&sh->ready, 1);
	while (!atomic_load(&sh->go))
		if (atomic_load(&sh->finish))
			_exit(1);
		else
			usleep(200);

	double t0 = sh->t0, deadline = t0 + duration;
	double rate = offered_rate * count / n_pubs;	/* this process's share */
	uint64_t sent = 0;
	int next_fd = 0;
	for (;;) {
		double t = now();
		if (t >= deadline || sent >= quota)
			break;
		uint64_t chunk;
		if (rate > 0) {
			uint64_t due = (uint64_t)((t - t0) * rate);
			if (due <= sent) {
				double wait = t0 + (sent + 1) / rate - t;
				struct timespec ts = {(time_t)wait, (long)((wait - (time_t)wait) * 1e9)};
				nanosleep(&ts, NULL);
				continue;
			}
			chunk = due - sent;
		} else {
			chunk = count < 64 ? (uint64_t)count : 64;
			if (chunk > window / 4)
				chunk = window / 4;
			if (!wait_window(chunk)) {
				atomic_store(&sh->stalled, 1);
				break;
			}
		}
		if (chunk > quota - sent)
			chunk = quota - sent;
		atomic_fetch_add_explicit(&sh->sent, chunk, memory_order_release);
		for (uint64_t k = 0; k < chunk; k++) {
			uint32_t pub = (uint32_t)(first + next_fd);
			uint64_t ns = mono_ns();
			memcpy(pkt + hdr, &seq[next_fd], 8);
			memcpy(pkt + hdr + 8, &pub, 4);
			memcpy(pkt + hdr + 12, &ns, 8);
			send_packet(fds[next_fd], pkt, len);
			seq[next_fd]++;
			next_fd = next_fd + 1 == count ? 0 : next_fd + 1;
		}
		sent += chunk;
	}
	for (int i = 0; i < count; i++)
		sh->pub_sent[first + i] = seq[i];
	_exit(0);
}

static int
manypubs(void)
{
	if (n_subs < 1 || n_subs > MAX_SUBS)
		die("1..%d subscribers", MAX_SUBS);
	if (n_pubs < 1 || n_pubs > MAX_PUBS)
		die("1..%d publishers", MAX_PUBS);
	if (n_pub_procs < 1 || n_pub_procs > MAX_PUB_PROCS || n_pub_procs > n_pubs)
		die("1..%d publisher processes, at most one per publisher", MAX_PUB_PROCS);
	if (payload_size < PUB_HEADER)
		die("manypubs payloads carry %d bytes of header: -s %d at least", PUB_HEADER, PUB_HEADER);
	raise_fd_limit(n_pubs + 64);

	pid_t subs[MAX_SUBS], pubs[MAX_PUB_PROCS];
	for (int i = 0; i < n_subs; i++) {
		subs[i] = fork();
		if (subs[i] < 0)
			die("fork:");
		if (subs[i] == 0)
			pubs_subscriber(i);
	}
	uint64_t quota_left = max_count ? max_count : UINT64_MAX;
	for (int p = 0, first = 0; p < n_pub_procs; p++) {
		int count = n_pubs / n_pub_procs + (p < n_pubs % n_pub_procs);
		uint64_t quota = max_count ? max_count * count / n_pubs : UINT64_MAX;
		if (max_count && p == n_pub_procs - 1)
			quota = quota_left;
		quota_left -= max_count ? quota : 0;
		pubs[p] = fork();
		if (pubs[p] < 0)
			die("fork:");
		if (pubs[p] == 0)
			pub_proc(first, count, quota);
		first += count;
	}
	double t_wait = now();
	while (atomic_load(&sh->ready) < n_subs + n_pub_procs) {
		if (atomic_load(&sh->finish) || now() - t_wait > 60)
			die("clients did not get ready");
		usleep(1000);
	}
	double cpu0 = server_cpu();
	sh->t0 = now();
	atomic_store(&sh->go, 1);
	for (int p = 0; p < n_pub_procs; p++) {
		int st;
		while (waitpid(pubs[p], &st, 0) < 0 && errno == EINTR)
			;
	}
	uint64_t sent = 0;
	for (int i = 0; i < n_pubs; i++)
		sent += sh->pub_sent[i];
	atomic_store(&sh->total, sent);
	atomic_store(&sh->done, 1);
	for (int i = 0; i < n_subs; i++) {
		int st;
		while (waitpid(subs[i], &st, 0) < 0 && errno == EINTR)
			;
	}
	double cpu1 = server_cpu();
	atomic_store(&sh->finish, 1);

	double t0 = sh->t0, t_end = t0, p50 = 0, p99 = 0, worst = 0;
	uint64_t received = 0, lost = 0, reordered = 0, bad = 0, tail = 0;
	int eof = 0, unfinished = 0, stalled = atomic_load(&sh->stalled);
	for (int i = 0; i < n_subs; i++) {
		struct sub_slot *s = &sh->sub[i];
		if (s->t_last > t_end)
			t_end = s->t_last;
		received += s->received;
		lost += s->lost;
		reordered += s->reordered;
		bad += s->bad;
		tail += s->tail;
		eof += s->eof;
		unfinished += !s->finished;
		/* the worst subscriber's */
		p50 = s->p50_us > p50 ? s->p50_us : p50;
		p99 = s->p99_us > p99 ? s->p99_us : p99;
		worst = s->max_us > worst ? s->max_us : worst;
	}
	double seconds = t_end - t0;
	double cpu = cpu0 >= 0 && cpu1 >= 0 ? cpu1 - cpu0 : -1;
	print_common("manypubs", seconds, cpu);
	printf(",\"publishers\":%d,\"publisher_procs\":%d,\"offered_rate\":%.1f,\"subscribers\":%d,"
	       "\"window\":%llu,\"messages\":%llu,\"deliveries\":%llu,\"expected_deliveries\":%llu,"
	       "\"lost\":%llu,\"tail_lost\":%llu,\"reordered\":%llu,\"bad\":%llu,\"eof\":%d,\"unfinished\":%d,"
	       "\"stalled\":%s,\"msgs_per_s\":%.1f,\"deliveries_per_s\":%.1f,"
	       "\"server_cpu_us_per_delivery\":%.4f,\"server_cpu_us_per_msg\":%.4f,"
	       "\"p50_us\":%.2f,\"p99_us\":%.2f,\"max_us\":%.2f}\n",
	       n_pubs, n_pub_procs, offered_rate, n_subs, (unsigned long long)window,
	       (unsigned long long)sent, (unsigned long long)received,
	       (unsigned long long)sent * n_subs, (unsigned long long)lost, (unsigned long long)tail,
	       (unsigned long long)reordered, (unsigned long long)bad, eof, unfinished,
	       stalled ? "true" : "false",
	       seconds > 0 ? sent / seconds : 0, seconds > 0 ? received / seconds : 0,
	       cpu >= 0 && received ? cpu * 1e6 / received : -1, cpu >= 0 && sent ? cpu * 1e6 / sent : -1,
	       p50, p99, worst);
	fflush(stdout);
	return stalled || lost || reordered || bad || eof || unfinished ? 2 : 0;
}

/* ------------------------------------------------------------------- wake */

static void
pin_to(int cpu)
{
	cpu_set_t set;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	if (sched_setaffinity(0, sizeof(set), &set) < 0)
		die("sched_setaffinity(%d):", cpu);
}

static int
wake(void)
{
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) < 0)
		die("socketpair:");
	size_t size = payload_size ? payload_size : 1;
	char *buf = calloc(1, size);
	pid_t pid = fork();
	if (pid < 0)
		die("fork:");
	if (pid == 0) {
		close(sv[0]);
		if (echo_cpu >= 0)
			pin_to(echo_cpu);
		ssize_t r;
		while ((r = recv(sv[1], buf, size, 0)) > 0 || (r < 0 && errno == EINTR))
			if (r > 0 && send(sv[1], buf, r, 0) < 0)
				break;
		_exit(0);
	}
	close(sv[1]);
	size_t cap = 2000000, n = 0;
	double *rtt = malloc(cap * sizeof(double));
	double t0 = 0, deadline = 0;
	for (int i = 0;; i++) {
		if (i == 2000) {
			t0 = now();
			deadline = t0 + duration;
		}
		if (i > 2000 && (n >= cap || now() >= deadline))
			break;
		double a = now();
		if (send(sv[0], buf, size, 0) < 0 || recv(sv[0], buf, size, 0) <= 0)
			die("ping-pong:");
		if (i >= 2000)
			rtt[n++] = (now() - a) * 1e6;
	}
	double seconds = now() - t0;
	close(sv[0]);
	waitpid(pid, NULL, 0);
	print_common("wake", seconds, -1);
	printf(",\"echo_cpu\":%d", echo_cpu);
	print_percentiles(rtt, n);
	return 0;
}

/* ------------------------------------------------------------------- hold */

static void
wait_line(void)
{
	char line[64];
	if (!fgets(line, sizeof(line), stdin))
		exit(0);
}

static int
hold(void)
{
	raise_fd_limit(n_clients + 64);
	double t0 = now();
	int *fds = hold_idle_clients(n_clients, 0);
	printf("{\"phase\":\"connected\",\"clients\":%d,\"seconds\":%.3f}\n", n_clients, now() - t0);
	fflush(stdout);
	wait_line();
	if (n_pats > 0) {
		char pat[128];
		t0 = now();
		for (int k = 0; k < n_pats; k++) {
			int c = k % n_clients;
			/* distinct and mixed in shape: literal, wildcard, trailing '/' */
			switch (k % 4) {
			case 0: snprintf(pat, sizeof(pat), "svc%d/node%d/cpu", c, k); break;
			case 1: snprintf(pat, sizeof(pat), "svc%d/*/evt%d", c, k); break;
			case 2: snprintf(pat, sizeof(pat), "svc%d/node%d/", c, k); break;
			default: snprintf(pat, sizeof(pat), "log%d/*/x%d/*", k % 97, k); break;
			}
			send_cmd(fds[c], "SUB", pat);
		}
		sync_clients(fds, n_clients, 5000000);
		printf("{\"phase\":\"subscribed\",\"patterns\":%d,\"seconds\":%.3f}\n", n_pats, now() - t0);
		fflush(stdout);
	}
	while (fgetc(stdin) != EOF)
		;
	return 0;
}

static void
usage(void)
{
	fprintf(stderr, "usage: loadgen flood|manypubs|latency|hold|wake -a ADDRESS [-s SIZE] [-n SUBS] "
			"[-N PUBS] [-G PROCS] [-r RATE] [-i IDLE] [-p PATS] [-W] [-S SLOW] [-c CLIENTS] "
			"[-d SECONDS] [-m COUNT] [-w WINDOW] [-P PID] [-C CPU]\n");
	exit(2);
}

/* Runs once per process: its state is in static variables. */
static int
loadgen_main(int argc, char **argv)
{
	if (argc < 2)
		usage();
	const char *mode = argv[1];
	int opt, duration_set = 0;
	optind = 2;
	while ((opt = getopt(argc, argv, "a:s:n:N:G:r:i:p:S:c:d:m:w:P:WC:")) != -1) {
		switch (opt) {
		case 'a': address = optarg; break;
		case 's': payload_size = strtoul(optarg, NULL, 0); break;
		case 'n': n_subs = atoi(optarg); break;
		case 'N': n_pubs = atoi(optarg); break;
		case 'G': n_pub_procs = atoi(optarg); break;
		case 'r': offered_rate = atof(optarg); break;
		case 'i': n_idle = atoi(optarg); break;
		case 'p': n_pats = atoi(optarg); break;
		case 'S': n_slow = atoi(optarg); break;
		case 'c': n_clients = atoi(optarg); break;
		case 'd': duration = atof(optarg); duration_set = 1; break;
		case 'm': max_count = strtoull(optarg, NULL, 0); break;
		case 'w': window = strtoull(optarg, NULL, 0); break;
		case 'P': server_pid = atol(optarg); break;
		case 'W': wild_idle = 1; break;
		case 'C': echo_cpu = atoi(optarg); break;
		default: usage();
		}
	}
	if ((!address && strcmp(mode, "wake")) || window < 4)
		usage();
	if (max_count && !duration_set)
		duration = 1e12;
	signal(SIGPIPE, SIG_IGN);
	sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED)
		die("mmap:");
	memset(sh, 0, sizeof(*sh));
	if (!strcmp(mode, "flood"))
		return flood();
	if (!strcmp(mode, "manypubs"))
		return manypubs();
	if (!strcmp(mode, "latency"))
		return latency();
	if (!strcmp(mode, "hold"))
		return hold();
	if (!strcmp(mode, "wake"))
		return wake();
	usage();
	return 2;
}

#ifdef LOADGEN_STANDALONE
int
main(int argc, char **argv)
{
	return loadgen_main(argc, argv);
}
#endif
