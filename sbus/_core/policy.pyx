# cython: language_level=3
"""Flood-control decisions (see policy.pxd), and their names for Python.

The broker cimports the inline functions; the ``def`` wrappers here let a
table test call the very same decisions without a broker.
"""
from libc.stdint cimport uint32_t, uint64_t

# The modes and orders by their wire names, indexed by conn.Mode and sendq.Order.
MODE_NAMES = ("queue", "discard", "block", "error")
ORDER_NAMES = ("queue", "stack", "random")


def decide(str soft, str hard, bint blocking, bint reply, bint over):
    """The FloodAction for a delivery that would block (see flood_action)."""
    cdef FloodAction action = flood_action(MODE_NAMES.index(soft), MODE_NAMES.index(hard),
                                           blocking, reply, over)
    return action


def still_blocking(str soft, str hard, uint32_t queued_msgs, uint64_t queued_bytes,
                   uint64_t max_bytes, uint64_t max_msgs):
    """Whether a blocking connection keeps holding the bus (see holds_bus)."""
    return holds_bus(MODE_NAMES.index(soft), MODE_NAMES.index(hard), queued_msgs,
                     queued_bytes, max_bytes, max_msgs)
