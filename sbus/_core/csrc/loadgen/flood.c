/* flood: one publisher (this process) and SUBS subscriber processes, with
 * IDLE clients holding patterns that never match (manysubs, manywild). */
#include "loadgen.h"

/* A flood subscriber's count: one sequence of numbers, from 0. */
static void
flood_take(struct receiver *r, const char *payload, uint64_t t_ns)
{
	(void)t_ns;
	uint64_t seq;
	memcpy(&seq, payload, sizeof(seq));
	r->slot->received++;
	if (seq == r->progress)
		r->progress++;
	else if (seq > r->progress) {
		r->slot->lost += seq - r->progress;
		r->progress = seq + 1;
	} else
		r->slot->reordered++;
}

static void
flood_tail(struct receiver *r)
{
	uint64_t total = atomic_load(&sh->total);
	r->slot->lost += total - r->progress;
	r->slot->tail += total - r->progress;
	r->progress = total;
}

static void
subscriber(int idx, int slow)
{
	struct receiver r = {.slot = &sh->sub[idx], .take = flood_take, .tail = flood_tail};
	int fd = connect_bus();

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
	receive(fd, &r);
	leave(r.slot);
}

/* The publisher: BATCH packets built once, each stamped with its sequence
 * number before it goes. */
struct flood_pub {
	int fd;
	size_t hdr;
	uint64_t seq;
	struct iovec iov[BATCH];
	struct mmsghdr msgs[BATCH];
};

static void
flood_send(void *ctx, uint64_t n)
{
	struct flood_pub *f = ctx;
	while (n) {
		int k = n < BATCH ? (int)n : BATCH;
		for (int i = 0; i < k; i++) {
			uint64_t seq = f->seq + i;
			if (payload_size >= SEQ_BYTES)
				memcpy((char *)f->iov[i].iov_base + f->hdr, &seq, sizeof(seq));
		}
		int done = 0;
		while (done < k) {
			int r = sendmmsg(f->fd, f->msgs + done, k - done, 0);
			if (r < 0) {
				if (errno == EINTR)
					continue;
				die("sendmmsg:");
			}
			done += r;
		}
		f->seq += k;
		n -= k;
	}
}

int
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

	struct flood_pub pub = {.fd = fd};
	char *bufs = malloc(BATCH * (payload_size + 128));
	if (!bufs)
		die("out of memory");
	pub.hdr = (size_t)snprintf(NULL, 0, "MSG %s", BENCH_KEY) + 1;
	for (int i = 0; i < BATCH; i++) {
		char *b = bufs + i * (payload_size + 128);
		pub.iov[i].iov_base = b;
		pub.iov[i].iov_len = build_packet(b, BENCH_KEY);
		memset(&pub.msgs[i], 0, sizeof(pub.msgs[i]));
		pub.msgs[i].msg_hdr.msg_iov = &pub.iov[i];
		pub.msgs[i].msg_hdr.msg_iovlen = 1;
	}

	double cpu0 = server_cpu();
	double t0 = now();
	/* Sleeps until a subscriber has drained to half the window once less
	 * than a quarter of it is free; sends up to BATCH in one sendmmsg. */
	struct pacing pace = {.t0 = t0, .deadline = t0 + duration,
			      .quota = max_count ? max_count : UINT64_MAX,
			      .need = window / 4, .most = BATCH};
	uint64_t waits = 0;
	uint64_t sent = publish(&pace, flood_send, &pub, &waits);
	int stalled = atomic_load(&sh->stalled);
	struct sub_totals st;
	finish_run(sent, pids, t0, cpu0, &st);
	reap(pids + n_subs, n_slow);
	print_common("flood", st.seconds, st.cpu);
	printf(",\"subscribers\":%d,\"slow\":%d,\"idle_clients\":%d,\"idle_patterns\":%d,"
	       "\"window\":%llu,\"messages\":%llu,\"deliveries\":%llu,\"expected_deliveries\":%llu,"
	       "\"lost\":%llu,\"tail_lost\":%llu,\"reordered\":%llu,\"bad\":%llu,\"eof\":%d,\"unfinished\":%d,"
	       "\"stalled\":%s,\"publisher_waits\":%llu,\"msgs_per_s\":%.1f,\"deliveries_per_s\":%.1f,"
	       "\"server_cpu_us_per_delivery\":%.4f,\"server_cpu_us_per_msg\":%.4f}\n",
	       n_subs, n_slow, n_idle, n_idle ? n_pats : 0, (unsigned long long)window,
	       (unsigned long long)sent, (unsigned long long)st.received,
	       (unsigned long long)sent * n_subs, (unsigned long long)st.lost, (unsigned long long)st.tail,
	       (unsigned long long)st.reordered, (unsigned long long)st.bad, st.eof, st.unfinished,
	       stalled ? "true" : "false", (unsigned long long)waits,
	       st.seconds > 0 ? sent / st.seconds : 0, st.seconds > 0 ? st.received / st.seconds : 0,
	       st.cpu >= 0 && st.received ? st.cpu * 1e6 / st.received : -1,
	       st.cpu >= 0 && sent ? st.cpu * 1e6 / sent : -1);
	fflush(stdout);
	for (int i = 0; i < n_idle; i++)
		close(idle[i]);
	return stalled || st.lost || st.reordered || st.bad || st.eof || st.unfinished ? 2 : 0;
}
