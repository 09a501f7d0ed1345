# cython: language_level=3
"""epoll and select(2) backends; the broker picks one by name at start-up.

Contract: ``set(fd, mask)`` registers, changes or (mask 0) removes interest;
a mask of 0 unregisters the fd entirely, so a paused or closing socket never
fires. ``poll(timeout_ms)`` fills ``fired[0:n]`` and returns n (0 on EINTR).
"""
from libc.errno cimport errno, EINTR, ENOENT
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memset
from posix.unistd cimport close

from sbus._core.includes.sys cimport (
    epoll_create1, epoll_ctl, epoll_wait, epoll_event,
    EPOLLIN, EPOLLOUT, EPOLLERR, EPOLLHUP, EPOLL_CLOEXEC,
    EPOLL_CTL_ADD, EPOLL_CTL_MOD, EPOLL_CTL_DEL,
    fd_set, FD_ZERO, FD_SET, FD_ISSET, FD_SETSIZE, select, timeval,
)

cdef enum:
    MAX_FIRED = 1024     # select can report every fd below FD_SETSIZE at once


cdef int raise_oserror(str what) except -1:
    import os
    raise OSError(errno, f"{what}: {os.strerror(errno)}")


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
        cdef int n, i, mask
        cdef unsigned int ev
        with nogil:
            n = epoll_wait(self.epfd, self.events, self.max_fired, timeout_ms)
        if n < 0:
            if errno == EINTR:
                return 0
            raise_oserror("epoll_wait")
        for i in range(n):
            ev = self.events[i].events
            mask = 0
            if ev & EPOLLIN:
                mask |= EV_READ
            if ev & EPOLLOUT:
                mask |= EV_WRITE
            if ev & (EPOLLHUP | EPOLLERR):
                mask |= EV_HUP | EV_READ
            self.fired[i].fd = self.events[i].data.fd
            self.fired[i].mask = mask
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


def backend_names():
    return ("epoll", "select")


cpdef Poller make_poller(str name):
    """The backend called name ('epoll' or 'select')."""
    if name == "epoll":
        return EpollPoller()
    if name == "select":
        return SelectPoller()
    raise ValueError(f"unknown event-loop backend {name!r} (choose epoll or select)")
