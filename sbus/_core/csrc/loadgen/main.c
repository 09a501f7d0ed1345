/*
 * loadgen: drives a broker that speaks the sbus protocol (sbusd, or
 * bench/relay) and prints one line of JSON on stdout.  The one load generator
 * of `sbus bench` and `make bench`: compiled into the package as
 * sbus._core.loadgen (run with `python -m sbus.cli.loadgen`), or on its own:
 * `cc -O2 -DLOADGEN_STANDALONE -o loadgen *.c` in this directory.
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
#include "loadgen.h"

const char *address = NULL;
size_t payload_size = 64;
int n_pubs = 256, n_pub_procs = 1;
double offered_rate = 0;
int n_subs = 1, n_idle = 0, n_pats = 10, n_slow = 0, n_clients = 1, wild_idle = 0;
double duration = 2.0;
uint64_t max_count = 0;
uint64_t window = 256;
long server_pid = 0;
int echo_cpu = -1;
struct shared *sh;

void
die(const char *fmt, ...)
{
	/* One write(2) for the whole line: the processes of a run share stderr,
	   and lines written in pieces interleave when several die at once. */
	char line[512];
	int err = errno, n;
	va_list ap;
	va_start(ap, fmt);
	n = snprintf(line, sizeof(line), "loadgen[%d]: ", getpid());
	n += vsnprintf(line + n, sizeof(line) - n, fmt, ap);
	va_end(ap);
	if (n < (int)sizeof(line) && fmt[0] && fmt[strlen(fmt) - 1] == ':')
		n += snprintf(line + n, sizeof(line) - n, " %s", strerror(err));
	if (n > (int)sizeof(line) - 2)
		n = sizeof(line) - 2;
	line[n++] = '\n';
	fflush(stderr);
	if (write(STDERR_FILENO, line, n) < 0)
		n = 0;  /* nowhere left to say it */
	if (sh)
		atomic_store(&sh->finish, 1);
	exit(1);
}

static void
usage(void)
{
	fprintf(stderr, "usage: loadgen flood|manypubs|latency|hold|wake -a ADDRESS [-s SIZE] [-n SUBS] "
			"[-N PUBS] [-G PROCS] [-r RATE] [-i IDLE] [-p PATS] [-W] [-S SLOW] [-c CLIENTS] "
			"[-d SECONDS] [-m COUNT] [-w WINDOW] [-P PID] [-C CPU]\n");
	exit(2);
}

/* Runs once per process: its state is in global variables. */
int
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
