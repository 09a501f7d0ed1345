# The access policy's publish decisions as the message path reads them: one
# identity's table (sbus.access.compiled's to_bytes() blob, copied into C
# once per identity at admission). A short table is walked in order with the
# spec's own matcher; a longer one is also kept in a segment trie (the index
# subscriptions use), so a publish visits only the entries along its key's
# segments and the first match is the lowest entry found. A connection
# points at its identity's table (Conn.access); NULL: no policy, and the
# message path pays one branch for it. A connection also remembers its own
# last decision (AclMemo), checked inline on the message path.
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from sbus._core.index cimport Index


cdef enum:
    ACL_ALLOW = 1           # the entry (or default) allows
    ACL_DISCONNECT = 2      # a denied publish closes the connection, not just dropped
    ACL_DEFAULT = -1        # acl_decide: no entry matched, the header decides
    ACL_LINEAR_MAX = 8      # entries walked in order; more go through the trie
    # A trie table remembers its last decisions, a slot per key by a cheap
    # hash, as NATS keeps a publish-permission cache per client: a publisher
    # mostly repeats a few keys, and a hit costs one compare instead of the
    # walk. The decision is a function of the key alone (the table never
    # changes; a reload makes new tables), so a slot never goes stale.
    ACL_CACHE_SLOTS = 8     # a power of two
    ACL_CACHE_KEY = 32      # longer keys are always walked
    ACL_MEMO_KEY = 32       # AclMemo: longer keys are never remembered
    ACL_MISS = -2           # acl_memo_get: not the remembered key


cdef struct AclEntry:
    const char *pattern     # into AclTable.patterns; not NUL-terminated
    uint32_t len
    uint32_t rule           # the policy's rule number (from 1)
    uint8_t flags


cdef struct AclCached:
    uint32_t len            # 0: empty (the empty key is never kept)
    int decided
    char key[ACL_CACHE_KEY]


# A connection's last publish decision, compared inline before any call: a
# publisher mostly repeats one key (every bench row does), and then the
# policy costs a length and a few word compares, no hash and no call, which
# the table's cache above would still pay. It is the decision of the table
# the connection pointed at when it was made: Hub.give_access, the only
# place a connection is given a table (admission, reload, live upgrade),
# forgets it, so a reload or a new identity never reads a stale one.
cdef struct AclMemo:
    uint32_t len            # the key's length + 1; 0: nothing remembered
    int decided             # what acl_decide gave for it
    char key[ACL_MEMO_KEY]


cdef struct AclTable:
    uint32_t count
    uint8_t default_flags
    uint32_t default_rule   # 0: the file's default
    AclEntry *entries
    char *patterns
    bint indexed            # count > ACL_LINEAR_MAX: index holds the entries
    Index index             # owner of each Sub: its entry's position + 1
    AclCached cache[ACL_CACHE_SLOTS]    # indexed tables only
    # The sbus.access Access it was made from (borrowed: the Table that owns
    # this struct holds it).
    void *access


# The first entry whose pattern matches key, or ACL_DEFAULT.
cdef int acl_decide(AclTable *t, const char *key, size_t klen) noexcept nogil


cdef inline uint8_t acl_flags(const AclTable *t, int decided) noexcept nogil:
    return t.default_flags if decided < 0 else t.entries[decided].flags


cdef inline uint32_t acl_rule(const AclTable *t, int decided) noexcept nogil:
    return t.default_rule if decided < 0 else t.entries[decided].rule


cdef class Table:
    """Owns one identity's AclTable; made from an Access (sbus.access)."""
    cdef AclTable t
    cdef object access


cdef inline uint64_t load8(const char *p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)        # a constant size: one unaligned load, no call
    return v


cdef inline uint32_t load4(const char *p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef inline bint same_short(const char *a, const char *b, size_t n) noexcept nogil:
    """a[:n] == b[:n] for n <= 32 without a call to memcmp: the loads
    overlap rather than read past n (a key may end its buffer)."""
    if n >= 8:
        if load8(a) != load8(b) or load8(a + n - 8) != load8(b + n - 8):
            return False
        if n > 16 and load8(a + 8) != load8(b + 8):
            return False
        return n <= 24 or load8(a + 16) == load8(b + 16)
    if n >= 4:
        return load4(a) == load4(b) and load4(a + n - 4) == load4(b + n - 4)
    return n == 0 or (a[0] == b[0] and a[n >> 1] == b[n >> 1] and a[n - 1] == b[n - 1])


cdef inline int acl_memo_get(const AclMemo *m, const char *key, size_t klen) noexcept nogil:
    """The remembered decision if key is the remembered key, else ACL_MISS."""
    if m.len == klen + 1 and same_short(m.key, key, klen):
        return m.decided
    return ACL_MISS


cdef inline void acl_memo_put(AclMemo *m, const char *key, size_t klen, int decided) noexcept nogil:
    if klen <= ACL_MEMO_KEY:
        memcpy(m.key, key, klen)
        m.len = <uint32_t>klen + 1
        m.decided = decided
