# cython: language_level=3
"""A broker's whole state as one blob and a list of descriptors, for a live
upgrade (sbus/sbusd/upgrade.py; docs/upgrade.md).

``export_state`` is called in the old process at the hand-over's safe point,
``restore_state`` in the new one on a fresh Broker that serves the same
listening socket and has read nothing yet. Between them the state crosses as
a versioned binary blob: a header (magic, format version, CRC-32 and length
of the body), the broker-wide counters, every distinct queued packet once,
then each connection with the index of its descriptor in the list, its
credentials, modes, counters, subscriptions in order (with their
multiplicity) and its send queue as indexes into the packets, so a packet
queued for many recipients is shared again after the restore. What can be
recomputed is: the index, the per-uid accounts and the subscription bytes,
which are checked against the figures the old process wrote.

The broker's state is reached only through its rooms' functions (peers,
subs, flood, control, sendq: their .pxd's "hand-over" parts) and Hub's
methods (carry, restore_carried, open_conn, pause), never their fields, so
what the broker keeps consistent stays consistent: a restored connection
joins the table as an accepted one does (Hub.open_conn grows the broker's
lists for it).
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE

from sbus._core.broker cimport Broker
from sbus._core.conn cimport Conn, Counters
from sbus._core.control cimport Modes, modes_of, restore_modes
from sbus._core.flood cimport holds_since, is_paused, restore_blocking
from sbus._core.growbuf cimport Buf, buf_append, buf_reserve
from sbus._core.hub cimport Carried
from sbus._core.includes.sys cimport ucred
from sbus._core.index cimport Sub
from sbus._core.peers cimport (
    ConnRecord, PeerCounts, carry_counts, conn_carry, conn_count, conn_restore, listener,
    next_conn, restore_counts, restore_queued, watchable)
from sbus._core.sendq cimport (
    Packet, get_packet_stats, packet_restore, restore_peak, sq_bytes, sq_live, sq_next)
from sbus._core.subs cimport (
    charged, conn_pattern, conn_sub_bytes, conn_subs, discard_sub, prebuild_sub,
    refused_count, restore_refused, restore_sub, stores)

import json
import zlib

FORMAT_VERSION = 1
MAGIC = b"SBUSHAND"
SUBS_MAGIC = b"SBUSSUBS"    # export_subscriptions: the index ahead of the state
cdef enum:
    HEADER_BYTES = 24       # magic, version u32, crc32 u32, body length u64
    NO_CRED = 0xFFFFFFFF    # upstream_cred absent


class HandoverError(ValueError):
    """A blob this build cannot restore; the text says why."""


# ---- writing -----------------------------------------------------------------

cdef inline int put_u8(Buf *o, uint8_t v) except -1:
    return buf_append(o, &v, 1)


cdef inline int put_u32(Buf *o, uint32_t v) except -1:
    return buf_append(o, &v, 4)


cdef inline int put_u64(Buf *o, uint64_t v) except -1:
    return buf_append(o, &v, 8)


cdef inline int put_i64(Buf *o, int64_t v) except -1:
    return buf_append(o, &v, 8)


cdef inline int put_f64(Buf *o, double v) except -1:
    return buf_append(o, &v, 8)


cdef int put_counters(Buf *o, const Counters *c) except -1:
    put_u64(o, c.msgs_in)
    put_u64(o, c.bytes_in)
    put_u64(o, c.msgs_out)
    put_u64(o, c.bytes_out)
    put_u64(o, c.replies_out)
    put_u64(o, c.drops_soft)
    put_u64(o, c.drops_hard)
    put_u64(o, c.drops_disconnect)
    return put_u64(o, c.blocks)


cdef int put_blob(Buf *o, bytes data) except -1:
    put_u32(o, <uint32_t>len(data))
    return buf_append(o, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))


cdef int put_patterns(Buf *o, const Conn *c) except -1:
    cdef uint32_t i, n
    cdef const char *pat
    put_u32(o, conn_subs(c))
    for i in range(conn_subs(c)):
        pat = conn_pattern(c, i, &n)
        put_u32(o, n)
        buf_append(o, pat, n)
    return 0


def export_state(Broker b):
    """(blob, fds) of a quiesced broker (see quiesce): fds[0] is the
    listening socket, the others its connections in the blob's order. The
    broker is left as it was, so it can go on serving if the hand-over fails."""
    cdef Buf o
    cdef Conn *c
    cdef Packet *p
    cdef int fd
    cdef uint32_t pos, nconns = 0
    cdef size_t at
    cdef dict packet_ids = {}
    cdef list packets = []
    cdef list fds = [listener(&b.peers)]
    cdef Carried car
    cdef PeerCounts pc
    cdef ConnRecord k
    cdef Modes m
    cdef double block_since
    cdef bint blocking
    if not b.at_safe_point():
        raise HandoverError("the broker is not at a safe point (call quiesce first)")
    last_totals = b.carry(&car)
    carry_counts(&b.peers, &pc)
    upstream_cred, upstream_state, ignored = b.ctl.carry()
    # Every distinct queued packet, numbered in the order first met.
    fd = 0
    c = next_conn(&b.peers, &fd)
    while c != NULL:
        pos = 0
        p = sq_next(&c.q, &pos)
        while p != NULL:
            if <size_t>p not in packet_ids:
                packet_ids[<size_t>p] = len(packets)
                packets.append(<size_t>p)
            p = sq_next(&c.q, &pos)
        c = next_conn(&b.peers, &fd)
    o.p = NULL
    o.len = o.cap = 0
    try:
        buf_reserve(&o, HEADER_BYTES)
        o.len = HEADER_BYTES
        put_counters(&o, &car.tot)
        for v in (pc.connects, pc.disconnects, car.trimmed_at, ignored, pc.next_id, car.seq,
                  charged(&b.subs), pc.refused, refused_count(&b.subs),
                  get_packet_stats().bytes_peak):
            put_u64(&o, v)
        put_f64(&o, car.started)
        put_u8(&o, pc.had_client)
        if upstream_cred is None:
            put_u32(&o, NO_CRED)
        else:
            put_blob(&o, upstream_cred)
        put_blob(&o, json.dumps({"last_totals": last_totals,
                                 "upstream_state": upstream_state,
                                 "policy": b.policy_counts()}).encode())
        put_u32(&o, <uint32_t>len(packets))
        for addr in packets:
            p = <Packet *><size_t>addr
            put_u32(&o, p.len)
            put_u64(&o, p.seq)
            put_u8(&o, p.reply)
            buf_append(&o, p.data, p.len)
        at = o.len
        put_u32(&o, 0)      # the connection count, written once known
        fd = 0
        c = next_conn(&b.peers, &fd)
        while c != NULL:
            nconns += 1
            put_u32(&o, <uint32_t>len(fds))
            fds.append(fd - 1)      # next_conn left fd just past c's
            conn_carry(c, &k)
            modes_of(c, &m)
            blocking = holds_since(c, &block_since)
            put_u64(&o, k.id)
            put_i64(&o, k.pid)
            put_i64(&o, k.uid)
            put_i64(&o, k.gid)
            put_u8(&o, m.soft)
            put_u8(&o, m.hard)
            put_u8(&o, m.order)
            put_u8(&o, m.echo)
            put_u8(&o, k.link | (k.frames << 1))    # frames: a bit of its own, the format stays
            put_u8(&o, is_paused(c))
            put_u8(&o, blocking)
            put_u8(&o, k.write_dead)
            put_f64(&o, k.connected_at)
            put_f64(&o, block_since)
            put_counters(&o, &k.counts)
            put_counters(&o, &k.reported)
            put_counters(&o, &k.listed.counts)
            put_u64(&o, k.listed.queued_bytes)
            put_u32(&o, k.listed.queued_msgs)
            put_u32(&o, k.listed.nsubs)
            put_u8(&o, k.listed.modes)
            put_u8(&o, k.listed.ever)
            put_u64(&o, conn_sub_bytes(c))
            put_patterns(&o, c)
            put_u64(&o, sq_bytes(&c.q))
            put_u32(&o, sq_live(&c.q))
            pos = 0
            p = sq_next(&c.q, &pos)
            while p != NULL:
                put_u32(&o, packet_ids[<size_t>p])
                p = sq_next(&c.q, &pos)
            c = next_conn(&b.peers, &fd)
        memcpy(o.p + at, &nconns, 4)
        blob = PyBytes_FromStringAndSize(o.p, o.len)
    finally:
        free(o.p)
    return sealed(MAGIC, blob), fds


cdef bytes sealed(bytes magic, bytes blob):
    """blob (whose first HEADER_BYTES are room for it) with its header."""
    cdef object body = memoryview(blob)[HEADER_BYTES:]
    return (magic + (FORMAT_VERSION).to_bytes(4, "little") +
            (zlib.crc32(body)).to_bytes(4, "little") +
            (len(blob) - HEADER_BYTES).to_bytes(8, "little") + body.tobytes())


def export_subscriptions(Broker b):
    """Every connection's subscriptions in order, by connection id: what a
    new process indexes (prebuild) while this one still serves, so that the
    hand-over itself only checks them."""
    cdef Buf o
    cdef Conn *c
    cdef int fd = 0
    cdef uint32_t nconns = 0
    cdef ConnRecord k
    o.p = NULL
    o.len = o.cap = 0
    try:
        buf_reserve(&o, HEADER_BYTES + 4)
        o.len = HEADER_BYTES + 4
        c = next_conn(&b.peers, &fd)
        while c != NULL:
            nconns += 1
            conn_carry(c, &k)
            put_u64(&o, k.id)
            put_patterns(&o, c)
            c = next_conn(&b.peers, &fd)
        memcpy(o.p + HEADER_BYTES, &nconns, 4)
        blob = PyBytes_FromStringAndSize(o.p, o.len)
    finally:
        free(o.p)
    return sealed(SUBS_MAGIC, blob)


cdef class Prebuilt:
    """Subscriptions indexed in a broker before their connections are there
    (owner NULL): restore_state gives each connection its own when they are
    what the state says, and removes the rest."""
    cdef Sub **subs         # every one, by connection, in order; NULL once taken
    cdef uint32_t n
    cdef dict spans         # connection id -> (first, count) in subs

    def __dealloc__(self):
        free(self.subs)

    cdef int discard(self, Broker b) except -1:
        cdef uint32_t i
        for i in range(self.n):
            if self.subs[i] != NULL:
                discard_sub(&b.subs, self.subs[i])
                self.subs[i] = NULL
        return 0


def prebuild(Broker b, bytes blob):
    """Index the subscriptions of export_subscriptions in b, a fresh broker,
    for restore_state to take over; a Prebuilt."""
    cdef In r
    cdef Prebuilt pre = Prebuilt()
    cdef uint32_t nconns, _conn, _sub, n, k, total = 0
    cdef size_t cap = 0
    cdef uint64_t conn_id
    cdef const char *pat
    cdef Sub **grown
    check_header(blob, SUBS_MAGIC)
    pre.spans = {}
    r.p = PyBytes_AS_STRING(blob) + HEADER_BYTES
    r.end = PyBytes_AS_STRING(blob) + PyBytes_GET_SIZE(blob)
    nconns = get_u32(&r)
    try:
        for _conn in range(nconns):
            conn_id = get_u64(&r)
            n = get_u32(&r)
            if <size_t>n > <size_t>(r.end - r.p) // 4:
                raise HandoverError("the subscriptions are truncated")
            if total + n > cap:
                cap = 2 * (total + n)
                grown = <Sub **>realloc(pre.subs, cap * sizeof(Sub *))
                if grown == NULL:
                    raise MemoryError()
                pre.subs = grown
            pre.spans[conn_id] = (total, n)
            for _sub in range(n):
                k = get_u32(&r)
                pat = get_span(&r, k)
                pre.subs[total] = prebuild_sub(&b.subs, pat, k)
                total += 1
                pre.n = total
    except BaseException:
        pre.discard(b)
        raise
    return pre


# ---- reading -----------------------------------------------------------------

cdef struct In:
    const char *p
    const char *end


cdef int take(In *r, void *dst, size_t n) except -1:
    if <size_t>(r.end - r.p) < n:
        raise HandoverError("the state is truncated")
    memcpy(dst, r.p, n)
    r.p += n
    return 0


cdef inline uint8_t get_u8(In *r) except? 0xFF:
    cdef uint8_t v
    take(r, &v, 1)
    return v


cdef inline uint32_t get_u32(In *r) except? 0xFFFFFFFF:
    cdef uint32_t v
    take(r, &v, 4)
    return v


cdef inline uint64_t get_u64(In *r) except? 0xFFFFFFFFFFFFFFFF:
    cdef uint64_t v
    take(r, &v, 8)
    return v


cdef inline int64_t get_i64(In *r) except? -1:
    cdef int64_t v
    take(r, &v, 8)
    return v


cdef inline double get_f64(In *r) except? -1:
    cdef double v
    take(r, &v, 8)
    return v


cdef const char *get_span(In *r, size_t n) except NULL:
    cdef const char *at = r.p
    if <size_t>(r.end - r.p) < n:
        raise HandoverError("the state is truncated")
    r.p += n
    return at


cdef bytes get_blob(In *r):
    cdef uint32_t n = get_u32(r)
    return get_span(r, n)[:n] if n else b""


cdef int get_counters(In *r, Counters *c) except -1:
    c.msgs_in = get_u64(r)
    c.bytes_in = get_u64(r)
    c.msgs_out = get_u64(r)
    c.bytes_out = get_u64(r)
    c.replies_out = get_u64(r)
    c.drops_soft = get_u64(r)
    c.drops_hard = get_u64(r)
    c.drops_disconnect = get_u64(r)
    c.blocks = get_u64(r)
    return 0


def check_header(bytes blob, bytes magic=MAGIC):
    """Raise HandoverError unless blob is whole and in this build's format."""
    if len(blob) < HEADER_BYTES or blob[:8] != magic:
        raise HandoverError("not an sbusd hand-over state (bad magic)")
    version = int.from_bytes(blob[8:12], "little")
    if version != FORMAT_VERSION:
        raise HandoverError(f"hand-over format version {version} is not this sbusd's "
                            f"({FORMAT_VERSION})")
    body_len = int.from_bytes(blob[16:24], "little")
    if body_len != len(blob) - HEADER_BYTES:
        raise HandoverError(f"the state is truncated ({len(blob) - HEADER_BYTES} of "
                            f"{body_len} bytes)")
    if zlib.crc32(memoryview(blob)[HEADER_BYTES:]) != int.from_bytes(blob[12:16], "little"):
        raise HandoverError("the state is corrupt (CRC-32 mismatch)")


