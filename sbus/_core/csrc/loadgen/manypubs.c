/* manypubs: PUBS publisher connections spread over PROCS processes, and
 * SUBS subscribers that count loss and order per publisher and time each
 * delivery. */
#include "loadgen.h"

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
 * delivery from the publisher's send.  Its progress is the sum of every
 * publisher's next expected sequence number. */
struct pubs_receiver {
	struct receiver r;	/* first: take and tail are given it */
	uint64_t *next;		/* each publisher's next sequence number expected */
	float *lat;		/* publish-to-delivery latencies, in microseconds */
	size_t nlat;
};

static void
pubs_take(struct receiver *r, const char *payload, uint64_t t_ns)
{
	struct pubs_receiver *s = (struct pubs_receiver *)r;
	uint64_t seq, sent_ns;
	uint32_t pub;
	memcpy(&seq, payload, 8);
	memcpy(&pub, payload + 8, 4);
	memcpy(&sent_ns, payload + 12, 8);
	if (pub >= (uint32_t)n_pubs) {
		r->slot->bad++;
		return;
	}
	r->slot->received++;
	if (seq == s->next[pub]) {
		s->next[pub]++;
		r->progress++;
	} else if (seq > s->next[pub]) {
		r->slot->lost += seq - s->next[pub];
		r->progress += seq + 1 - s->next[pub];
		s->next[pub] = seq + 1;
	} else
		r->slot->reordered++;
	if (s->nlat < LAT_SAMPLES)
		s->lat[s->nlat++] = t_ns > sent_ns ? (t_ns - sent_ns) * 1e-3f : 0;
}

static void
pubs_tail(struct receiver *r)
{
	struct pubs_receiver *s = (struct pubs_receiver *)r;
	for (int p = 0; p < n_pubs; p++)
		if (s->next[p] < sh->pub_sent[p]) {
			r->slot->lost += sh->pub_sent[p] - s->next[p];
			r->slot->tail += sh->pub_sent[p] - s->next[p];
		}
}

static void
pubs_subscriber(int idx)
{
	static const char block[] = "CMSG blocking/hard/block";
	struct pubs_receiver s = {
		.r = {.slot = &sh->sub[idx], .timed = 1, .take = pubs_take, .tail = pubs_tail},
		.next = calloc(n_pubs, sizeof(uint64_t)),
		.lat = malloc(LAT_SAMPLES * sizeof(float)),
	};
	if (!s.next || !s.lat)
		die("out of memory");
	int fd = connect_bus();

	send_cmd(fd, "SUB", BENCH_KEY);
	send_packet(fd, block, sizeof(block) - 1);
	sync_clients(&fd, 1, 1000000 + idx);
	atomic_fetch_add(&sh->ready, 1);

	receive(fd, &s.r);
	qsort(s.lat, s.nlat, sizeof(float), cmp_float);
	s.r.slot->p50_us = percentile(s.lat, s.nlat, 50);
	s.r.slot->p99_us = percentile(s.lat, s.nlat, 99);
	s.r.slot->max_us = s.nlat ? s.lat[s.nlat - 1] : 0;
	leave(s.r.slot);
}

/* Publishers first..first+count-1 of a manypubs run, all in this process:
 * one message on each connection in turn. */
struct pubs {
	int first, count, next_fd;
	int *fds;
	uint64_t *seq;		/* each publisher's next sequence number */
	char *pkt;
	size_t len, hdr;
};

static void
pubs_send(void *ctx, uint64_t n)
{
	struct pubs *g = ctx;
	for (uint64_t k = 0; k < n; k++) {
		uint32_t pub = (uint32_t)(g->first + g->next_fd);
		uint64_t ns = mono_ns();
		memcpy(g->pkt + g->hdr, &g->seq[g->next_fd], 8);
		memcpy(g->pkt + g->hdr + 8, &pub, 4);
		memcpy(g->pkt + g->hdr + 12, &ns, 8);
		send_packet(g->fds[g->next_fd], g->pkt, g->len);
		g->seq[g->next_fd]++;
		g->next_fd = g->next_fd + 1 == g->count ? 0 : g->next_fd + 1;
	}
}

/* Paced by the window, or by the offered rate (this process's share). */
static void
pub_proc(int first, int count, uint64_t quota)
{
	struct pubs g = {.first = first, .count = count};
	g.fds = malloc(count * sizeof(int));
	g.seq = calloc(count, sizeof(uint64_t));
	g.pkt = malloc(payload_size + 128);
	if (!g.fds || !g.seq || !g.pkt)
		die("out of memory");
	for (int i = 0; i < count; i++)
		g.fds[i] = connect_bus();
	sync_clients(g.fds, count, 4000000 + first);
	g.len = build_packet(g.pkt, BENCH_KEY);
	g.hdr = g.len - payload_size;
	atomic_fetch_add(&sh->ready, 1);
	while (!atomic_load(&sh->go))
		if (atomic_load(&sh->finish))
			_exit(1);
		else
			usleep(200);

	uint64_t chunk = count < 64 ? (uint64_t)count : 64;
	if (chunk > window / 4)
		chunk = window / 4;
	struct pacing pace = {.t0 = sh->t0, .deadline = sh->t0 + duration,
			      .rate = offered_rate * count / n_pubs, .quota = quota,
			      .need = chunk, .most = chunk};
	uint64_t waits = 0;
	publish(&pace, pubs_send, &g, &waits);
	for (int i = 0; i < count; i++)
		sh->pub_sent[first + i] = g.seq[i];
	_exit(0);
}

int
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
	reap(pubs, n_pub_procs);
	uint64_t sent = 0;
	for (int i = 0; i < n_pubs; i++)
		sent += sh->pub_sent[i];
	struct sub_totals st;
	finish_run(sent, subs, sh->t0, cpu0, &st);
	int stalled = atomic_load(&sh->stalled);
	print_common("manypubs", st.seconds, st.cpu);
	printf(",\"publishers\":%d,\"publisher_procs\":%d,\"offered_rate\":%.1f,\"subscribers\":%d,"
	       "\"window\":%llu,\"messages\":%llu,\"deliveries\":%llu,\"expected_deliveries\":%llu,"
	       "\"lost\":%llu,\"tail_lost\":%llu,\"reordered\":%llu,\"bad\":%llu,\"eof\":%d,\"unfinished\":%d,"
	       "\"stalled\":%s,\"msgs_per_s\":%.1f,\"deliveries_per_s\":%.1f,"
	       "\"server_cpu_us_per_delivery\":%.4f,\"server_cpu_us_per_msg\":%.4f,"
	       "\"p50_us\":%.2f,\"p99_us\":%.2f,\"max_us\":%.2f}\n",
	       n_pubs, n_pub_procs, offered_rate, n_subs, (unsigned long long)window,
	       (unsigned long long)sent, (unsigned long long)st.received,
	       (unsigned long long)sent * n_subs, (unsigned long long)st.lost, (unsigned long long)st.tail,
	       (unsigned long long)st.reordered, (unsigned long long)st.bad, st.eof, st.unfinished,
	       stalled ? "true" : "false",
	       st.seconds > 0 ? sent / st.seconds : 0, st.seconds > 0 ? st.received / st.seconds : 0,
	       st.cpu >= 0 && st.received ? st.cpu * 1e6 / st.received : -1,
	       st.cpu >= 0 && sent ? st.cpu * 1e6 / sent : -1,
	       st.p50_us, st.p99_us, st.max_us);
	fflush(stdout);
	return stalled || st.lost || st.reordered || st.bad || st.eof || st.unfinished ? 2 : 0;
}
