# cython: language_level=3
"""One identity's publish table in C (see acl.pxd), read from the blob
``sbus.access.compiled.Access.to_bytes()`` gives: the contract is that
module's docstring. Made at admission (a slow path), shared by every
connection of the identity, freed with the policy it came from."""
from libc.stdint cimport uint8_t, uint32_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

import struct

_HEADER = struct.Struct("<BBHII")
_ENTRY = struct.Struct("<BBHI")
_VERSION = 1


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

    def __dealloc__(self):
        free(self.t.entries)
        free(self.t.patterns)

    def decide(self, bytes key):
        """(allowed, disconnect, rule) for a publish of key, as the broker
        decides it (the key already canonical): for the tests."""
        cdef int d = acl_decide(&self.t, key, len(key))
        cdef uint8_t flags = acl_flags(&self.t, d)
        return bool(flags & ACL_ALLOW), bool(flags & ACL_DISCONNECT), acl_rule(&self.t, d)

    @property
    def nbytes(self):
        """What the table costs in C (shared by its identity's connections)."""
        cdef uint32_t i
        cdef size_t n = sizeof(AclTable) + self.t.count * sizeof(AclEntry)
        for i in range(self.t.count):
            n += self.t.entries[i].len
        return n
