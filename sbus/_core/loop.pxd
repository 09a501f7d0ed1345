# Readiness backends for the broker's event loop: one small interface
# (set interest, poll) with an epoll and a select(2) implementation.
from sbus._core.includes.sys cimport epoll_event


cdef enum:
    EV_READ = 1
    EV_WRITE = 2
    EV_HUP = 4      # peer hung up or socket error; read to find out which


cdef struct Fired:
    int fd
    int mask


cdef class Poller:
    cdef Fired *fired           # filled by poll(), consumed by the broker
    cdef int max_fired
    cdef unsigned char *interest  # fd-indexed EV_READ|EV_WRITE masks
    cdef int interest_cap
    cdef readonly str name

    cdef int set(self, int fd, int mask) except -1
    cdef int poll(self, int timeout_ms) except -1
    cdef int fd_limit(self) noexcept
    cdef int ensure(self, int fd) except -1


cdef class EpollPoller(Poller):
    cdef int epfd
    cdef epoll_event *events


cdef class SelectPoller(Poller):
    cdef int maxfd
