# cython: language_level=3
"""Reporting: the records the broker hands to its on_event callback, the
stats reply, and the periodic stats and flood summaries.

Every key comes from ``sbus.logschema`` (the one home of event and field
names); the broker only says when a record is due.
"""
from libc.string cimport memcmp
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t

from sbus._core.conn cimport (
    Conn, Counters, R_NONE, R_EOF, R_ERROR, R_PROTOCOL, R_CRED, R_BANG, R_USER,
    R_FLOOD, R_OVERSIZE, R_LIMIT, R_SHUTDOWN, R_FD_LIMIT, R_SUB_BUDGET, R_CONN_BUDGET, R_POLICY_DENIED,
    R_POLICY_REFUSED, R_POLICY_REVOKED, R_COUNT)
from sbus._core.budget cimport Account, Accounts, UNLIMITED
from sbus._core.sendq cimport PacketStats, get_packet_stats

from sbus import logschema as ls
from sbus._core.policy import MODE_NAMES, ORDER_NAMES

# The compiled Reason enum by logschema's names.
_REASONS = {
    R_EOF: ls.DISCONNECT_EOF, R_ERROR: ls.DISCONNECT_ERROR,
    R_PROTOCOL: ls.DISCONNECT_PROTOCOL_ERROR, R_CRED: ls.DISCONNECT_CRED_REFUSED,
    R_BANG: ls.DISCONNECT_BANG_MISUSE, R_USER: ls.DISCONNECT_USER_REFUSED,
    R_FLOOD: ls.DISCONNECT_FLOOD_ERROR, R_OVERSIZE: ls.DISCONNECT_OVERSIZE,
    R_LIMIT: ls.DISCONNECT_LIMIT, R_SHUTDOWN: ls.DISCONNECT_SHUTDOWN,
    R_FD_LIMIT: ls.DISCONNECT_FD_LIMIT, R_SUB_BUDGET: ls.DISCONNECT_SUB_BUDGET,
    R_CONN_BUDGET: ls.DISCONNECT_CONNECTION_BUDGET,
    R_POLICY_DENIED: ls.DISCONNECT_POLICY_DENIED, R_POLICY_REFUSED: ls.DISCONNECT_POLICY_REFUSED,
    R_POLICY_REVOKED: ls.DISCONNECT_POLICY_REVOKED,
}
REASON_NAMES = tuple(_REASONS.get(r) for r in range(R_COUNT))

_IDENT = ls.CLIENT_COUNTER_FIELDS[:4]
_MODE_FIELDS = ("soft", "hard", "order", "echo")
# The flood event's own fields: identity and interval_s are added elsewhere.
_FLOOD_FIELDS = tuple(name for name, _ in ls.EVENT_FIELDS[ls.FLOOD]
                      if name not in _IDENT and name != "interval_s")


def reason_names():
    """The disconnect reason of every compiled Reason but R_NONE, in enum order."""
    return REASON_NAMES[R_NONE + 1:]


cdef str text(const char *s, size_t n):
    return s[:n].decode("utf-8", "backslashreplace")


cdef dict ident(const Conn *c):
    return dict(zip(_IDENT, (c.id, c.pid, c.uid, c.gid)))


cdef dict counters(const Conn *c):
    cdef const Counters *n = &c.counts
    return dict(zip(ls.CLIENT_COUNTER_FIELDS, (
        c.id, c.pid, c.uid, c.gid, n.msgs_in, n.bytes_in, n.msgs_out, n.bytes_out,
        n.replies_out, n.drops_soft, n.drops_hard, n.drops_disconnect, c.q.live, c.q.bytes,
        c.nsubs, c.denied)))


cdef dict entry(const Conn *c):
    d = counters(c)
    d.update(zip(_MODE_FIELDS, (MODE_NAMES[c.soft], MODE_NAMES[c.hard],
                                ORDER_NAMES[c.order], bool(c.echo))))
    return d


cdef dict subscription(const Conn *c, const char *pattern, size_t n, str refusal):
    d = ident(c)
    if refusal is not None and n > REFUSED_PATTERN_LOGGED:
        logged = text(pattern, REFUSED_PATTERN_LOGGED) + "..."
    else:
        logged = text(pattern, n)
    d.update(pattern=logged, accepted=refusal is None, reason=refusal)
    return d


cdef dict disconnect(const Conn *c, object detail, double now):
    d = ident(c)
    d.update(reason=REASON_NAMES[c.reason], detail=detail,
             duration_s=round(now - c.connected_at, 6), counters=counters(c))
    return d


