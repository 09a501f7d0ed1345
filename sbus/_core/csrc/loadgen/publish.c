/* The publisher loop of flood and manypubs: paced by the subscribers'
 * window (or by an offered rate), ended by the deadline, the quota or a
 * stall. The mode only says how a chunk of messages is stamped and sent. */
#include "loadgen.h"

enum {
	WINDOW_STALLED = -1,	/* the subscribers made no progress for 5 s */
	WINDOW_DEADLINE = -2,	/* the run ended while waiting */
};

/* Waits until the window has room for `need` more messages; the room, or
 * WINDOW_STALLED or WINDOW_DEADLINE. Every publisher process waits the same
 * way: pub_waiting counts the sleepers, whom a subscriber wakes once it has
 * drained to half the window. */
static int64_t
wait_window(uint64_t need, double deadline, uint64_t *waits)
{
	double since = 0;
	uint64_t last = 0;
	for (;;) {
		uint64_t sent = atomic_load(&sh->sent), lo = min_progress();
		uint64_t inflight = sent - (lo < sent ? lo : sent);
		if (inflight + need <= window)
			return (int64_t)(window - inflight);
		double t = now();
		if (t >= deadline)
			return WINDOW_DEADLINE;
		if (!since || lo != last) {
			last = lo;
			since = t;
		} else if (t - since > 5.0)
			return WINDOW_STALLED;
		atomic_fetch_add(&sh->pub_waiting, 1);
		uint32_t v = atomic_load(&sh->wake);
		sent = atomic_load(&sh->sent);
		lo = min_progress();
		if (sent - (lo < sent ? lo : sent) + need > window) {
			struct timespec ts = {0, 100 * 1000 * 1000};
			futex(&sh->wake, FUTEX_WAIT, v, &ts);
			(*waits)++;
		}
		atomic_fetch_sub(&sh->pub_waiting, 1);
	}
}

uint64_t
publish(const struct pacing *p, void (*send)(void *ctx, uint64_t n), void *ctx, uint64_t *waits)
{
	uint64_t sent = 0;
	for (;;) {
		double t = now();
		if (t >= p->deadline || sent >= p->quota)
			break;
		uint64_t chunk;
		if (p->rate > 0) {
			uint64_t due = (uint64_t)((t - p->t0) * p->rate);
			if (due <= sent) {
				double wait = p->t0 + (sent + 1) / p->rate - t;
				struct timespec ts = {(time_t)wait, (long)((wait - (time_t)wait) * 1e9)};
				nanosleep(&ts, NULL);
				continue;
			}
			chunk = due - sent;
		} else {
			int64_t room = wait_window(p->need, p->deadline, waits);
			if (room == WINDOW_STALLED)
				atomic_store(&sh->stalled, 1);
			if (room < 0)
				break;
			chunk = (uint64_t)room < p->most ? (uint64_t)room : p->most;
		}
		if (chunk > p->quota - sent)
			chunk = p->quota - sent;
		/* Counted before they go: a subscriber may see them first. */
		atomic_fetch_add_explicit(&sh->sent, chunk, memory_order_release);
		send(ctx, chunk);
		sent += chunk;
	}
	return sent;
}
