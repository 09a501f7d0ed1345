# cython: language_level=3
"""Shared packets and per-client send queues; see sendq.pxd."""
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

cdef PacketStats packet_stats
packet_stats.live = 0
packet_stats.bytes = 0
packet_stats.bytes_peak = 0
packet_stats.allocated = 0
packet_stats.freed = 0


cdef PacketStats *get_packet_stats() noexcept nogil:
    return &packet_stats


cdef Packet *packet_new(const char *data, size_t n, uint64_t seq) noexcept nogil:
    """A packet with no holders yet; NULL on OOM."""
    cdef Packet *p = <Packet *>malloc(sizeof(Packet) + n)
    if p == NULL:
        return NULL
    p.refs = 0
    p.len = <uint32_t>n
    p.seq = seq
    p.reply = 0
    p.data = <char *>(p + 1)
    memcpy(p.data, data, n)
    packet_stats.live += 1
    packet_stats.allocated += 1
    packet_stats.bytes += n
    if packet_stats.bytes > packet_stats.bytes_peak:
        packet_stats.bytes_peak = packet_stats.bytes
    return p


cdef void packet_release(Packet *p) noexcept nogil:
    """Drop one holder's reference; frees the packet with its last holder."""
    if p.refs > 1:
        p.refs -= 1
        return
    packet_stats.live -= 1
    packet_stats.freed += 1
    packet_stats.bytes -= p.len
    free(p)


cdef inline uint32_t ring(SendQueue *q, uint32_t pos) noexcept nogil:
    return (q.head + pos) & (q.cap - 1)


cdef Packet *sq_next(const SendQueue *q, uint32_t *pos) noexcept nogil:
    cdef Packet *p
    while pos[0] < q.count:
        p = q.slots[(q.head + pos[0]) & (q.cap - 1)]
        pos[0] += 1
        if p != NULL:
            return p
    return NULL


cdef Packet *packet_restore(const char *data, size_t n, uint64_t seq, bint reply) noexcept nogil:
    cdef Packet *p = packet_new(data, n, seq)
    if p != NULL:
        p.reply = reply
    return p


cdef void restore_peak(uint64_t peak) noexcept nogil:
    if peak > packet_stats.bytes_peak:
        packet_stats.bytes_peak = peak


cdef int compact_or_grow(SendQueue *q) noexcept nogil:
    """Make room for one more slot: squeeze out holes, else double the ring."""
    cdef uint32_t new_cap, i, j = 0
    cdef Packet **slots
    cdef Packet *p
    if q.slots != NULL and q.live < q.count // 2:
        new_cap = q.cap
    else:
        new_cap = q.cap * 2 if q.cap else 8
    slots = <Packet **>malloc(new_cap * sizeof(Packet *))
    if slots == NULL:
        return -1
    for i in range(q.count):
        p = q.slots[ring(q, i)]
        if p != NULL:
            slots[j] = p
            j += 1
    free(q.slots)
    q.slots = slots
    q.cap = new_cap
    q.head = 0
    q.count = j
    return 0


cdef int sq_push(SendQueue *q, Packet *p) noexcept nogil:
    """Append p (taking a reference); -1 on OOM, leaving p untouched."""
    if q.count == q.cap and compact_or_grow(q) < 0:
        return -1
    q.slots[ring(q, q.count)] = p
    q.count += 1
    q.live += 1
    q.bytes += p.len
    p.refs += 1
    return 0


cdef inline bint frees_sooner(Packet *a, Packet *b) noexcept nogil:
    """Random order's preference: a packet this queue holds alone (sending it
    frees it), then larger, then older."""
    cdef bint a_last = a.refs == 1
    cdef bint b_last = b.refs == 1
    if a_last != b_last:
        return a_last
    if a.len != b.len:
        return a.len > b.len
    return a.seq < b.seq


cdef uint32_t sq_select(SendQueue *q, int order, uint32_t *positions,
                        Packet **out, uint32_t max_n) noexcept nogil:
    """Choose up to max_n packets to send next, in sending order, without
    removing them; positions[] records where they sit for sq_consume."""
    cdef uint32_t n = 0, i, k
    cdef Packet *p
    if q.live == 0 or max_n == 0:
        return 0
    if order == ORDER_QUEUE:
        i = 0
        while i < q.count and n < max_n:
            p = q.slots[ring(q, i)]
            if p != NULL:
                positions[n] = i
                out[n] = p
                n += 1
            i += 1
    elif order == ORDER_STACK:
        i = q.count
        while i > 0 and n < max_n:
            i -= 1
            p = q.slots[ring(q, i)]
            if p != NULL:
                positions[n] = i
                out[n] = p
                n += 1
    else:
        # Keep the best max_n seen so far, sorted, by insertion.
        for i in range(q.count):
            p = q.slots[ring(q, i)]
            if p == NULL:
                continue
            if n == max_n and not frees_sooner(p, out[n - 1]):
                continue
            k = n if n < max_n else n - 1
            while k > 0 and frees_sooner(p, out[k - 1]):
                out[k] = out[k - 1]
                positions[k] = positions[k - 1]
                k -= 1
            out[k] = p
            positions[k] = i
            if n < max_n:
                n += 1
    return n


