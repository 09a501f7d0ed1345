# The batched deliveries of `sbus queue` (docs/queues.md, "Batches"), packed
# by the service and parsed by the consumers with no Python-level loop over
# bytes. A `jobs` payload is records back to back, each the decimal size of
# a `job` payload, one space, and that payload: `TAG DELIVERIES KEY\0PAYLOAD`.
# sbus.queue.wire has the plain-Python twins (pack_jobs_py, parse_jobs_py),
# which the tests hold these to. A producer's batch ("Producers' batches")
# is records `SIZE PAYLOAD` on `KEY/.sbus-jobs`: pack_puts packs them
# (twin: wire.pack_puts_py). Intake is the service's reader: it takes the
# jobs off the bus in C, a batch's one by one, and leaves the rest to the
# service. Job and Acks are the consumers' (sbus.client.consume): a delivery
# made straight from its record, and the acks held to go out together.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsUnsignedLongLong, PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport uint64_t
from libc.string cimport memchr, memcmp, memcpy

from .batch cimport Sink
from .inflight cimport Held
from .includes.sys cimport CLOCK_MONOTONIC, clock_gettime, timespec

from ..queue.wire import ACK, NACK, REJECT, WireError


cdef extern from "Python.h":
    # A (key, payload) tuple of bytes is in no reference cycle.
    void PyObject_GC_UnTrack(object o)


cdef enum:
    MAX_DIGITS = 18     # the longest count the convention allows (wire._count)

# Keys under this prefix are the service's requests, never jobs (wire.PREFIX).
cdef const char *REQUESTS = b"sbus/queue/"
cdef size_t REQUESTS_LEN = 11
# A producer's batch of jobs on key K travels on K + this suffix (wire.PUT_SUFFIX).
cdef const char *PUTS = b"/.sbus-jobs"
cdef size_t PUTS_LEN = 11


cdef inline int digits(uint64_t n) noexcept:
    cdef int d = 1
    while n >= 10:
        n //= 10
        d += 1
    return d


cdef inline char *put_count(char *at, uint64_t n, int width) noexcept:
    """Write n in ``width`` decimal digits (its own count of them) at ``at``;
    returns the byte after them."""
    cdef int i
    for i in range(width - 1, -1, -1):
        at[i] = <char>(48 + n % 10)
        n //= 10
    return at + width


def pack_jobs(uint64_t first, list jobs, Py_ssize_t limit):
    """The payloads of ``jobs`` deliveries for ``jobs[i]`` under the tag
    ``first + i``, in order, each at most ``limit`` bytes (a record larger
    than that alone in its payload). A job is the service's in-flight entry:
    ``(key, payload)`` delivered once, or ``(key, payload, deliveries)``."""
    cdef Py_ssize_t n = PyList_GET_SIZE(jobs), i, j, start = 0, size = 0
    cdef Entry *es
    cdef Entry *e
    cdef char *at
    cdef list out = []
    if n == 0:
        return out
    es = <Entry *>PyMem_Malloc(n * sizeof(Entry))
    if es == NULL:
        raise MemoryError()
    try:
        entries(jobs, first, es)
        for i in range(n + 1):
            if i < n and (size == 0 or size + es[i].rec <= limit):
                size += es[i].rec
                continue
            # jobs[start:i] make one payload of ``size`` bytes
            packed = PyBytes_FromStringAndSize(NULL, size)
            at = PyBytes_AS_STRING(packed)
            for j in range(start, i):
                e = &es[j]
                at = put_count(at, e.body, e.rec - e.body - 1)
                at[0] = b' '
                at = put_count(at + 1, first + <uint64_t>j, e.tag_digits)
                at[0] = b' '
                at = put_count(at + 1, e.deliveries, e.deliveries_digits)
                at[0] = b' '
                memcpy(at + 1, e.key, e.klen)
                at += 1 + e.klen
                at[0] = 0
                memcpy(at + 1, e.payload, e.plen)
                at += 1 + e.plen
            out.append(packed)
            if i < n:
                start, size = i, es[i].rec
    finally:
        PyMem_Free(es)
    return out


