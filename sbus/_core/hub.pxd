# What the broker is around its message path: the rooms it embeds (peers,
# subs, flood, control), the per-connection lists the path fills, the loop's
# slow side, acting on the rooms' decisions, teardown, and the Python
# surface. broker.pyx's Broker extends Hub with the message path and the
# loop's turn; the methods marked "the message path's" are Broker's (a Hub
# alone is never made).
from libc.stdint cimport uint32_t, uint64_t

from sbus._core.conn cimport Conn, Counters
from sbus._core.control cimport Control
from sbus._core.flood cimport Flood
from sbus._core.includes.sys cimport ucred
from sbus._core.loop cimport Poller
from sbus._core.peers cimport Peers
from sbus._core.protocol cimport CredForm
from sbus._core.subs cimport Subs


cdef enum:
    ACCEPT_BATCH = 64       # connections accepted per readable event


# What a live upgrade carries of the broker's own state (handover.pyx); the
# rooms' state crosses through the rooms' functions.
cdef struct Carried:
    Counters tot
    uint64_t seq
    uint64_t trimmed_at
    double started


cdef class Hub:
    # ---- the loop and the rooms
    cdef Poller poller
    cdef int wakeup_fd
    cdef Peers peers                # the connection table (peers.conns[fd]) and accounts
    cdef Subs subs                  # the index the message path matches against
    cdef Flood flood                # who holds the bus, and who is paused
    cdef Control ctl                # control messages and the upstream link
    # ---- lists of at most one entry per connection (grow_lists)
    cdef uint32_t list_cap
    cdef Conn **recips              # one message's recipients
    cdef Conn **touched             # recipients with pending deliveries this turn
    cdef uint32_t ntouched
    cdef Conn **blockers            # of those, the ones in a block mode (may_block_bus)
    cdef uint32_t nblockers
    cdef Conn **closing             # marked; torn down by finalize_closing
    cdef uint32_t nclosing

    # ---- configuration (the names of the configuration's options; the rest
    # is the rooms')
    cdef size_t max_message
    cdef bint auto_close
    cdef double log_messages        # fraction of messages sampled to on_message

    # ---- state
    cdef Counters tot               # broker-wide traffic counters
    cdef uint64_t seq               # messages published since start
    cdef uint64_t rng               # xorshift state for sampling
    cdef uint64_t trimmed_at        # disconnects at the last malloc_trim
    cdef double now
    cdef double started
    cdef double next_tick
    cdef double tick_interval
    cdef bint running
    cdef bint signalled             # the wakeup fd fired: run signal handlers after the turn
    cdef object stop_reason
    cdef dict close_details
    cdef object on_event
    cdef object on_message
    cdef object on_tick
    cdef object callback_error      # the first exception a callback raised this turn
    cdef dict last_totals
    # ---- the access policy (sbus.access; docs/policy.md): None, or the
    # Policy whose compiled tables the connections point at
    cdef object policy
    cdef dict tables                # Access -> acl.Table, one per identity
    cdef dict user_names            # uid -> name or None, when the policy uses %u
    cdef uint64_t denied            # publishes it denied since start
    cdef dict policy_uids           # uid -> [publishes denied, SUBs refused], kept after
    #                                 its connections leave: the per-uid counters
    cdef double deny_window         # the second publish_denied records are counted in
    cdef uint32_t deny_logged       # ...records written in it
    cdef uint64_t deny_suppressed   # records left out since the last one written

    # ---- the message path's (Broker)
    cdef int flush_pending(self) except -1       # every recipient's chain, then the turn's packets
    cdef int flush_deliveries(self) except -1    # every recipient's chain; the slots stay
    cdef int reply(self, Conn *c, bytes packet) except -1   # behind c's deliveries
    cdef int mark_closing(self, Conn *c, int reason, detail) except -1   # first reason wins
    cdef int release_buffers(self) except -1     # madvise away pages large packets touched
    cdef bint at_safe_point(self) noexcept       # nothing read, pending or closing

    # ---- the loop's slow side
    cdef int poll_timeout(self) noexcept         # ms until the next tick or block check
    cdef int housekeeping(self) except -1        # on the tick: trim memory, on_tick
    cdef int raise_callback_error(self) except -1   # the turn's kept exception, once

    # ---- acting on the rooms' decisions
    cdef int accept_clients(self) except -1      # up to ACCEPT_BATCH per event
    cdef int admit(self, int fd, ucred *cred) except -1   # peers.refusal, else open_conn
    # The one way a connection joins the table (admit, attach_link, the
    # hand-over): the lists grown for it first, then peers.conn_open.
    cdef Conn *open_conn(self, int fd, ucred *cred, bint link) except NULL
    cdef int give_access(self, Conn *c) except -1   # c.access: its identity's table
    cdef int policy_decide(self, Conn *c, const char *key, size_t klen,
                           const CredForm *form) except? -2   # c.memo missed: acl_decide
    cdef int deny_publish(self, Conn *c, const char *key, size_t klen,
                          int decided) except -1    # count, log, drop or close
    cdef int count_for_uid(self, uint32_t uid, int which) except -1   # 0 publish, 1 SUB
    cdef int grow_lists(self, uint32_t need) except -1   # one entry per connection
    cdef int subscribe(self, Conn *c, const char *pat, size_t n) except -1    # refused: close
    cdef int unsubscribe(self, Conn *c, const char *pat, size_t n) except -1  # '!' misuse: close
    cdef int act(self, Conn *c, int action) except -1    # a control.CTL_ decision about c
    cdef int link_note(self, bytes packet) except -1     # tell the link, if it is told
    cdef int release(self, Conn *c) except -1            # c may stop holding the bus
    cdef int pause(self, Conn *c) except -1              # stop reading c until resume_all
    cdef int resume_all(self) except -1                  # read every paused connection again
    cdef int check_block_timeouts(self) except -1        # close who held it block_timeout
    cdef int update_interest(self, Conn *c) except -1    # read unless paused, write if queued

    # ---- closing: marked by mark_closing, torn down at the end of the turn
    cdef int finalize_closing(self) except -1    # free, log client_disconnect, auto_close
    cdef void count_drops_disconnect(self, Conn *c, uint64_t n) noexcept

    # ---- reporting (records: report.pyx)
    cdef int emit(self, str name, dict fields) except -1   # on_event; an exception is kept
    cdef int keep_callback_error(self, object err) except -1   # the first of the turn
    cdef int sample(self, Conn *c, const char *key, size_t klen, size_t n,
                    uint32_t fanout) except -1      # on_message for a log_messages share

    # ---- the live upgrade (handover.pyx)
    cdef int quiesce(self) except -1             # bring a stopped broker to the safe point
    cdef int resume(self) except -1              # let run() serve again
    cdef dict carry(self, Carried *out)          # fills out; returns last_totals
    cdef int restore_carried(self, const Carried *c, object last_totals) except -1
