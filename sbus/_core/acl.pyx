# cython: language_level=3
"""One identity's publish table in C (see acl.pxd), read from the blob
``sbus.access.compiled.Access.to_bytes()`` gives: the contract is that
module's docstring. Made at admission (a slow path), shared by every
connection of the identity, freed with the policy it came from."""
from libc.stdint cimport uint8_t, uint32_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcmp, memcpy

from sbus._core.index cimport Sub, index_init, index_free, index_add, index_match
from sbus._core.protocol cimport pattern_matches

import struct

_HEADER = struct.Struct("<BBHII")
_ENTRY = struct.Struct("<BBHI")
_VERSION = 1


cdef void take_first(void *ctx, Sub *sub) noexcept nogil:
    """index_match callback: keep the lowest entry position matched."""
    cdef int *best = <int *>ctx
    cdef int pos = <int>(<size_t>sub.owner) - 1
    if best[0] < 0 or pos < best[0]:
        best[0] = pos


cdef int acl_decide(AclTable *t, const char *key, size_t klen) noexcept nogil:
    cdef uint32_t i
    cdef AclCached *slot
    cdef int best = ACL_DEFAULT
    # A chunk's key is judged as its message's (docs/chunks.md, sbus.client.chunks.SUFFIX),
    # a producer's batch of jobs as its jobs' (docs/queues.md, sbus.queue.wire.PUT_SUFFIX).
    if klen > 12 and memcmp(key + klen - 12, b"/.sbus-chunk", 12) == 0:
        klen -= 12
    if klen > 11 and memcmp(key + klen - 11, b"/.sbus-jobs", 11) == 0:
        klen -= 11
    if t.indexed:
        if klen == 0 or klen > ACL_CACHE_KEY:
            index_match(&t.index, key, klen, take_first, &best)
            return best
        slot = &t.cache[(klen + <uint8_t>key[klen - 1] * 7 + <uint8_t>key[klen >> 1] * 31)
                        & (ACL_CACHE_SLOTS - 1)]
        if slot.len == klen and memcmp(slot.key, key, klen) == 0:
            return slot.decided
        index_match(&t.index, key, klen, take_first, &best)
        memcpy(slot.key, key, klen)
        slot.len = <uint32_t>klen
        slot.decided = best
        return best
    for i in range(t.count):
        if pattern_matches(t.entries[i].pattern, t.entries[i].len, key, klen):
            return <int>i
    return ACL_DEFAULT


cdef class Table:
    def __cinit__(self, access):
        cdef bytes blob = access.to_bytes()
        cdef uint32_t i, count
        cdef size_t pos, total, at = 0
        version, flags, _, count, rule = _HEADER.unpack_from(blob, 0)
        if version != _VERSION:
            raise ValueError(f"access table version {version}, not {_VERSION}")
        self.access = access
        self.t.access = <void *>access
        self.t.count = 0
        self.t.default_flags = flags
        self.t.default_rule = rule
        total = len(blob) - _HEADER.size - count * _ENTRY.size
        self.t.entries = <AclEntry *>malloc(count * sizeof(AclEntry) if count else 1)
        self.t.patterns = <char *>malloc(total if total else 1)
        if self.t.entries == NULL or self.t.patterns == NULL:
            raise MemoryError()
        pos = _HEADER.size
        for i in range(count):
            eflags, _, length, number = _ENTRY.unpack_from(blob, pos)
            pos += _ENTRY.size
            if pos + length > <size_t>len(blob):
                raise ValueError("access table cut short")
            memcpy(self.t.patterns + at, <const char *>blob + pos, length)
            self.t.entries[i].pattern = self.t.patterns + at
            self.t.entries[i].len = length
            self.t.entries[i].rule = number
            self.t.entries[i].flags = eflags
            at += length
            pos += length
        if pos != <size_t>len(blob):
            raise ValueError("trailing bytes after the access table")
        self.t.count = count
        if count > ACL_LINEAR_MAX:
            if index_init(&self.t.index) < 0:
                index_free(&self.t.index)
                raise MemoryError()
            self.t.indexed = True
            for i in range(count):
                if index_add(&self.t.index, <void *>(<size_t>i + 1), self.t.entries[i].pattern,
                             self.t.entries[i].len) == NULL:
                    raise MemoryError()

    def __dealloc__(self):
        if self.t.indexed:
            index_free(&self.t.index)
        free(self.t.entries)
        free(self.t.patterns)

    def decide(self, bytes key):
        """(allowed, disconnect, rule) for a publish of key, as the broker
        decides it (the key already canonical): for the tests."""
        cdef int d = acl_decide(&self.t, key, len(key))
        cdef uint8_t flags = acl_flags(&self.t, d)
        return bool(flags & ACL_ALLOW), bool(flags & ACL_DISCONNECT), acl_rule(&self.t, d)

    def decide_times(self, bytes key, uint32_t n):
        """Decide a publish of key n times (benchmarks: the per-message cost)."""
        cdef uint32_t _turn
        cdef int d = ACL_DEFAULT
        for _turn in range(n):
            d = acl_decide(&self.t, key, len(key))
        return d

    @property
    def nbytes(self):
        """What the table costs in C, without its trie (shared by its
        identity's connections)."""
        cdef uint32_t i
        cdef size_t n = sizeof(AclTable) + self.t.count * sizeof(AclEntry)
        for i in range(self.t.count):
            n += self.t.entries[i].len
        return n


def memo_hits(remembered, bytes key):
    """Whether a connection that remembered a decision for remembered (None:
    nothing yet) takes it for a publish of key (acl_memo_get): for the tests."""
    cdef AclMemo m
    m.len = 0
    if remembered is not None:
        acl_memo_put(&m, <bytes>remembered, len(remembered), 7)
    return acl_memo_get(&m, key, len(key)) != ACL_MISS