def pack_puts(bytes key, bytes batch_key, list payloads, Py_ssize_t limit):
    """The packets that publish ``payloads`` as jobs on ``key`` (docs/queues.md,
    "Producers' batches"): ``(batch_key, records)`` pairs, each payload at most
    ``limit`` bytes of records ``SIZE PAYLOAD``, in order; a job whose record
    alone is over ``limit`` goes as ``(key, payload)``, a plain job, where it
    falls. Nothing is made per job but its record's bytes in a packet."""
    cdef Py_ssize_t n = PyList_GET_SIZE(payloads), i, j, start = 0, size = 0, rec, plen
    cdef PyObject *item
    cdef char *at
    cdef list out = []
    for i in range(n):
        if not isinstance(<object>PyList_GET_ITEM(payloads, i), bytes):
            raise TypeError(f"a job's payload must be bytes, not "
                            f"{type(<object>PyList_GET_ITEM(payloads, i)).__name__}")
    i = 0
    while i <= n:
        rec = 0
        if i < n:
            plen = PyBytes_GET_SIZE(<object>PyList_GET_ITEM(payloads, i))
            rec = digits(<uint64_t>plen) + 1 + plen
            if size == 0 or size + rec <= limit:
                if rec <= limit:
                    size += rec
                    i += 1
                    continue
        if size:
            # payloads[start:i] make one packet of ``size`` bytes
            packed = PyBytes_FromStringAndSize(NULL, size)
            at = PyBytes_AS_STRING(packed)
            for j in range(start, i):
                item = PyList_GET_ITEM(payloads, j)
                plen = PyBytes_GET_SIZE(<object>item)
                at = put_count(at, <uint64_t>plen, digits(<uint64_t>plen))
                at[0] = b' '
                memcpy(at + 1, PyBytes_AS_STRING(<object>item), plen)
                at += 1 + plen
            out.append((batch_key, packed))
            size = 0
        if i < n and rec > limit:
            out.append((key, <object>PyList_GET_ITEM(payloads, i)))
            i += 1
        elif i == n:
            break
        start = i
    return out


cdef struct Entry:
    uint64_t deliveries
    int tag_digits
    int deliveries_digits
    const char *key
    Py_ssize_t klen
    const char *payload
    Py_ssize_t plen
    Py_ssize_t body     # the size of its ``job`` payload
    Py_ssize_t rec      # the size of its record: the body's size, a space, the body


cdef int entries(list jobs, uint64_t first, Entry *es) except -1:
    """Each of ``jobs`` as a record under the tag first + its index (the list
    keeps the bytes alive). Tags are consecutive: their width is counted
    once, then grows at each power of ten."""
    cdef Py_ssize_t n = PyList_GET_SIZE(jobs), i
    cdef PyObject *job
    cdef PyObject *key
    cdef PyObject *payload
    cdef uint64_t tag = first, wider = 10
    cdef int tag_digits = digits(first)
    cdef Entry *e
    for i in range(tag_digits - 1):
        wider = wider * 10 if i < 18 else <uint64_t>-1    # 10 ** 20 is past uint64_t
    for i in range(n):
        e = &es[i]
        job = PyList_GET_ITEM(jobs, i)
        key = PyTuple_GET_ITEM(<object>job, 0)
        payload = PyTuple_GET_ITEM(<object>job, 1)
        if PyTuple_GET_SIZE(<object>job) > 2:
            e.deliveries = <uint64_t><object>PyTuple_GET_ITEM(<object>job, 2)
            e.deliveries_digits = digits(e.deliveries)
        else:
            e.deliveries, e.deliveries_digits = 1, 1
        if tag >= wider and tag_digits < 20:
            tag_digits += 1
            wider = wider * 10 if tag_digits < 20 else <uint64_t>-1
        e.tag_digits = tag_digits
        tag += 1
        e.key, e.klen = PyBytes_AS_STRING(<object>key), PyBytes_GET_SIZE(<object>key)
        e.payload, e.plen = PyBytes_AS_STRING(<object>payload), PyBytes_GET_SIZE(<object>payload)
        e.body = tag_digits + 1 + e.deliveries_digits + 1 + e.klen + 1 + e.plen
        e.rec = digits(e.body) + 1 + e.body
    return 0


cdef int read_count(const char *p, const char *end, const char **after,
                    uint64_t *value) except -1:
    """A count (1 to MAX_DIGITS digits) then one space, at p; ValueError otherwise."""
    cdef const char *q = p
    cdef uint64_t v = 0
    while q < end and b'0' <= q[0] <= b'9' and q - p < MAX_DIGITS:
        v = v * 10 + <uint64_t>(q[0] - 48)
        q += 1
    if q == p or q >= end or q[0] != b' ':
        raise ValueError("a jobs record whose header is not counts separated by spaces")
    value[0] = v
    after[0] = q + 1
    return 0


