/*
 * The io_uring ring of the broker's io_uring backend (loop.pyx IoUringPoller),
 * through the raw syscalls and <linux/io_uring.h>: no liburing, so nothing in
 * a wheel links against a library the host may lack, and a kernel without
 * io_uring (or one that refuses it: io_uring_disabled, seccomp) is found out
 * by io_uring_setup failing, at run time.
 *
 * Only what the loop needs: one-shot POLL_ADD and POLL_REMOVE submissions,
 * one io_uring_enter per loop turn that submits them and waits for
 * completions with a timeout (IORING_ENTER_EXT_ARG), and batches of
 * non-waiting RECVs, one io_uring_enter for every readable connection's
 * packets instead of a recvmmsg each.
 *
 * Not multishot receives into a provided-buffer ring: the kernel would then
 * receive ahead of the broker, which must be able to stop reading before a
 * reader in a block mode passes its limit by more than one batch
 * (RECV_BATCH packets); with buffers sized for the largest packet it could
 * offer only a batch of them at a time, and every other readable
 * connection's multishot receive would end with ENOBUFS, to be armed again
 * each turn.
 *
 * Contract: sbus_uring_init returns 0 or -errno; every other function that
 * returns int returns 0 or -errno; the ring is single-threaded.
 */
#ifndef SBUS_URING_H
#define SBUS_URING_H

#include <errno.h>
#include <linux/io_uring.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif

struct sbus_uring {
	int fd;
	unsigned sq_entries;
	unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
	unsigned *cq_head, *cq_tail, *cq_mask;
	struct io_uring_sqe *sqes;
	struct io_uring_cqe *cqes;
	void *sq_ring, *cq_ring;
	size_t sq_ring_size, cq_ring_size, sqes_size;
	unsigned tail;		/* our copy of *sq_tail */
	unsigned unsubmitted;	/* SQEs written since the last io_uring_enter */
};

static inline int
sbus_uring_setup(unsigned entries, struct io_uring_params *p)
{
	int fd = (int)syscall(__NR_io_uring_setup, entries, p);
	return fd < 0 ? -errno : fd;
}

static inline int
sbus_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags,
		 void *arg, size_t argsz)
{
	int r = (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, arg, argsz);
	return r < 0 ? -errno : r;
}

static inline void
sbus_uring_free(struct sbus_uring *r)
{
	if (r->sqes && r->sqes != MAP_FAILED)
		munmap(r->sqes, r->sqes_size);
	if (r->cq_ring && r->cq_ring != MAP_FAILED && r->cq_ring != r->sq_ring)
		munmap(r->cq_ring, r->cq_ring_size);
	if (r->sq_ring && r->sq_ring != MAP_FAILED)
		munmap(r->sq_ring, r->sq_ring_size);
	if (r->fd >= 0)
		close(r->fd);
	memset(r, 0, sizeof(*r));
	r->fd = -1;
}

