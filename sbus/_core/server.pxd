# The server around the message path: the connection table and each
# connection's life (accept, subscriptions, control messages, closing), the
# loop that drives it, and the Python surface (run, stop, close, stats).
# broker.Broker extends it with the per-message path; the five methods under
# "the message path" are implemented there.
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t

from sbus._core.budget cimport Account, Accounts
from sbus._core.conn cimport Conn, Counters
from sbus._core.includes.sys cimport ucred
from sbus._core.index cimport Index, Sub
from sbus._core.loop cimport Poller
from sbus._core.report cimport Budgets


cdef enum:
    ACCEPT_BATCH = 64       # connections accepted per readable event


cdef class Server:
    cdef Poller poller
    cdef int listen_fd
    cdef int wakeup_fd
    cdef int spare_fd               # given up when accept runs out of descriptors
    cdef Index index                # the segment trie of every subscription
    cdef Conn **conns               # fd-indexed; NULL where no connection
    cdef int conns_cap
    cdef uint32_t nconns
    cdef uint32_t list_cap          # capacity of the per-connection lists below
    cdef Conn **recips              # one message's recipients
    cdef Conn **touched             # recipients with pending deliveries this batch
    cdef uint32_t ntouched
    cdef Conn **closing             # marked; torn down by finalize_closing
    cdef uint32_t nclosing
    cdef Conn **paused              # not read while the bus is blocked
    cdef uint32_t npaused
    cdef uint32_t nblocking         # connections holding the bus
    cdef char *scratch              # normalised patterns
    cdef size_t scratch_cap

    # configuration (the names of the configuration's options)
    cdef size_t max_message
    cdef int sndbuf
    cdef uint8_t soft
    cdef uint8_t hard
    cdef uint8_t order
    cdef uint64_t queue_max_bytes
    cdef uint64_t queue_max_msgs
    cdef uint64_t total_max_bytes
    cdef double block_timeout
    cdef uint32_t max_subscriptions
    cdef uint32_t max_pattern
    cdef uint64_t sub_max_bytes         # budgets (budget.pxd; docs/security.md)
    cdef uint64_t user_sub_max_bytes
    cdef uint64_t total_sub_max_bytes
    cdef uint64_t user_max_connections
    cdef uint64_t user_queue_max_bytes
    cdef bint auto_close
    cdef double log_messages        # fraction of messages sampled to on_message
    cdef int64_t *allowed_uids
    cdef int n_allowed
    cdef int access_mode            # mode enforced at accept (abstract sockets), or -1
    cdef int64_t own_uid
    cdef int64_t own_gid

    # state
    cdef Counters tot               # broker-wide traffic counters
    cdef Accounts accounts          # one per uid with a connection
    cdef Budgets budgets            # broker-wide subscription bytes and refusals
    cdef uint64_t connects
    cdef uint64_t disconnects
    cdef uint64_t trimmed_at        # disconnects at the last malloc_trim
    cdef uint64_t cmsgs_ignored
    cdef uint64_t next_id
    cdef double now
    cdef double started
    cdef double next_tick
    cdef double tick_interval
    cdef bint running
    cdef bint had_client
    cdef bint signalled             # the wakeup fd fired: run signal handlers after the turn
    cdef bint accept_paused
    cdef bint fd_exhausted_logged
    cdef object stop_reason
    cdef dict close_details
    cdef object on_event
    cdef object on_message
    cdef object on_tick
    cdef object callback_error      # the first exception a callback raised this turn
    cdef dict last_totals

    # ---- the message path (broker.Broker)
    cdef int on_readable(self, Conn *c, int mask) except -1    # read a batch, deliver it
    cdef int drain(self, Conn *c) except -1                    # write c's queue
    cdef int flush_pending(self) except -1                     # send the batch's deliveries
    cdef int reply(self, Conn *c, bytes packet) except -1      # queue a control reply
    cdef int release_buffers(self) except -1                   # hand back idle receive pages

    # ---- the loop: one turn is poll, dispatch, before_sleep, housekeeping
    cdef int poll_timeout(self) noexcept         # ms until the next tick or block check
    cdef int dispatch(self, int n) except -1     # handle fired[0:n]
    cdef int before_sleep(self) except -1        # tear down marked conns, block timeouts
    cdef int housekeeping(self) except -1        # on the tick: trim memory, on_tick
    cdef int raise_callback_error(self) except -1   # the turn's kept exception, once

    # ---- accepting
    cdef int accept_clients(self) except -1      # up to ACCEPT_BATCH per event
    cdef int admit(self, int fd, ucred *cred) except -1   # add_conn, or close with a record
    cdef Conn *add_conn(self, int fd, ucred *cred) except NULL  # in the default modes
    cdef str refuse_peer(self, ucred *cred)      # why it may not connect, or None
    cdef int fd_exhausted(self, int err) except -1   # spare fd, else pause accepting
    cdef int grow_table(self, int fd) except -1      # conns[] to hold fd
    cdef int grow_lists(self, uint32_t need) except -1   # one entry per connection

    # ---- subscriptions
    cdef int subscribe(self, Conn *c, const char *pat, size_t n) except -1    # refused: close
    cdef int unsubscribe(self, Conn *c, const char *pat, size_t n) except -1  # '!' misuse: close
    cdef int refuse_pattern(self, Conn *c, int refusal, const char *pat,
                            size_t n) except -1   # log the refused SUB, close c
    cdef int over_sub_budget(self, Conn *c, size_t cost, const char *pat,
                             size_t n) except -1  # 1: refused (logged, c closing)
    cdef void drop_sub(self, Conn *c, Sub *sub) noexcept   # out of the index, uncharged

    # ---- control messages
    cdef int control(self, Conn *c, const char *key, size_t n) except -1   # reply, mode, or ignore
    cdef int set_mode(self, Conn *c, int which, int value) except -1   # may release the bus

    # ---- blocking the bus (the decisions: policy.pxd)
    cdef int start_blocking(self, Conn *c) except -1        # c holds the bus from now
    cdef int maybe_unblock(self, Conn *c) except -1         # stop_blocking unless holds_bus
    cdef int stop_blocking(self, Conn *c) except -1         # the last one resumes the paused
    cdef int pause(self, Conn *c) except -1                 # stop reading c until resume_all
    cdef int resume_all(self) except -1                     # read every paused connection again
    cdef int check_block_timeouts(self) except -1           # close who held it block_timeout
    cdef int update_interest(self, Conn *c) except -1       # read unless paused, write if queued

    # ---- closing: mark now, tear down at the end of the turn
    cdef int mark_closing(self, Conn *c, int reason, detail) except -1   # first reason wins
    cdef int finalize_closing(self) except -1    # free, log client_disconnect, auto_close
    cdef void count_drops_disconnect(self, Conn *c, uint64_t n) noexcept

    # ---- reporting (records: report.pyx)
    cdef int emit(self, str name, dict fields) except -1   # on_event; an exception is kept
    cdef int keep_callback_error(self, object err) except -1   # the first of the turn
