# The queue service's per-consumer jobs in flight, in C (inflight.pxd),
# and its held jobs (Held):
# every job given out costs a dict entry and every ack an int and a dict
# pop in Python; here a job is a pointer in an array and an ack is read
# straight from its control payload. The jobs are the service's own
# (key, payload) or (key, payload, deliveries) tuples, held by reference.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_New, PyList_SET_ITEM
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport uint64_t
from libc.string cimport memmove

from ..queue.wire import WireError


cdef enum:
    MAX_DIGITS = 18     # the longest tag the convention allows (jobs.parse_tags)
    MIN_CAP = 64


cdef class InFlight:
    """Tag -> job for the jobs given out and not settled, in tag order.
    Iterating gives the tags, ``values()`` the jobs, both oldest first."""

    def __cinit__(self):
        self.tags = NULL
        self.jobs = NULL
        self.lo = self.hi = self.cap = self.live = 0

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.jobs != NULL:
            for i in range(self.lo, self.hi):
                Py_XDECREF(self.jobs[i])
        PyMem_Free(self.tags)
        PyMem_Free(self.jobs)

    def __len__(self):
        return self.live

    def __bool__(self):
        return self.live > 0

    def __iter__(self):
        return iter([self.tags[i] for i in range(self.lo, self.hi) if self.jobs[i] != NULL])

    def values(self):
        return [<object>self.jobs[i] for i in range(self.lo, self.hi) if self.jobs[i] != NULL]

    @property
    def oldest(self):
        """The tag of the oldest job in flight; None if there is none."""
        return self.tags[self.lo] if self.live else None

    cdef int room(self, Py_ssize_t n) except -1:
        """Space for n more at hi: the settled entries below lo go first,
        then the arrays grow."""
        cdef Py_ssize_t used = self.hi - self.lo, cap
        cdef void *p
        if self.hi + n <= self.cap:
            return 0
        if self.lo:
            memmove(self.tags, self.tags + self.lo, used * sizeof(uint64_t))
            memmove(self.jobs, self.jobs + self.lo, used * sizeof(PyObject *))
            self.lo, self.hi = 0, used
            if used + n <= self.cap and used * 2 <= self.cap:
                return 0
        cap = max(MIN_CAP, self.cap * 2, used + n)
        p = PyMem_Realloc(self.tags, cap * sizeof(uint64_t))
        if p == NULL:
            raise MemoryError()
        self.tags = <uint64_t *>p
        p = PyMem_Realloc(self.jobs, cap * sizeof(PyObject *))
        if p == NULL:
            raise MemoryError()
        self.jobs = <PyObject **>p
        self.cap = cap
        return 0

    def add(self, uint64_t first, list jobs):
        """``jobs`` given out under the tags ``first``, ``first + 1``, ...;
        greater than every tag here."""
        cdef Py_ssize_t n = PyList_GET_SIZE(jobs), i
        cdef PyObject *job
        if self.hi > self.lo and first <= self.tags[self.hi - 1]:
            raise ValueError("InFlight.add: tags must grow")
        self.room(n)
        for i in range(n):
            job = PyList_GET_ITEM(jobs, i)
            Py_INCREF(<object>job)
            self.tags[self.hi] = first + <uint64_t>i
            self.jobs[self.hi] = job
            self.hi += 1
        self.live += n

    cdef Py_ssize_t find(self, uint64_t tag) noexcept:
        """The index of ``tag`` in [lo, hi) if it is in flight, else -1.
        Acks mostly come oldest first: the first entry is tried first."""
        cdef Py_ssize_t a = self.lo, b = self.hi, m
        if a < b and self.tags[a] == tag:
            return a if self.jobs[a] != NULL else -1
        while a < b:
            m = (a + b) >> 1
            if self.tags[m] < tag:
                a = m + 1
            else:
                b = m
        if a < self.hi and self.tags[a] == tag and self.jobs[a] != NULL:
            return a
        return -1

    cdef object take(self, Py_ssize_t i):
        """The job at index i, settled; its reference passes to the caller."""
        cdef object job = <object>self.jobs[i]
        self.forget(i)      # ``job`` holds it now
        return job

    cdef void forget(self, Py_ssize_t i) noexcept:
        """Settle the job at index i and let it go."""
        Py_XDECREF(self.jobs[i])
        self.jobs[i] = NULL
        self.live -= 1
        while self.lo < self.hi and self.jobs[self.lo] == NULL:
            self.lo += 1
        if self.lo == self.hi:
            self.lo = self.hi = 0

    def pop_tags(self, list tags):
        """The jobs of these tags (ints), in their order, settled; tags not
        in flight are skipped."""
        cdef list out = []
        cdef Py_ssize_t i
        for tag in tags:
            i = self.find(<uint64_t>tag)
            if i >= 0:
                out.append(self.take(i))
        return out

    def settle(self, bytes args):
        """As ``pop_tags(jobs.parse_tags(args))``, without an int per tag:
        (the jobs settled, how many tags ``args`` named). WireError, with
        nothing settled, for arguments that are not counts separated by spaces."""
        cdef list out = []
        cdef Py_ssize_t named = self.settle_into(args, out)
        return out, named

    def drop(self, bytes args):
        """``settle`` for an ack or a reject, which need not the jobs: they
        are let go here. (How many were settled, how many tags ``args`` named.)"""
        cdef Py_ssize_t before = self.live
        cdef Py_ssize_t named = self.settle_into(args, None)
        return before - self.live, named

    cdef Py_ssize_t settle_into(self, bytes args, list out) except -1:
        """Settle the tags of ``args``, their jobs appended to ``out`` (let
        go if it is None); how many tags it named. WireError, with nothing
        settled, for arguments that are not counts separated by spaces."""
        cdef const char *p = PyBytes_AS_STRING(args)
        cdef const char *end = p + PyBytes_GET_SIZE(args)
        cdef const char *start
        cdef uint64_t v
        cdef uint64_t *parsed = <uint64_t *>PyMem_Malloc(
            (PyBytes_GET_SIZE(args) // 2 + 1) * sizeof(uint64_t))
        cdef Py_ssize_t n = 0, k, i
        if parsed == NULL:
            raise MemoryError()
        try:
            while p < end:
                if p[0] == b' ':
                    p += 1
                    continue
                start = p
                v = 0
                while p < end and p[0] != b' ':
                    if not b'0' <= p[0] <= b'9' or p - start >= MAX_DIGITS:
                        raise WireError(f"a tag is not a count: {args[:80]!r}")
                    v = v * 10 + <uint64_t>(p[0] - 48)
                    p += 1
                parsed[n] = v
                n += 1
            for k in range(n):
                i = self.find(parsed[k])
                if i < 0:
                    continue
                if out is None:
                    self.forget(i)
                else:
                    out.append(self.take(i))
        finally:
            PyMem_Free(parsed)
        return n

    def clear(self):
        """Every job in flight, oldest first; none is left."""
        cdef list out = self.values()
        cdef Py_ssize_t i
        for i in range(self.lo, self.hi):
            Py_XDECREF(self.jobs[i])
            self.jobs[i] = NULL
        self.lo = self.hi = self.live = 0
        return out


cdef class Held:
    """The jobs waiting for a consumer, oldest first: a ring of references
    to the service's job tuples, which the reader (jobs.Intake) appends to in
    C, and ``deal`` hands round the consumers in C, where a deque took a
    Python call per job each way."""

    def __cinit__(self):
        self.ring = NULL
        self.head = self.size = self.cap = 0

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self.size):
            Py_XDECREF(self.ring[(self.head + i) & (self.cap - 1)])
        PyMem_Free(self.ring)

    def __len__(self):
        return self.size

    def __bool__(self):
        return self.size > 0

    def __iter__(self):
        return iter(self.take(self.size, False))

    cdef int grow(self, Py_ssize_t n) except -1:
        """Room for n more; the capacity stays a power of two."""
        cdef Py_ssize_t cap = self.cap or MIN_CAP, i
        cdef PyObject **ring
        if self.size + n <= self.cap:
            return 0
        while cap < self.size + n:
            cap *= 2
        ring = <PyObject **>PyMem_Malloc(cap * sizeof(PyObject *))
        if ring == NULL:
            raise MemoryError()
        for i in range(self.size):
            ring[i] = self.ring[(self.head + i) & (self.cap - 1)]
        PyMem_Free(self.ring)
        self.ring, self.head, self.cap = ring, 0, cap
        return 0

    cdef int push(self, object job) except -1:
        if self.size == self.cap:
            self.grow(1)
        Py_INCREF(job)
        self.ring[(self.head + self.size) & (self.cap - 1)] = <PyObject *>job
        self.size += 1
        return 0

    def append(self, job):
        self.push(job)

    def requeue(self, list jobs):
        """Put ``jobs`` in front of the held ones, in their order."""
        cdef Py_ssize_t n = PyList_GET_SIZE(jobs), i
        cdef PyObject *job
        self.grow(n)
        for i in range(n - 1, -1, -1):
            job = PyList_GET_ITEM(jobs, i)
            Py_INCREF(<object>job)
            self.head = (self.head - 1) & (self.cap - 1)
            self.ring[self.head] = job
            self.size += 1

    def take(self, Py_ssize_t n, bint remove=True):
        """The first n jobs (all of them if fewer are held), oldest first;
        taken out unless ``remove`` is false."""
        cdef Py_ssize_t i
        cdef PyObject *job
        cdef list out
        n = min(n, self.size)
        out = PyList_New(n)
        for i in range(n):
            job = self.ring[(self.head + i) & (self.cap - 1)]
            if not remove:
                Py_INCREF(<object>job)
            PyList_SET_ITEM(out, i, <object>job)    # steals the reference
        if remove:
            self.head = (self.head + n) & (self.cap - 1) if self.cap else 0
            self.size -= n
        return out

    def deal(self, Py_ssize_t n, list hands):
        """Take the first n jobs out round ``hands`` (lists), one each in
        turn: the k-th goes to ``hands[k % len(hands)]``."""
        cdef Py_ssize_t width = PyList_GET_SIZE(hands), i
        cdef PyObject *job
        if width == 0:
            return
        n = min(n, self.size)
        for i in range(n):
            job = self.ring[(self.head + i) & (self.cap - 1)]
            # PyList_Append takes a reference of its own: the ring's goes below.
            (<list>PyList_GET_ITEM(hands, i % width)).append(<object>job)
            Py_XDECREF(job)
            self.ring[(self.head + i) & (self.cap - 1)] = NULL
        self.head = (self.head + n) & (self.cap - 1) if self.cap else 0
        self.size -= n
