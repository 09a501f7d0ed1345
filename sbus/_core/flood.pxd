# Flood control's state: the queue limits, who holds the bus (a connection
# in a block mode over a limit), and who is paused while it is held. The
# decisions themselves are policy.pxd's; the broker embeds one Flood, reads
# nblocking and the limits on the message path, and changes them only
# through these functions, acting on what they return (set a connection's
# interest, resume the paused, close who held the bus too long).
from libc.stdint cimport uint32_t, uint64_t

from sbus._core.conn cimport Conn, MODE_BLOCK
from sbus._core.policy cimport FloodAction, flood_action
from sbus._core.sendq cimport get_packet_stats


cdef struct Flood:
    uint64_t queue_max_bytes
    uint64_t queue_max_msgs
    uint64_t total_max_bytes
    double block_timeout
    uint32_t nblocking      # connections holding the bus
    Conn **paused           # not read while the bus is held
    uint32_t npaused
    uint32_t resumed        # next_resumed's place in paused
    uint32_t cap            # of paused: one entry per connection


cdef int flood_init(Flood *f, config) except -1
cdef void flood_free(Flood *f) noexcept
cdef int flood_reserve(Flood *f, uint32_t cap) except -1

cdef bint stop_blocking(Flood *f, Conn *c) noexcept   # True: the bus is free now
cdef bint release(Flood *f, Conn *c) noexcept         # stop_blocking unless it holds_bus
cdef bint pause(Flood *f, Conn *c) noexcept           # True: newly paused
cdef Conn *next_resumed(Flood *f) noexcept            # a paused one, unpaused; NULL: none
cdef void forget(Flood *f, Conn *c) noexcept          # a closing one out of the paused
cdef bint timed_out(Flood *f, Conn *c, double now) noexcept   # held the bus block_timeout
cdef str timeout_detail(Flood *f)
# The hand-over: whether c holds the bus, and since when; whether it is
# paused (Hub.pause pauses it again); c held the bus (since) in the old process.
cdef inline bint holds_since(const Conn *c, double *since) noexcept nogil:
    since[0] = c.block_since
    return c.blocking

cdef inline bint is_paused(const Conn *c) noexcept nogil:
    return c.paused

cdef void restore_blocking(Flood *f, Conn *c, double since) noexcept


cdef inline void start_blocking(Flood *f, Conn *c, double now) noexcept nogil:
    if not c.blocking:
        c.blocking = 1
        c.block_since = now
        c.counts.blocks += 1
        f.nblocking += 1


# The slow path of a full socket: what to do with a delivery of length bytes
# that c cannot take now (policy.flood_action); over a limit in a block mode,
# c holds the bus from now. fresh: no packet holds these bytes yet, so
# queueing them adds to the broker-wide total. Inline: it runs per delivery
# to a slow reader, on the broker's message path.
cdef inline FloodAction on_full(Flood *f, Conn *c, uint64_t length, bint reply, bint fresh,
                                double now) noexcept nogil:
    cdef bint over = (c.q.bytes + length > f.queue_max_bytes or
                      c.q.live + 1 > f.queue_max_msgs or
                      c.acct.queued_bytes + length > c.acct.max_queued_bytes or
                      (fresh and get_packet_stats().bytes + length > f.total_max_bytes))
    cdef FloodAction action = flood_action(c.soft, c.hard, c.blocking, reply, over)
    if over and action == FloodAction.FLOOD_QUEUE_BLOCK:
        start_blocking(f, c, now)      # over a limit: hold the bus first
    return action


# Whether flushing pend_bytes in npend deliveries could make c (a recipient
# in a block mode) hold the bus, with packet_bytes in packets now.
cdef inline bint could_block(Flood *f, Conn *c, uint64_t pend_bytes, uint64_t npend,
                             uint64_t packet_bytes) noexcept nogil:
    return c.soft == MODE_BLOCK or (
        c.q.bytes + pend_bytes > f.queue_max_bytes or
        c.q.live + npend > f.queue_max_msgs or
        c.acct.queued_bytes + pend_bytes > c.acct.max_queued_bytes or
        packet_bytes + pend_bytes > f.total_max_bytes)


# Whether flushing could make any of blockers[0:n] hold the bus (could_block).
cdef inline bint any_could_block(Flood *f, Conn **blockers, uint32_t n, uint64_t pend_bytes,
                                 uint64_t npend, uint64_t packet_bytes) noexcept nogil:
    cdef uint32_t i
    for i in range(n):
        if could_block(f, blockers[i], pend_bytes, npend, packet_bytes):
            return True
    return False
