# Batched client I/O for the two clients (sbus.client.sync and sbus.client.aio).
#
# Outbox packs MSG/SUB/UNSUB/CMSG packets back to back in one C buffer and
# sends them with sendmmsg; a partial send (a full socket, a signal) leaves
# the unsent tail owed, so the caller can wait and call send() again without
# reordering anything. Inbox takes up to `slots` packets with one recvmmsg
# and builds the Message/ControlMessage tuples straight from the C buffer.
# take() and AsyncMessages hand queued messages on without a Python-level
# loop or a coroutine per message.
# The checks here are the broker's own (protocol.pxd), so a packet the
# client lets through is one the broker accepts.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdlib cimport free, malloc
from libc.string cimport memchr, memcmp, memcpy, memset

from .includes.sys cimport (
    CLOCK_MONOTONIC, MADV_DONTNEED, MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, MSG_NOSIGNAL,
    MSG_TRUNC, MSG_DONTWAIT, MSG_PEEK, POLLIN, PROT_READ, PROT_WRITE, clock_gettime, iovec, madvise, mmap,
    mmsghdr, msghdr, munmap, poll, pollfd, recvmmsg, sendmmsg, timespec,
)
from .protocol cimport KEY_OK, CredForm, check_rest, is_cred_key, parse_cred_form

import os

from ..errors import BusClosedError, KeyRefusedError, MessageTooLargeError, ProtocolError


cdef extern from "<sys/socket.h>" nogil:
    enum:
        MSG_WAITFORONE
    ssize_t sendmsg(int fd, const msghdr *msg, int flags)


cdef extern from "<sys/mman.h>" nogil:
    enum:
        MAP_NORESERVE


cdef extern from "Python.h":
    # A tuple subclass is built as tuple_subtype_new builds one: tp_alloc
    # with two items, then the items set in place (one allocation, no args tuple).
    ctypedef struct PyTypeObject_ "PyTypeObject":
        PyObject *(*tp_alloc)(PyTypeObject_ *, Py_ssize_t) except NULL
    void PyTuple_SET_ITEM(object t, Py_ssize_t i, object v)
    bint PyExceptionInstance_Check(object o)
    PyObject *PyIter_Next(object o)     # NULL at the end, and on an error
    object PyObject_CallNoArgs(object func)     # vectorcall, no argument tuple (3.9+)
    PyObject *PyErr_Occurred()
    void Py_SET_SIZE(object o, Py_ssize_t size)
    void PyErr_SetString(object type, const char *message)


cdef extern from *:
    """
    /* am_send (3.10+) lets `await` take a result without a StopIteration;
       Cython has no special method for the slot, so AsyncMessages sets it.
       Before 3.10 the slot does not exist and __next__ serves instead. */
    #if PY_VERSION_HEX >= 0x030A0000
    typedef PySendResult sbus_send_result;
    #else
    typedef __Pyx_PySendResult sbus_send_result;   /* Cython's stand-in */
    #endif
    typedef sbus_send_result (*sbus_sendfunc)(PyObject *, PyObject *, PyObject **);
    static int sbus_set_am_send(PyTypeObject *type, sbus_sendfunc send) {
    #if PY_VERSION_HEX >= 0x030A0000
        if (type->tp_as_async != NULL) {
            type->tp_as_async->am_send = send;
            return 1;
        }
    #endif
        return 0;
    }
    """
    ctypedef enum sbus_send_result:
        PYGEN_RETURN
        PYGEN_ERROR
    ctypedef sbus_send_result (*sbus_sendfunc)(PyObject *, PyObject *, PyObject **)
    int sbus_set_am_send(PyTypeObject_ *type, sbus_sendfunc send)


cdef extern from "csrc/batch/message_freelist.h":
    int sbus_free_install(PyTypeObject_ *type)
    PyObject *sbus_pair_new(PyTypeObject_ *type) except NULL


