# The broker: one class, from accept to sendmmsg.
#
# The life of a message:
#   1. receive: recvmmsg reads up to RECV_BATCH packets of one connection
#      into the loop turn's next free receive slots (rhdrs/riov over
#      recv_area); every readable connection of the turn gets slots of its own.
#      It asks for about as many as the connection had lately (Conn.recv_want):
#      a recvmmsg that asks for more than there is pays for a failed read
#      (EAGAIN), which with many publishers of one packet a turn each is a
#      large share of the receive cost; what a read leaves is read next turn,
#      every backend being level-triggered. Where the backend receives in
#      batches (io_uring), the turn's readable connections are read in rounds
#      of up to RECV_BATCH packets, one io_uring_enter each (read_rounds).
#   2. match: a MSG's key is looked up in the segment trie (index); every
#      recipient gets a Pending entry naming the slot, chained per recipient.
#   3. send: once per loop turn (before_sleep, as redis's beforeSleep), or
#      sooner when the slots run out, each recipient gets one sendmmsg of its
#      chain from every publisher, straight from the receive slots.
#   4. queue: only what a send could not take is copied, once per message,
#      into a refcounted Packet that every recipient's send queue shares; the
#      flood policy (policy.pxd) decides per delivery to queue, drop, block
#      the bus or disconnect. EPOLLOUT then drains the queue.
# Around that path: the connection table and each connection's life (accept,
# subscriptions, control messages, closing), the loop that drives it, and the
# Python surface (run, stop, close, stats).
from libc.stdint cimport uint8_t, int32_t, uint32_t, uint64_t, int64_t

from sbus._core.budget cimport Account, Accounts
from sbus._core.conn cimport Conn, Counters
from sbus._core.includes.sys cimport mmsghdr, iovec, ucred
from sbus._core.index cimport Index, Sub
from sbus._core.loop cimport Fired, Poller, RecvOp
from sbus._core.protocol cimport CredForm
from sbus._core.report cimport Budgets
from sbus._core.sendq cimport Packet


cdef enum:
    ACCEPT_BATCH = 64       # connections accepted per readable event
    RECV_BATCH = 32         # packets read from one connection per recvmmsg, at most
    RECV_GROW_AFTER = 2     # full reads in a row before a connection is asked for more
    SEND_BATCH = 64         # packets written to one connection per sendmmsg
    TURN_SLOTS_MAX = 256    # receive slots one loop turn fills before a flush
    TURN_AREA_BYTES = 32 << 20  # ...and at most this much address space for them
    RECV_BATCH_MIN = 8      # a connection is read only with this many slots free


