# Readiness backends for the broker's event loop: one small interface
# (set interest, poll) with epoll, select(2) and io_uring implementations,
# and for io_uring a batched receive (recv_batch).
#
# Between loop turns nothing received is in flight or held: recv_batch
# returns only once every receive it submitted has completed (or been
# cancelled and its completion reaped), into buffers the caller owns, and
# the io_uring ring never owns receive buffers (no provided-buffer ring, no
# multishot receive). What a Poller carries from one poll() to the next is
# readiness only (armed polls, completions of polls reaped early by
# recv_batch): a new process that takes over the connections loses nothing
# by dropping it and polling afresh.
from libc.stdint cimport uint32_t, int32_t

from sbus._core.includes.sys cimport epoll_event


cdef extern from "csrc/uring.h" nogil:
    struct sbus_uring:
        int fd
        unsigned unsubmitted
    enum:
        POLLIN
        POLLOUT
        ECANCELED
        EINPROGRESS
    int sbus_uring_init(sbus_uring *r, unsigned entries)
    void sbus_uring_free(sbus_uring *r)
    int sbus_uring_submit(sbus_uring *r, int wait, int timeout_ms)
    int sbus_uring_poll_add(sbus_uring *r, int fd, unsigned events, unsigned long long user_data)
    int sbus_uring_poll_remove(sbus_uring *r, unsigned long long target,
                               unsigned long long user_data)
    int sbus_uring_recv(sbus_uring *r, int fd, void *buf, unsigned len,
                        unsigned long long user_data)
    int sbus_uring_cancel(sbus_uring *r, unsigned long long target,
                          unsigned long long user_data)
    int sbus_uring_peek(sbus_uring *r, unsigned long long *user_data, int *res)
    void sbus_uring_advance(sbus_uring *r)


cdef enum:
    EV_READ = 1
    EV_WRITE = 2
    EV_HUP = 4      # peer hung up or socket error; read to find out which


cdef struct Fired:
    int fd
    int mask


# One packet to receive in a batch (Poller.recv_batch).
cdef struct RecvOp:
    int fd
    char *buf
    uint32_t len
    int32_t res         # set: its length (0: EOF or an empty packet), or -errno (-EAGAIN: none)


# A completion recv_batch reaped that was not one of its receives.
cdef struct Held:
    unsigned long long tag
    int res


# Whether this is the interpreter's only thread: then a wait need not let
# go of the GIL (poll's keep_gil), which costs a mutex and a condition
# variable each way on every loop turn.
cdef bint only_thread() noexcept


cdef class Poller:
    cdef Fired *fired           # filled by poll(), consumed by the broker
    cdef int max_fired
    cdef unsigned char *interest  # fd-indexed EV_READ|EV_WRITE masks
    cdef int interest_cap
    cdef readonly str name
    cdef readonly str fallback    # why the backend asked for is not this one, or None
    cdef readonly bint batch_recv  # recv_batch is available
    cdef bint keep_gil            # poll() waits holding the GIL (set by the caller each turn)

    cdef int set(self, int fd, int mask) except -1
    cdef int poll(self, int timeout_ms) except -1
    cdef int recv_batch(self, RecvOp *ops, int n) except -1
    cdef int fd_limit(self) noexcept
    cdef int ensure(self, int fd) except -1


cdef class EpollPoller(Poller):
    cdef int epfd
    cdef epoll_event *events


cdef class SelectPoller(Poller):
    cdef int maxfd


cdef class IoUringPoller(Poller):
    cdef sbus_uring ring
    cdef unsigned char *armed     # fd-indexed: the mask of its one-shot poll in flight, or 0
    cdef uint32_t *gen            # fd-indexed: the generation of its current poll
    cdef int *rearm               # the fds that fired last poll(): armed again before waiting
    cdef int nrearm
    cdef int state_cap
    cdef Held *held               # poll completions recv_batch reaped, for the next poll()
    cdef int nheld
    cdef int held_cap

    cdef int grow_state(self, int fd) except -1
    cdef int arm(self, int fd, int mask) except -1
    cdef int hold(self, unsigned long long tag, int res) except -1
    cdef int fire(self, unsigned long long tag, int res, int count) noexcept
