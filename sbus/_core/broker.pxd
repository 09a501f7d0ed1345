# The broker: the connection table and the per-message path.
#
# The life of a message:
#   1. receive: recvmmsg reads up to RECV_BATCH packets of one connection
#      into fixed receive slots (rhdrs/riov over recv_area).
#   2. match: a MSG's key is looked up in the segment trie (index); every
#      recipient gets a Pending entry naming the slot, chained per recipient.
#   3. send: at the end of the batch each recipient gets one sendmmsg of its
#      chain, straight from the receive slots.
#   4. queue: only what a send could not take is copied, once per message,
#      into a refcounted Packet that every recipient's send queue shares; the
#      flood policy (policy.pxd) decides per delivery to queue, drop, block
#      the bus or disconnect. EPOLLOUT then drains the queue.
# Connections that misbehave are only marked closing and torn down at the
# end of the loop turn. Records for the log are built in report.pyx.
from libc.stdint cimport uint8_t, int32_t, uint32_t, uint64_t, int64_t

from sbus._core.conn cimport Conn, Counters
from sbus._core.includes.sys cimport mmsghdr, iovec, ucred
from sbus._core.index cimport Index
from sbus._core.loop cimport Poller
from sbus._core.protocol cimport CredForm
from sbus._core.sendq cimport Packet


cdef enum:
    RECV_BATCH = 32         # packets read from one connection per recvmmsg
    SEND_BATCH = 64         # packets written to one connection per sendmmsg
    ACCEPT_BATCH = 64       # connections accepted per readable event


# One delivery waiting for the end of the batch: a receive slot or a packet.
cdef struct Pending:
    int32_t next            # next entry of the same recipient, or -1
    int32_t slot            # receive slot, or -1 for pkt
    Packet *pkt             # a control reply (slot -1), or NULL


# The state of one MSG while the segment trie is walked for its recipients.
cdef struct FanOut:
    uint64_t seq
    Conn *sender
    bint is_cred            # a !/cred/ key: only gid/uid/pid may receive it
    int64_t gid
    int64_t uid
    int64_t pid
    Conn **recips
    uint32_t n


