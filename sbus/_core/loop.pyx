# cython: language_level=3
"""epoll, select(2) and io_uring backends; the broker picks one by name at
start-up. io_uring falls back to epoll where the kernel lacks or refuses it
(``Poller.fallback`` says why).

Contract: ``set(fd, mask)`` registers, changes or (mask 0) removes interest;
a mask of 0 unregisters the fd entirely, so a paused or closing socket never
fires. ``poll(timeout_ms)`` fills ``fired[0:n]`` and returns n (0 on EINTR).
Every backend is level-triggered: an fd that stays ready fires again.
With ``keep_gil`` set, poll waits holding the GIL (see only_thread).
Where ``batch_recv`` is set, ``recv_batch(ops, n)`` receives one packet per
op, in order, and returns once every op has its result.
"""
from cpython.pystate cimport (
    PyInterpreterState, PyThreadState, PyInterpreterState_ThreadHead, PyThreadState_Next)
from libc.errno cimport errno, EAGAIN, EINTR, ENOENT
from libc.stdint cimport uint32_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memset, memmove
from posix.unistd cimport close

from sbus._core.includes.sys cimport (
    epoll_create1, epoll_ctl, epoll_wait, epoll_event,
    EPOLLIN, EPOLLOUT, EPOLLERR, EPOLLHUP, EPOLL_CLOEXEC,
    EPOLL_CTL_ADD, EPOLL_CTL_MOD, EPOLL_CTL_DEL,
    fd_set, FD_ZERO, FD_SET, FD_ISSET, FD_SETSIZE, select, timeval,
)

cdef enum:
    MAX_FIRED = 1024     # select can report every fd below FD_SETSIZE at once
    URING_ENTRIES = 1024     # submission ring; a fuller one is submitted early
    REMOVE_TAG = 1 << 62     # user_data of a POLL_REMOVE's or a cancel's own completion

# user_data of a receive of recv_batch: RECV_TAG | its index in the batch
# (poll tags use the low 62 bits).
cdef unsigned long long RECV_TAG = (<unsigned long long>1) << 63


cdef extern from "Python.h":
    PyInterpreterState *PyInterpreterState_Get() noexcept


cdef extern from *:
    """
    #include <poll.h>
    #include <sys/epoll.h>
    /* fired_mask reads epoll's events and io_uring's poll results alike. */
    _Static_assert(EPOLLIN == POLLIN && EPOLLOUT == POLLOUT && EPOLLERR == POLLERR
                   && EPOLLHUP == POLLHUP, "epoll and poll(2) readiness bits differ");
    """


cdef inline int fired_mask(uint32_t events) noexcept nogil:
    """Readiness as the loop's EV_* bits: a hang-up or an error is also a
    read, which finds out what is wrong."""
    cdef int mask = 0
    if events & EPOLLIN:
        mask |= EV_READ
    if events & EPOLLOUT:
        mask |= EV_WRITE
    if events & (EPOLLHUP | EPOLLERR):
        mask |= EV_HUP | EV_READ
    return mask


cdef bint only_thread() noexcept:
    # Every Python thread's state is on this list from before it starts (the
    # starting thread makes it, holding the GIL), so a thread started from
    # Python is seen on the next turn, before the loop waits again. One that
    # C code starts later (PyGILState_Ensure) waits for the GIL at most one
    # wait; sbusd starts none.
    cdef PyThreadState *head = PyInterpreterState_ThreadHead(PyInterpreterState_Get())
    return head != NULL and PyThreadState_Next(head) == NULL


cdef int raise_oserror(str what) except -1:
    return raise_errno(errno, what)


cdef int raise_errno(int err, str what) except -1:
    import os
    raise OSError(err, f"{what}: {os.strerror(err)}")


cdef class Poller:
    def __cinit__(self, *args, **kwargs):
        self.fired = <Fired *>malloc(MAX_FIRED * sizeof(Fired))
        self.max_fired = MAX_FIRED
        self.interest = NULL
        self.interest_cap = 0
        if self.fired == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.fired)
        free(self.interest)

    cdef int ensure(self, int fd) except -1:
        cdef int cap
        cdef unsigned char *grown
        if fd < self.interest_cap:
            return 0
        cap = self.interest_cap * 2 if self.interest_cap else 1024
        while cap <= fd:
            cap *= 2
        grown = <unsigned char *>realloc(self.interest, cap)
        if grown == NULL:
            raise MemoryError()
        memset(grown + self.interest_cap, 0, cap - self.interest_cap)
        self.interest = grown
        self.interest_cap = cap
        return 0

    cdef int set(self, int fd, int mask) except -1:
        raise NotImplementedError

    cdef int poll(self, int timeout_ms) except -1:
        raise NotImplementedError

    cdef int recv_batch(self, RecvOp *ops, int n) except -1:
        raise NotImplementedError

    cdef int fd_limit(self) noexcept:
        return 1 << 30