cdef dict refused(uint64_t id, int64_t pid, int64_t uid, int64_t gid, int reason, str detail):
    """The disconnect record of a peer refused at accept: it never connected."""
    d = dict(zip(_IDENT, (id, pid, uid, gid)))
    zero = dict.fromkeys(ls.CLIENT_COUNTER_FIELDS, 0)
    zero.update(d)
    d.update(reason=REASON_NAMES[reason], detail=detail, duration_s=0.0, counters=zero)
    return d


cdef list entries(Conn **table, int cap):
    cdef int fd
    out = []
    for fd in range(cap):
        if table[fd] != NULL and not table[fd].closing:
            out.append(entry(table[fd]))
    return out


cdef list take_changed_entries(Conn **table, int cap):
    """Entries for the connections that are new or changed (counters, queue,
    subscriptions or modes) since the last call, which remembers what it
    listed: an idle client is listed once, so ten thousand of them neither
    stall the loop nor fill the log every time."""
    cdef int fd
    cdef Conn *c
    cdef uint8_t modes
    out = []
    for fd in range(cap):
        c = table[fd]
        if c == NULL or c.closing:
            continue
        modes = c.soft | (c.hard << 2) | (c.order << 4) | (c.echo << 6)
        if (c.listed.ever and c.listed.modes == modes and c.listed.nsubs == c.nsubs
                and c.listed.queued_msgs == c.q.live and c.listed.queued_bytes == c.q.bytes
                and memcmp(&c.listed.counts, &c.counts, sizeof(Counters)) == 0):
            continue
        c.listed.counts = c.counts
        c.listed.queued_msgs = c.q.live
        c.listed.queued_bytes = c.q.bytes
        c.listed.nsubs = c.nsubs
        c.listed.modes = modes
        c.listed.ever = 1
        out.append(entry(c))
    return out


cdef list take_flood_records(Conn **table, int cap):
    """Per connection whose drops or blocks grew since the last call: the
    growth and its queue now; the call remembers the counts it reported.
    Rate-limits flood logging to one record per client per call."""
    cdef int fd
    cdef Conn *c
    out = []
    for fd in range(cap):
        c = table[fd]
        if c == NULL:
            continue
        if (c.counts.drops_soft != c.reported.drops_soft or
                c.counts.drops_hard != c.reported.drops_hard or
                c.counts.blocks != c.reported.blocks):
            d = ident(c)
            d.update(zip(_FLOOD_FIELDS, (
                c.counts.drops_soft - c.reported.drops_soft,
                c.counts.drops_hard - c.reported.drops_hard,
                c.counts.blocks - c.reported.blocks,
                c.q.live, c.q.bytes, MODE_NAMES[c.soft], MODE_NAMES[c.hard])))
            out.append(d)
            c.reported = c.counts
    return out


cdef list users(const Accounts *accounts):
    """Each uid with a connection: its usage against its budgets, by uid."""
    cdef uint32_t i
    cdef const Account *a
    out = []
    for i in range(accounts.size):
        a = accounts.table[i]
        while a != NULL:
            out.append(dict(zip(ls.USER_FIELDS, (
                a.uid, a.conns, _budget(a.max_conns), a.sub_bytes, _budget(a.max_sub_bytes),
                a.queued_bytes, _budget(a.max_queued_bytes)))))
            a = a.next
    out.sort(key=lambda d: d["uid"])
    return out


cdef object _budget(uint64_t limit):
    return None if limit == UNLIMITED else limit


cdef dict totals(Conn **table, int cap, uint32_t nclients, uint64_t connects,
                 uint64_t disconnects, const Counters *tot, uint64_t subscriptions,
                 const Budgets *b):
    cdef PacketStats *ps = get_packet_stats()
    cdef int fd
    cdef uint64_t queued_msgs = 0
    for fd in range(cap):
        if table[fd] != NULL:
            queued_msgs += table[fd].q.live
    return dict(zip(ls.TOTALS_FIELDS, (
        nclients, connects, disconnects, tot.msgs_in, tot.bytes_in, tot.msgs_out,
        tot.bytes_out, tot.replies_out, tot.drops_soft, tot.drops_hard, tot.drops_disconnect,
        queued_msgs, ps.bytes, ps.bytes_peak, subscriptions, b.sub_bytes, b.conns_refused,
        b.subs_refused, b.denied, b.policy_subs_refused)))