cdef enum:
    OUTBOX_SLOTS = 512          # sendmmsg takes at most UIO_MAXIOV (1024)
    OUTBOX_MIN_BYTES = 1 << 18
    INBOX_SLOTS = 64
    KEEP_MAPPED = 1 << 16       # slot bytes kept resident after a large packet
    CHUNK_SUFFIX_LEN = 12       # len(b"/.sbus-chunk"), sbus.client.chunks.SUFFIX
    POLL_MAX_MS = 1 << 30       # a longer timeout waits in several polls


cdef inline bytes as_bytes(object text):
    """str as UTF-8 (surrogateescape), bytes as is, any other bytes-like copied."""
    if type(text) is bytes:
        return <bytes>text
    if isinstance(text, str):
        return (<str>text).encode("utf-8", "surrogateescape")
    return bytes(text)


cdef inline double now() noexcept:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline void put_item(list out, Py_ssize_t k, object item) noexcept:
    Py_INCREF(item)     # PyList_SET_ITEM steals a reference
    PyList_SET_ITEM(out, k, item)


cdef int raise_errno(str what) except -1:
    cdef int err = errno
    raise OSError(err, f"{what}: {os.strerror(err)}")


cdef inline int raise_pending() except -1:
    """Propagate the exception a C call left set, if any."""
    return -1 if PyErr_Occurred() != NULL else 0


cdef int check_key(const char *key, size_t klen, bint is_pattern) except -1:
    """Raise KeyRefusedError for a key (or pattern) the broker would refuse by
    closing the connection: a NUL, or the reserved '!' misused."""
    cdef CredForm form
    cdef int check
    what = "pattern" if is_pattern else "key"
    if memchr(key, 0, klen) != NULL:
        raise KeyRefusedError(f"a routing {what} cannot contain NUL: {key[:klen]!r}")
    if memchr(key, b'!', klen) == NULL:
        return 0
    if is_cred_key(key, klen):
        if parse_cred_form(key, klen, False, &form) < 0:
            raise KeyRefusedError(f"malformed !/cred/ {what} {key[:klen]!r}")
        check = check_rest(key + form.prefix_len, klen - form.prefix_len, is_pattern)
    else:
        check = check_rest(key, klen, is_pattern)
    if check != KEY_OK:
        raise KeyRefusedError(f"reserved '!' misused in {what} {key[:klen]!r}")
    return 0


def check_publish_key(bytes key):
    """Raise KeyRefusedError if the broker would refuse to relay ``key``."""
    check_key(key, len(key), False)


def check_pattern(bytes pattern):
    """Raise KeyRefusedError if the broker would refuse ``SUB pattern``
    (credentials aside: only the broker knows whose they are)."""
    check_key(pattern, len(pattern), True)


cdef int refuse_size(size_t size, size_t max_message) except -1:
    raise MessageTooLargeError(f"packet of {size} bytes exceeds the bus limit of {max_message}")


def pack_publish(object key, object payload, size_t max_message):
    """``MSG key\\0payload`` after the checks the broker would make."""
    cdef bytes k = as_bytes(key)
    cdef bytes p = as_bytes(payload)
    cdef size_t klen = PyBytes_GET_SIZE(k), plen = PyBytes_GET_SIZE(p)
    cdef size_t size = 5 + klen + plen
    check_key(PyBytes_AS_STRING(k), klen, False)
    if size > max_message:
        refuse_size(size, max_message)
    out = PyBytes_FromStringAndSize(NULL, size)
    cdef char *o = PyBytes_AS_STRING(out)
    memcpy(o, b"MSG ", 4)
    memcpy(o + 4, PyBytes_AS_STRING(k), klen)
    o[4 + klen] = 0
    memcpy(o + 5 + klen, PyBytes_AS_STRING(p), plen)
    return out