cdef class EpollPoller(Poller):
    def __cinit__(self, *args, **kwargs):
        self.name = "epoll"
        self.events = <epoll_event *>malloc(MAX_FIRED * sizeof(epoll_event))
        if self.events == NULL:
            raise MemoryError()
        self.epfd = epoll_create1(EPOLL_CLOEXEC)
        if self.epfd < 0:
            raise_oserror("epoll_create1")

    def __dealloc__(self):
        if self.epfd >= 0:
            close(self.epfd)
        free(self.events)

    cdef int set(self, int fd, int mask) except -1:
        cdef epoll_event ev
        cdef int old, op
        self.ensure(fd)
        old = self.interest[fd]
        if old == mask:
            return 0
        self.interest[fd] = <unsigned char>mask
        ev.events = 0
        if mask & EV_READ:
            ev.events |= EPOLLIN
        if mask & EV_WRITE:
            ev.events |= EPOLLOUT
        ev.data.u64 = 0
        ev.data.fd = fd
        if mask == 0:
            op = EPOLL_CTL_DEL
        elif old == 0:
            op = EPOLL_CTL_ADD
        else:
            op = EPOLL_CTL_MOD
        if epoll_ctl(self.epfd, op, fd, &ev) < 0:
            if op == EPOLL_CTL_DEL and errno == ENOENT:
                return 0
            self.interest[fd] = <unsigned char>old
            raise_oserror("epoll_ctl")
        return 0

    cdef int poll(self, int timeout_ms) except -1:
        cdef int n, i
        if self.keep_gil:
            n = epoll_wait(self.epfd, self.events, self.max_fired, timeout_ms)
        else:
            with nogil:
                n = epoll_wait(self.epfd, self.events, self.max_fired, timeout_ms)
        if n < 0:
            if errno == EINTR:
                return 0
            raise_oserror("epoll_wait")
        for i in range(n):
            self.fired[i].fd = self.events[i].data.fd
            self.fired[i].mask = fired_mask(self.events[i].events)
        return n


cdef class SelectPoller(Poller):
    """select(2): fds at or above FD_SETSIZE cannot be watched (fd_limit)."""

    def __cinit__(self, *args, **kwargs):
        self.name = "select"
        self.maxfd = -1

    cdef int fd_limit(self) noexcept:
        return FD_SETSIZE

    cdef int set(self, int fd, int mask) except -1:
        if fd >= FD_SETSIZE:
            raise OSError(24, f"fd {fd} is beyond select's FD_SETSIZE ({FD_SETSIZE})")
        self.ensure(fd)
        self.interest[fd] = <unsigned char>mask
        if mask and fd > self.maxfd:
            self.maxfd = fd
        elif not mask and fd == self.maxfd:
            while self.maxfd >= 0 and self.interest[self.maxfd] == 0:
                self.maxfd -= 1
        return 0

    cdef int poll(self, int timeout_ms) except -1:
        cdef fd_set rset, wset
        cdef timeval tv
        cdef timeval *tvp = NULL
        cdef int fd, n, count = 0, mask
        cdef int top = self.maxfd
        FD_ZERO(&rset)
        FD_ZERO(&wset)
        for fd in range(top + 1):
            if self.interest[fd] & EV_READ:
                FD_SET(fd, &rset)
            if self.interest[fd] & EV_WRITE:
                FD_SET(fd, &wset)
        if timeout_ms >= 0:
            tv.tv_sec = timeout_ms // 1000
            tv.tv_usec = (timeout_ms % 1000) * 1000
            tvp = &tv
        if self.keep_gil:
            n = select(top + 1, &rset, &wset, NULL, tvp)
        else:
            with nogil:
                n = select(top + 1, &rset, &wset, NULL, tvp)
        if n < 0:
            if errno == EINTR:
                return 0
            raise_oserror("select")
        fd = 0
        while fd <= top and n > 0 and count < self.max_fired:
            mask = 0
            if FD_ISSET(fd, &rset):
                mask |= EV_READ
            if FD_ISSET(fd, &wset):
                mask |= EV_WRITE
            if mask:
                self.fired[count].fd = fd
                self.fired[count].mask = mask
                count += 1
            fd += 1
        return count


