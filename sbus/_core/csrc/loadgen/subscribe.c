/* The subscriber loop of flood and manypubs: receive in batches, check each
 * packet against the one the publishers send, let the mode count it, report
 * progress to the publishers' window (waking one that sleeps on it), and
 * account for a tail that never comes. Also how both modes end a run: wait
 * for the subscribers, then sum what they counted. */
#include "loadgen.h"

void
receive(int fd, struct receiver *r)
{
	struct sub_slot *slot = r->slot;
	char pkt_template[256];
	size_t hdr = (size_t)sprintf(pkt_template, "MSG %s", BENCH_KEY) + 1;
	size_t pkt_len = hdr + payload_size;
	size_t bufsize = pkt_len + 64;
	char *bufs = malloc(bufsize * BATCH);
	struct iovec iov[BATCH];
	struct mmsghdr msgs[BATCH];
	if (!bufs)
		die("out of memory");
	for (int i = 0; i < BATCH; i++) {
		iov[i].iov_base = bufs + i * bufsize;
		iov[i].iov_len = bufsize;
		memset(&msgs[i], 0, sizeof(msgs[i]));
		msgs[i].msg_hdr.msg_iov = &iov[i];
		msgs[i].msg_hdr.msg_iovlen = 1;
	}
	set_timeout(fd, 0.1);

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
				if (r->progress >= atomic_load(&sh->total))
					break;
				if (!idle_since)
					idle_since = now();
				else if (now() - idle_since > 1.0) {
					/* The tail never came: the broker stalled or dropped it. */
					r->tail(r);
					break;
				}
			}
			continue;
		}
		idle_since = 0;
		uint64_t t_ns = r->timed ? mono_ns() : 0;
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
			r->take(r, p + hdr, t_ns);
		}
		slot->t_last = now();
		atomic_store_explicit(&slot->next, r->progress, memory_order_seq_cst);
		if (atomic_load(&sh->pub_waiting) &&
		    atomic_load_explicit(&sh->sent, memory_order_relaxed) - r->progress <= window / 2) {
			atomic_fetch_add(&sh->wake, 1);
			futex(&sh->wake, FUTEX_WAKE, INT_MAX, NULL);
		}
		if (atomic_load(&sh->done) && r->progress >= atomic_load(&sh->total))
			break;
	}
out:
	free(bufs);
}

void
leave(struct sub_slot *slot)
{
	slot->finished = 1;
	atomic_store(&slot->next, UINT64_MAX / 2);	/* never hold a publisher back again */
	_exit(0);
}

void
reap(const pid_t *pids, int n)
{
	for (int i = 0; i < n; i++)
		while (waitpid(pids[i], NULL, 0) < 0 && errno == EINTR)
			;
}

static void
sum_subscribers(double t0, struct sub_totals *out)
{
	double t_end = t0;
	for (int i = 0; i < n_subs; i++) {
		struct sub_slot *s = &sh->sub[i];
		if (s->t_last > t_end)
			t_end = s->t_last;
		out->received += s->received;
		out->lost += s->lost;
		out->reordered += s->reordered;
		out->bad += s->bad;
		out->tail += s->tail;
		out->eof += s->eof;
		out->unfinished += !s->finished;
		out->p50_us = s->p50_us > out->p50_us ? s->p50_us : out->p50_us;
		out->p99_us = s->p99_us > out->p99_us ? s->p99_us : out->p99_us;
		out->max_us = s->max_us > out->max_us ? s->max_us : out->max_us;
	}
	out->seconds = t_end - t0;
}

void
finish_run(uint64_t sent, const pid_t *subs, double t0, double cpu0, struct sub_totals *out)
{
	atomic_store(&sh->total, sent);
	atomic_store(&sh->done, 1);
	reap(subs, n_subs);
	/* Read before finish: the other clients' teardown is not the run's work. */
	double cpu1 = server_cpu();
	atomic_store(&sh->finish, 1);
	memset(out, 0, sizeof(*out));
	out->cpu = cpu0 >= 0 && cpu1 >= 0 ? cpu1 - cpu0 : -1;
	sum_subscribers(t0, out);
}