# One delivery waiting for the flush: a receive slot or a packet.
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
    # ---- the loop and the connection table
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
    cdef Conn **touched             # recipients with pending deliveries this turn
    cdef uint32_t ntouched
    cdef Conn **blockers            # of those, the ones in a block mode (may_block_bus)
    cdef uint32_t nblockers
    cdef Conn **closing             # marked; torn down by finalize_closing
    cdef uint32_t nclosing
    cdef Conn **paused              # not read while the bus is blocked
    cdef uint32_t npaused
    cdef uint32_t nblocking         # connections holding the bus
    cdef char *scratch              # normalised patterns
    cdef size_t scratch_cap

    # ---- the message path
    # 1. receive slots, filled in turn by every connection read until the flush
    cdef char *recv_area
    cdef size_t recv_area_size
    cdef size_t recv_high           # largest packet since the area was last released
    cdef uint32_t turn_slots        # slots in recv_area (TURN_SLOTS_MAX, TURN_AREA_BYTES)
    cdef uint32_t nslots            # slots used since the last flush
    cdef mmsghdr rhdrs[TURN_SLOTS_MAX]
    cdef iovec riov[TURN_SLOTS_MAX]
    cdef uint64_t batch_seqs[TURN_SLOTS_MAX]
    cdef Fired *readable            # batched receive: the turn's readable connections
    cdef RecvOp rops[RECV_BATCH]    # ...and one round's receives, into the next slots
    cdef uint64_t seq               # messages published since start
    cdef uint64_t rng               # xorshift state for sampling
    # 2. pending entries, chained per recipient (Conn.pend_head/pend_tail)
    cdef Pending *pend
    cdef int32_t npend
    cdef int32_t pend_cap
    cdef uint64_t pend_bytes        # their lengths: the most the flush can queue anywhere
    cdef bint flushing              # flush_conn is writing (mark_closing must not flush)
    cdef int32_t batch_pend         # the first entry of the batch being read, or -1
    # 3. one sendmmsg per recipient: siov/sreply are filled, send_prepared writes them
    cdef mmsghdr shdrs[SEND_BATCH]
    cdef iovec siov[SEND_BATCH]
    cdef uint8_t sreply[SEND_BATCH]
    cdef int32_t sent_entries[SEND_BATCH]   # the Pending entry behind each siov
    cdef Packet *ssel[SEND_BATCH]           # drain: the queued packets behind each siov
    cdef uint32_t spos[SEND_BATCH]
    # 4. a slot's shared packet, made once some recipient had to queue it
    cdef Packet *batch_pkts[TURN_SLOTS_MAX]

    # ---- configuration (the names of the configuration's options)
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

    # ---- state
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
    # ---- the upstream link (sbusd --upstream; sbus/sbusd/link.py), or a bridge
    # that claimed the link place (CMSG link/attach: sbus bridge --private); NULL without one
    cdef Conn *link
    cdef bint link_notes            # tell the link of connections and subscriptions (a leaf's)
    cdef bytes upstream_cred        # the link's credentials upstream: the nesting prefix
    cdef dict upstream_state        # the link's last reported state, for stats

    # ---- the loop: one turn is poll, dispatch, before_sleep, housekeeping
    cdef int poll_timeout(self) noexcept         # ms until the next tick or block check
    cdef int dispatch(self, int n) except -1     # handle fired[0:n]
    cdef int before_sleep(self) except -1        # flush, tear down marked conns, block timeouts
    cdef int housekeeping(self) except -1        # on the tick: trim memory, on_tick
    cdef int release_buffers(self) except -1     # madvise away pages large packets touched
    cdef int raise_callback_error(self) except -1   # the turn's kept exception, once

    # ---- receiving: one batch of one connection into the turn's free slots
    cdef int on_readable(self, Conn *c, int mask) except -1   # EOF, oversize, empty: close c
    cdef bint before_read(self, Conn *c, int mask) except -1   # False: the bus is blocked, c paused
    cdef int recv_failed(self, Conn *c, int err) except -1     # close c with the reason err means
    cdef bint take_packet(self, Conn *c, int mask, int slot, size_t length,
                          bint truncated) except -1   # handle it; False: c is closing
    cdef int read_rounds(self, int n) except -1  # readable[0:n] through Poller.recv_batch
    cdef int take_batch(self, Conn *c, int mask, uint32_t base, int first,
                        int want) except -1      # one connection's share of a round
    cdef bint may_block_bus(self) noexcept       # the flush could stop the bus: flush first
    cdef int handle_packet(self, Conn *c, int slot, size_t n) except -1  # by verb, or close c
    cdef int publish(self, Conn *c, int slot, const char *key, size_t klen,
                     size_t n) except -1         # check the key, count, pend_add per recipient
    cdef int match_canonical(self, const char *key, size_t klen, CredForm *form,
                             FanOut *f) except -1   # match a !/cred/ key spelt with zeros again
    cdef int sample(self, Conn *c, const char *key, size_t klen, size_t n,
                    uint32_t fanout) except -1      # on_message for a log_messages share

    # ---- delivering: pending entries, one sendmmsg per recipient, the queue
    cdef int reply(self, Conn *c, bytes packet) except -1      # behind c's deliveries
    cdef int pend_add(self, Conn *c, int32_t slot, Packet *pkt) except -1  # chain onto c's entries
    cdef int flush_pending(self) except -1       # every recipient's chain, then the turn's packets
    cdef int flush_deliveries(self) except -1    # every recipient's chain; the slots stay
    cdef int flush_conn(self, Conn *c) except -1  # send c's chain; the rest goes to enqueue
    cdef int send_prepared(self, Conn *c, uint32_t k) except -1  # sendmmsg siov[0:k]; returns sent
    cdef int enqueue(self, Conn *c, Pending *e) except -1        # act on policy.flood_action
    cdef Packet *shared_packet(self, Pending *e) noexcept        # the slot's; NULL: no memory
    cdef int drain(self, Conn *c) except -1      # write c's queue in its order, on EPOLLOUT
    cdef int send_failed(self, Conn *c, int err) except -1       # EPIPE: stop_writing; else close
    cdef int stop_writing(self, Conn *c) except -1   # peer gone: drop queue and later deliveries

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
    cdef int refuse_pattern(self, Conn *c, str refusal, const char *pat, size_t n,
                            int reason, str detail) except -1   # log the refused SUB, close c
    cdef int over_sub_budget(self, Conn *c, size_t cost, const char *pat,
                             size_t n) except -1  # 1: refused (logged, c closing)
    cdef void drop_sub(self, Conn *c, Sub *sub) noexcept   # out of the index, uncharged

    # ---- the upstream link: told of connections and subscriptions
    cdef int link_note(self, bytes packet) except -1
    cdef int claim_link(self, Conn *c) except -1
    cdef int link_control(self, const char *key, size_t n, const char *payload,
                          size_t plen) except -1
    cdef size_t nested_prefix(self, const char *pat, size_t n) noexcept

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
    cdef int flush_before_close(self, Conn *c) except -1   # c's entries of earlier batches
    cdef int finalize_closing(self) except -1    # free, log client_disconnect, auto_close
    cdef void count_drops_disconnect(self, Conn *c, uint64_t n) noexcept

    # ---- reporting (records: report.pyx)
    cdef int emit(self, str name, dict fields) except -1   # on_event; an exception is kept
    cdef int keep_callback_error(self, object err) except -1   # the first of the turn
