# cython: language_level=3
"""Subscriptions (see subs.pxd): SUB and UNSUB through one normalising
step, the subscription budgets, and the index they feed."""
from libc.stdint cimport uint32_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memcmp

from sbus._core cimport report
from sbus._core.report cimport text
from sbus._core.budget cimport pattern_cost
from sbus._core.conn cimport R_ERROR, R_CRED, R_BANG, R_LIMIT, R_SUB_BUDGET, R_POLICY_REFUSED
from sbus._core.index cimport index_init, index_free, index_add, index_remove, index_match
from sbus._core.protocol cimport (
    CRED_CANONICAL_MAX, cred_canonical_prefix, is_cred_key, check_rest, KEY_OK, KEY_BANG_MISUSE,
    normalise_pattern, PATTERN_OK,
    PATTERN_CRED_MALFORMED, PATTERN_CRED_MISMATCH, PATTERN_NESTED_CRED_MALFORMED,
    PATTERN_BANG_MISUSE, PATTERN_TOO_LONG)

from sbus.logschema import (
    REFUSE_BANG_MISUSE, REFUSE_CRED_MALFORMED, REFUSE_CRED_MISMATCH, REFUSE_NOT_SUBSCRIBED,
    REFUSE_PATTERN_TOO_LONG, REFUSE_TOO_MANY, REFUSE_SUB_BUDGET_CONNECTION,
    REFUSE_SUB_BUDGET_USER, REFUSE_SUB_BUDGET_TOTAL, REFUSE_POLICY_DENIED)

# A refused SUB: its logged reason, and the connection's Reason and detail.
_PATTERN_REFUSALS = {
    PATTERN_CRED_MALFORMED: (REFUSE_CRED_MALFORMED, R_CRED, "malformed !/cred/ pattern"),
    PATTERN_CRED_MISMATCH: (REFUSE_CRED_MISMATCH, R_CRED,
                            "credentials do not match the client's"),
    PATTERN_NESTED_CRED_MALFORMED: (REFUSE_CRED_MALFORMED, R_CRED,
                                    "malformed nested !/cred/ pattern"),
    PATTERN_BANG_MISUSE: (REFUSE_BANG_MISUSE, R_BANG, "reserved '!' in pattern"),
    PATTERN_TOO_LONG: (REFUSE_PATTERN_TOO_LONG, R_LIMIT, "pattern too long"),
}
_NO_MEMORY = (None, R_ERROR, "out of memory", None)


cdef int subs_init(Subs *s, config) except -1:
    s.scratch = NULL
    if index_init(&s.index) < 0:
        raise MemoryError()
    s.max_subscriptions = config.max_subscriptions
    # 0: no limit of its own; a pattern is as long as a packet allows.
    s.max_pattern = config.max_pattern or config.max_message
    s.conn_max_bytes = config.sub_max_bytes
    s.total_max_bytes = config.total_sub_max_bytes
    s.bytes = 0
    s.refused = 0
    s.policy_refused = 0
    s.scratch_cap = s.max_pattern + 128
    if s.scratch_cap < 4096:
        s.scratch_cap = 4096
    s.scratch = <char *>malloc(s.scratch_cap)
    if s.scratch == NULL:
        raise MemoryError()
    return 0


cdef void subs_free(Subs *s) noexcept:
    index_free(&s.index)
    free(s.scratch)
    s.scratch = NULL


cdef int link_pattern(const char *pat, size_t n, char *out, size_t cap,
                      size_t *out_len) noexcept nogil:
    """A !/cred/ pattern of the link, stored as written once well formed: the
    link receives private keys for others anyway, and a bridge subscribes to
    the host form of every other host with '*' for the host field
    (!/cred/*/4294967295/0/, docs/bridge.md)."""
    cdef int check = check_rest(pat, n, True)
    if check == KEY_BANG_MISUSE:
        return PATTERN_BANG_MISUSE
    if check != KEY_OK:
        return PATTERN_CRED_MALFORMED
    if n > cap:
        return PATTERN_TOO_LONG
    memcpy(out, pat, n)
    out_len[0] = n
    return PATTERN_OK