cdef struct Record:
    uint64_t tag
    uint64_t deliveries
    const char *key
    Py_ssize_t klen
    const char *payload
    Py_ssize_t plen


cdef const char *next_record(const char *p, const char *end, Record *r) except NULL:
    """Read the record at p (p < end) of a ``jobs`` payload into r; returns
    where the next begins. ValueError for one that does not follow the convention."""
    cdef uint64_t size
    cdef const char *rec_end
    cdef const char *nul
    read_count(p, end, &p, &size)
    if size > <uint64_t>(end - p):
        raise ValueError("a jobs record longer than its payload")
    rec_end = p + size
    read_count(p, rec_end, &p, &r.tag)
    read_count(p, rec_end, &p, &r.deliveries)
    nul = <const char *>memchr(p, 0, rec_end - p)
    if nul == NULL:
        raise ValueError("a jobs record without NUL after its key")
    r.key, r.klen = p, nul - p
    r.payload, r.plen = nul + 1, rec_end - nul - 1
    return rec_end


def parse_jobs(bytes data):
    """The records of a ``jobs`` payload: a list of (tag, deliveries, key,
    payload). ValueError for a payload that does not follow the convention."""
    cdef const char *p = PyBytes_AS_STRING(data)
    cdef const char *end = p + PyBytes_GET_SIZE(data)
    cdef Record r
    cdef list out = []
    while p < end:
        p = next_record(p, end, &r)
        out.append((r.tag, r.deliveries, PyBytes_FromStringAndSize(r.key, r.klen),
                    PyBytes_FromStringAndSize(r.payload, r.plen)))
    return out


def parse_tags(bytes args):
    """The tags in the arguments of a control message (``ack TOKEN TAG...``
    after the token): counts of 1 to MAX_DIGITS digits separated by spaces,
    extra spaces ignored. WireError for anything else. One ack names
    hundreds of tags: this is wire.parse_tags_py without an object per tag
    but the int."""
    cdef const char *p = PyBytes_AS_STRING(args)
    cdef const char *end = p + PyBytes_GET_SIZE(args)
    cdef const char *start
    cdef uint64_t v
    cdef list out = []
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
        out.append(PyLong_FromUnsignedLongLong(v))
    return out


cdef bytes pack_acks(bytes head, list tags):
    """``head`` (``ack TOKEN``) and each tag after a space: the ack control
    payload, formatted in C (wire.pack_control would make a str per tag)."""
    cdef Py_ssize_t n = PyList_GET_SIZE(tags), i, size = PyBytes_GET_SIZE(head)
    cdef uint64_t tag
    cdef char *at
    for i in range(n):
        size += 1 + digits(PyLong_AsUnsignedLongLong(<object>PyList_GET_ITEM(tags, i)))
    out = PyBytes_FromStringAndSize(NULL, size)
    at = PyBytes_AS_STRING(out)
    memcpy(at, PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head))
    at += PyBytes_GET_SIZE(head)
    for i in range(n):
        tag = PyLong_AsUnsignedLongLong(<object>PyList_GET_ITEM(tags, i))
        at[0] = b' '
        at = put_count(at + 1, tag, digits(tag))
    return out