def send_publish(int fd, object key, object payload, int flags, size_t max_message):
    """Check and send one ``MSG key\\0payload`` with sendmsg(2), gathering the
    parts in place (no packet is built). OSError as send(2) reports it."""
    cdef bytes k = as_bytes(key)
    cdef bytes p = as_bytes(payload)
    cdef size_t klen = PyBytes_GET_SIZE(k), plen = PyBytes_GET_SIZE(p)
    cdef size_t size = 5 + klen + plen
    cdef iovec parts[4]
    cdef msghdr msg
    cdef ssize_t n
    check_key(PyBytes_AS_STRING(k), klen, False)
    if size > max_message:
        refuse_size(size, max_message)
    parts[0].iov_base = <void *><const char *>b"MSG "
    parts[0].iov_len = 4
    parts[1].iov_base = PyBytes_AS_STRING(k)
    parts[1].iov_len = klen
    parts[2].iov_base = <void *><const char *>b"\0"
    parts[2].iov_len = 1
    parts[3].iov_base = PyBytes_AS_STRING(p)
    parts[3].iov_len = plen
    memset(&msg, 0, sizeof(msg))
    msg.msg_iov = parts
    msg.msg_iovlen = 4
    # First without blocking and with the GIL held (the usual case: the
    # socket has room); only a send that would block lets other threads run.
    # A non-blocking socket fails EAGAIN again in the second call.
    n = sendmsg(fd, &msg, flags | MSG_NOSIGNAL | MSG_DONTWAIT)
    if n < 0 and errno == EAGAIN and not flags & MSG_DONTWAIT:
        while True:
            with nogil:
                n = sendmsg(fd, &msg, flags | MSG_NOSIGNAL)
            if n >= 0 or errno != EINTR:
                break
            PyErr_CheckSignals()
    if n < 0:
        raise_errno("sendmsg")


