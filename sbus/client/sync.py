"""A blocking sbus client: one connected ``SOCK_SEQPACKET`` socket, one packet per message.

The client keeps the socket, a queue of messages that arrived while it
waited for a control reply (see :meth:`Client.query`) or that a batch read
took ahead, the packets its buffered mode packed, and, with a reconnect
policy, its subscriptions and a backlog (see :mod:`sbus.client.reconnect`).
Batches go through :mod:`sbus._core.batch` (sendmmsg/recvmmsg); the plain
Python :func:`~sbus.client.protocol.pack_publish` and :func:`~sbus.client.protocol.parse`
are their reference.
Every call takes the send(2)/recv(2) flags and passes them to the kernel, so
``MSG_DONTWAIT``, ``MSG_PEEK`` and friends behave as they do on a bare
socket; :meth:`Client.fileno` makes the client usable with select, poll,
epoll, :mod:`selectors` and asyncio.

Keys, patterns and payloads may be ``str`` (encoded as UTF-8, with lone
surrogates from ``surrogateescape`` mapped back to their bytes) or bytes-like.
"""
from __future__ import annotations

import collections
import errno
import socket
import time
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from .. import address as _address
from .._core.batch import Inbox, Messages, Outbox, check_pattern
from .._core.batch import take as _take
from .._core.batch import pack_publish as _pack_publish
from .._core.batch import send_publish as _send_publish
from ..errors import (
    AddressError,
    BacklogFullError,
    BatchInterruptedError,
    BusClosedError,
    MessageRefusedError,
    MessageTooLargeError,
    ProtocolError,
    SbusError,
)
from . import reconnect as _reconnect
from .protocol import (MAX_MESSAGE, WHOAMI, ControlMessage, Credentials, Message, Text,
                       _routing_key, encode, pack_control, pack_publish, pack_subscribe,
                       pack_unsubscribe, parse, parse_stats)
from .reconnect import Reconnect

__all__ = ["Client"]

# Linux socket options that Python's socket module does not name (asm-generic/socket.h).
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
# unix_dgram_sendmsg() refuses a packet longer than sk_sndbuf - 32 with EMSGSIZE.
_KERNEL_PACKET_OVERHEAD = 32


def _open_socket(addr: _address.Address) -> socket.socket:
    if addr.fd is not None:
        try:
            sock = socket.socket(fileno=addr.fd)
        except OSError as exc:
            raise AddressError(f"{addr.text}: {exc.strerror or exc}") from exc
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
            sock.detach()  # not ours to close: the caller still owns a wrong fd
            raise AddressError(f"{addr.text} is not a unix-domain SOCK_SEQPACKET socket")
        return sock
    if addr.random:
        raise AddressError(f"{addr.text} is for sbusd only; connect to /dev/unix/abstract/HEX")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(addr.sun_path)
    except BaseException:
        sock.close()
        raise
    return sock


def _grow_buffer(sock: socket.socket, force: int, option: int, size: int) -> None:
    """Make the socket buffer hold a ``size``-byte packet; never shrink it.

    The kernel doubles the value it is given; SO_*BUFFORCE (root or
    CAP_NET_ADMIN) ignores net.core.[wr]mem_max, the plain option is capped by it.
    """
    if sock.getsockopt(socket.SOL_SOCKET, option) >= size + _KERNEL_PACKET_OVERHEAD:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, force, size)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, option, size)


