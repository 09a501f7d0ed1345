# The broker: client table, receive/parse/match/fan-out/send, flood control.
from libc.stdint cimport uint8_t, int32_t, uint32_t, uint64_t, int64_t

from sbus._core.includes.sys cimport mmsghdr, iovec, ucred
from sbus._core.index cimport Index, Sub
from sbus._core.protocol cimport CredForm
from sbus._core.loop cimport Poller
from sbus._core.sendq cimport SendQueue, Packet


cdef enum Mode:
    MODE_QUEUE = 0
    MODE_DISCARD = 1
    MODE_BLOCK = 2
    MODE_ERROR = 3


cdef enum Reason:
    R_NONE = 0
    R_EOF
    R_ERROR
    R_PROTOCOL
    R_CRED
    R_BANG
    R_USER
    R_FLOOD
    R_OVERSIZE
    R_LIMIT
    R_SHUTDOWN
    R_FD_LIMIT


cdef enum:
    RECV_BATCH = 32         # packets read from one client per recvmmsg
    SEND_BATCH = 64         # packets written to one client per sendmmsg


cdef struct Counters:
    uint64_t msgs_in        # MSG packets published
    uint64_t bytes_in
    uint64_t msgs_out       # MSG deliveries
    uint64_t bytes_out
    uint64_t replies_out    # control replies the broker wrote (whoami, stats)
    uint64_t drops_soft
    uint64_t drops_hard
    uint64_t drops_disconnect
    uint64_t blocks         # times this client started holding the bus


# A client's state as a periodic stats record last listed it: an idle client
# is listed once, not in every record.
cdef struct Listed:
    Counters c
    uint64_t queued_bytes
    uint32_t queued_msgs
    uint32_t nsubs
    uint8_t modes           # soft, hard, order and echo packed
    uint8_t ever


cdef struct Client:
    int fd
    uint64_t id
    int64_t pid
    int64_t uid
    int64_t gid
    uint8_t soft
    uint8_t hard
    uint8_t order
    uint8_t echo
    uint8_t closing         # marked; torn down at the end of the loop turn
    uint8_t paused          # not read while the bus is blocked
    uint8_t blocking        # counted in Broker.nblocking
    uint8_t write_dead      # peer gone: deliveries are dropped, input read to EOF
    int reason
    double connected_at
    double block_since
    SendQueue q
    Sub **subs
    uint32_t nsubs
    uint32_t subs_cap
    uint64_t stamp          # seq of the last message it was picked for
    int32_t pend_head       # its deliveries pending in this batch
    int32_t pend_tail
    Counters c
    Counters reported       # c at the last flood summary
    Listed listed           # what the last periodic stats listing showed



# One delivery waiting for the end of the batch: a received slot or a packet.
cdef struct Pending:
    int32_t next
    int32_t slot            # receive slot, or -1 for pkt
    Packet *pkt


cdef struct FanOut:
    uint64_t seq
    Client *sender
    bint is_cred
    int64_t gid
    int64_t uid
    int64_t pid
    Client **recips
    uint32_t n


cdef class Broker:
    cdef Poller poller
    cdef int listen_fd
    cdef int wakeup_fd
    cdef int spare_fd
    cdef Index index
    cdef Client **clients           # fd-indexed
    cdef int clients_cap
    cdef uint32_t nclients
    cdef uint32_t list_cap          # capacity of the per-client scratch lists
    cdef Client **recips
    cdef Client **touched
    cdef uint32_t ntouched
    cdef Client **closing
    cdef uint32_t nclosing
    cdef Client **paused
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
    cdef Packet *batch_pkts[RECV_BATCH]
    cdef uint64_t batch_seqs[RECV_BATCH]
    # send batch
    cdef mmsghdr shdrs[SEND_BATCH]
    cdef iovec siov[SEND_BATCH]
    cdef Packet *ssel[SEND_BATCH]
    cdef uint32_t spos[SEND_BATCH]
    cdef int32_t sent_entries[SEND_BATCH]
    cdef char *scratch              # normalised patterns, replies
    cdef size_t scratch_cap

    # configuration
    cdef size_t max_message
    cdef int sndbuf
    cdef uint8_t soft_default
    cdef uint8_t hard_default
    cdef uint8_t order_default
    cdef uint64_t q_max_bytes
    cdef uint64_t q_max_msgs
    cdef uint64_t total_max_bytes
    cdef double block_timeout
    cdef uint32_t max_subs
    cdef uint32_t max_pattern
    cdef bint auto_close
    cdef bint had_client
    cdef int64_t *allowed_uids
    cdef int n_allowed
    cdef int access_mode            # mode enforced at accept (abstract sockets), or -1
    cdef int64_t own_uid
    cdef int64_t own_gid
    cdef double sample_rate
    cdef uint64_t rng

    # state
    cdef Counters tot               # broker-wide traffic counters
    cdef uint64_t connects
    cdef uint64_t disconnects
    cdef uint64_t trimmed_at        # disconnects at the last malloc_trim
    cdef uint64_t cmsgs_ignored
    cdef uint64_t next_id
    cdef uint64_t seq
    cdef double now
    cdef double started
    cdef double next_tick
    cdef double tick_interval
    cdef bint running
    cdef bint accept_paused
    cdef bint fd_exhausted_logged
    cdef object stop_reason
    cdef dict close_details
    cdef str refusal                # why normalise() refused a pattern
    cdef object on_event
    cdef object on_message
    cdef object on_tick
    cdef dict last_totals

    cdef int accept_clients(self) except -1
    cdef str refuse_peer(self, ucred *cred)
    cdef int fd_exhausted(self, int err) except -1
    cdef int grow_lists(self, uint32_t need) except -1
    cdef int on_readable(self, Client *c, int mask) except -1
    cdef int handle_packet(self, Client *c, int slot, size_t n) except -1
    cdef int publish(self, Client *c, int slot, const char *key, size_t klen, size_t n) except -1
    cdef int match_canonical(self, const char *key, size_t klen, CredForm *form, FanOut *f) except -1
    cdef int subscribe(self, Client *c, const char *pat, size_t n) except -1
    cdef int unsubscribe(self, Client *c, const char *pat, size_t n) except -1
    cdef int control(self, Client *c, const char *key, size_t n) except -1
    cdef int reply(self, Client *c, bytes packet) except -1
    cdef Py_ssize_t normalise(self, Client *c, const char *pat, size_t n, bint refuse) except -2
    cdef int pend_add(self, Client *c, int32_t slot, Packet *pkt) except -1
    cdef int flush_pending(self) except -1
    cdef int flush_client(self, Client *c) except -1
    cdef int enqueue(self, Client *c, Pending *e) except -1
    cdef int drain(self, Client *c) except -1
    cdef void count_sent(self, Client *c, int sent, uint64_t nbytes, int replies) noexcept
    cdef int send_failed(self, Client *c, int err) except -1
    cdef int write_dead(self, Client *c) except -1
    cdef int set_mode(self, Client *c, int which, int value) except -1
    cdef int start_blocking(self, Client *c) except -1
    cdef int maybe_unblock(self, Client *c) except -1
    cdef int pause(self, Client *c) except -1
    cdef int resume_all(self) except -1
    cdef int update_interest(self, Client *c) except -1
    cdef int mark_closing(self, Client *c, int reason, detail) except -1
    cdef int finalize_closing(self) except -1
    cdef int check_block_timeouts(self) except -1
    cdef int emit(self, str name, dict fields) except -1
    cdef dict ident(self, Client *c)
    cdef dict counters(self, Client *c)
    cdef dict client_entry(self, Client *c)
    cdef dict zero_counters(self, dict ident)