cdef class Intake(Sink):
    """The queue service's reader (a batch.Sink for ``receive_into``): a
    plain message that is a job goes to ``held`` (an inflight.Held) as a
    ``(key, payload)`` tuple, counted in ``received``, and so does each job of
    a producer's batch (a key ending in ``/.sbus-jobs``), under the key
    before that suffix; anything else, in order, to ``others`` for the
    service: a key that is private (``!``, the service's own inbox and
    control key) or under ``sbus/queue/``, a job whose key and payload are
    longer than ``room`` (too large to deliver), or what is left of a batch
    from a record that does not follow the convention, or whose key is not
    under ``prefix`` (the queue's pattern when it ends in ``/``), under its
    batch key."""

    cdef Held held
    cdef list others
    cdef bytes last_key     # reused while the keys repeat
    cdef bytes prefix
    cdef readonly Py_ssize_t room
    cdef public Py_ssize_t received

    def __cinit__(self, Held held, Py_ssize_t room, bytes prefix=b""):
        self.held = held
        self.others = []
        self.last_key = b""
        self.room = room
        self.prefix = prefix

    cdef inline bytes key_of(self, const char *key, size_t klen):
        cdef bytes k = self.last_key
        if <size_t>PyBytes_GET_SIZE(k) != klen or memcmp(PyBytes_AS_STRING(k), key, klen) != 0:
            k = PyBytes_FromStringAndSize(key, klen)
            self.last_key = k
        return k

    cdef inline int take(self, bytes k, const char *payload, size_t plen) except -1:
        job = (k, PyBytes_FromStringAndSize(payload, plen))
        PyObject_GC_UnTrack(job)
        if <Py_ssize_t>(PyBytes_GET_SIZE(k) + plen) > self.room:
            self.others.append(job)
        else:
            self.held.push(job)
            self.received += 1
        return 0

    cdef int put(self, const char *key, size_t klen,
                 const char *payload, size_t plen) except -1:
        if (klen and key[0] == b'!') or (
                klen >= REQUESTS_LEN and memcmp(key, REQUESTS, REQUESTS_LEN) == 0):
            self.others.append((PyBytes_FromStringAndSize(key, klen),
                                PyBytes_FromStringAndSize(payload, plen)))
            return 0
        if klen > PUTS_LEN and memcmp(key + klen - PUTS_LEN, PUTS, PUTS_LEN) == 0:
            return self.put_batch(key, klen, payload, plen)
        return self.take(self.key_of(key, klen), payload, plen)

    cdef int put_batch(self, const char *key, size_t klen,
                       const char *payload, size_t plen) except -1:
        """The jobs of a producer's batch: records ``SIZE PAYLOAD``, all on
        the key before the suffix."""
        cdef const char *p = payload
        cdef const char *end = payload + plen
        cdef const char *q
        cdef uint64_t size
        cdef size_t jlen = klen - PUTS_LEN
        cdef Py_ssize_t plen_prefix = PyBytes_GET_SIZE(self.prefix)
        if plen_prefix and (<Py_ssize_t>jlen < plen_prefix or memcmp(
                key, PyBytes_AS_STRING(self.prefix), plen_prefix) != 0):
            p = payload     # a key outside the queue's: none of it is a job
        else:
            k = self.key_of(key, jlen)
            while p < end:
                q = p
                size = 0
                while q < end and b'0' <= q[0] <= b'9' and q - p < MAX_DIGITS:
                    size = size * 10 + <uint64_t>(q[0] - 48)
                    q += 1
                if q == p or q >= end or q[0] != b' ' or size > <uint64_t>(end - q - 1):
                    break
                self.take(k, q + 1, <size_t>size)
                p = q + 1 + size
            if p == end:
                return 0
        self.others.append((PyBytes_FromStringAndSize(key, klen),
                            PyBytes_FromStringAndSize(p, end - p)))
        return 0

    def take_others(self):
        """The messages that were not jobs since the last call, in order."""
        out, self.others = self.others, []
        return out


cdef class Job:
    """One delivery: ``key`` and ``payload`` as published, ``deliveries`` (1
    the first time; more means it was given out before and not acknowledged),
    and ``tag``, the service's name for this delivery. Settle it once, with
    ``ack()`` or ``nack()``; with the asyncio client, await them."""

    cdef readonly bytes key
    cdef readonly bytes payload
    cdef readonly object deliveries
    cdef readonly object tag
    cdef readonly bint settled
    cdef object settle      # settle(verb, tag): what ack() and nack() return

    def __init__(self, bytes key, bytes payload, deliveries, tag, settle):
        self.key, self.payload, self.deliveries, self.tag = key, payload, deliveries, tag
        self.settle = settle

    @property
    def redelivered(self):
        return self.deliveries > 1

    def ack(self):
        """Done: the service forgets the job."""
        if self.settled:
            raise RuntimeError(f"job {self.tag} is already settled")
        self.settled = True
        if type(self.settle) is Settler:
            return (<Settler>self.settle).ack(self.tag)
        return self.settle(ACK, self.tag)

    def nack(self, bint requeue=True):
        """Not done: the job goes to a consumer again, or with ``requeue=False``
        is dropped (counted as rejected)."""
        if self.settled:
            raise RuntimeError(f"job {self.tag} is already settled")
        self.settled = True
        return self.settle(NACK if requeue else REJECT, self.tag)

    def __repr__(self):
        return (f"Job(key={self.key!r}, payload={self.payload[:40]!r}, "
                f"deliveries={self.deliveries}, tag={self.tag})")


