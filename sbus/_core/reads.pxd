# How many packets the broker asks a connection for in one read (Conn.recv_want):
# about as many as it had lately. A read that asks for more than there is pays
# for a failed receive (recvmmsg), or for a failed receive per packet missing
# where each packet asked for is a receive of its own (io_uring's recv_batch,
# per_op); with many publishers of one packet a turn each that is a large
# share of the receive cost. Inline functions only, for broker.pyx.
from libc.stdint cimport uint8_t, uint32_t

from sbus._core.conn cimport Conn


cdef enum:
    RECV_BATCH = 32         # packets read from one connection per recvmmsg, at most
    RECV_GROW_AFTER = 2     # full reads in a row before a connection is asked for more


cdef inline uint32_t read_want(Conn *c, uint32_t room, bint per_op) noexcept:
    """How many packets to ask c for, with room slots free; per_op (each a
    receive of its own, recv_batch), a new record starts at one."""
    if c.recv_want == 0:
        c.recv_want = 1 if per_op else RECV_BATCH    # a new record: nothing known yet
    return c.recv_want if room > c.recv_want else room


cdef inline void note_read(Conn *c, uint32_t want, int got, bint per_op) noexcept:
    """Adjusts c.recv_want after a read that asked for want packets and got
    got: a read that asks for more than there is pays for a failed receive
    (recvmmsg), or for a failed receive per packet missing (per_op)."""
    if got == <int>want:
        # Full: there may be more. Ask for more only once it keeps filling,
        # so one packet a turn settles at one without a failed read; a
        # backlog still doubles its way to RECV_BATCH.
        c.recv_full += 1
        if c.recv_full >= RECV_GROW_AFTER and want == c.recv_want:
            c.recv_want = RECV_BATCH if want * 2 > RECV_BATCH else <uint8_t>(want * 2)
            c.recv_full = 0
    elif got > 0:
        # Drained: shrink slowly, so a stream whose turns vary keeps its
        # large reads; per_op, to what there was, each extra costing a receive.
        c.recv_full = 0
        c.recv_want = <uint8_t>(got if per_op or got > c.recv_want - 1 else c.recv_want - 1)
