# The pattern index: a segment trie, a trie over path segments.
#
# A pattern descends through one node per segment that is literal, or
# exactly '*'; it is stored at the node where it stops (its end, a trailing
# '/', or a segment that mixes '*' with other bytes). So the root holds the
# empty pattern and patterns like 'a*/...', the root's literal children are
# the first-segment buckets, and '*/x/...' lives under the root's '*' child.
# A key visits only the nodes along its own segments (literal child and '*'
# child at each level), and every candidate there is confirmed by the full
# matcher.
from libc.stdint cimport uint32_t, uint64_t


cdef struct Sub:
    void *owner            # the subscriber; opaque here
    char *pattern          # owned copy, not NUL-terminated
    uint32_t len
    uint32_t owner_pos     # slot in the owner's own list (kept by the owner)
    Node *node             # where it is stored
    uint32_t node_pos      # slot in node.subs


cdef struct Node:
    Node *parent
    Node *next             # hash chain in Index.table (literal children only)
    uint64_t hash
    char *segment          # literal segment; NULL for a '*' child or the root
    uint32_t segment_len
    Node *star             # child for a segment that is exactly '*'
    uint32_t nchildren     # literal children, in Index.table
    Sub **subs
    uint32_t n
    uint32_t cap


cdef struct Visit:
    Node *node
    size_t pos             # where the key's next segment starts; > len: none left


cdef struct Index:
    Node **table           # literal children of every node, keyed (parent, segment)
    uint32_t size          # power of two
    uint32_t nnodes        # nodes in the table
    Node root
    uint64_t nsubs
    Visit *stack           # scratch for index_match
    size_t stack_cap


# Called for each subscription whose pattern matches the key.
ctypedef void (*match_fn)(void *ctx, Sub *sub) noexcept nogil


cdef int index_init(Index *idx) noexcept nogil
cdef void index_free(Index *idx) noexcept nogil
cdef Sub *index_add(Index *idx, void *owner, const char *pattern, size_t n) noexcept nogil
cdef void index_remove(Index *idx, Sub *sub) noexcept nogil
cdef void index_match(Index *idx, const char *key, size_t n,
                      match_fn fn, void *ctx) noexcept nogil


cdef class PatternIndex:
    cdef Index idx
    cdef dict handles
    cdef uint64_t next_handle
