# The broker: the per-message path, from receive slot to sendmmsg.
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
# Everything around this path (the connection table, accept, subscriptions,
# control messages, closing, the loop) is server.Server's; Broker extends it.
from libc.stdint cimport uint8_t, int32_t, uint32_t, uint64_t, int64_t

from sbus._core.conn cimport Conn
from sbus._core.includes.sys cimport mmsghdr, iovec
from sbus._core.protocol cimport CredForm
from sbus._core.sendq cimport Packet
from sbus._core.server cimport Server


cdef enum:
    RECV_BATCH = 32         # packets read from one connection per recvmmsg
    SEND_BATCH = 64         # packets written to one connection per sendmmsg


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


cdef class Broker(Server):
    # 1. receive slots
    cdef char *recv_area
    cdef size_t recv_area_size
    cdef size_t recv_high           # largest packet since the area was last released
    cdef mmsghdr rhdrs[RECV_BATCH]
    cdef iovec riov[RECV_BATCH]
    cdef uint64_t batch_seqs[RECV_BATCH]
    cdef uint64_t seq               # messages published since start
    cdef uint64_t rng               # xorshift state for sampling
    # 2. pending entries, chained per recipient (Conn.pend_head/pend_tail)
    cdef Pending *pend
    cdef int32_t npend
    cdef int32_t pend_cap
    # 3. one sendmmsg per recipient: siov/sreply are filled, send_prepared writes them
    cdef mmsghdr shdrs[SEND_BATCH]
    cdef iovec siov[SEND_BATCH]
    cdef uint8_t sreply[SEND_BATCH]
    cdef int32_t sent_entries[SEND_BATCH]   # the Pending entry behind each siov
    cdef Packet *ssel[SEND_BATCH]           # drain: the queued packets behind each siov
    cdef uint32_t spos[SEND_BATCH]
    # 4. a slot's shared packet, made once some recipient had to queue it
    cdef Packet *batch_pkts[RECV_BATCH]

    # ---- buffers
    cdef int release_buffers(self) except -1     # madvise away pages large packets touched

    # ---- receiving: one batch of one connection, then flush_pending
    cdef int on_readable(self, Conn *c, int mask) except -1   # EOF, oversize, empty: close c
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
    cdef int flush_pending(self) except -1       # every recipient's chain, then the batch's packets
    cdef int flush_conn(self, Conn *c) except -1  # send c's chain; the rest goes to enqueue
    cdef int send_prepared(self, Conn *c, uint32_t k) except -1  # sendmmsg siov[0:k]; returns sent
    cdef int enqueue(self, Conn *c, Pending *e) except -1        # act on policy.flood_action
    cdef Packet *shared_packet(self, Pending *e) noexcept        # the slot's; NULL: no memory
    cdef int drain(self, Conn *c) except -1      # write c's queue in its order, on EPOLLOUT
    cdef int send_failed(self, Conn *c, int err) except -1       # EPIPE: stop_writing; else close
    cdef int stop_writing(self, Conn *c) except -1   # peer gone: drop queue and later deliveries