def jobs_from(bytes data, object settle):
    """The records of a ``jobs`` payload as Job objects settled through
    ``settle``; ValueError as parse_jobs raises it."""
    cdef const char *p = PyBytes_AS_STRING(data)
    cdef const char *end = p + PyBytes_GET_SIZE(data)
    cdef Record r
    cdef Job job
    cdef bytes key = b""    # reused while the keys repeat
    cdef list out = []
    while p < end:
        p = next_record(p, end, &r)
        if PyBytes_GET_SIZE(key) != r.klen or memcmp(PyBytes_AS_STRING(key), r.key, r.klen) != 0:
            key = PyBytes_FromStringAndSize(r.key, r.klen)
        job = Job.__new__(Job)
        job.key = key
        job.payload = PyBytes_FromStringAndSize(r.payload, r.plen)
        job.tag = r.tag
        job.deliveries = r.deliveries
        job.settle = settle
        out.append(job)
    return out


cdef double monotonic() noexcept:
    # The clock of time.monotonic(), which the consumer's renewer compares ``due`` with.
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class Acks:
    """Acks held to go out together: one ``ack TOKEN TAG TAG...`` control
    message (sbus.client.consume). ``add`` and ``take`` change the held set
    in C with the GIL held, so a consumer's thread and its renewer share it
    without a lock. ``due`` is when the oldest held ack must go (``delay``
    after it was held; None when none is held), ``limit`` how many are held
    at most (then they go at once), ``started`` counts the times an ack was
    held with none before it, and ``watched`` is the renewer's word that it
    looks at ``due`` without being woken."""

    cdef list tags
    cdef object control
    cdef object token
    cdef double delay
    cdef readonly Py_ssize_t limit
    cdef public object due
    cdef readonly Py_ssize_t started
    cdef public bint watched

    def __cinit__(self, double delay, Py_ssize_t limit):
        self.tags = []
        self.control = self.token = ""
        self.delay = delay
        self.limit = limit if limit > 1 else 1

    def add(self, control, token, tag):
        """Hold one ack; see ``hold``."""
        return self.hold(control, token, tag)

    cdef object hold(self, object control, object token, object tag):
        """Hold one ack. None if others were held already; else True. A
        packet (key, payload) instead if one must go out now: the acks held
        for another token or control key (this one is held), or, once
        ``limit`` are held, all of them (none is held)."""
        cdef object out = True
        if self.tags:
            if token == self.token and control == self.control:
                self.tags.append(tag)
                return self.take() if len(self.tags) >= self.limit else None
            out = self.take()
        self.control, self.token = control, token
        self.due = monotonic() + self.delay
        self.started += 1
        self.tags.append(tag)
        if out is True and self.limit == 1:
            return self.take()
        return out

    def take(self):
        """The packet (key, payload) of the acks held, which are forgotten; None if none are."""
        if not self.tags:
            return None
        tags, self.tags = self.tags, []
        self.due = None
        # Packed from a list nobody else sees: Python code may run meanwhile.
        return (self.control, pack_acks(f"{ACK} {self.token}".encode(), tags))


cdef class Settler:
    """What settles the jobs delivered under one token (sbus.client.consume):
    an ack is held in ``acks`` (Job.ack comes here in C: a consumer acks
    every job); ``ack`` returns ``done`` while it is held, or what
    ``publish`` returns for the packet that must go now, and wakes
    ``session.wake()`` for the first held while nobody watches. Other verbs
    go to ``other(verb, tag)``."""

    cdef Acks acks
    cdef object control
    cdef object token
    cdef object publish
    cdef object done
    cdef object session
    cdef object other

    def __init__(self, Acks acks, control, token, publish, done, session, other):
        self.acks, self.control, self.token = acks, control, token
        self.publish, self.done, self.session, self.other = publish, done, session, other

    cdef object ack(self, object tag):
        held = self.acks.hold(self.control, self.token, tag)
        if held is None:
            return self.done
        if not self.acks.watched:
            self.session.wake()     # the first held: the renewer sends it when it is due
        # held: True, or the acks of an earlier token or half the prefetch, to go now
        return self.done if held is True else self.publish(*held)

    def __call__(self, verb, tag):
        return self.ack(tag) if verb == ACK else self.other(verb, tag)


cdef class Feed:
    """What ``for job in consumer`` iterates (sbus.client.consume): the jobs
    of the batch at hand, popped in C from ``items`` (the consumer's list of
    them, last first), and ``more()`` (the consumer's ``__next__``, which
    refills ``items`` or raises StopIteration) once it is empty. A job of a
    batch then costs no Python call."""

    cdef list items
    cdef object more

    def __init__(self, list items, more):
        self.items, self.more = items, more

    def __iter__(self):
        return self

    def __next__(self):
        cdef Py_ssize_t n = PyList_GET_SIZE(self.items)
        if n:
            return self.items.pop()
        return self.more()
