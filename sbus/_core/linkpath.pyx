# cython: language_level=3
# The leaf link's per-message path (sbus/sbusd/link.py), both ways: a Relay
# is the batch.Sink that Inbox.receive hands each plain message to in C, and
# packs it into an Outbox that goes on with one sendmmsg, so a public message
# crossing the link makes no Python object. A private key (`!`) is the one
# exception: the link's Python decides what becomes of it (strip our prefix
# on the way down, keep a local process's own on the way up), through the
# `private` callable. link.py keeps the per-message reference path that the
# tests hold this one to (SBUS_LINK_REFERENCE=1).
#
# On the socketpair to its own broker the link asks for frames (frames.pxd):
# LinkInbox takes the broker's frames apart and FrameSender gathers the
# Outbox's packets into frames, so neither side pays the kernel a packet per
# message there. The upstream sees an ordinary client: a packet per message.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport uint32_t
from libc.string cimport memchr, memcmp, memcpy, memset

from .batch cimport Inbox, Outbox, Sink
from .frames cimport FRAME_BYTES, FRAME_ENTRY_HEAD, FRAME_HEAD, FRAME_MSGS, frame_next, frame_start, is_frame
from .includes.sys cimport MSG_DONTWAIT, MSG_NOSIGNAL, MSG_TRUNC, iovec, mmsghdr, recvmmsg, sendmmsg

import os

from ..errors import BusClosedError, MessageTooLargeError, ProtocolError


cdef enum:
    CHUNK_SUFFIX_LEN = 12       # len(b"/.sbus-chunk"), as batch.pyx
    FRAMES_PER_SEND = 8         # frames per sendmmsg: a full Outbox (512 packets) in one call
    KEEP_MAPPED = 1 << 16       # slot bytes kept resident after a large packet (as batch.pyx)


cdef char FRAME_MAGIC[FRAME_HEAD]
frame_start(FRAME_MAGIC)


