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
# The packet pos slots from the oldest (pos < count), or NULL for a hole:
# a walk over the queue in ring order that does not know the ring.
cdef Packet *sq_at(const SendQueue *q, uint32_t pos) noexcept nogil