cdef class Outbox:
    """Packets packed for one sendmmsg: at most 512, and as many bytes as
    max(256 KiB, max_message) holds. Refusals are raised before a packet is
    packed, so everything packed can be sent."""

    def __cinit__(self, size_t max_message):
        cdef int i
        self.max_message = max_message
        self.last_key = self.last_key_bytes = b""
        self.cap = max_message + 64 if max_message + 64 > OUTBOX_MIN_BYTES else OUTBOX_MIN_BYTES
        self.slots = OUTBOX_SLOTS
        self.buf = <char *>malloc(self.cap)
        self.iov = <iovec *>malloc(self.slots * sizeof(iovec))
        self.hdrs = <mmsghdr *>malloc(self.slots * sizeof(mmsghdr))
        if self.buf == NULL or self.iov == NULL or self.hdrs == NULL:
            raise MemoryError()
        memset(self.hdrs, 0, self.slots * sizeof(mmsghdr))
        for i in range(self.slots):
            self.hdrs[i].msg_hdr.msg_iov = &self.iov[i]
            self.hdrs[i].msg_hdr.msg_iovlen = 1

    def __dealloc__(self):
        free(self.buf)
        free(self.iov)
        free(self.hdrs)

    def __len__(self):
        """Packets packed and not yet sent."""
        return self.count - self.head

    @property
    def nbytes(self):
        """Bytes packed, sent or not (what the buffer holds until it is cleared)."""
        return self.used

    @property
    def full(self):
        return self.count == self.slots

    def clear(self):
        """Forget every packet, sent or not, and any held pair."""
        self.count = self.head = 0
        self.used = 0
        self.held = None

    def unsent(self):
        """The packets still owed, as bytes, oldest first."""
        cdef int i
        return [PyBytes_FromStringAndSize(<char *>self.iov[i].iov_base, self.iov[i].iov_len)
                for i in range(self.head, self.count)]

    cdef int _append(self, const char *head, size_t hlen, const char *key, size_t klen,
                     const char *tail, size_t tlen) noexcept:
        """Pack head+key+tail as one packet; 0 when it does not fit."""
        cdef size_t size = hlen + klen + tlen
        cdef char *at
        if self.count == self.slots or self.used + size > self.cap:
            return 0
        at = self.buf + self.used
        memcpy(at, head, hlen)
        memcpy(at + hlen, key, klen)
        memcpy(at + hlen + klen, tail, tlen)
        self.iov[self.count].iov_base = at
        self.iov[self.count].iov_len = size
        self.count += 1
        self.used += size
        return 1

    cpdef bint add_publish(self, object key, object payload) except -1:
        """Check and pack ``MSG key\\0payload``; False if the box is full
        (send, then add again). KeyRefusedError or MessageTooLargeError if the
        broker would refuse it."""
        cdef bytes k, p
        cdef size_t klen, plen, size
        if key is self.last_key:
            k = self.last_key_bytes     # encoded and checked already
        else:
            k = as_bytes(key)
            if memchr(PyBytes_AS_STRING(k), 0, PyBytes_GET_SIZE(k)) != NULL or memchr(
                    PyBytes_AS_STRING(k), b'!', PyBytes_GET_SIZE(k)) != NULL:
                check_key(PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k), False)
            if type(key) is str or type(key) is bytes:     # immutable: the same object, the same key
                self.last_key, self.last_key_bytes = key, k
        p = as_bytes(payload)
        klen, plen = PyBytes_GET_SIZE(k), PyBytes_GET_SIZE(p)
        size = 5 + klen + plen
        if size > self.max_message:
            refuse_size(size, self.max_message)
        return self.pack_message(PyBytes_AS_STRING(k), klen, PyBytes_AS_STRING(p), plen)

    cdef int pack_message(self, const char *key, size_t klen,
                          const char *payload, size_t plen) noexcept:
        """Pack ``MSG key\\0payload`` from C bytes already checked by the
        caller (add_publish, sbus._core.natswire); 0 when the box is full."""
        cdef size_t size = 5 + klen + plen
        cdef char *at
        if self.count == self.slots or self.used + size > self.cap:
            return 0
        at = self.buf + self.used
        memcpy(at, b"MSG ", 4)
        memcpy(at + 4, key, klen)
        at[4 + klen] = 0
        memcpy(at + 5 + klen, payload, plen)
        self.iov[self.count].iov_base = at
        self.iov[self.count].iov_len = size
        self.count += 1
        self.used += size
        return 1

    cpdef bint add_packet(self, bytes packet) except -1:
        """Pack a packet already built and checked; False if the box is full."""
        return self._append(PyBytes_AS_STRING(packet), PyBytes_GET_SIZE(packet), NULL, 0, NULL, 0)

    def pack_many(self, object items, Py_ssize_t base):
        """Pack (key, payload) pairs from the iterator ``items`` until it ends
        (then ``exhausted`` is set) or the box is full; returns how many were
        packed. A pair that did not fit is held and packed first next time.
        A refused pair raises with ``index = base + its position``; the
        pairs packed before it stay packed."""
        cdef Py_ssize_t k = 0
        cdef PyObject *got
        cdef bint adding = False
        self.exhausted = False
        # One try for the whole batch: a try statement per pair saves and
        # restores the exception state each time, a good part of what packing costs.
        try:
            while self.count < self.slots:
                if self.held is not None:
                    item, self.held = self.held, None
                else:
                    got = PyIter_Next(items)
                    if got == NULL:
                        raise_pending()     # the iterator's own error, if it raised one
                        self.exhausted = True
                        break
                    item = <object>got
                    Py_DECREF(item)     # the cast took a second reference to PyIter_Next's
                key, payload = item
                adding = True
                if not self.add_publish(key, payload):
                    self.held = item
                    break
                adding = False
                k += 1
        except (KeyRefusedError, MessageTooLargeError) as exc:
            if adding:
                exc.index = base + k
            raise
        return k

    def send(self, int fd, int flags=0):
        """sendmmsg what is owed until all of it is sent; returns how many
        went out, and clears the box. An OSError (BlockingIOError for a full
        non-blocking socket) leaves the rest owed: ``head`` counts what went out."""
        cdef int start = self.head
        cdef int n
        cdef bint wait = False      # as send_publish: block (without the GIL) only when full
        while self.head < self.count:
            if wait:
                with nogil:
                    n = sendmmsg(fd, self.hdrs + self.head, self.count - self.head,
                                 flags | MSG_NOSIGNAL)
            else:
                n = sendmmsg(fd, self.hdrs + self.head, self.count - self.head,
                             flags | MSG_NOSIGNAL | MSG_DONTWAIT)
            if n < 0:
                if errno == EINTR:
                    PyErr_CheckSignals()
                elif errno == EAGAIN and not flags & MSG_DONTWAIT and not wait:
                    wait = True     # a non-blocking socket fails EAGAIN again then
                else:
                    raise_errno("sendmmsg")
                continue
            wait = False
            self.head += n
        sent = self.head - start
        self.count = self.head = 0
        self.used = 0
        return sent