cdef inline int normalise(Subs *s, Conn *c, const char *pat, size_t n,
                          size_t *stored) noexcept:
    """The form c's pattern is stored in, into s.scratch: a PATTERN_ result."""
    if c.link and is_cred_key(pat, n):
        return link_pattern(pat, n, s.scratch, s.scratch_cap, stored)
    return normalise_pattern(pat, n, c.gid, c.uid, c.pid, s.scratch, s.scratch_cap, stored)


cdef inline tuple refused(Conn *c, str logged, const char *pat, size_t n, int reason,
                          str detail):
    return (report.subscription(c, pat, n, logged), reason, detail, None)


cdef int room_for_one(Conn *c) noexcept:
    cdef uint32_t cap
    cdef Sub **grown
    if c.nsubs == c.subs_cap:
        cap = c.subs_cap * 2 if c.subs_cap else 4
        grown = <Sub **>realloc(c.subs, cap * sizeof(Sub *))
        if grown == NULL:
            return -1
        c.subs = grown
        c.subs_cap = cap
    return 0


cdef void charge(Subs *s, Conn *c, Sub *sub, size_t cost) noexcept:
    sub.owner_pos = c.nsubs
    c.subs[c.nsubs] = sub
    c.nsubs += 1
    c.sub_bytes += cost
    c.acct.sub_bytes += cost
    s.bytes += cost


cdef tuple over_budget(Subs *s, Conn *c, size_t cost, const char *pat, size_t n):
    """A SUB whose pattern would take c, its uid or the broker past a
    subscription-bytes budget is refused (and counted); None if it fits."""
    if c.sub_bytes + cost > s.conn_max_bytes:
        logged, used, limit, flag = (REFUSE_SUB_BUDGET_CONNECTION, c.sub_bytes,
                                     s.conn_max_bytes, "--sub-max-bytes")
    elif c.acct.sub_bytes + cost > c.acct.max_sub_bytes:
        logged, used, limit, flag = (REFUSE_SUB_BUDGET_USER, c.acct.sub_bytes,
                                     c.acct.max_sub_bytes, "--user-sub-max-bytes")
    elif s.bytes + cost > s.total_max_bytes:
        logged, used, limit, flag = (REFUSE_SUB_BUDGET_TOTAL, s.bytes,
                                     s.total_max_bytes, "--total-sub-max-bytes")
    else:
        return None
    s.refused += 1
    return refused(c, logged, pat, n, R_SUB_BUDGET,
                   f"pattern of {cost} bytes over {flag} {limit} ({used} in use)")


cdef tuple policy_refusal(access, bytes pattern):
    decision = access.may_subscribe(pattern)
    if decision.allowed:
        return None
    rule = decision.rule.number if decision.rule is not None else 0
    who = f"rule {rule}" if rule else "the default"
    return rule, f"{who} refuses {text(pattern, len(pattern))!r}: {decision.why}"


cdef tuple subscribe(Subs *s, Conn *c, const char *pat, size_t n, size_t nested, access):
    cdef size_t stored = 0
    cdef size_t cost
    cdef int refusal
    cdef Sub *sub
    if n > s.max_pattern:
        return refused(c, REFUSE_PATTERN_TOO_LONG, pat, n, R_LIMIT,
                       f"pattern longer than {s.max_pattern} bytes")
    if c.nsubs >= s.max_subscriptions:
        return refused(c, REFUSE_TOO_MANY, pat, n, R_LIMIT,
                       f"more than {s.max_subscriptions} subscriptions")
    pat += nested
    n -= nested
    refusal = normalise(s, c, pat, n, &stored)
    if refusal != PATTERN_OK:
        logged, reason, detail = _PATTERN_REFUSALS[refusal]
        return refused(c, logged, pat, n, reason, detail)
    if access is not None:
        # Decided on the stored form: the one delivery matches against.
        policy = policy_refusal(access, s.scratch[:stored])
        if policy is not None:
            s.policy_refused += 1
            return refused(c, REFUSE_POLICY_DENIED, pat, n, R_POLICY_REFUSED, policy[1])
    cost = pattern_cost(s.scratch, stored)
    over = over_budget(s, c, cost, pat, n)
    if over is not None:
        return over
    if room_for_one(c) < 0:
        return _NO_MEMORY
    sub = index_add(&s.index, c, s.scratch, stored)
    if sub == NULL:
        return _NO_MEMORY
    charge(s, c, sub, cost)
    return (report.subscription(c, s.scratch, stored, None), 0, None, s.scratch[:stored])