static inline int
sbus_uring_init(struct sbus_uring *r, unsigned entries)
{
	struct io_uring_params p;
	int fd;
	memset(r, 0, sizeof(*r));
	r->fd = -1;
	/* Completions are reaped only by the one thread that submits, in
	 * io_uring_enter: let the kernel defer its work to then (6.1+). */
	memset(&p, 0, sizeof(p));
	p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
	fd = sbus_uring_setup(entries, &p);
	if (fd == -EINVAL) {
		memset(&p, 0, sizeof(p));
		fd = sbus_uring_setup(entries, &p);
	}
	if (fd < 0)
		return fd;
	r->fd = fd;
	/* The timeout of a wait is passed in io_uring_getevents_arg (5.11), and
	 * a full completion ring must not drop completions (5.5). */
	if (!(p.features & IORING_FEAT_EXT_ARG) || !(p.features & IORING_FEAT_NODROP)) {
		sbus_uring_free(r);
		return -ENOSYS;
	}
	r->sq_entries = p.sq_entries;
	r->sq_ring_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
	r->cq_ring_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
	if (p.features & IORING_FEAT_SINGLE_MMAP && r->cq_ring_size > r->sq_ring_size)
		r->sq_ring_size = r->cq_ring_size;
	r->sq_ring = mmap(NULL, r->sq_ring_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
			  fd, IORING_OFF_SQ_RING);
	if (r->sq_ring == MAP_FAILED) {
		int err = -errno;
		sbus_uring_free(r);
		return err;
	}
	if (p.features & IORING_FEAT_SINGLE_MMAP)
		r->cq_ring = r->sq_ring;
	else {
		r->cq_ring = mmap(NULL, r->cq_ring_size, PROT_READ | PROT_WRITE,
				  MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
		if (r->cq_ring == MAP_FAILED) {
			int err = -errno;
			sbus_uring_free(r);
			return err;
		}
	}
	r->sqes_size = p.sq_entries * sizeof(struct io_uring_sqe);
	r->sqes = mmap(NULL, r->sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
		       IORING_OFF_SQES);
	if (r->sqes == MAP_FAILED) {
		int err = -errno;
		sbus_uring_free(r);
		return err;
	}
	char *sq = r->sq_ring, *cq = r->cq_ring;
	r->sq_head = (unsigned *)(sq + p.sq_off.head);
	r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
	r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
	r->sq_array = (unsigned *)(sq + p.sq_off.array);
	r->cq_head = (unsigned *)(cq + p.cq_off.head);
	r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
	r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
	r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
	for (unsigned i = 0; i < p.sq_entries; i++)
		r->sq_array[i] = i;	/* SQE i is always slot i */
	r->tail = *r->sq_tail;
	return 0;
}

/* Submits what was written, and with wait, waits up to timeout_ms (-1:
 * forever) for a completion.  Returns 0 or -errno (-EINTR: a signal). */
static inline int
sbus_uring_submit(struct sbus_uring *r, int wait, int timeout_ms)
{
	struct io_uring_getevents_arg arg;
	struct __kernel_timespec ts;
	unsigned flags = 0;
	int n;
	if (!wait && !r->unsubmitted)
		return 0;
	memset(&arg, 0, sizeof(arg));
	if (wait) {
		flags |= IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG;
		if (timeout_ms >= 0) {
			ts.tv_sec = timeout_ms / 1000;
			ts.tv_nsec = (long long)(timeout_ms % 1000) * 1000000;
			arg.ts = (uint64_t)(uintptr_t)&ts;
		}
	}
	n = sbus_uring_enter(r->fd, r->unsubmitted, wait ? 1 : 0, flags,
			     wait ? &arg : NULL, wait ? sizeof(arg) : 0);
	if (n == -ETIME)
		n = 0;
	if (n >= 0)
		r->unsubmitted -= (unsigned)n < r->unsubmitted ? (unsigned)n : r->unsubmitted;
	return n < 0 ? n : 0;
}

/* The next free SQE, cleared; submits first when the ring is full.  NULL
 * when even that fails. */
static inline struct io_uring_sqe *
sbus_uring_sqe(struct sbus_uring *r)
{
	unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
	if (r->tail - head >= r->sq_entries) {
		if (sbus_uring_submit(r, 0, 0) < 0)
			return NULL;
		head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
		if (r->tail - head >= r->sq_entries)
			return NULL;
	}
	struct io_uring_sqe *sqe = &r->sqes[r->tail & *r->sq_mask];
	memset(sqe, 0, sizeof(*sqe));
	return sqe;
}

static inline void
sbus_uring_push(struct sbus_uring *r)
{
	r->tail++;
	r->unsubmitted++;
	__atomic_store_n(r->sq_tail, r->tail, __ATOMIC_RELEASE);
}

/* One-shot readiness of fd for POLLIN/POLLOUT events; its completion carries
 * user_data and the revents (or -errno). */
static inline int
sbus_uring_poll_add(struct sbus_uring *r, int fd, unsigned events, uint64_t user_data)
{
	struct io_uring_sqe *sqe = sbus_uring_sqe(r);
	if (!sqe)
		return -EBUSY;
	sqe->opcode = IORING_OP_POLL_ADD;
	sqe->fd = fd;
	sqe->poll32_events = events;
	sqe->user_data = user_data;
	sbus_uring_push(r);
	return 0;
}

/* One packet of fd into buf, without waiting: MSG_DONTWAIT makes the
 * kernel complete it at once, with -EAGAIN when there is none (5.19+;
 * where an older kernel waits instead, sbus_uring_cancel takes it back).
 * Its completion carries user_data and the length (0: EOF or an empty
 * packet; above len cannot happen, a longer packet is cut to len) or -errno. */
static inline int
sbus_uring_recv(struct sbus_uring *r, int fd, void *buf, unsigned len, uint64_t user_data)
{
	struct io_uring_sqe *sqe = sbus_uring_sqe(r);
	if (!sqe)
		return -EBUSY;
	sqe->opcode = IORING_OP_RECV;
	sqe->fd = fd;
	sqe->addr = (uint64_t)(uintptr_t)buf;
	sqe->len = len;
	sqe->msg_flags = MSG_DONTWAIT;
	sqe->user_data = user_data;
	sbus_uring_push(r);
	return 0;
}

/* A request aimed at the earlier one submitted with target (a cancel or a
 * poll removal); its own completion carries user_data. */
static inline int
sbus_uring_aim(struct sbus_uring *r, uint8_t opcode, uint64_t target, uint64_t user_data)
{
	struct io_uring_sqe *sqe = sbus_uring_sqe(r);
	if (!sqe)
		return -EBUSY;
	sqe->opcode = opcode;
	sqe->fd = -1;
	sqe->addr = target;
	sqe->user_data = user_data;
	sbus_uring_push(r);
	return 0;
}

/* Cancels the request submitted with target, whatever its kind. */
static inline int
sbus_uring_cancel(struct sbus_uring *r, uint64_t target, uint64_t user_data)
{
	return sbus_uring_aim(r, IORING_OP_ASYNC_CANCEL, target, user_data);
}

/* Cancels the poll submitted with target. */
static inline int
sbus_uring_poll_remove(struct sbus_uring *r, uint64_t target, uint64_t user_data)
{
	return sbus_uring_aim(r, IORING_OP_POLL_REMOVE, target, user_data);
}

/* The oldest unread completion, or 0 when there is none. */
static inline int
sbus_uring_peek(struct sbus_uring *r, uint64_t *user_data, int32_t *res)
{
	unsigned head = *r->cq_head;
	if (head == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE))
		return 0;
	struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
	*user_data = cqe->user_data;
	*res = cqe->res;
	return 1;
}

static inline void
sbus_uring_advance(struct sbus_uring *r)
{
	__atomic_store_n(r->cq_head, *r->cq_head + 1, __ATOMIC_RELEASE);
}

#endif
