# The broker: the loop and the per-message path, from recvmmsg to sendmmsg.
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
#      of up to RECV_BATCH packets, one io_uring_enter each (read_rounds);
#      there every packet asked for is a receive of its own, which costs as
#      much when it finds nothing, so a connection is asked for what it had
#      last time, starting at one.
#   2. match: a MSG's key is looked up in the segment trie (index); every
#      recipient gets a Pending entry naming the slot, chained per recipient.
#   3. send: once per loop turn (before_sleep, as redis's beforeSleep), or
#      sooner when the slots run out or HOLD_READS connections were read,
#      each recipient gets one sendmmsg of its chain from every publisher,
#      straight from the receive slots. HOLD_READS bounds how long a
#      delivery waits for the turn's other reads: a turn that finds many
#      publishers with a message each would otherwise hold the first for
#      all the others' receives. A light turn (its poll reported at most
#      LIGHT_TURN connections) holds nothing, and sends after each read as
#      the relay does (io_uring's reads of such a turn are one round, one
#      syscall, and it sends after the round). Python publishers at 50k
#      msgs/s send in bursts of about 5, which the broker finds together:
#      holding the first for the other four cost p50 1.35x the relay's,
#      and neither LIGHT_TURN 4 nor a bound on the hold's time (10 or
#      30 us) helped, because the delivery then reaches a recipient whose
#      core went idle meanwhile. At saturation most messages come in turns
#      of more than 16, whose coalescing keeps CPU per delivery at about
#      0.9x the relay's (1.04x with no hold at all).
#   4. queue: only what a send could not take is copied, once per message,
#      into a refcounted Packet that every recipient's send queue shares; the
#      flood policy (flood.on_full, policy.pxd) decides per delivery to
#      queue, drop, block the bus or disconnect. EPOLLOUT then drains the queue.
# Around that path, each slow path is a room of its own that owns its state
# and returns decisions the broker acts on: peers.pxd (the connection table,
# accept, admit or refuse, the per-uid accounts, teardown), subs.pxd (SUB and
# UNSUB, the index, the subscription budgets), flood.pxd (holding the bus,
# pausing, block timeouts) and control.pxd (CMSGs and the upstream link).
# Broker extends Hub (hub.pxd), which holds the rooms and acts on them, tears
# connections down and is the Python surface; here are the message path and
# the loop's turn, which must not call across modules.
from libc.stdint cimport uint8_t, int32_t, uint32_t, uint64_t, int64_t

from sbus._core.conn cimport Conn
from sbus._core.hub cimport Hub
from sbus._core.includes.sys cimport mmsghdr, iovec
from sbus._core.loop cimport Fired, RecvOp
from sbus._core.protocol cimport CredForm
from sbus._core.reads cimport RECV_BATCH
from sbus._core.sendq cimport Packet


# What siov[i] holds (sreply[i]), for send_prepared's counts.
cdef enum:
    SENT_DELIVERY = 0
    SENT_REPLY = 1
    SENT_FRAME = 2


cdef enum:
    SEND_BATCH = 64         # packets written to one connection per sendmmsg
    TURN_SLOTS_MAX = 256    # receive slots one loop turn fills before a flush
    TURN_AREA_BYTES = 32 << 20  # ...and at most this much address space for them
    RECV_BATCH_MIN = 8      # a connection is read only with this many slots free
    HOLD_READS = 16         # connections read before the deliveries they brought go out
    LIGHT_TURN = 16         # a turn that fired at most this many connections sends after each read
    VIEW_SLOTS = 256        # packets of frames (frames.pxd) one flush holds: 4 full frames


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


