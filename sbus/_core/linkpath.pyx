# cython: language_level=3
# The leaf link's per-message path (sbus/sbusd/link.py), both ways: a Relay
# is the batch.Sink that Inbox.receive hands each plain message to in C, and
# packs it into an Outbox that goes on with one sendmmsg, so a public message
# crossing the link makes no Python object. A private key (`!`) is the one
# exception: the link's Python decides what becomes of it (strip our prefix
# on the way down, keep a local process's own on the way up), through the
# `private` callable. link.py keeps the per-message reference path that the
# tests hold this one to (SBUS_LINK_REFERENCE=1).
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcpy

from .batch cimport Inbox, Outbox, Sink
from .includes.sys cimport MSG_DONTWAIT


cdef class Relay(Sink):
    """Messages put() in order go on to ``fd`` as ``MSG key\\0payload``
    through ``box`` (sent when it fills, and by ``flush()``), with no Python
    object made for a public one. A key starting with ``!`` goes to
    ``private(key, payload)``, which returns the key to send it on with, or
    None when it is not to be sent (the link handled it). Once ``fd`` is full
    (EAGAIN), what the box holds and every later message of the batch
    (packets, bytes) go to ``spill``, in order, for the link's Python queue:
    nothing is ever sent ahead of it; ``hold`` set does the same from the
    first message (the link's queue is not empty). ``sent`` counts what went out. Any
    other error of sendmmsg is kept in ``error`` (the batch spills from
    there), for the link to act on once the batch is in."""

    cdef Outbox box
    cdef int fd
    cdef object private
    cdef public list spill
    cdef public Py_ssize_t sent
    cdef public object error
    cdef public bint hold
    cdef public Py_ssize_t pumped
    cdef public int batches
    cdef public bint drained

    def __cinit__(self, Outbox box, int fd, object private):
        self.box = box
        self.fd = fd
        self.private = private
        self.spill = []
        self.sent = 0
        self.error = None

    cdef int put(self, const char *key, size_t klen,
                 const char *payload, size_t plen) except -1:
        cdef bytes k
        if klen and key[0] == b'!':
            k = self.private(PyBytes_FromStringAndSize(key, klen),
                             PyBytes_FromStringAndSize(payload, plen))
            if k is None:
                return 0
            key, klen = PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k)
            return self.relay(key, klen, payload, plen)
        return self.relay(key, klen, payload, plen)

    cdef int relay(self, const char *key, size_t klen,
                   const char *payload, size_t plen) except -1:
        if not self.spill and self.error is None and not self.hold:
            if self.box.pack_message(key, klen, payload, plen):
                return 0
            self.flush()
            if not self.spill and self.error is None and self.box.pack_message(key, klen, payload, plen):
                return 0
        # Behind what waits (or larger than an empty box holds): as a packet.
        cdef bytes packet = PyBytes_FromStringAndSize(NULL, 5 + klen + plen)
        cdef char *at = PyBytes_AS_STRING(packet)
        memcpy(at, b"MSG ", 4)
        memcpy(at + 4, key, klen)
        at[4 + klen] = 0
        memcpy(at + 5 + klen, payload, plen)
        self.spill.append(packet)
        return 0

    def flush(self):
        """Send what the box holds; what ``fd`` does not take now goes to
        ``spill`` (and an error other than EAGAIN to ``error``)."""
        cdef int owed = len(self.box)
        if not owed:
            return
        try:
            self.sent += self.box.send(self.fd, MSG_DONTWAIT)
        except OSError as e:
            if not isinstance(e, BlockingIOError):
                self.error = e
            self.sent += owed - len(self.box)
            self.spill.extend(self.box.unsent())
            self.box.clear()

    def pump(self, Inbox inbox, int fd, int limit, int batches):
        """Up to ``batches`` recvmmsg batches of ``limit`` packets from ``fd``
        through this Relay (``inbox.receive``'s sink), with no Python between
        them: one turn of the link's loop moves many batches for one return
        to its Python. Stops after a batch that holds anything but plain
        messages (returned, from its first such item on, as Inbox.receive
        returns it), that spilled or failed to send, or that was short or
        found nothing: ``drained`` then says ``fd`` has no more now.
        ``pumped`` counts the messages the Relay took and ``batches`` the
        recvmmsg calls made, set also when an OSError other than
        BlockingIOError ends it (raised as it comes)."""
        cdef list items = []
        cdef int taken
        self.pumped = 0
        self.batches = 0
        self.drained = False
        while self.batches < batches:
            self.batches += 1
            try:
                items = inbox.receive(fd, limit, MSG_DONTWAIT, -1.0, self)
            except BlockingIOError:
                self.drained = True
                return []
            taken = inbox.taken
            self.pumped += taken
            if len(items) + taken < limit:
                self.drained = True
                break
            if items or self.spill or self.error is not None:
                break
        return items

    def take_spill(self):
        """The packets spilled since the last call, oldest first."""
        out, self.spill = self.spill, []
        return out