cdef class LinkInbox(Inbox):
    """The reader of a connection that takes frames (the link's of its own
    broker, a bridge's, sbus.Client.take_frames): an Inbox that also takes
    frames apart, each packet taken as if it had come alone. The link turns
    ``chunks`` off (a chunk is a plain message there: it relays it as any
    other); a client keeps them, and its ``route``, as Inbox does."""

    cdef public Py_ssize_t frames   # frames taken apart, all told

    def receive(self, int fd, int limit, int flags=0, double timeout=-1.0, Sink sink=None):
        """As Inbox.receive, frames taken apart (``limit`` counts packets
        read). The socket is tried first: the link and the bridge call this
        when their loop found it readable (Inbox.read would wait at once
        after a short batch)."""
        cdef int n
        limit = max(1, min(limit, self.slots))
        n = recvmmsg(fd, self.hdrs, limit, flags | MSG_DONTWAIT, NULL)
        if n < 0 and errno == EAGAIN and not flags & MSG_DONTWAIT:
            n = self.wait(fd, limit, flags, timeout)
        if n < 0:
            raise OSError(errno, os.strerror(errno))    # BlockingIOError for EAGAIN
        self.drained = n < limit
        return self.parse(n, sink)

    cdef list parse(self, int n, Sink sink):
        """As Inbox.parse, frames taken apart, for receive() and for the
        clients' take_batch alike (``n`` counts packets read)."""
        cdef int i
        cdef size_t size, at
        cdef Py_ssize_t length
        cdef const char *p
        cdef const char *packet
        cdef list out = []
        self.taken = self.irregular = self.chunked = self.routed = 0
        for i in range(n):
            size = self.hdrs[i].msg_len
            p = <const char *>self.iov[i].iov_base
            if size == 0:
                out.append(BusClosedError("the broker closed the connection"))
                self.irregular += 1
                break
            if size > self.max_message or self.hdrs[i].msg_hdr.msg_flags & MSG_TRUNC:
                out.append(MessageTooLargeError(
                    f"received a packet larger than {self.max_message} bytes; it was dropped"))
                self.irregular += 1
            elif is_frame(p, size):
                self.frames += 1
                at = FRAME_HEAD
                length = frame_next(p, size, &at, &packet)
                while length > 0:
                    self.take(packet, <size_t>length, sink, out)
                    length = frame_next(p, size, &at, &packet)
                if length < 0:
                    out.append(ProtocolError(f"malformed frame: {p[:size if size < 64 else 64]!r}"))
                    self.irregular += 1
            else:
                self.take(p, size, sink, out)
            if size > KEEP_MAPPED:
                self.release(i)
        return out

    cpdef object take_batch(self, int limit, object timeout, int flags):
        """As Inbox.take_batch, at most ``limit`` messages (it reads ``limit``
        packets, and a frame holds many): the rest wait in ``queue``, in order."""
        batch = Inbox.take_batch(self, limit, timeout, flags)
        if batch and len(batch) > limit:
            self.queue.extend(batch[limit:])
            del batch[limit:]
        return batch

    cdef int take(self, const char *p, size_t size, Sink sink, list out) except -1:
        """One packet: a plain message to sink while nothing irregular came
        before it in the batch, else an item of out."""
        cdef const char *nul
        cdef size_t klen
        if size >= 4 and memcmp(p, b"MSG ", 4) == 0:
            nul = <const char *>memchr(p + 4, 0, size - 4)
            if nul != NULL:
                klen = nul - (p + 4)
                if self.chunks and klen >= CHUNK_SUFFIX_LEN and memcmp(
                        nul - CHUNK_SUFFIX_LEN, b"/.sbus-chunk", CHUNK_SUFFIX_LEN) == 0:
                    self.chunked += 1
                    self.irregular += 1
                elif self.routed_prefix is not None and 0 < PyBytes_GET_SIZE(self.routed_prefix) <= klen \
                        and memcmp(p + 4, PyBytes_AS_STRING(self.routed_prefix),
                                   PyBytes_GET_SIZE(self.routed_prefix)) == 0:
                    self.routed += 1
                    self.irregular += 1
                if sink is not None and not self.irregular:
                    sink.put(p + 4, klen, nul + 1, size - 5 - klen)
                    self.taken += 1
                else:
                    out.append(self.make(self.message_type, p + 4, klen, nul + 1, size - 5 - klen))
                return 0
        elif size >= 5 and memcmp(p, b"CMSG ", 5) == 0:
            nul = <const char *>memchr(p + 5, 0, size - 5)
            klen = nul - (p + 5) if nul != NULL else size - 5
            out.append(self.make(self.control_type, p + 5, klen,
                                 nul + 1 if nul != NULL else p, size - 6 - klen if nul != NULL else 0))
            self.irregular += 1
            return 0
        out.append(ProtocolError(f"malformed packet: {p[:size if size < 64 else 64]!r}"))
        self.irregular += 1
        return 0


