# Frames: many sbus packets in one SOCK_SEQPACKET packet, between sbus's own
# processes: the socketpair between a leaf broker and its own link process
# (docs/hierarchy.md, "Frames on the link's socketpair"), and a bridge's
# connections (docs/bridge.md, "Speed"). The protocol is a packet per message,
# and stays so for every client that does not ask: a connection of the link
# place, the broker's own uid or root asks with `CMSG link/frames` and,
# answered "ok", may send frames and gets its deliveries in frames. A packet
# per message costs the kernel an allocation, a copy and a wake-up each; a
# frame of 64 costs one of each.
#
#   FRAME := "\0FRM" (LEN PACKET)+
#   LEN   := u32 in the host's byte order (both ends are on one host), >= 1
#
# A PACKET is any packet of the protocol, never a frame. Declarations and
# inline functions only: the broker and the link (linkpath.pyx) share them.
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

from sbus._core.sendq cimport Packet


cdef enum:
    FRAME_HEAD = 4              # len("\0FRM")
    FRAME_ENTRY_HEAD = 4        # LEN
    FRAME_MSGS = 64             # packets in one frame, at most (a receiver may close a sender of more)
    FRAME_BYTES = 32768         # a frame's bytes, at most (and never more than the receiver's max message)


cdef inline bint is_frame(const char *p, size_t n) noexcept nogil:
    # No packet of the protocol starts with a NUL byte.
    return n > FRAME_HEAD and p[0] == 0 and memcmp(p, b"\0FRM", FRAME_HEAD) == 0


cdef inline size_t frame_start(char *out) noexcept nogil:
    memcpy(out, b"\0FRM", FRAME_HEAD)
    return FRAME_HEAD


cdef inline size_t frame_put(char *out, size_t at, const char *packet, uint32_t n) noexcept nogil:
    """Append one packet at out + at; returns where the next goes."""
    memcpy(out + at, &n, FRAME_ENTRY_HEAD)
    memcpy(out + at + FRAME_ENTRY_HEAD, packet, n)
    return at + FRAME_ENTRY_HEAD + n


cdef inline Py_ssize_t frame_next(const char *frame, size_t n, size_t *at,
                                  const char **packet) noexcept nogil:
    """The length of the packet at *at in frame[0:n] (*packet set to it, *at
    moved past it); 0 at the end, -1 when the rest is not a packet's LEN and
    bytes."""
    cdef uint32_t length
    if at[0] == n:
        return 0
    if n - at[0] < FRAME_ENTRY_HEAD:
        return -1
    memcpy(&length, frame + at[0], FRAME_ENTRY_HEAD)
    if length == 0 or length > n - at[0] - FRAME_ENTRY_HEAD:
        return -1
    packet[0] = frame + at[0] + FRAME_ENTRY_HEAD
    at[0] += FRAME_ENTRY_HEAD + length
    return length


cdef inline uint32_t frame_packets(char *out, Packet **pkts, uint32_t k, size_t *size,
                                   uint64_t *nbytes) noexcept nogil:
    """Fill out with a frame of queued packets pkts[0:k], up to the first
    control reply or the first that would pass FRAME_BYTES; returns how many
    it holds (*size the frame's bytes, *nbytes the packets')."""
    cdef size_t at = frame_start(out)
    cdef uint32_t m = 0
    nbytes[0] = 0
    while m < k and not pkts[m].reply and at + FRAME_ENTRY_HEAD + pkts[m].len <= FRAME_BYTES:
        at = frame_put(out, at, pkts[m].data, <uint32_t>pkts[m].len)
        nbytes[0] += pkts[m].len
        m += 1
    size[0] = at
    return m
