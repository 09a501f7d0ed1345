# cython: language_level=3
"""First-segment pattern index; see index.pxd for the layout."""
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memchr, memcmp, memcpy

from sbus._core.protocol cimport pattern_matches, first_segment_len

cdef enum:
    INITIAL_TABLE_SIZE = 64


cdef inline uint64_t fnv1a(const char *s, size_t n) noexcept nogil:
    cdef uint64_t h = 14695981039346656037ULL
    cdef size_t i
    for i in range(n):
        h ^= <unsigned char>s[i]
        h *= 1099511628211ULL
    return h


cdef int index_init(Index *idx) noexcept nogil:
    idx.size = INITIAL_TABLE_SIZE
    idx.table = <Bucket **>calloc(idx.size, sizeof(Bucket *))
    idx.nbuckets = 0
    idx.nsubs = 0
    idx.wild.next = NULL
    idx.wild.segment = NULL
    idx.wild.segment_len = 0
    idx.wild.subs = NULL
    idx.wild.n = 0
    idx.wild.cap = 0
    return 0 if idx.table != NULL else -1


cdef void bucket_free_subs(Bucket *b) noexcept nogil:
    cdef uint32_t i
    for i in range(b.n):
        free(b.subs[i].pattern)
        free(b.subs[i])
    free(b.subs)
    b.subs = NULL
    b.n = 0
    b.cap = 0


cdef void index_free(Index *idx) noexcept nogil:
    cdef uint32_t i
    cdef Bucket *b
    cdef Bucket *nxt
    if idx.table != NULL:
        for i in range(idx.size):
            b = idx.table[i]
            while b != NULL:
                nxt = b.next
                bucket_free_subs(b)
                free(b.segment)
                free(b)
                b = nxt
        free(idx.table)
        idx.table = NULL
    bucket_free_subs(&idx.wild)
    idx.nsubs = 0
    idx.nbuckets = 0


cdef bint segment_is_literal(const char *s, size_t n) noexcept nogil:
    return memchr(s, b'*', n) == NULL


cdef Bucket *find_bucket(Index *idx, const char *seg, size_t n, uint64_t h) noexcept nogil:
    cdef Bucket *b = idx.table[h & (idx.size - 1)]
    while b != NULL:
        if b.hash == h and b.segment_len == n and memcmp(b.segment, seg, n) == 0:
            return b
        b = b.next
    return NULL


cdef void grow_table(Index *idx) noexcept nogil:
    cdef uint32_t new_size = idx.size * 2
    cdef Bucket **table = <Bucket **>calloc(new_size, sizeof(Bucket *))
    cdef uint32_t i
    cdef Bucket *b
    cdef Bucket *nxt
    if table == NULL:
        return              # keep the old table: longer chains, still correct
    for i in range(idx.size):
        b = idx.table[i]
        while b != NULL:
            nxt = b.next
            b.next = table[b.hash & (new_size - 1)]
            table[b.hash & (new_size - 1)] = b
            b = nxt
    free(idx.table)
    idx.table = table
    idx.size = new_size


cdef Bucket *get_bucket(Index *idx, const char *seg, size_t n) noexcept nogil:
    cdef uint64_t h = fnv1a(seg, n)
    cdef Bucket *b = find_bucket(idx, seg, n, h)
    if b != NULL:
        return b
    b = <Bucket *>calloc(1, sizeof(Bucket))
    if b == NULL:
        return NULL
    b.segment = <char *>malloc(n if n else 1)
    if b.segment == NULL:
        free(b)
        return NULL
    memcpy(b.segment, seg, n)
    b.segment_len = <uint32_t>n
    b.hash = h
    b.next = idx.table[h & (idx.size - 1)]
    idx.table[h & (idx.size - 1)] = b
    idx.nbuckets += 1
    if idx.nbuckets > idx.size:
        grow_table(idx)
    return b


cdef void drop_bucket(Index *idx, Bucket *b) noexcept nogil:
    """Unlink and free an empty bucket, so churn does not grow the table."""
    cdef Bucket **link = &idx.table[b.hash & (idx.size - 1)]
    while link[0] != NULL and link[0] != b:
        link = &link[0].next
    if link[0] == b:
        link[0] = b.next
        idx.nbuckets -= 1
    free(b.subs)
    free(b.segment)
    free(b)