def restore_state(Broker b, bytes blob, list fds, Prebuilt pre=None):
    """Rebuild in b, a fresh broker on fds[0], the state export_state wrote:
    its connections on the descriptors fds[1:], their subscriptions (the
    index; those of pre, prebuild's, where they are the same), queues,
    modes and counters; the per-uid accounts are recomputed. Raises
    HandoverError for a blob it cannot trust; b is then unusable."""
    cdef In r
    cdef uint32_t npackets, nconns, i, j, k, n, nq, _slot
    cdef uint32_t fd_index
    cdef int fd
    cdef Packet *p
    cdef Packet **pkts = NULL
    cdef Conn *c
    cdef Sub *sub
    cdef const char *pat
    cdef const char *mark
    cdef uint32_t first
    cdef bint same
    cdef ucred cred
    cdef Carried car
    cdef PeerCounts pc
    cdef ConnRecord rec
    cdef Modes m
    cdef uint64_t sub_bytes, q_bytes
    cdef uint64_t ignored, peak, subs_refused
    cdef uint64_t budget_sub_bytes
    cdef uint64_t seq
    cdef uint8_t reply, paused, blocking
    cdef double block_since
    check_header(blob)
    if not fds or fds[0] != listener(&b.peers):
        raise HandoverError("the first descriptor is not the broker's listening socket")
    if conn_count(&b.peers):
        raise HandoverError("the broker has connections of its own already")
    r.p = PyBytes_AS_STRING(blob) + HEADER_BYTES
    r.end = PyBytes_AS_STRING(blob) + PyBytes_GET_SIZE(blob)
    get_counters(&r, &car.tot)
    pc.connects = get_u64(&r)
    pc.disconnects = get_u64(&r)
    car.trimmed_at = get_u64(&r)
    ignored = get_u64(&r)
    pc.next_id = get_u64(&r)
    car.seq = get_u64(&r)
    budget_sub_bytes = get_u64(&r)
    pc.refused = get_u64(&r)
    subs_refused = get_u64(&r)
    peak = get_u64(&r)
    car.started = get_f64(&r)
    pc.had_client = get_u8(&r)
    n = get_u32(&r)
    upstream_cred = None if n == NO_CRED else get_span(&r, n)[:n]
    try:
        extra = json.loads(get_blob(&r))
        b.restore_carried(&car, extra["last_totals"])
        b.ctl.restore(upstream_cred, extra["upstream_state"], ignored)
        policy_counts = extra.get("policy")     # none from an sbusd before the policy
    except (ValueError, KeyError, TypeError):
        raise HandoverError("the state's broker record is corrupt") from None
    restore_refused(&b.subs, subs_refused)
    npackets = get_u32(&r)
    used = set()
    try:
        if npackets:
            pkts = <Packet **>malloc(npackets * sizeof(Packet *))
            if pkts == NULL:
                raise MemoryError()
        for i in range(npackets):
            n = get_u32(&r)
            seq = get_u64(&r)
            reply = get_u8(&r)
            pat = get_span(&r, n)
            p = packet_restore(pat, n, seq, reply)
            if p == NULL:
                raise MemoryError()
            pkts[i] = p
        nconns = get_u32(&r)
        for i in range(nconns):
            fd_index = get_u32(&r)
            if fd_index == 0 or fd_index >= <uint32_t>len(fds) or fd_index in used:
                raise HandoverError(f"connection {i}: bad descriptor index {fd_index}")
            used.add(fd_index)
            fd = fds[fd_index]
            if not watchable(&b.peers, fd):
                raise HandoverError(f"descriptor {fd} is beyond what the {b.backend} "
                                    f"backend can watch")
            rec.id = get_u64(&r)
            rec.pid = get_i64(&r)
            rec.uid = get_i64(&r)
            rec.gid = get_i64(&r)
            m.soft = get_u8(&r)
            m.hard = get_u8(&r)
            m.order = get_u8(&r)
            m.echo = get_u8(&r)
            rec.link = get_u8(&r)
            rec.frames = rec.link >> 1
            rec.link &= 1
            paused = get_u8(&r)
            blocking = get_u8(&r)
            rec.write_dead = get_u8(&r)
            rec.connected_at = get_f64(&r)
            block_since = get_f64(&r)
            get_counters(&r, &rec.counts)
            get_counters(&r, &rec.reported)
            get_counters(&r, &rec.listed.counts)
            rec.listed.queued_bytes = get_u64(&r)
            rec.listed.queued_msgs = get_u32(&r)
            rec.listed.nsubs = get_u32(&r)
            rec.listed.modes = get_u8(&r)
            rec.listed.ever = get_u8(&r)
            cred.pid = <int>rec.pid
            cred.uid = <unsigned int>rec.uid
            cred.gid = <unsigned int>rec.gid
            # As admission and attach_link open one: the broker's lists grown
            # for it, charged to its uid's account (peers.account_for).
            c = b.open_conn(fd, &cred, rec.link)
            conn_restore(c, &rec)
            if not restore_modes(c, &m):
                raise HandoverError(f"connection {rec.id}: bad modes")
            if rec.link and not b.ctl.restore_link(c):
                raise HandoverError("two upstream links")
            sub_bytes = get_u64(&r)
            n = get_u32(&r)
            # Prebuilt for this connection and still the same: take them over.
            span = pre.spans.get(rec.id) if pre is not None else None
            same = span is not None and span[1] == n
            if same:
                first = span[0]
                mark = r.p
                for j in range(n):
                    k = get_u32(&r)
                    pat = get_span(&r, k)
                    sub = pre.subs[first + j]
                    if sub == NULL or not stores(sub, pat, k):
                        same = False
                        break
                r.p = mark
            for j in range(n):
                k = get_u32(&r)
                pat = get_span(&r, k)
                sub = NULL
                if same:
                    sub = pre.subs[first + j]
                    pre.subs[first + j] = NULL
                restore_sub(&b.subs, c, pat, k, sub)
            if conn_sub_bytes(c) != sub_bytes:
                raise HandoverError(f"connection {rec.id}: its subscriptions cost "
                                    f"{conn_sub_bytes(c)} bytes, the state says {sub_bytes}")
            q_bytes = get_u64(&r)
            nq = get_u32(&r)
            for _slot in range(nq):
                k = get_u32(&r)
                if k >= npackets:
                    raise HandoverError(f"connection {rec.id}: bad packet index {k}")
                restore_queued(c, pkts[k])
            if sq_bytes(&c.q) != q_bytes:
                raise HandoverError(f"connection {rec.id}: its queue holds "
                                    f"{sq_bytes(&c.q)} bytes, the state says {q_bytes}")
            if blocking:
                restore_blocking(&b.flood, c, block_since)
            if paused:
                b.pause(c)      # sets its interest: not read until the bus is free
            else:
                b.update_interest(c)
        if r.p != r.end:
            raise HandoverError(f"{r.end - r.p} bytes after the last connection")
        if pre is not None:
            pre.discard(b)      # what is no connection's any more
        if charged(&b.subs) != budget_sub_bytes:
            raise HandoverError(f"the subscriptions cost {charged(&b.subs)} bytes, "
                                f"the state says {budget_sub_bytes}")
        for i in range(npackets):
            if pkts[i].refs == 0:
                raise HandoverError(f"packet {i} is in no queue")
    finally:
        free(pkts)
    restore_counts(&b.peers, &pc)
    b.restore_policy_counts(policy_counts)
    restore_peak(peak)
    return None


def quiesce(Broker b):
    """Bring a broker whose run() has returned to the hand-over's safe
    point: every delivery of the last turn written or queued, every
    connection marked closing torn down, nothing pending. Nothing is read."""
    b.quiesce()


def resume(Broker b):
    """Let run() serve again after it stopped between two turns: for a
    signal to act on, or a hand-over that failed."""
    b.resume()
