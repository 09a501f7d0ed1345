# Per-client send queues of shared, reference-counted packets.
#
# A message fanned out to many clients is stored once as a Packet; each queue
# holds a reference. The queue is a ring of Packet pointers. Order 'queue'
# sends oldest first, 'stack' newest first, 'random' the packets that free
# memory fastest (see sq_select); the random order may leave NULL holes.
from libc.stdint cimport uint32_t, uint64_t


cdef enum Order:
    ORDER_QUEUE = 0
    ORDER_STACK = 1
    ORDER_RANDOM = 2


cdef struct Packet:
    uint32_t refs          # queues holding it
    uint32_t len
    uint64_t seq           # arrival order: ties in random order go oldest first
    char *data             # points just past the header, same allocation
    bint reply             # the broker's own control reply, not a delivery


cdef struct SendQueue:
    Packet **slots         # NULL until the first push: idle clients cost nothing
    uint32_t cap           # power of two
    uint32_t head          # ring index of the oldest slot
    uint32_t count         # slots in use from head, holes included
    uint32_t live          # packets actually held
    uint64_t bytes         # sum of their lengths


# Broker-wide packet accounting: each packet counts once however many queues hold it.
cdef struct PacketStats:
    uint64_t live
    uint64_t bytes
    uint64_t bytes_peak
    uint64_t allocated
    uint64_t freed


cdef PacketStats *get_packet_stats() noexcept nogil
cdef Packet *packet_new(const char *data, size_t n, uint64_t seq) noexcept nogil
cdef void packet_release(Packet *p) noexcept nogil

cdef int sq_push(SendQueue *q, Packet *p) noexcept nogil
cdef uint32_t sq_select(SendQueue *q, int order, uint32_t *positions,
                        Packet **out, uint32_t max_n) noexcept nogil
cdef void sq_consume(SendQueue *q, uint32_t *positions, uint32_t n) noexcept nogil
cdef uint32_t sq_clear(SendQueue *q) noexcept nogil

# The hand-over (handover.pyx).
cdef inline uint64_t sq_bytes(const SendQueue *q) noexcept nogil:   # queued, in bytes
    return q.bytes

cdef inline uint32_t sq_live(const SendQueue *q) noexcept nogil:    # packets queued
    return q.live

# A walk over the queue from the oldest, holes skipped, that does not know
# the ring: the packet at *pos or after (*pos moved past it); NULL at the end.
cdef Packet *sq_next(const SendQueue *q, uint32_t *pos) noexcept nogil
# A packet as the old process held it: packet_new's, marked a control reply or not.
cdef Packet *packet_restore(const char *data, size_t n, uint64_t seq, bint reply) noexcept nogil
# The broker-wide peak of packet bytes goes on from the old process's.
cdef void restore_peak(uint64_t peak) noexcept nogil