cdef void drop_sub(Subs *s, Conn *c, Sub *sub) noexcept:
    cdef size_t cost = pattern_cost(sub.pattern, sub.len)
    c.sub_bytes -= cost
    c.acct.sub_bytes -= cost
    s.bytes -= cost
    index_remove(&s.index, sub)


cdef tuple unsubscribe(Subs *s, Conn *c, const char *pat, size_t n, size_t nested):
    cdef size_t stored = 0
    cdef int refusal
    cdef uint32_t i
    cdef Sub *sub
    cdef Sub *last
    pat += nested
    n -= nested
    refusal = normalise(s, c, pat, n, &stored)
    if refusal == PATTERN_BANG_MISUSE:
        # as in SUB; a pattern refused for its credentials was simply
        # never stored, so it is not found
        return (None, R_BANG, "reserved '!' in pattern", None)
    if refusal == PATTERN_OK:
        i = c.nsubs
        while i > 0:        # newest first: the usual case
            i -= 1
            sub = c.subs[i]
            if sub.len == stored and memcmp(sub.pattern, s.scratch, stored) == 0:
                c.nsubs -= 1
                if i != c.nsubs:
                    last = c.subs[c.nsubs]
                    c.subs[i] = last
                    last.owner_pos = i
                drop_sub(s, c, sub)
                return (report.subscription(c, pat, n, None), 0, None, s.scratch[:stored])
    return (report.subscription(c, pat, n, REFUSE_NOT_SUBSCRIBED), 0, None, None)


cdef void drop_all(Subs *s, Conn *c) noexcept:
    cdef uint32_t j
    for j in range(c.nsubs):
        drop_sub(s, c, c.subs[j])


# ---- the hand-over -------------------------------------------------------------

cdef Sub *prebuild_sub(Subs *s, const char *pat, size_t n) except NULL:
    cdef Sub *sub = index_add(&s.index, NULL, pat, n)
    if sub == NULL:
        raise MemoryError()
    return sub


cdef void discard_sub(Subs *s, Sub *sub) noexcept:
    index_remove(&s.index, sub)


cdef int restore_sub(Subs *s, Conn *c, const char *pat, size_t n, Sub *prebuilt) except -1:
    cdef Sub *sub = prebuilt
    if room_for_one(c) < 0:
        raise MemoryError()
    if sub != NULL:
        sub.owner = c
    else:
        sub = index_add(&s.index, c, pat, n)
        if sub == NULL:
            raise MemoryError()
    charge(s, c, sub, pattern_cost(pat, n))
    return 0


cdef void restore_refused(Subs *s, uint64_t refused) noexcept:
    s.refused = refused


cdef int match_canonical(Subs *s, const char *key, size_t klen, CredForm *form,
                         match_fn fn, void *ctx) except -1:
    """Subscriptions store !/cred/ numbers without leading zeros, so a key
    spelling them with zeros ("!/cred/007/...") is matched again in that
    form: both spellings name the same client (fn must not pick a connection
    twice)."""
    cdef char canon[CRED_CANONICAL_MAX]
    cdef size_t clen = cred_canonical_prefix(form, canon)
    cdef size_t rest = klen - form.prefix_len
    cdef char *alt
    if clen == form.prefix_len and memcmp(canon, key, clen) == 0:
        return 0
    alt = <char *>malloc(clen + rest)
    if alt == NULL:
        raise MemoryError()
    memcpy(alt, canon, clen)
    memcpy(alt + clen, key + form.prefix_len, rest)
    index_match(&s.index, alt, clen + rest, fn, ctx)
    free(alt)
    return 0