cdef inline unsigned long long poll_tag(int fd, uint32_t gen) noexcept nogil:
    return (<unsigned long long>(gen & 0x3fffffff) << 32) | <unsigned int>fd


cdef class IoUringPoller(Poller):
    """io_uring: a one-shot POLL_ADD per watched fd, armed again after it
    fires, and one io_uring_enter per poll() that submits the turn's polls
    and waits. One-shot polls check readiness when armed, so an fd that
    stays readable fires again, as with epoll. recv_batch receives the
    packets of every readable connection with one io_uring_enter, where
    recvmmsg takes a system call per connection. Raises OSError where the
    kernel lacks io_uring, refuses it, or lacks what this needs (5.11)."""

    def __cinit__(self, *args, **kwargs):
        cdef int err
        self.name = "io_uring"
        self.batch_recv = True
        self.armed = NULL
        self.gen = NULL
        self.held = NULL
        self.rearm = <int *>malloc(MAX_FIRED * sizeof(int))
        if self.rearm == NULL:
            raise MemoryError()
        err = sbus_uring_init(&self.ring, URING_ENTRIES)
        if err < 0:
            raise_errno(-err, "io_uring_setup")

    def __dealloc__(self):
        sbus_uring_free(&self.ring)
        free(self.armed)
        free(self.gen)
        free(self.rearm)
        free(self.held)

    cdef int grow_state(self, int fd) except -1:
        cdef int cap
        cdef unsigned char *armed
        cdef uint32_t *gen
        self.ensure(fd)
        if fd < self.state_cap:
            return 0
        cap = self.interest_cap
        armed = <unsigned char *>realloc(self.armed, cap)
        if armed == NULL:
            raise MemoryError()
        self.armed = armed
        gen = <uint32_t *>realloc(self.gen, cap * sizeof(uint32_t))
        if gen == NULL:
            raise MemoryError()
        self.gen = gen
        memset(self.armed + self.state_cap, 0, cap - self.state_cap)
        memset(self.gen + self.state_cap, 0, (cap - self.state_cap) * sizeof(uint32_t))
        self.state_cap = cap
        return 0

    cdef int arm(self, int fd, int mask) except -1:
        cdef unsigned events = 0
        cdef int err
        if mask & EV_READ:
            events |= POLLIN
        if mask & EV_WRITE:
            events |= POLLOUT
        self.gen[fd] += 1
        err = sbus_uring_poll_add(&self.ring, fd, events, poll_tag(fd, self.gen[fd]))
        if err < 0:
            raise_errno(-err, "io_uring poll_add")
        self.armed[fd] = <unsigned char>mask
        return 0

    cdef int set(self, int fd, int mask) except -1:
        cdef int err
        self.grow_state(fd)
        self.interest[fd] = <unsigned char>mask
        if self.armed[fd] == mask:
            return 0
        if self.armed[fd]:
            err = sbus_uring_poll_remove(&self.ring, poll_tag(fd, self.gen[fd]), REMOVE_TAG)
            if err < 0:
                raise_errno(-err, "io_uring poll_remove")
            self.armed[fd] = 0
            self.gen[fd] += 1       # whatever the removed poll still reports is stale
        if mask:
            self.arm(fd, mask)
        else:
            # The caller may close fd next and a new connection reuse its
            # number: the removal must reach the kernel first.
            err = sbus_uring_submit(&self.ring, 0, 0)
            if err < 0 and err != -EINTR:
                raise_errno(-err, "io_uring_enter")
        return 0

    cdef int fire(self, unsigned long long tag, int res, int count) noexcept:
        """Turns a completion into fired[count]; returns 1, or 0 for one
        that fires nothing (a removal's own, a poll since removed or
        replaced, a cancelled poll)."""
        cdef int fd, mask
        if tag & REMOVE_TAG:
            return 0
        fd = <int><uint32_t>tag      # poll_tag: the fd is the low 32 bits
        if fd >= self.state_cap or tag != poll_tag(fd, self.gen[fd]):
            return 0
        self.armed[fd] = 0
        self.rearm[self.nrearm] = fd
        self.nrearm += 1
        if res < 0:
            if res == -ECANCELED:
                return 0
            mask = EV_HUP | EV_READ     # let the read find out what is wrong
        else:
            mask = fired_mask(<uint32_t>res)
        self.fired[count].fd = fd
        self.fired[count].mask = mask
        return 1

    cdef int hold(self, unsigned long long tag, int res) except -1:
        cdef int cap
        cdef Held *grown
        if self.nheld == self.held_cap:
            cap = self.held_cap * 2 if self.held_cap else 64
            grown = <Held *>realloc(self.held, cap * sizeof(Held))
            if grown == NULL:
                raise MemoryError()
            self.held = grown
            self.held_cap = cap
        self.held[self.nheld].tag = tag
        self.held[self.nheld].res = res
        self.nheld += 1
        return 0

    cdef int poll(self, int timeout_ms) except -1:
        cdef int i, fd, err, count = 0
        cdef int res
        cdef unsigned long long tag
        for i in range(self.nrearm):
            fd = self.rearm[i]
            if self.interest[fd] and not self.armed[fd]:
                self.arm(fd, self.interest[fd])
        self.nrearm = 0
        # Completions recv_batch kept are older than any in the ring: with
        # some, this only submits.
        if self.keep_gil:
            err = sbus_uring_submit(&self.ring, self.nheld == 0, timeout_ms)
        else:
            with nogil:
                err = sbus_uring_submit(&self.ring, self.nheld == 0, timeout_ms)
        if err < 0 and err != -EINTR:
            raise_errno(-err, "io_uring_enter")
        i = 0
        while i < self.nheld and count < self.max_fired:
            count += self.fire(self.held[i].tag, self.held[i].res, count)
            i += 1
        if i:
            self.nheld -= i
            memmove(self.held, self.held + i, self.nheld * sizeof(Held))
        while count < self.max_fired and sbus_uring_peek(&self.ring, &tag, &res):
            sbus_uring_advance(&self.ring)
            count += self.fire(tag, res, count)
        return count

    cdef int recv_batch(self, RecvOp *ops, int n) except -1:
        cdef int i, err, res, done = 0
        cdef unsigned long long tag
        cdef bint cancelled = False
        for i in range(n):
            ops[i].res = -EINPROGRESS
            err = sbus_uring_recv(&self.ring, ops[i].fd, ops[i].buf, ops[i].len, RECV_TAG | <unsigned>i)
            if err < 0:
                raise_errno(-err, "io_uring recv")
        while True:
            while self.ring.unsubmitted:
                err = sbus_uring_submit(&self.ring, 0, 0)
                if err < 0 and err != -EINTR:
                    raise_errno(-err, "io_uring_enter")
            while sbus_uring_peek(&self.ring, &tag, &res):
                sbus_uring_advance(&self.ring)
                if tag & RECV_TAG:
                    # One taken back before it found a packet read nothing.
                    ops[tag & ~RECV_TAG].res = -EAGAIN if res == -ECANCELED else res
                    done += 1
                else:
                    self.hold(tag, res)
            if done == n:
                return 0
            if not cancelled:
                # A kernel that waits for data in spite of MSG_DONTWAIT:
                # take back what it still waits on, so nothing is received
                # after this returns.
                cancelled = True
                for i in range(n):
                    if ops[i].res == -EINPROGRESS:
                        err = sbus_uring_cancel(&self.ring, RECV_TAG | <unsigned>i, REMOVE_TAG)
                        if err < 0:
                            raise_errno(-err, "io_uring cancel")
                continue
            with nogil:
                err = sbus_uring_submit(&self.ring, 1, -1)
            if err < 0 and err != -EINTR:
                raise_errno(-err, "io_uring_enter")


def backend_names():
    return ("epoll", "select", "io_uring")


cpdef Poller make_poller(str name):
    """The backend called name ('epoll', 'select' or 'io_uring'). Where
    io_uring is unavailable the epoll backend is returned, its ``fallback``
    saying why."""
    cdef Poller p
    if name == "epoll":
        return EpollPoller()
    if name == "select":
        return SelectPoller()
    if name == "io_uring":
        try:
            return IoUringPoller()
        except OSError as err:
            p = EpollPoller()
            p.fallback = f"io_uring is unavailable ({err.strerror or err}): using epoll"
            return p
    raise ValueError(f"unknown event-loop backend {name!r} (choose epoll, select or io_uring)")
