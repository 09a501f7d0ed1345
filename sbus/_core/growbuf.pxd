# A growable byte buffer: one output of unknown size built in C, doubling as
# it fills (the bridge's NATS frames, a live upgrade's state). Declarations and
# inline functions only; whoever fills one frees .p.
from libc.stdlib cimport realloc
from libc.string cimport memcpy


cdef struct Buf:
    char *p
    size_t len
    size_t cap


cdef inline int buf_reserve(Buf *b, size_t more) except -1:
    cdef size_t cap = b.cap if b.cap else 4096
    cdef char *p
    if b.len + more <= b.cap:
        return 0
    while cap < b.len + more:
        cap *= 2
    p = <char *>realloc(b.p, cap)
    if p == NULL:
        raise MemoryError()
    b.p = p
    b.cap = cap
    return 0


cdef inline int buf_append(Buf *b, const void *s, size_t n) except -1:
    if b.len + n > b.cap:
        buf_reserve(b, n)
    memcpy(b.p + b.len, s, n)
    b.len += n
    return 0
