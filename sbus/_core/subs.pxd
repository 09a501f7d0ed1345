# Subscriptions: the segment trie of every pattern, the one step that
# normalises a pattern as a connection sent it into the form stored, and the
# subscription budgets (per connection, per uid, broker-wide). The broker
# embeds one Subs and reads its index on the message path (index_match);
# everything that adds, removes or charges a pattern is here. SUB and UNSUB
# return a decision: (record, reason, detail, stored), where record is the
# log record or None, reason the connection's close Reason or 0, and stored
# the pattern as stored or removed (for the link), or None.
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcmp

from sbus._core.conn cimport Conn
from sbus._core.index cimport Index, Sub, match_fn
from sbus._core.protocol cimport CredForm


cdef struct Subs:
    Index index             # the segment trie of every subscription
    char *scratch           # the pattern normalise stored last
    size_t scratch_cap
    uint32_t max_subscriptions
    size_t max_pattern
    uint64_t conn_max_bytes     # --sub-max-bytes
    uint64_t total_max_bytes    # --total-sub-max-bytes (per uid: the Account's)
    uint64_t bytes              # charged now, broker-wide
    uint64_t refused            # SUBs refused over a budget since start
    uint64_t policy_refused     # SUBs the access policy refused since start


cdef int subs_init(Subs *s, config) except -1
cdef void subs_free(Subs *s) noexcept

# access: c's sbus.access Access (None: no policy), asked about the pattern as
# stored, after the !/cred/ check and before the budgets.
cdef tuple subscribe(Subs *s, Conn *c, const char *pat, size_t n, size_t nested, access)
cdef tuple unsubscribe(Subs *s, Conn *c, const char *pat, size_t n, size_t nested)
# Every pattern of a closing connection out of the index and uncharged;
# c.nsubs stays for its disconnect record.
cdef void drop_all(Subs *s, Conn *c) noexcept
# Match a !/cred/ key again spelt as subscriptions store it (no leading
# zeros in its numbers) when it is spelt otherwise; fn as index_match's.
cdef int match_canonical(Subs *s, const char *key, size_t klen, CredForm *form,
                         match_fn fn, void *ctx) except -1
# Why the access policy refuses pattern (as stored) to access: (rule, detail)
# when it does, else None. The subscribe check and a reload's revocation.
cdef tuple policy_refusal(access, bytes pattern)

# The hand-over (handover.pyx): patterns as stored, checked by the old process.
# c's subscriptions in order, as stored (pattern i of conn_subs, *n bytes).
cdef inline uint32_t conn_subs(const Conn *c) noexcept nogil:
    return c.nsubs

cdef inline const char *conn_pattern(const Conn *c, uint32_t i, uint32_t *n) noexcept nogil:
    n[0] = c.subs[i].len
    return c.subs[i].pattern

cdef inline uint64_t conn_sub_bytes(const Conn *c) noexcept nogil:
    return c.sub_bytes

cdef inline uint64_t charged(const Subs *s) noexcept nogil:     # broker-wide
    return s.bytes

cdef inline uint64_t refused_count(const Subs *s) noexcept nogil:
    return s.refused

cdef Sub *prebuild_sub(Subs *s, const char *pat, size_t n) except NULL   # no owner yet
# Whether sub (prebuild_sub's) stores exactly pat.
cdef inline bint stores(const Sub *sub, const char *pat, size_t n) noexcept nogil:
    return sub.len == n and memcmp(sub.pattern, pat, n) == 0
cdef void discard_sub(Subs *s, Sub *sub) noexcept
# c's next subscription: prebuilt (prebuild_sub's, same pattern) or NULL to index it now.
cdef int restore_sub(Subs *s, Conn *c, const char *pat, size_t n, Sub *prebuilt) except -1
cdef void restore_refused(Subs *s, uint64_t refused) noexcept