cdef class Broker(Hub):
    # ---- the message path
    # 1. receive slots, filled in turn by every connection read until the flush
    cdef char *recv_area
    cdef size_t recv_area_size
    cdef size_t recv_high           # largest packet since the area was last released
    cdef uint32_t turn_slots        # slots in recv_area (TURN_SLOTS_MAX, TURN_AREA_BYTES)
    cdef uint32_t nslots            # slots used since the last flush
    # Slots from TURN_SLOTS_MAX on are views: the packets of the frames read
    # (a link's, frames.pxd), pointing into the frame's slot (take_frame).
    cdef mmsghdr rhdrs[TURN_SLOTS_MAX + VIEW_SLOTS]
    cdef iovec riov[TURN_SLOTS_MAX + VIEW_SLOTS]
    cdef uint64_t batch_seqs[TURN_SLOTS_MAX + VIEW_SLOTS]
    cdef uint32_t nviews            # views used since the last flush
    cdef Fired *readable            # batched receive: the turn's readable connections
    cdef RecvOp rops[RECV_BATCH]    # ...and one round's receives, into the next slots
    # 2. pending entries, chained per recipient (Conn.pend_head/pend_tail)
    cdef Pending *pend
    cdef int32_t npend
    cdef int32_t pend_cap
    cdef uint64_t pend_bytes        # their lengths: the most the flush can queue anywhere
    cdef bint flushing              # flush_conn is writing (mark_closing must not flush)
    cdef int32_t batch_pend         # the first entry of the batch being read, or -1
    cdef uint32_t reads_held        # connections read since the last flush (HOLD_READS)
    cdef int turn_fired             # connections the turn's poll reported (LIGHT_TURN)
    # 3. one sendmmsg per recipient: siov/sreply are filled, send_prepared writes them
    cdef mmsghdr shdrs[SEND_BATCH]
    cdef iovec siov[SEND_BATCH]
    cdef uint8_t sreply[SEND_BATCH]         # SENT_DELIVERY, SENT_REPLY or SENT_FRAME
    cdef uint32_t fmsgs[SEND_BATCH]         # a frame's deliveries...
    cdef uint64_t fbytes[SEND_BATCH]        # ...and their bytes
    cdef char *frame_area                   # SEND_BATCH frames of FRAME_BYTES, mapped
    cdef int32_t sent_entries[SEND_BATCH]   # the Pending entry behind each siov
    cdef Packet *ssel[SEND_BATCH]           # drain: the queued packets behind each siov
    cdef uint32_t spos[SEND_BATCH]
    # 4. a slot's shared packet, made once some recipient had to queue it
    cdef Packet *batch_pkts[TURN_SLOTS_MAX + VIEW_SLOTS]

    # ---- the loop's turn: poll, dispatch, before_sleep, Hub.housekeeping
    cdef int dispatch(self, int n) except -1     # handle fired[0:n]
    cdef int before_sleep(self) except -1        # flush, tear down marked conns, block timeouts

    # ---- receiving: one batch of one connection into the turn's free slots
    cdef int on_readable(self, Conn *c, int mask) except -1   # EOF, oversize, empty: close c
    cdef bint before_read(self, Conn *c, int mask) except -1   # False: the bus is blocked, c paused
    cdef int recv_failed(self, Conn *c, int err) except -1     # close c with the reason err means
    cdef bint take_packet(self, Conn *c, int mask, int slot, size_t length,
                          bint truncated) except -1   # handle it; False: c is closing
    cdef int read_rounds(self, int n) except -1  # readable[0:n] through Poller.recv_batch
    cdef int take_batch(self, Conn *c, int mask, uint32_t base, int first,
                        int want) except -1      # one connection's share of a round
    cdef bint flush_first(self, bint frames) noexcept  # flush before the next read
    cdef int handle_packet(self, Conn *c, int slot, size_t n) except -1  # by verb, or close c
    cdef int take_frame(self, Conn *c, int slot, size_t n) except -1   # each packet in a view
    cdef int publish(self, Conn *c, int slot, const char *key, size_t klen,
                     size_t n) except -1         # check the key, count, pend_add per recipient

    # ---- delivering: pending entries, one sendmmsg per recipient, the queue
    cdef int pend_add(self, Conn *c, int32_t slot, Packet *pkt) except -1  # chain onto c's entries
    cdef int flush_conn(self, Conn *c) except -1  # send c's chain; the rest goes to enqueue
    cdef uint32_t pack_frame(self, int32_t *e, uint32_t k) noexcept  # siov[k]: a frame from *e on
    cdef int send_prepared(self, Conn *c, uint32_t k) except -1  # sendmmsg siov[0:k]; returns sent
    cdef int enqueue(self, Conn *c, Pending *e) except -1        # act on flood.on_full
    cdef Packet *shared_packet(self, Pending *e) noexcept        # the slot's; NULL: no memory
    cdef int drain(self, Conn *c) except -1      # write c's queue in its order, on EPOLLOUT
    cdef int send_failed(self, Conn *c, int err) except -1       # EPIPE: stop_writing; else close
    cdef int stop_writing(self, Conn *c) except -1   # peer gone: drop queue and later deliveries

    # ---- closing (mark now; Hub.finalize_closing tears down at the end of the turn)
    cdef int flush_before_close(self, Conn *c) except -1   # c's entries of earlier batches
