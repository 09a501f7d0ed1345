# cython: language_level=3
"""Flood control's state (see flood.pxd): holding and releasing the bus,
pausing readers while it is held, and the block timeout."""
from libc.stdint cimport uint32_t
from libc.stdlib cimport realloc, free

from sbus._core.policy cimport holds_bus


cdef int flood_init(Flood *f, config) except -1:
    f.queue_max_bytes = config.queue_max_bytes
    f.queue_max_msgs = config.queue_max_msgs
    f.total_max_bytes = config.total_max_bytes
    f.block_timeout = config.block_timeout
    f.nblocking = 0
    f.paused = NULL
    f.npaused = 0
    f.resumed = 0
    f.cap = 0
    return 0


cdef void flood_free(Flood *f) noexcept:
    free(f.paused)
    f.paused = NULL


cdef int flood_reserve(Flood *f, uint32_t cap) except -1:
    cdef Conn **grown
    if cap <= f.cap:
        return 0
    grown = <Conn **>realloc(f.paused, cap * sizeof(Conn *))
    if grown == NULL:
        raise MemoryError()
    f.paused = grown
    f.cap = cap
    return 0


cdef bint stop_blocking(Flood *f, Conn *c) noexcept:
    c.blocking = 0
    f.nblocking -= 1
    return f.nblocking == 0


cdef bint release(Flood *f, Conn *c) noexcept:
    if holds_bus(c.soft, c.hard, c.q.live, c.q.bytes, f.queue_max_bytes, f.queue_max_msgs):
        return False
    return stop_blocking(f, c)


cdef bint pause(Flood *f, Conn *c) noexcept:
    if c.paused:
        return False
    c.paused = 1
    f.paused[f.npaused] = c
    f.npaused += 1
    return True


cdef Conn *next_resumed(Flood *f) noexcept:
    """In the order they were paused; the list is empty once it says NULL."""
    cdef Conn *c
    if f.resumed == f.npaused:
        f.npaused = f.resumed = 0
        return NULL
    c = f.paused[f.resumed]
    f.resumed += 1
    c.paused = 0
    return c


cdef void forget(Flood *f, Conn *c) noexcept:
    cdef uint32_t j
    for j in range(f.npaused):
        if f.paused[j] == c:
            f.npaused -= 1
            f.paused[j] = f.paused[f.npaused]
            return


cdef bint timed_out(Flood *f, Conn *c, double now) noexcept:
    return c.blocking and not c.closing and now - c.block_since >= f.block_timeout


cdef str timeout_detail(Flood *f):
    return f"kept the bus blocked for {f.block_timeout:g}s"


cdef void restore_blocking(Flood *f, Conn *c, double since) noexcept:
    c.blocking = 1
    c.block_since = since
    f.nblocking += 1