cdef class Broker:
    cdef Poller poller
    cdef int listen_fd
    cdef int wakeup_fd
    cdef int spare_fd               # given up when accept runs out of descriptors
    cdef Index index                # the segment trie of every subscription
    cdef Conn **conns               # fd-indexed; NULL where no connection
    cdef int conns_cap
    cdef uint32_t nconns
    cdef uint32_t list_cap          # capacity of the per-connection scratch lists
    cdef Conn **recips
    cdef Conn **touched             # recipients with Pending entries this batch
    cdef uint32_t ntouched
    cdef Conn **closing             # marked; torn down by finalize_closing
    cdef uint32_t nclosing
    cdef Conn **paused              # not read while the bus is blocked
    cdef uint32_t npaused
    cdef uint32_t nblocking
    cdef Pending *pend
    cdef int32_t npend
    cdef int32_t pend_cap

    # receive batch
    cdef char *recv_area
    cdef size_t recv_area_size
    cdef size_t recv_high           # largest packet since the area was last released
    cdef mmsghdr rhdrs[RECV_BATCH]
    cdef iovec riov[RECV_BATCH]
    cdef Packet *batch_pkts[RECV_BATCH]     # a slot's shared copy, once one was needed
    cdef uint64_t batch_seqs[RECV_BATCH]
    # send batch: siov/sreply are filled, then send_prepared writes them
    cdef mmsghdr shdrs[SEND_BATCH]
    cdef iovec siov[SEND_BATCH]
    cdef uint8_t sreply[SEND_BATCH]
    cdef Packet *ssel[SEND_BATCH]
    cdef uint32_t spos[SEND_BATCH]
    cdef int32_t sent_entries[SEND_BATCH]
    cdef char *scratch              # normalised patterns
    cdef size_t scratch_cap

    # configuration (the names of sbus.config's options)
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
    cdef bint auto_close
    cdef double log_messages        # fraction of messages sampled to on_message
    cdef int64_t *allowed_uids
    cdef int n_allowed
    cdef int access_mode            # mode enforced at accept (abstract sockets), or -1
    cdef int64_t own_uid
    cdef int64_t own_gid

    # state
    cdef Counters tot               # broker-wide traffic counters
    cdef uint64_t connects
    cdef uint64_t disconnects
    cdef uint64_t trimmed_at        # disconnects at the last malloc_trim
    cdef uint64_t cmsgs_ignored
    cdef uint64_t next_id
    cdef uint64_t seq
    cdef uint64_t rng
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

    # ---- the loop: one turn is poll, dispatch, before_sleep, housekeeping
    cdef int poll_timeout(self) noexcept         # ms until the next tick or block check
    cdef int dispatch(self, int n) except -1     # handle fired[0:n]
    cdef int before_sleep(self) except -1        # tear down marked conns, block timeouts
    cdef int housekeeping(self) except -1        # on the tick: trim memory, on_tick
    cdef int raise_callback_error(self) except -1

    # ---- accepting
    cdef int accept_clients(self) except -1      # up to ACCEPT_BATCH per event
    cdef int admit(self, int fd, ucred *cred) except -1
    cdef Conn *add_conn(self, int fd, ucred *cred) except NULL
    cdef str refuse_peer(self, ucred *cred)      # why it may not connect, or None
    cdef int fd_exhausted(self, int err) except -1
    cdef int grow_table(self, int fd) except -1
    cdef int grow_lists(self, uint32_t need) except -1

    # ---- receiving: one batch, then flush_pending
    cdef int on_readable(self, Conn *c, int mask) except -1
    cdef int handle_packet(self, Conn *c, int slot, size_t n) except -1
    cdef int publish(self, Conn *c, int slot, const char *key, size_t klen, size_t n) except -1
    cdef int match_canonical(self, const char *key, size_t klen, CredForm *form,
                             FanOut *f) except -1
    cdef int sample(self, Conn *c, const char *key, size_t klen, size_t n,
                    uint32_t fanout) except -1

    # ---- subscriptions
    cdef int subscribe(self, Conn *c, const char *pat, size_t n) except -1
    cdef int unsubscribe(self, Conn *c, const char *pat, size_t n) except -1
    cdef int refuse_pattern(self, Conn *c, int refusal, const char *pat, size_t n) except -1

    # ---- control messages
    cdef int control(self, Conn *c, const char *key, size_t n) except -1
    cdef int reply(self, Conn *c, bytes packet) except -1
    cdef int set_mode(self, Conn *c, int which, int value) except -1

    # ---- delivering: pending entries, one sendmmsg per recipient, the queue
    cdef int pend_add(self, Conn *c, int32_t slot, Packet *pkt) except -1
    cdef int flush_pending(self) except -1       # send every recipient's chain
    cdef int flush_conn(self, Conn *c) except -1
    cdef int send_prepared(self, Conn *c, uint32_t k) except -1  # returns packets sent
    cdef int enqueue(self, Conn *c, Pending *e) except -1        # acts on flood_action
    cdef Packet *shared_packet(self, Pending *e) noexcept        # NULL: out of memory
    cdef int drain(self, Conn *c) except -1      # write c's queue in its order
    cdef int send_failed(self, Conn *c, int err) except -1
    cdef int stop_writing(self, Conn *c) except -1
    cdef void count_drops_disconnect(self, Conn *c, uint64_t n) noexcept

    # ---- blocking the bus
    cdef int start_blocking(self, Conn *c) except -1
    cdef int maybe_unblock(self, Conn *c) except -1
    cdef int pause(self, Conn *c) except -1
    cdef int resume_all(self) except -1
    cdef int check_block_timeouts(self) except -1
    cdef int update_interest(self, Conn *c) except -1

    # ---- closing: mark now, tear down at the end of the turn
    cdef int mark_closing(self, Conn *c, int reason, detail) except -1
    cdef int finalize_closing(self) except -1

    # ---- reporting (records: report.pyx)
    cdef int emit(self, str name, dict fields) except -1
    cdef int keep_callback_error(self, object err) except -1
