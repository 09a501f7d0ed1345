# Control messages (CMSG) and the upstream link. A client's CMSG sets its
# modes or asks whoami, stats, for the link place (link/attach) or for frames
# (link/frames: the broker's own uid or root, as link/attach); the link
# itself (sbusd --upstream's, or a bridge that claimed the place) tells the
# broker its identity upstream, log records and state (link/...). Each call
# returns a CTL_ decision the broker acts on, with what it needs in answer.
# The broker holds one Control and reads link, notes and answer.
from libc.stdint cimport uint8_t, uint64_t, int64_t

from sbus._core.conn cimport Conn


cdef enum:
    CTL_DONE = 0            # nothing for the broker to do
    CTL_ANSWER = 1          # reply answer (a packet) to the sender
    CTL_STATS = 2           # reply the broker's stats (stats_reply)
    CTL_MODES = 3           # the sender's modes changed: it may release the bus
    CTL_IGNORED = 4         # not a control message of this broker: log answer (a record)
    CTL_LOG = 5             # a record from the link: emit answer, (event, fields)


cdef class Control:
    cdef Conn *link             # the upstream link or a bridge in its place; NULL without one
    cdef bint notes             # tell the link of connections and subscriptions (a leaf's)
    cdef bytes upstream_cred    # the link's credentials upstream: the nesting prefix
    cdef dict upstream_state    # the link's last reported state, for stats
    cdef int64_t own_uid
    cdef uint64_t ignored       # CMSGs ignored since start
    cdef object answer          # what the last CTL_ANSWER, CTL_IGNORED or CTL_LOG carries

    cdef int control(self, Conn *c, const char *key, size_t n) except -1
    cdef int from_link(self, const char *key, size_t n, const char *payload,
                       size_t plen) except -1
    cdef int claim(self, Conn *c) except -1      # link/attach: CTL_ANSWER
    cdef int grant_frames(self, Conn *c) except -1   # link/frames: CTL_ANSWER
    cdef int attach(self, Conn *c) except -1     # c, a link conn_open made, is the upstream link
    cdef bint detach(self, Conn *c) noexcept     # c is closing; True if it was the link
    # The length of "<upstream credentials>/" that starts a pattern in the
    # nested form under this leaf's own upstream identity, else 0.
    cdef size_t nested_prefix(self, const char *pat, size_t n) noexcept
    # The hand-over: what the old process's Control knew, as carry gives it
    # (upstream_cred, upstream_state, ignored).
    cdef tuple carry(self)
    cdef int restore(self, bytes upstream_cred, dict upstream_state, uint64_t ignored) except -1
    cdef bint restore_link(self, Conn *c) noexcept   # False: it has one already


cdef bytes stats_reply(dict snapshot, size_t max_message)


# A connection's modes, as its CMSGs set them (the hand-over carries them).
cdef struct Modes:
    uint8_t soft            # conn Mode
    uint8_t hard            # conn Mode, never MODE_QUEUE
    uint8_t order           # sendq Order
    uint8_t echo


cdef void modes_of(const Conn *c, Modes *out) noexcept
# False, c unchanged: modes no connection could have set.
cdef bint restore_modes(Conn *c, const Modes *m) noexcept