class Client:
    """A connection to an sbus broker.

    ``address`` uses the sbusd syntax (a path, ``/dev/unix/abstract/HEX`` or
    ``/dev/fd/N``, which adopts descriptor N); None means ``$SBUS_ADDRESS``,
    else ``/run/sbus.socket``. ``max_message`` must match the broker's limit.

    ``buffered=True`` packs published messages (and the SUB/UNSUB/CMSG
    packets sent between them, to keep their order) into a C buffer sent
    with one sendmmsg(2) when it is full, on :meth:`flush`, before
    :meth:`query`, :meth:`receive` or iteration, and on :meth:`close`.
    ``reconnect=True`` (or an :class:`~sbus.client.reconnect.Reconnect` policy)
    rides out a broker restart; see :mod:`sbus.client.reconnect`.

    Messages received while :meth:`query` or :meth:`whoami` wait for their
    reply, and the rest of a batch iteration read, are queued for
    :meth:`receive`; ``pending`` counts them. A poller watching
    :meth:`fileno` does not see that queue, so drain it first.
    """

    def __init__(self, address: Optional[str] = None, *, max_message: int = MAX_MESSAGE,
                 buffered: bool = False, reconnect: Union[None, bool, Reconnect] = None) -> None:
        self.address = _address.from_environment(address)
        self.max_message = max_message
        self._buffered = buffered
        self._policy = _reconnect.policy(reconnect)
        self._sock: Optional[socket.socket] = None
        self._fd = -1           # -1 while closed or disconnected: a syscall on it fails EBADF
        self._closed = False
        self._out = Outbox(max_message)
        self._out_flags = 0
        self._in = Inbox(max_message, Message, ControlMessage)
        self._inbox: Deque[Any] = collections.deque()
        # Replies still owed to query() calls that gave up (timeout, EAGAIN,
        # signal): the broker answers each request once, and such a reply
        # must not be mistaken for the answer to a later request.
        self._abandoned: Dict[bytes, int] = {}
        self._session = _reconnect.Session() if self._policy else None
        self._backlog = _reconnect.Backlog(self._policy.max_backlog) if self._policy else None
        self._failures = 0
        self._down_since: Optional[float] = None
        self._next_attempt = 0.0
        self._generation = 0    # connections made so far, for query() to notice a new one
        self._attach(_open_socket(_address.parse(self.address)))

    def _attach(self, sock: socket.socket) -> None:
        try:
            _grow_buffer(sock, _SO_SNDBUFFORCE, socket.SO_SNDBUF, self.max_message)
            _grow_buffer(sock, _SO_RCVBUFFORCE, socket.SO_RCVBUF, self.max_message)
        except BaseException:
            sock.close()
            raise
        self._sock, self._fd = sock, sock.fileno()
        self._generation += 1

    # -- the socket ----------------------------------------------------------

    def fileno(self) -> int:
        return self._socket().fileno()

    @property
    def socket(self) -> socket.socket:
        """The underlying socket, for setsockopt/fcntl/ioctl. Keep it blocking."""
        return self._socket()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        """False while a reconnecting client waits for the broker."""
        return self._sock is not None

    @property
    def buffered(self) -> bool:
        """Whether publish() packs instead of sending; turning it off sends what is packed."""
        return self._buffered

    @buffered.setter
    def buffered(self, on: bool) -> None:
        if not on and len(self._out):
            self.flush()
        self._buffered = on

    @property
    def pending(self) -> int:
        """How many received messages wait in the client (not in the socket)."""
        return len(self._inbox)

    @property
    def backlog(self) -> int:
        """Bytes published while the broker was away and not yet sent."""
        return self._backlog.nbytes if self._backlog is not None else 0

    def close(self) -> None:
        """Send what is buffered, then close; idempotent. Later calls raise BusClosedError.

        A reconnecting client makes one attempt to deliver its backlog and
        drops what it cannot deliver at once (call :meth:`flush` first to wait).
        """
        if self._closed:
            return
        try:
            if len(self._out) or (self._backlog is not None and self._backlog.packets):
                self._send_buffered(wait=False)
        finally:
            self._shut()

    def _shut(self) -> None:
        self._closed = True
        self._out.clear()
        if self._backlog is not None:
            self._backlog.clear()
        self._detach()

    def _detach(self) -> None:
        sock, self._sock, self._fd = self._sock, None, -1
        if sock is not None:
            sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ("closed" if self._closed else "disconnected" if self._sock is None
                 else f"fd={self._fd}")
        return f"<sbus.Client {self.address!r} {state}>"

    def _socket(self) -> socket.socket:
        if self._sock is None:
            if self._closed:
                raise BusClosedError("the client is closed")
            self._reconnect(wait=True)
        return self._sock   # type: ignore[return-value]

    # -- losing and finding the broker -------------------------------------------

    def _lost(self, exc: BaseException) -> None:
        """The connection failed: without a policy, close and raise; with
        one, keep what was not sent and fall through to reconnecting."""
        if self._policy is None:
            raise BusClosedError("the broker closed the connection") from exc
        unsent = self._out.unsent()
        self._out.clear()
        self._detach()
        self._abandoned.clear()     # the new broker owes no old replies
        self._down_since = time.monotonic()
        self._failures = 0
        self._next_attempt = 0.0
        if self._policy.on_disconnect is not None:
            self._policy.on_disconnect(exc)
        self._keep([p for p in reversed(unsent) if not self._session.covers(p)], front=True)

    def _keep(self, packets: List[bytes], front: bool = False) -> None:
        if front:   # packets already packed were published before the backlog
            for packet in packets:
                self._backlog.packets.appendleft(packet)
                self._backlog.nbytes += len(packet)
        else:
            self._backlog.add_all(packets)

    def _reconnect(self, wait: bool, deadline: Optional[float] = None) -> bool:
        """Attempt to connect (when one is due, or waiting for it); True once
        connected and restored. BusClosedError once the policy gives up;
        TimeoutError once ``deadline`` (a monotonic time) passes first."""
        policy = self._policy
        if policy is None:
            raise BusClosedError("the broker closed the connection")
        while True:
            while self._sock is None:
                now = time.monotonic()
                if now >= self._next_attempt and self._attempt():
                    break
                if policy.exhausted(self._failures, now - (self._down_since or now)):
                    attempts = self._failures
                    self._shut()
                    raise BusClosedError(f"{self.address}: no broker after {attempts} attempts "
                                         f"to reconnect")
                if not wait:
                    return False
                pause = max(0.0, self._next_attempt - time.monotonic())
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"{self.address}: no broker within the timeout")
                    pause = min(pause, left)
                time.sleep(pause)
            self._deliver_backlog()
            if self._sock is not None:
                return True

    def _attempt(self) -> bool:
        try:
            sock = _open_socket(_address.parse(self.address))
        except OSError:
            return self._failed()
        self._attach(sock)
        try:
            self._restore()
        except (OSError, SbusError, TimeoutError):
            self._detach()
            return self._failed()
        self._failures = 0
        self._down_since = None
        if self._policy.on_reconnect is not None:
            self._policy.on_reconnect()
        return True

    def _failed(self) -> bool:
        self._failures += 1
        self._next_attempt = time.monotonic() + self._policy.delay(self._failures)
        return False

    def _restore(self) -> None:
        """Replay the session and wait for the broker to answer a whoami sent
        after it, so the subscriptions are in place; messages arriving first
        are queued. A broker that hangs up instead refused the replay."""
        for packet in self._session.replay() + [pack_control(WHOAMI)]:
            while not self._out.add_packet(packet):
                self._out.send(self._fd)
        self._out.send(self._fd)
        deadline = time.monotonic() + self._policy.confirm_timeout
        while True:
            batch = self._in.receive(self._fd, 64, 0, max(0.0, deadline - time.monotonic()))
            for i, item in enumerate(batch):
                if isinstance(item, BaseException):
                    raise item
                if type(item) is ControlMessage and item.key == WHOAMI:
                    # What came after the reply is queued too; an end of the
                    # connection is left for the next read to find again.
                    self._inbox.extend(m for m in batch[i + 1:] if type(m) is not BusClosedError)
                    return
                self._inbox.append(item)

    def _deliver_backlog(self) -> None:
        backlog, out = self._backlog, self._out
        while backlog.packets:
            for packet in backlog.packets:
                if not out.add_packet(packet):
                    break
            try:
                sent = out.send(self._fd)
            except OSError as exc:
                backlog.taken(out.head)
                out.clear()
                if exc.errno not in _GONE:
                    raise
                self._lost(exc)
                return
            backlog.taken(sent)

    # -- sending ---------------------------------------------------------------

    def _send_failed(self, exc: OSError, packet: Optional[bytes]) -> None:
        """Turn a failed send of ``packet`` into the error to raise, or, with
        a reconnect policy, into a kept packet."""
        if self._closed:
            raise BusClosedError("the client is closed") from None
        if exc.errno == errno.EMSGSIZE:
            raise MessageTooLargeError(
                f"the kernel refused a {len(packet or b'')}-byte packet (socket send buffer "
                f"too small; see net.core.wmem_max)") from exc
        if exc.errno not in _GONE:
            raise exc
        if self._policy is None:
            raise BusClosedError("the broker closed the connection") from exc
        if self._sock is not None:
            self._lost(exc)
        if packet is not None and not self._session.covers(packet):
            try:
                self._backlog.add(packet)
            except BacklogFullError:
                # A full backlog is no reason to stop trying: the broker may be back.
                if not self._reconnect(wait=False):
                    raise
                self._send_now(packet)
                return
        self._reconnect(wait=False)

    def _send_now(self, packet: bytes) -> None:
        try:
            self._socket().send(packet, socket.MSG_NOSIGNAL)
        except OSError as exc:
            self._send_failed(exc, packet)

    def send_packet(self, packet: bytes, flags: int = 0) -> None:
        """Send one raw protocol packet with send(2) ``flags`` (MSG_NOSIGNAL is always added)."""
        if len(packet) > self.max_message:
            raise MessageTooLargeError(
                f"packet of {len(packet)} bytes exceeds the bus limit of {self.max_message}")
        if self._session is not None:
            if packet.startswith(b"SUB "):
                check_pattern(packet[4:])   # replayed on every reconnect: never a refused one
            self._session.note(packet)
        if self._buffered:
            self._buffer(packet, flags)
            return
        try:
            if self._sock is None:
                raise OSError(errno.EBADF, "disconnected")
            self._sock.send(packet, flags | socket.MSG_NOSIGNAL)
        except OSError as exc:
            self._send_failed(exc, packet)

    def _buffer(self, packet: bytes, flags: int) -> None:
        if flags != self._out_flags and len(self._out):
            self.flush()
        self._out_flags = flags
        if not self._out.add_packet(packet):
            self.flush()
            self._out.add_packet(packet)

    def subscribe(self, pattern: Text, flags: int = 0) -> None:
        """Receive messages whose key matches ``pattern`` ('' matches everything)."""
        self.send_packet(pack_subscribe(pattern), flags)

    def unsubscribe(self, pattern: Text, flags: int = 0) -> None:
        """Drop one earlier subscription to exactly ``pattern``."""
        self.send_packet(pack_unsubscribe(pattern), flags)

    def publish(self, key: Text, payload: Text = b"", flags: int = 0) -> None:
        """Publish one message. KeyRefusedError or MessageTooLargeError, before
        anything is sent, for a message the broker would refuse."""
        if self._buffered:
            if flags != self._out_flags and len(self._out):
                self.flush()
            self._out_flags = flags
            if not self._out.add_publish(key, payload):
                self.flush()
                self._out.add_publish(key, payload)
            return
        try:
            _send_publish(self._fd, key, payload, flags, self.max_message)
        except OSError as exc:
            self._send_failed(exc, _pack_publish(key, payload, self.max_message))

    def publish_many(self, messages: Iterable[Tuple[Text, Text]], flags: int = 0) -> int:
        """Publish (key, payload) pairs in order, packed into batches sent with
        sendmmsg(2); returns how many were published.

        A pair the broker would refuse raises KeyRefusedError or
        MessageTooLargeError with ``index`` (its position) and ``sent`` (how
        many before it went out); nothing after it is sent. A connection
        failing mid-batch raises BatchInterruptedError with ``sent``; so does
        BlockingIOError (a full socket and MSG_DONTWAIT), and the rest is dropped.
        Buffered packets go out first; all of the batch is sent on return.
        """
        if len(self._out):
            self.flush()
        items = iter(messages)
        out = self._out
        packed = 0
        try:
            while True:
                try:
                    packed += out.pack_many(items, packed)
                except MessageRefusedError as exc:
                    self._send_batch(flags, exc.index - len(out))
                    exc.sent = exc.index
                    raise
                self._send_batch(flags, packed - len(out))
                if out.exhausted:
                    return packed
        except BlockingIOError:
            out.clear()     # a full socket under MSG_DONTWAIT: ``sent`` says how far it got
            raise

    def _send_batch(self, flags: int, done: int) -> None:
        """Send the outbox; ``done`` messages of this batch went out before it."""
        out = self._out
        before = out.head
        try:
            out.send(self._fd, flags)
        except OSError as exc:
            sent = done + out.head - before
            if self._closed:
                out.clear()
                raise BusClosedError("the client is closed") from None
            if exc.errno not in _GONE:
                exc.sent = sent     # BlockingIOError: the rest stays packed
                raise
            if self._policy is None:
                total = done + len(out) + out.head - before
                out.clear()
                raise BatchInterruptedError(
                    f"the broker closed the connection after {sent} of {total} messages "
                    f"of the batch were sent", sent) from exc
            if self._sock is not None:
                self._lost(exc)
            else:
                unsent = [p for p in out.unsent() if not self._session.covers(p)]
                out.clear()
                try:
                    self._keep(unsent)
                except BacklogFullError as full:
                    full.index = sent + full.index
                    raise
            self._reconnect(wait=False)

    def flush(self) -> None:
        """Send what the buffered mode packed. A reconnecting client without
        a broker waits for one (as its policy allows) and sends the backlog."""
        self._send_buffered(wait=True)

    def _send_buffered(self, wait: bool) -> None:
        if self._closed:
            raise BusClosedError("the client is closed")
        if len(self._out):
            self._send_batch(self._out_flags, 0)
        if self._sock is None and self._policy is not None:
            self._reconnect(wait)

    def send_cmsg(self, key: Text, payload: Optional[Text] = None, flags: int = 0) -> None:
        """Send a control message to the broker (``CMSG key`` or ``CMSG key\\0payload``)."""
        self.send_packet(pack_control(key, payload), flags)

    # -- receiving -------------------------------------------------------------

    def receive(self, flags: int = 0, *, timeout: Optional[float] = None
                ) -> Union[Message, ControlMessage]:
        """The next message, from the client's queue or else recv(2) with ``flags``.

        ``MSG_PEEK`` leaves the message to be received again; ``MSG_DONTWAIT``
        raises BlockingIOError if none is ready. ``timeout`` (seconds) raises
        TimeoutError. BusClosedError means the broker closed the connection;
        MessageTooLargeError means an oversized packet was received and dropped.
        """
        if self._inbox:
            if self._closed:
                raise BusClosedError("the client is closed")
            item = self._inbox[0] if flags & socket.MSG_PEEK else self._inbox.popleft()
            if isinstance(item, BaseException):
                raise item
            return item
        if len(self._out):
            self.flush()
        while True:
            packet = self._read_one(flags, timeout)
            if not (type(packet) is ControlMessage and self._abandoned.get(packet.key)):
                return packet
            if flags & socket.MSG_PEEK:
                # Consume the late reply, so that peeking can see past it.
                self._read_one(flags & ~socket.MSG_PEEK, None)
            self._forget(packet.key)

    def receive_many(self, max: int = 64, *, timeout: Optional[float] = None,
                     flags: int = 0) -> List[Union[Message, ControlMessage]]:
        """Up to ``max`` messages: the queued ones, else what one recvmmsg(2)
        takes (waiting for the first, as :meth:`receive` does).

        An oversized or malformed packet in the batch ends the list; its
        error is raised by the next call. ``flags`` as for recv(2), except
        that MSG_PEEK is not supported here.
        """
        if flags & socket.MSG_PEEK:
            raise ValueError("receive_many does not peek; use receive(MSG_PEEK)")
        inbox = self._inbox
        if not inbox:
            if len(self._out):
                self.flush()
            batch = self._read(max, flags, timeout)
            if not self._in.irregular and not inbox:
                return batch    # only messages, in order: no need to queue them
            self._queue(batch)
        if inbox and isinstance(inbox[0], BaseException):
            raise inbox.popleft()
        return _take(inbox, max)

    def batches(self, max: int = 64) -> Iterator[List[Union[Message, ControlMessage]]]:
        """:meth:`receive_many` until the broker closes the connection: lists
        of up to ``max`` messages, as they arrive."""
        while True:
            try:
                yield self.receive_many(max)
            except BusClosedError:
                return

    def __iter__(self) -> Iterator[Union[Message, ControlMessage]]:
        """Receive messages until the broker closes the connection, reading
        them in batches (a message read and not yet yielded stays queued).
        The iterator (:class:`sbus._core.batch.Messages`) takes them from the
        queue in C; a queued error is raised in its turn."""
        return Messages(self._inbox, self._refill)

    def _refill(self) -> bool:
        """One batch into the queue for iteration; False once the broker closed."""
        if len(self._out):
            self.flush()
        try:
            self._fill(self._in.slots, 0, None)
        except BusClosedError:
            return False
        return True

    def _fill(self, limit: int, flags: int, timeout: Optional[float]) -> None:
        """One recvmmsg into the queue."""
        self._queue(self._read(limit, flags, timeout))

    def _queue(self, batch: List[Any]) -> None:
        """Queue a batch, late replies to abandoned queries left out."""
        if self._in.irregular and self._abandoned:
            batch = [m for m in batch if not (type(m) is ControlMessage and self._late(m.key))]
        if self._inbox:
            # After a reconnect, _read returns the first of the messages that
            # arrived while the replay was confirmed; the rest are queued.
            self._inbox.extendleft(reversed(batch))
        else:
            self._inbox.extend(batch)

    def _late(self, key: bytes) -> bool:
        if self._abandoned.get(key):
            self._forget(key)
            return True
        return False

    def _read_one(self, flags: int, timeout: Optional[float]) -> Union[Message, ControlMessage]:
        item = self._read(1, flags, timeout)[0]
        if isinstance(item, BaseException):
            raise item
        return item

    def _read(self, limit: int, flags: int, timeout: Optional[float]) -> List[Any]:
        """What one recvmmsg returns (never empty). A lost connection raises
        BusClosedError, or with a reconnect policy is restored first; the
        timeout covers the reconnecting too."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._sock is None:
                if self._closed:
                    raise BusClosedError("the client is closed")
                self._reconnect(wait=True, deadline=deadline)
                if self._inbox:     # queued while the replay was confirmed
                    return [self._inbox.popleft()]
            try:
                batch = self._in.receive(self._fd, limit, flags, -1.0 if deadline is None
                                         else max(0.0, deadline - time.monotonic()))
            except OSError as exc:
                if exc.errno not in _GONE or self._closed:
                    raise
                self._lost(exc)
                continue
            if self._in.irregular and type(batch[-1]) is BusClosedError:
                if self._policy is None:
                    return batch
                self._lost(batch.pop())
                if not batch:
                    continue
            return batch

    def _forget(self, key: bytes) -> None:
        left = self._abandoned[key] - 1
        if left:
            self._abandoned[key] = left
        else:
            del self._abandoned[key]

    # -- requests to the broker --------------------------------------------------

    def query(self, key: Text, payload: Optional[Text] = None, flags: int = 0, *,
              timeout: Optional[float] = None) -> bytes:
        """Send a control message and return the payload of the broker's reply.

        The reply is the next control message with the same key; other
        messages that arrive meanwhile are queued for :meth:`receive`.
        ``flags`` go to the send(2) and every recv(2) (MSG_PEEK excepted).
        If the wait ends in an exception, the late reply is discarded when it
        arrives. Buffered packets are sent first; a reconnecting client asks
        the new broker again if the connection is lost meanwhile.
        """
        raw_key = _routing_key(key, "key")
        packet = pack_control(raw_key, payload)
        if len(packet) > self.max_message:
            raise MessageTooLargeError(
                f"packet of {len(packet)} bytes exceeds the bus limit of {self.max_message}")
        if len(self._out):
            self.flush()
        generation = self._ask(packet, flags)
        flags &= ~socket.MSG_PEEK
        # The broker answers requests in order, so the first replies
        # belong to requests that were abandoned earlier.
        stale = self._abandoned.pop(raw_key, 0)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                packet_in = self._read_one(flags, left)
                if generation != self._generation:  # asked a broker that went away
                    generation, stale = self._ask(packet, flags), 0
                if type(packet_in) is ControlMessage and packet_in.key == raw_key:
                    if stale:
                        stale -= 1
                        continue
                    return packet_in.payload
                self._inbox.append(packet_in)
        except BaseException:
            if generation == self._generation and not self._closed:
                self._abandoned[raw_key] = stale + 1
            raise

    def _ask(self, packet: bytes, flags: int) -> int:
        """Send a request now (never buffered or kept: a lost one is asked
        again); returns the connection it went to."""
        while True:
            sock = self._socket()
            try:
                sock.send(packet, flags | socket.MSG_NOSIGNAL)
                return self._generation
            except OSError as exc:
                if exc.errno in _GONE and self._policy is not None and not self._closed:
                    self._lost(exc)
                    continue
                self._send_failed(exc, None)
                raise

    def whoami(self, flags: int = 0, *, timeout: Optional[float] = None) -> Credentials:
        """Ask the broker for this client's credentials (``!/cred/GID/UID/PID...``)."""
        reply = self.query(WHOAMI, None, flags, timeout=timeout)
        return Credentials.parse(reply.decode("ascii", "replace"))

    def stats(self, flags: int = 0, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """The broker's counters: the JSON reply to ``CMSG stats``."""
        return parse_stats(self.query(b"stats", None, flags, timeout=timeout))


# send(2)/recv(2) errors that mean the broker is gone (EBADF: the client
# already knows, and keeps fd -1 until it reconnects).
_GONE = frozenset((errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF))
