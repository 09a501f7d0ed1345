# cython: language_level=3
"""Segment-trie pattern index; see index.pxd for the layout."""
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memchr, memcmp, memcpy, memset

from sbus._core.protocol cimport pattern_matches

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
    memset(idx, 0, sizeof(Index))
    idx.size = INITIAL_TABLE_SIZE
    idx.table = <Node **>calloc(idx.size, sizeof(Node *))
    idx.stack_cap = 64
    idx.stack = <Visit *>malloc(idx.stack_cap * sizeof(Visit))
    return 0 if idx.table != NULL and idx.stack != NULL else -1


cdef void free_node_subs(Node *node) noexcept nogil:
    cdef uint32_t i
    for i in range(node.n):
        free(node.subs[i].pattern)
        free(node.subs[i])
    free(node.subs)


cdef void free_star_chain(Node *node) noexcept nogil:
    """Free a node reached through '*' children only, and its '*' subtree;
    literal nodes are freed from the table."""
    cdef Node *nxt
    while node != NULL:
        nxt = node.star
        free_node_subs(node)
        free(node)
        node = nxt


cdef void index_free(Index *idx) noexcept nogil:
    cdef uint32_t i
    cdef Node *b
    cdef Node *nxt
    if idx.table != NULL:
        for i in range(idx.size):
            b = idx.table[i]
            while b != NULL:
                nxt = b.next
                free_star_chain(b.star)
                free_node_subs(b)
                free(b.segment)
                free(b)
                b = nxt
        free(idx.table)
        idx.table = NULL
    free_star_chain(idx.root.star)
    free_node_subs(&idx.root)
    free(idx.stack)
    memset(idx, 0, sizeof(Index))


cdef inline uint64_t child_hash(Node *parent, const char *seg, size_t n) noexcept nogil:
    return fnv1a(seg, n) ^ (<uint64_t><uintptr_t>parent * 0x9E3779B97F4A7C15ULL)


cdef Node *find_child(Index *idx, Node *parent, const char *seg, size_t n) noexcept nogil:
    cdef uint64_t h = child_hash(parent, seg, n)
    cdef Node *c = idx.table[h & (idx.size - 1)]
    while c != NULL:
        if (c.hash == h and c.parent == parent and c.segment_len == n and
                memcmp(c.segment, seg, n) == 0):
            return c
        c = c.next
    return NULL


cdef void grow_table(Index *idx) noexcept nogil:
    cdef uint32_t new_size = idx.size * 2
    cdef Node **table = <Node **>calloc(new_size, sizeof(Node *))
    cdef uint32_t i
    cdef Node *c
    cdef Node *nxt
    if table == NULL:
        return              # keep the old table: longer chains, still correct
    for i in range(idx.size):
        c = idx.table[i]
        while c != NULL:
            nxt = c.next
            c.next = table[c.hash & (new_size - 1)]
            table[c.hash & (new_size - 1)] = c
            c = nxt
    free(idx.table)
    idx.table = table
    idx.size = new_size


cdef Node *literal_child(Index *idx, Node *parent, const char *seg, size_t n) noexcept nogil:
    cdef Node *c = find_child(idx, parent, seg, n)
    if c != NULL:
        return c
    c = <Node *>calloc(1, sizeof(Node))
    if c == NULL:
        return NULL
    c.segment = <char *>malloc(n if n else 1)
    if c.segment == NULL:
        free(c)
        return NULL
    memcpy(c.segment, seg, n)
    c.segment_len = <uint32_t>n
    c.parent = parent
    c.hash = child_hash(parent, seg, n)
    c.next = idx.table[c.hash & (idx.size - 1)]
    idx.table[c.hash & (idx.size - 1)] = c
    idx.nnodes += 1
    parent.nchildren += 1
    if idx.nnodes > idx.size:
        grow_table(idx)
    return c


cdef Node *star_child(Node *parent) noexcept nogil:
    if parent.star == NULL:
        parent.star = <Node *>calloc(1, sizeof(Node))
        if parent.star != NULL:
            parent.star.parent = parent
    return parent.star


cdef Node *descend(Index *idx, const char *p, size_t n) noexcept nogil:
    """The node a pattern is stored at, creating the path; NULL on OOM."""
    cdef Node *node = &idx.root
    cdef size_t pos = 0, seg_len
    cdef const char *seg
    cdef const char *slash
    if n == 0:
        return node
    while True:
        seg = p + pos
        slash = <const char *>memchr(seg, b'/', n - pos)
        seg_len = <size_t>(slash - seg) if slash != NULL else n - pos
        if seg_len == 1 and seg[0] == b'*':
            node = star_child(node)
        elif memchr(seg, b'*', seg_len) != NULL:
            return node     # 'a*b' matches no single segment: stop here
        else:
            node = literal_child(idx, node, seg, seg_len)
        if node == NULL or slash == NULL:
            return node
        pos += seg_len + 1
        if pos == n:
            return node     # trailing '/': everything below matches


