# The access policy's publish decisions as the message path reads them: one
# identity's table (sbus.access.compiled's to_bytes() blob, copied into C
# once per identity at admission). A short table is walked in order with the
# spec's own matcher; a longer one is also kept in a segment trie (the index
# subscriptions use), so a publish visits only the entries along its key's
# segments and the first match is the lowest entry found. A connection
# points at its identity's table (Conn.access); NULL: no policy, and the
# message path pays one branch for it.
from libc.stdint cimport uint8_t, uint32_t

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


cdef struct AclEntry:
    const char *pattern     # into AclTable.patterns; not NUL-terminated
    uint32_t len
    uint32_t rule           # the policy's rule number (from 1)
    uint8_t flags


cdef struct AclCached:
    uint32_t len            # 0: empty (the empty key is never kept)
    int decided
    char key[ACL_CACHE_KEY]


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