cdef void trim(SendQueue *q) noexcept nogil:
    while q.count and q.slots[q.head] == NULL:
        q.head = (q.head + 1) & (q.cap - 1)
        q.count -= 1
    while q.count and q.slots[ring(q, q.count - 1)] == NULL:
        q.count -= 1
    if q.count == 0:
        q.head = 0
        if q.cap > 64:      # give back memory a burst left behind
            free(q.slots)
            q.slots = NULL
            q.cap = 0


cdef void sq_consume(SendQueue *q, uint32_t *positions, uint32_t n) noexcept nogil:
    """Remove the first n packets of the last sq_select (they were sent)."""
    cdef uint32_t i, slot
    cdef Packet *p
    for i in range(n):
        slot = ring(q, positions[i])
        p = q.slots[slot]
        q.slots[slot] = NULL
        q.live -= 1
        q.bytes -= p.len
        packet_release(p)
    trim(q)


cdef uint32_t sq_clear(SendQueue *q) noexcept nogil:
    """Release every packet and the ring; returns how many were dropped."""
    cdef uint32_t i, dropped = q.live
    cdef Packet *p
    for i in range(q.count):
        p = q.slots[ring(q, i)]
        if p != NULL:
            packet_release(p)
    free(q.slots)
    q.slots = NULL
    q.cap = 0
    q.head = 0
    q.count = 0
    q.live = 0
    q.bytes = 0
    return dropped


# ---- Python-visible wrapper (tests and benchmarks) --------------------------

_ORDERS = {"queue": ORDER_QUEUE, "stack": ORDER_STACK, "random": ORDER_RANDOM}


cdef class SendQueueSim:
    """Several send queues sharing packets, driven from Python: a test and
    benchmark harness for the exact code the broker runs."""
    cdef SendQueue *queues
    cdef int nqueues
    cdef uint64_t seq

    def __cinit__(self, int nqueues=1):
        cdef int i
        self.queues = <SendQueue *>malloc(nqueues * sizeof(SendQueue))
        if self.queues == NULL:
            raise MemoryError()
        self.nqueues = nqueues
        for i in range(nqueues):
            self.queues[i].slots = NULL
            self.queues[i].cap = 0
            self.queues[i].head = 0
            self.queues[i].count = 0
            self.queues[i].live = 0
            self.queues[i].bytes = 0
        self.seq = 0

    def __dealloc__(self):
        cdef int i
        if self.queues != NULL:
            for i in range(self.nqueues):
                sq_clear(&self.queues[i])
            free(self.queues)

    def push(self, bytes data, queues=None):
        """Store data once and append it to the given queues (default all)."""
        cdef Packet *p = packet_new(data, len(data), self.seq)
        if p == NULL:
            raise MemoryError()
        self.seq += 1
        for i in (range(self.nqueues) if queues is None else queues):
            if sq_push(&self.queues[<int>i], p) < 0:
                raise MemoryError()
        if p.refs == 0:
            packet_release(p)

    def pop(self, int queue, str order="queue", uint32_t n=1):
        """Send (remove) up to n packets from one queue; returns their data."""
        cdef uint32_t positions[64]
        cdef Packet *out[64]
        cdef uint32_t got, i
        if n > 64:
            n = 64
        got = sq_select(&self.queues[queue], _ORDERS[order], positions, out, n)
        result = [out[i].data[:out[i].len] for i in range(got)]
        sq_consume(&self.queues[queue], positions, got)
        return result

    def queued(self, int queue):
        return (self.queues[queue].live, self.queues[queue].bytes)

    def clear(self, int queue):
        return sq_clear(&self.queues[queue])


def packet_counters():
    """Broker-wide packet counters of this process (live, bytes, peak, allocated, freed)."""
    return {"live": packet_stats.live, "bytes": packet_stats.bytes,
            "bytes_peak": packet_stats.bytes_peak,
            "allocated": packet_stats.allocated, "freed": packet_stats.freed}