cdef class FrameSender:
    """Sends what an Outbox owes to the link's broker in frames: up to
    FRAME_MSGS packets and ``frame_max`` bytes each (the broker's
    --max-message bounds a frame as any packet), gathered from the box's
    buffer with iovecs, FRAMES_PER_SEND frames per sendmmsg. A packet too
    large for a frame, or the last one alone, goes as itself."""

    cdef mmsghdr hdrs[FRAMES_PER_SEND]
    cdef iovec iov[FRAMES_PER_SEND * (1 + 2 * FRAME_MSGS)]
    cdef uint32_t lens[FRAMES_PER_SEND * FRAME_MSGS]
    cdef int packets[FRAMES_PER_SEND]
    cdef size_t frame_max
    cdef public Py_ssize_t frames   # frames sent, all told

    def __cinit__(self, size_t max_message):
        self.frame_max = FRAME_BYTES if max_message > FRAME_BYTES else max_message
        memset(self.hdrs, 0, sizeof(self.hdrs))

    def send(self, Outbox box, int fd):
        """As ``box.send(fd, MSG_DONTWAIT)``: returns how many packets went
        out and clears the box; an OSError (BlockingIOError when the socket
        is full) leaves the rest owed, ``box.head`` counting what went out."""
        cdef int start = box.head
        cdef int nframes, n, i
        while box.head < box.count:
            nframes = self.gather(box)
            n = sendmmsg(fd, self.hdrs, nframes, MSG_DONTWAIT | MSG_NOSIGNAL)
            if n < 0:
                if errno == EINTR:
                    PyErr_CheckSignals()
                    continue
                raise OSError(errno, os.strerror(errno))
            for i in range(n):
                box.head += self.packets[i]
                self.frames += self.hdrs[i].msg_hdr.msg_iovlen > 1
        sent = box.head - start
        box.count = box.head = 0
        box.used = 0
        return sent

    cdef int gather(self, Outbox box) noexcept:
        """hdrs[0:return]: the packets box owes from box.head on, in frames."""
        cdef int nframes = 0, j = box.head, v = 0, nlens = 0, m
        cdef size_t size, length
        while nframes < FRAMES_PER_SEND and j < box.count:
            self.hdrs[nframes].msg_hdr.msg_iov = &self.iov[v]
            length = box.iov[j].iov_len
            if j + 1 == box.count or FRAME_HEAD + FRAME_ENTRY_HEAD + length > self.frame_max:
                self.iov[v] = box.iov[j]
                v += 1
                j += 1
                self.hdrs[nframes].msg_hdr.msg_iovlen = 1
                self.packets[nframes] = 1
                nframes += 1
                continue
            self.iov[v].iov_base = FRAME_MAGIC
            self.iov[v].iov_len = FRAME_HEAD
            v += 1
            size = FRAME_HEAD
            m = 0
            while j < box.count and m < FRAME_MSGS:
                length = box.iov[j].iov_len
                if size + FRAME_ENTRY_HEAD + length > self.frame_max:
                    break
                self.lens[nlens] = <uint32_t>length
                self.iov[v].iov_base = &self.lens[nlens]
                self.iov[v].iov_len = FRAME_ENTRY_HEAD
                self.iov[v + 1] = box.iov[j]
                v += 2
                nlens += 1
                m += 1
                j += 1
                size += FRAME_ENTRY_HEAD + length
            self.hdrs[nframes].msg_hdr.msg_iovlen = 1 + 2 * m
            self.packets[nframes] = m
            nframes += 1
        return nframes


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
    cdef public FrameSender framer      # set once the broker takes frames: box goes in them
    cdef public bint keep               # a full fd leaves the box owed (blocked), not spilled
    cdef public bint blocked            # the box holds what fd did not take: flush() again

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
            if not self.blocked:
                self.flush()
                if not self.spill and self.error is None and not self.blocked and \
                        self.box.pack_message(key, klen, payload, plen):
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
        """Send what the box holds; what ``fd`` does not take now stays in
        the box with ``keep`` (``blocked`` set, until a flush sends it all),
        else goes to ``spill`` (and an error other than EAGAIN to ``error``).
        Kept, a full fd costs no Python object a message: the link waits for
        it to take the box, reading nothing meanwhile."""
        cdef int owed = len(self.box)
        if not owed:
            self.blocked = False
            return
        try:
            if self.framer is not None:
                self.sent += self.framer.send(self.box, self.fd)
            else:
                self.sent += self.box.send(self.fd, MSG_DONTWAIT)
            self.blocked = False
        except OSError as e:
            if not isinstance(e, BlockingIOError):
                self.error = e
            self.sent += owed - len(self.box)
            if self.keep and self.error is None:
                self.blocked = True
                return
            self.spill.extend(self.box.unsent())
            self.box.clear()

    def pump(self, Inbox inbox, int fd, int limit, int batches):
        """Up to ``batches`` recvmmsg batches of ``limit`` packets from ``fd``
        through this Relay (``inbox.receive``'s sink), with no Python between
        them: one turn of the link's loop moves many batches for one return
        to its Python. Stops after a batch that holds anything but plain
        messages (returned, from its first such item on, as Inbox.receive
        returns it), that spilled, failed to send or left the box blocked, or that was short or
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
            if self.box.count > self.box.head:
                # Sent before the next batch is read, so that a batch of at
                # most a box is kept whole by a full fd, not spilled.
                self.flush()
                if self.blocked or self.spill or self.error is not None:
                    break
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
            if items or self.spill or self.error is not None or self.blocked:
                break
        return items

    def take_spill(self):
        """The packets spilled since the last call, oldest first."""
        out, self.spill = self.spill, []
        return out
