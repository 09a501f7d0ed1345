# One queue consumer's jobs in flight (sbus.queue.state): the jobs given
# out and not yet settled, by tag, oldest first. Tags only grow, so the
# jobs sit in one array in tag order; a settled job leaves a hole that the
# oldest end skips and a later append squeezes out. Held: the jobs waiting
# for a consumer, a ring.
from cpython.object cimport PyObject
from libc.stdint cimport uint64_t


cdef class InFlight:
    cdef uint64_t *tags
    cdef PyObject **jobs        # owned references; NULL once settled
    cdef Py_ssize_t lo, hi      # live entries are in [lo, hi), the first of them at lo
    cdef Py_ssize_t cap
    cdef Py_ssize_t live        # entries in [lo, hi) not settled

    cdef Py_ssize_t find(self, uint64_t tag) noexcept
    cdef object take(self, Py_ssize_t i)
    cdef void forget(self, Py_ssize_t i) noexcept
    cdef int room(self, Py_ssize_t n) except -1
    cdef Py_ssize_t settle_into(self, bytes args, list out) except -1


cdef class Held:
    cdef PyObject **ring        # owned references, the oldest at head
    cdef Py_ssize_t head, size  # live entries: ring[(head + i) % cap] for i < size
    cdef Py_ssize_t cap         # a power of two (0 before the first)

    cdef int grow(self, Py_ssize_t n) except -1
    cdef int push(self, object job) except -1
