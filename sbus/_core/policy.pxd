# Flood control as pure decisions: what to do with a delivery that cannot be
# written now, and whether a connection still holds the bus. No state is
# changed here; flood.pxd acts on the answer (on_full, release).
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from sbus._core.conn cimport MODE_DISCARD, MODE_BLOCK, MODE_ERROR


cpdef enum FloodAction:
    FLOOD_QUEUE = 0         # queue it
    FLOOD_QUEUE_BLOCK = 1   # queue it and hold the bus until the queue drains
    FLOOD_DROP_SOFT = 2     # discard it: soft mode discard
    FLOOD_DROP_HARD = 3     # discard it: over the queue limit, hard mode discard
    FLOOD_CLOSE_SOFT = 4    # disconnect: soft mode error
    FLOOD_CLOSE_HARD = 5    # disconnect: over the queue limit, hard mode error


cdef inline FloodAction flood_action(uint8_t soft, uint8_t hard, bint blocking,
                                     bint reply, bint over) noexcept nogil:
    """The action for one delivery that would block a connection in modes
    soft/hard, which already holds the bus (blocking) or not; reply: the
    broker's own control reply; over: queueing it passes a queue limit."""
    # The soft modes are about deliveries. The broker's own reply is what a
    # client waits for (whoami as a barrier): it is queued, and only the
    # hard limit can refuse it.
    if soft == MODE_DISCARD and not reply:
        return FLOOD_DROP_SOFT
    if soft == MODE_ERROR and not reply:
        return FLOOD_CLOSE_SOFT
    if over:
        # A connection in a block mode has already stopped the bus: what the
        # current receive batch still holds is queued beyond the limit (at
        # most one batch), so blocking loses nothing.
        if blocking and (soft == MODE_BLOCK or hard == MODE_BLOCK):
            return FLOOD_QUEUE_BLOCK
        if hard == MODE_DISCARD:
            return FLOOD_DROP_HARD
        if hard == MODE_ERROR:
            return FLOOD_CLOSE_HARD
        return FLOOD_QUEUE_BLOCK    # hard block: keep it, hold the bus
    if soft == MODE_BLOCK and not reply:
        return FLOOD_QUEUE_BLOCK
    return FLOOD_QUEUE


cdef inline bint holds_bus(uint8_t soft, uint8_t hard, uint32_t queued_msgs,
                           uint64_t queued_bytes, uint64_t max_bytes,
                           uint64_t max_msgs) noexcept nogil:
    """Whether a blocking connection keeps the bus blocked: soft block until
    its queue is empty, hard block while the queue is at a limit."""
    return ((soft == MODE_BLOCK and queued_msgs > 0) or
            (hard == MODE_BLOCK and (queued_bytes >= max_bytes or queued_msgs >= max_msgs)))