cdef Sub *index_add(Index *idx, void *owner, const char *pattern, size_t n) noexcept nogil:
    """Store one subscription (duplicates are stored again); NULL on OOM."""
    cdef size_t seg = first_segment_len(pattern, n)
    cdef Bucket *b
    cdef Sub **grown
    cdef uint32_t cap
    cdef Sub *sub
    if n == 0 or not segment_is_literal(pattern, seg):
        b = &idx.wild
    else:
        b = get_bucket(idx, pattern, seg)
        if b == NULL:
            return NULL
    if b.n == b.cap:
        cap = b.cap * 2 if b.cap else 2
        grown = <Sub **>realloc(b.subs, cap * sizeof(Sub *))
        if grown == NULL:
            return NULL
        b.subs = grown
        b.cap = cap
    sub = <Sub *>malloc(sizeof(Sub))
    if sub == NULL:
        return NULL
    sub.pattern = <char *>malloc(n if n else 1)
    if sub.pattern == NULL:
        free(sub)
        return NULL
    memcpy(sub.pattern, pattern, n)
    sub.len = <uint32_t>n
    sub.owner = owner
    sub.owner_pos = 0
    sub.bucket = b
    sub.bucket_pos = b.n
    b.subs[b.n] = sub
    b.n += 1
    idx.nsubs += 1
    return sub


cdef void index_remove(Index *idx, Sub *sub) noexcept nogil:
    """Remove and free one subscription (swap-remove inside its bucket)."""
    cdef Bucket *b = sub.bucket
    cdef Sub *last
    b.n -= 1
    if sub.bucket_pos != b.n:
        last = b.subs[b.n]
        b.subs[sub.bucket_pos] = last
        last.bucket_pos = sub.bucket_pos
    idx.nsubs -= 1
    free(sub.pattern)
    free(sub)
    if b.n == 0 and b != &idx.wild:
        drop_bucket(idx, b)
    elif b.cap > 8 and b.n < b.cap // 4:
        b.cap //= 2
        b.subs = <Sub **>realloc(b.subs, b.cap * sizeof(Sub *))


cdef inline void match_bucket(Bucket *b, const char *key, size_t n,
                              match_fn fn, void *ctx) noexcept nogil:
    cdef uint32_t i
    cdef Sub *s
    for i in range(b.n):
        s = b.subs[i]
        if pattern_matches(s.pattern, s.len, key, n):
            fn(ctx, s)


cdef void index_match(Index *idx, const char *key, size_t n,
                      match_fn fn, void *ctx) noexcept nogil:
    """Call fn for every subscription matching key. A subscriber holding
    several matching patterns is reported once per pattern: the caller
    de-duplicates per message."""
    cdef size_t seg = first_segment_len(key, n)
    cdef Bucket *b = find_bucket(idx, key, seg, fnv1a(key, seg))
    if b != NULL:
        match_bucket(b, key, n, fn, ctx)
    if idx.wild.n:
        match_bucket(&idx.wild, key, n, fn, ctx)


# ---- Python-visible wrapper (tests, property tests, benchmarks) -------------

cdef void collect_owner(void *ctx, Sub *sub) noexcept nogil:
    # The GIL is held by the caller (PatternIndex.match); owners are small ints.
    with gil:
        (<set>ctx).add(<uintptr_t>sub.owner)


cdef class PatternIndex:
    """A pattern index over integer owner ids, for tests and benchmarks.

    ``add(owner, pattern)`` returns a handle; ``remove(handle)`` deletes that
    one stored copy; ``match(key)`` returns the sorted owner ids that match.
    """

    def __cinit__(self):
        if index_init(&self.idx) < 0:
            raise MemoryError()
        self.handles = {}
        self.next_handle = 1

    def __dealloc__(self):
        index_free(&self.idx)

    def add(self, uintptr_t owner, bytes pattern):
        cdef Sub *sub = index_add(&self.idx, <void *>owner, pattern, len(pattern))
        if sub == NULL:
            raise MemoryError()
        handle = self.next_handle
        self.next_handle += 1
        self.handles[handle] = <uintptr_t>sub
        return handle

    def remove(self, handle):
        cdef uintptr_t sub = self.handles.pop(handle)
        index_remove(&self.idx, <Sub *>sub)

    def match(self, bytes key):
        cdef set owners = set()
        index_match(&self.idx, key, len(key), collect_owner, <void *>owners)
        return sorted(owners)

    def count_matches(self, bytes key):
        """Number of matching subscriptions, without building a result (benchmarks)."""
        cdef uint64_t count = 0
        index_match(&self.idx, key, len(key), count_one, &count)
        return count

    def __len__(self):
        return self.idx.nsubs

    @property
    def bucket_count(self):
        return self.idx.nbuckets

    @property
    def wildcard_count(self):
        return self.idx.wild.n


cdef void count_one(void *ctx, Sub *sub) noexcept nogil:
    (<uint64_t *>ctx)[0] += 1
