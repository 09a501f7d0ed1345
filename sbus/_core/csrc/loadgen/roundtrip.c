/* Round trips, one message in flight: latency (through the broker) and
 * wake (over a socketpair, no broker: the machine's floor). */
#include "loadgen.h"

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

int
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

static void
pin_to(int cpu)
{
	cpu_set_t set;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	if (sched_setaffinity(0, sizeof(set), &set) < 0)
		die("sched_setaffinity(%d):", cpu);
}

int
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