cdef class Sink:
    """Receives plain messages in C (see Inbox.receive); subclassed in Cython."""

    cdef int put(self, const char *key, size_t klen,
                 const char *payload, size_t plen) except -1:
        raise NotImplementedError("a Sink subclass implements put()")

    def add(self, list messages):
        """Messages already made as objects ((key, payload) tuples of bytes),
        each as put() takes it."""
        cdef bytes key, payload
        for key, payload in messages:
            self.put(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                     PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload))


cdef class Inbox:
    """Up to 64 packets per recvmmsg, each slot max_message + 1 bytes (one
    more than the limit, so an oversized packet shows even without
    MSG_TRUNC). The slots are mapped with MAP_NORESERVE: only the pages
    packets touch are resident, and a large packet's pages are handed back."""

    def __cinit__(self, size_t max_message, object message_type, object control_type,
                  int slots=INBOX_SLOTS):
        cdef int i
        cdef void *area
        self.max_message = max_message
        self.message_type = message_type
        self.control_type = control_type
        sbus_free_install(<PyTypeObject_ *>message_type)
        self.slots = slots
        self.slot_size = max_message + 1
        self.area_size = <size_t>slots * self.slot_size
        area = mmap(NULL, self.area_size, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if area == MAP_FAILED:
            raise MemoryError()
        self.area = <char *>area
        self.iov = <iovec *>malloc(slots * sizeof(iovec))
        self.hdrs = <mmsghdr *>malloc(slots * sizeof(mmsghdr))
        if self.iov == NULL or self.hdrs == NULL:
            raise MemoryError()
        memset(self.hdrs, 0, slots * sizeof(mmsghdr))
        for i in range(slots):
            self.iov[i].iov_base = self.area + i * self.slot_size
            self.iov[i].iov_len = self.slot_size
            self.hdrs[i].msg_hdr.msg_iov = &self.iov[i]
            self.hdrs[i].msg_hdr.msg_iovlen = 1
        self.last_key = b""
        self.routed_prefix = b""
        self.chunks = True
        self.fd = -1
        self.queue = ()

    def __dealloc__(self):
        if self.area != NULL:
            munmap(self.area, self.area_size)
        free(self.iov)
        free(self.hdrs)

    @property
    def route(self):
        """A key prefix (bytes; b"" for none) whose messages count as
        irregular, as ``routed`` does: a client's reply inbox, so that a
        batch without a reply is handed on without a look at each key."""
        return self.routed_prefix

    @route.setter
    def route(self, bytes prefix):
        self.routed_prefix = prefix

    def receive(self, int fd, int limit, int flags=0, double timeout=-1.0, Sink sink=None):
        """recvmmsg up to ``limit`` packets (waiting for the first, at most
        ``timeout`` seconds if it is not negative, unless the socket or
        ``flags`` say MSG_DONTWAIT) and parse them, in order.

        Returns a list of Message and ControlMessage objects, in which an
        oversized or malformed packet is the exception that reports it, and
        the end of the connection is a BusClosedError (always last).
        ``irregular`` counts the control messages and exceptions, and, while
        ``chunks`` is set, the chunks of larger messages (``chunked`` counts
        those: keys ending in sbus.client.chunks.SUFFIX), and the messages
        on the ``route`` prefix (``routed`` counts those), so a caller
        finding it 0 can take the list as plain messages. OSError as
        recvmmsg(2) reports it (BlockingIOError: nothing to read);
        TimeoutError when ``timeout`` passes first.

        With a ``sink``, the plain messages before the first irregular packet
        go to ``sink.put()`` instead (``taken`` counts them), and the list
        holds the rest, from that packet on, so the order is kept."""
        cdef int n = self.read(fd, limit, flags, timeout)
        if n < 0:
            raise_errno("recvmmsg")
        return self.parse(n, sink)

    cpdef object take_batch(self, int limit, object timeout, int flags):
        """A receive_many call, whole, when it is the usual one (sbus.client
        .sync and .aio): nothing queued (``queue``, a deque) or owed
        (``outbox``, an Outbox or None), a socket (``fd``, -1 for none), no
        MSG_PEEK, and the batch plain messages (by ``irregular``): then the
        list receive() returns. Else None, and the client's own path takes
        over, from the batch ``held()`` returns if one was read; () when
        MSG_DONTWAIT found nothing. ``deadline`` is when ``timeout``
        (seconds, if not None) ends; TimeoutError then, as receive()."""
        cdef double wait = -1.0
        cdef int n
        if timeout is not None:
            wait = timeout
            wait = wait if wait > 0.0 else 0.0
            self.deadline = now() + wait
        if self.fd < 0 or len(self.queue) or flags & MSG_PEEK or (
                self.outbox is not None and self.outbox.count != self.outbox.head):
            return None
        n = self.read(self.fd, limit, flags, wait)
        if n < 0:
            if errno == EAGAIN and flags & MSG_DONTWAIT:
                return ()
            raise_errno("recvmmsg")
        batch = self.parse(n, None)
        if self.irregular:
            self.kept = batch
            return None
        return batch

    def held(self):
        """The batch the last take_batch() read and left to the caller (once), or None."""
        batch, self.kept = self.kept, None
        return batch

    cdef int read(self, int fd, int limit, int flags, double timeout) except? -2:
        """recvmmsg up to ``limit`` packets into the slots, as receive() says; -1 with errno set."""
        cdef int n
        if limit > self.slots:
            limit = self.slots
        if limit < 1:
            limit = 1
        # What is there already is taken with the GIL held; only a wait
        # releases it (and a poll(2) is made only when there is a timeout).
        # A socket the last call emptied is empty again nearly every time
        # (98-99% for a reader that keeps up with a publisher; full batches
        # are followed by more 99% of the time), so the read that would fail
        # EAGAIN first is skipped: one syscall less per wake-up.
        if self.drained and not flags & MSG_DONTWAIT:
            n = self.wait(fd, limit, flags, timeout)
        else:
            n = recvmmsg(fd, self.hdrs, limit, flags | MSG_DONTWAIT, NULL)
            if n < 0 and errno == EAGAIN and not flags & MSG_DONTWAIT:
                n = self.wait(fd, limit, flags, timeout)
        if n >= 0:
            self.drained = n < limit
        return n

    cdef list parse(self, int n, Sink sink):
        """The n packets read into the slots, as receive() returns them."""
        cdef int i, k = 0
        cdef size_t size, klen
        cdef const char *p
        cdef const char *nul
        cdef int irregular = 0
        cdef int chunked = 0
        cdef int routed = 0
        cdef bytes prefix = self.routed_prefix
        cdef size_t plen = PyBytes_GET_SIZE(prefix)
        cdef const char *pstart = PyBytes_AS_STRING(prefix)
        # Sized once and filled in place (an append per item grows it
        # several times); what the loop does not fill is cut off at the end.
        cdef list out = PyList_New(n)
        message_type = self.message_type
        self.taken = 0
        for i in range(n):
            size = self.hdrs[i].msg_len
            p = <const char *>self.iov[i].iov_base
            if size == 0:
                # SOCK_SEQPACKET reads 0 bytes at EOF; the broker never sends
                # an empty packet, and every later slot would read 0 as well.
                item = BusClosedError("the broker closed the connection")
                irregular += 1
                put_item(out, k, item)
                k += 1
                break
            if size > self.max_message or self.hdrs[i].msg_hdr.msg_flags & MSG_TRUNC:
                item = MessageTooLargeError(
                    f"received a packet larger than {self.max_message} bytes; it was dropped")
                irregular += 1
            elif size >= 4 and memcmp(p, b"MSG ", 4) == 0:
                nul = <const char *>memchr(p + 4, 0, size - 4)
                if nul == NULL:
                    item = ProtocolError(
                        f"MSG packet without NUL after the key: {p[:size if size < 64 else 64]!r}")
                    irregular += 1
                    put_item(out, k, item)
                    k += 1
                    continue
                klen = nul - (p + 4)
                if self.chunks and klen >= CHUNK_SUFFIX_LEN and memcmp(
                        nul - CHUNK_SUFFIX_LEN, b"/.sbus-chunk", CHUNK_SUFFIX_LEN) == 0:
                    chunked += 1
                    irregular += 1
                elif plen and klen >= plen and memcmp(p + 4, pstart, plen) == 0:
                    routed += 1
                    irregular += 1
                if sink is not None and not irregular:
                    sink.put(p + 4, klen, nul + 1, size - 5 - klen)
                    self.taken += 1
                    if size > KEEP_MAPPED:
                        self.release(i)
                    continue
                item = self.make(message_type, p + 4, klen, nul + 1, size - 5 - klen)
            elif size >= 5 and memcmp(p, b"CMSG ", 5) == 0:
                nul = <const char *>memchr(p + 5, 0, size - 5)
                if nul == NULL:
                    item = self.make(self.control_type, p + 5, size - 5, p, 0)
                else:
                    klen = nul - (p + 5)
                    item = self.make(self.control_type, p + 5, klen, nul + 1, size - 6 - klen)
                irregular += 1
            else:
                item = ProtocolError(f"unknown packet type: {p[:size if size < 64 else 64]!r}")
                irregular += 1
            put_item(out, k, item)
            k += 1
            if size > KEEP_MAPPED:
                self.release(i)
        if k < n:
            Py_SET_SIZE(out, k)
        self.irregular = irregular
        self.chunked = chunked
        self.routed = routed
        return out

    cdef int wait(self, int fd, int limit, int flags, double timeout) except? -2:
        """recvmmsg once at least one packet is there (with a timeout, poll(2)
        waits for it); -1 with errno set as recvmmsg or poll left it. Without
        a timeout, a non-blocking socket fails EAGAIN at once."""
        cdef int n, ready
        cdef pollfd pfd
        cdef double deadline = now() + timeout if timeout >= 0 else -1.0
        cdef double left
        pfd.fd = fd
        pfd.events = POLLIN
        while True:
            if deadline < 0:
                with nogil:
                    n = recvmmsg(fd, self.hdrs, limit, flags | MSG_WAITFORONE, NULL)
            else:
                left = (deadline - now()) * 1000 + 0.999   # ms, rounded up
                if left > POLL_MAX_MS:
                    left = POLL_MAX_MS
                with nogil:
                    ready = poll(&pfd, 1, <int>left if left >= 1 else 0)
                if ready == 0:
                    if now() < deadline:
                        continue    # a timeout longer than one poll takes
                    raise TimeoutError(f"no message within {timeout:g} s")
                # readable, or an error that recvmmsg reports (EOF reads 0 bytes)
                n = recvmmsg(fd, self.hdrs, limit, flags | MSG_DONTWAIT, NULL) if ready > 0 else -1
                if n < 0 and errno == EAGAIN:
                    continue    # taken by another reader of the socket
            if n >= 0 or errno != EINTR:
                return n
            PyErr_CheckSignals()

    cdef object make(self, object cls, const char *key, size_t klen,
                     const char *payload, size_t plen):
        """cls(key, payload) for a two-field NamedTuple; a key equal to the
        last one reuses its bytes object (bytes are immutable)."""
        cdef bytes k = self.last_key
        if <size_t>PyBytes_GET_SIZE(k) != klen or memcmp(PyBytes_AS_STRING(k), key, klen) != 0:
            k = PyBytes_FromStringAndSize(key, klen)
            self.last_key = k
        payload_obj = PyBytes_FromStringAndSize(payload, plen)
        t = <object>sbus_pair_new(<PyTypeObject_ *>cls)
        Py_DECREF(t)    # the <object> cast took a second reference to sbus_pair_new's
        Py_INCREF(k)
        PyTuple_SET_ITEM(t, 0, k)
        Py_INCREF(payload_obj)
        PyTuple_SET_ITEM(t, 1, payload_obj)
        return t

    cdef void release(self, int i) noexcept:
        """Hand back the pages of slot i beyond the first KEEP_MAPPED bytes."""
        cdef size_t page = 4096
        cdef char *start = self.area + i * self.slot_size + KEEP_MAPPED
        cdef size_t offset = <size_t>start % page
        cdef size_t length
        if offset:
            start += page - offset
        if start >= self.area + (i + 1) * self.slot_size:
            return
        length = <size_t>(self.area + (i + 1) * self.slot_size - start) // page * page
        if length:
            madvise(start, length, MADV_DONTNEED)


def take(object queue, Py_ssize_t limit):
    """Pop up to ``limit`` items from the front of the deque ``queue``,
    stopping before an exception (the caller raises it in its turn)."""
    cdef Py_ssize_t k = 0
    if limit <= 0:
        return []
    for item in queue:
        if k == limit or PyExceptionInstance_Check(item):
            break
        k += 1
    if k == len(queue):
        # Usually the queue is one batch just read, all of it taken: copied
        # and cleared at once, not popped by a call per item.
        out = list(queue)
        queue.clear()
        return out
    popleft = queue.popleft
    return [PyObject_CallNoArgs(popleft) for _ in range(k)]


cdef class Messages:
    """``for message in client``: the client's queue, refilled by
    ``refill()`` (one batch read; False once the broker has closed the
    connection) whenever it is empty. A queued exception is raised in its
    turn, and a BusClosedError ends the iteration."""

    def __cinit__(self, object queue, object refill):
        self.queue = queue
        self.popleft = queue.popleft
        self.refill = refill

    def __iter__(self):
        return self

    def __next__(self):
        while not len(self.queue):
            if not self.refill():
                raise StopIteration
        item = self.popleft()
        if PyExceptionInstance_Check(item):
            if isinstance(item, BusClosedError):
                raise StopIteration
            raise item
        return item


cdef class AsyncMessages:
    """``async for`` over a client's queue. A queued message (of exactly
    ``message_type``) comes from an awaitable that completes at once: this
    object, whose am_send returns the message (no coroutine, future or
    StopIteration per message). Anything else (an empty queue, a control
    message, an error) is left to ``slow()``, the client's own coroutine."""

    def __cinit__(self, object queue, object message_type, object slow):
        self.queue = queue
        self.popleft = queue.popleft
        self.message_type = message_type
        self.slow = slow

    def __aiter__(self):
        return self

    def __anext__(self):
        if self.value is not None:
            # an earlier __anext__() was never awaited: its message stays first
            raise RuntimeError("anext(): the previous message was not awaited")
        queue = self.queue
        if len(queue) and type(queue[0]) is self.message_type:
            self.value = self.popleft()
            return self
        return self.slow()

    def __await__(self):
        return self

    def __next__(self):
        # for an interpreter that does not use am_send
        value = self.ready()
        raise StopIteration(value)

    cdef object ready(self):
        value, self.value = self.value, None
        if value is None:
            raise RuntimeError("cannot reuse an already awaited __anext__()")
        return value


cdef sbus_send_result async_messages_send(PyObject *self, PyObject *arg,
                                          PyObject **result) noexcept:
    cdef AsyncMessages it = <AsyncMessages>self
    cdef object value = it.value
    if value is None:
        PyErr_SetString(RuntimeError, b"cannot reuse an already awaited __anext__()")
        result[0] = NULL
        return PYGEN_ERROR
    it.value = None
    Py_INCREF(value)
    result[0] = <PyObject *>value
    return PYGEN_RETURN


# Whether AsyncMessages has its am_send slot (Python 3.10+).
AM_SEND = bool(sbus_set_am_send(<PyTypeObject_ *>AsyncMessages, async_messages_send))