cdef void prune(Index *idx, Node *node) noexcept nogil:
    """Free nodes left with no subscriptions and no children, bottom up."""
    cdef Node *parent
    cdef Node **link
    while (node != &idx.root and node.n == 0 and node.nchildren == 0 and
           node.star == NULL):
        parent = node.parent
        if node.segment == NULL:
            parent.star = NULL
        else:
            link = &idx.table[node.hash & (idx.size - 1)]
            while link[0] != node:
                link = &link[0].next
            link[0] = node.next
            idx.nnodes -= 1
            parent.nchildren -= 1
            free(node.segment)
        free(node.subs)
        free(node)
        node = parent


cdef Sub *index_add(Index *idx, void *owner, const char *pattern, size_t n) noexcept nogil:
    """Store one subscription (duplicates are stored again); NULL on OOM."""
    cdef Node *node = descend(idx, pattern, n)
    cdef Sub **grown
    cdef uint32_t cap
    cdef Sub *sub
    if node == NULL:
        return NULL
    if node.n == node.cap:
        cap = node.cap * 2 if node.cap else 2
        grown = <Sub **>realloc(node.subs, cap * sizeof(Sub *))
        if grown == NULL:
            prune(idx, node)
            return NULL
        node.subs = grown
        node.cap = cap
    sub = <Sub *>malloc(sizeof(Sub))
    if sub == NULL:
        prune(idx, node)
        return NULL
    sub.pattern = <char *>malloc(n if n else 1)
    if sub.pattern == NULL:
        free(sub)
        prune(idx, node)
        return NULL
    memcpy(sub.pattern, pattern, n)
    sub.len = <uint32_t>n
    sub.owner = owner
    sub.owner_pos = 0
    sub.node = node
    sub.node_pos = node.n
    node.subs[node.n] = sub
    node.n += 1
    idx.nsubs += 1
    return sub


cdef void index_remove(Index *idx, Sub *sub) noexcept nogil:
    """Remove and free one subscription, and the nodes it alone kept."""
    cdef Node *node = sub.node
    cdef Sub *last
    node.n -= 1
    if sub.node_pos != node.n:
        last = node.subs[node.n]
        node.subs[sub.node_pos] = last
        last.node_pos = sub.node_pos
    idx.nsubs -= 1
    free(sub.pattern)
    free(sub)
    if node.n == 0:
        free(node.subs)
        node.subs = NULL
        node.cap = 0
        prune(idx, node)
    elif node.cap > 8 and node.n < node.cap // 4:
        node.cap //= 2
        node.subs = <Sub **>realloc(node.subs, node.cap * sizeof(Sub *))


cdef inline bint push(Index *idx, size_t *top, Node *node, size_t pos) noexcept nogil:
    cdef Visit *grown
    if top[0] == idx.stack_cap:
        grown = <Visit *>realloc(idx.stack, 2 * idx.stack_cap * sizeof(Visit))
        if grown == NULL:
            return False
        idx.stack = grown
        idx.stack_cap *= 2
    idx.stack[top[0]].node = node
    idx.stack[top[0]].pos = pos
    top[0] += 1
    return True


cdef void index_match(Index *idx, const char *key, size_t n,
                      match_fn fn, void *ctx) noexcept nogil:
    """Call fn for every subscription matching key. A subscriber holding
    several matching patterns is reported once per pattern: the caller
    de-duplicates per message."""
    cdef size_t top = 0, seg_len, nxt
    cdef Visit v
    cdef Node *node
    cdef Node *child
    cdef const char *slash
    cdef uint32_t i
    cdef Sub *s
    push(idx, &top, &idx.root, 0)
    while top:
        top -= 1
        v = idx.stack[top]
        node = v.node
        for i in range(node.n):
            s = node.subs[i]
            if pattern_matches(s.pattern, s.len, key, n):
                fn(ctx, s)
        if v.pos > n:
            continue        # the key has no segment left
        slash = <const char *>memchr(key + v.pos, b'/', n - v.pos)
        seg_len = <size_t>(slash - (key + v.pos)) if slash != NULL else n - v.pos
        nxt = v.pos + seg_len + 1 if slash != NULL else n + 1
        if node.nchildren:
            child = find_child(idx, node, key + v.pos, seg_len)
            if child != NULL:
                push(idx, &top, child, nxt)
        if node.star != NULL:
            push(idx, &top, node.star, nxt)


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
    def node_count(self):
        """Literal trie nodes (the first level are the first-segment buckets)."""
        return self.idx.nnodes

    @property
    def root_count(self):
        """Patterns stored at the root: empty, or '*' mixed into the first segment."""
        return self.idx.root.n


cdef void count_one(void *ctx, Sub *sub) noexcept nogil:
    (<uint64_t *>ctx)[0] += 1
