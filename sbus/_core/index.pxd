# The pattern index: subscriptions keyed on the first path segment.
#
# A pattern whose first segment (bytes before the first '/') is literal lives
# in a hash-table bucket under that segment; an empty pattern, or one with '*'
# in its first segment, lives in the wildcard list. A key is matched only
# against its own segment's bucket and the wildcard list.
from libc.stdint cimport uint32_t, uint64_t


cdef struct Sub:
    void *owner            # the subscriber; opaque here
    char *pattern          # owned copy, not NUL-terminated
    uint32_t len
    uint32_t owner_pos     # slot in the owner's own list (kept by the owner)
    Bucket *bucket         # the bucket or the wildcard list holding it
    uint32_t bucket_pos    # slot in bucket.subs


cdef struct Bucket:
    Bucket *next           # hash chain
    uint64_t hash
    char *segment
    uint32_t segment_len
    Sub **subs
    uint32_t n
    uint32_t cap


cdef struct Index:
    Bucket **table
    uint32_t size          # power of two
    uint32_t nbuckets
    Bucket wild            # not in the table
    uint64_t nsubs


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
