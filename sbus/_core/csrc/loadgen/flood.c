/* flood: one publisher (this process) and SUBS subscriber processes, with
 * IDLE clients holding patterns that never match (manysubs, manywild). */
#include "loadgen.h"

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
