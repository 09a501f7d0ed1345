"""A blocking sbus client: one connected ``SOCK_SEQPACKET`` socket, one packet per message.

A driver over the I/O-free :class:`sbus.client.core.Core`, which keeps the
queue of messages that arrived while the client waited for a control reply
(see :meth:`Client.query`) or that a batch read took ahead, the packets its
buffered mode packed, and, with a reconnect policy, its subscriptions and a
backlog (see :mod:`sbus.client.reconnect`); this module makes the blocking
syscalls, and reconnects inside the call that needs the broker. Batches go
through :mod:`sbus._core.batch` (sendmmsg/recvmmsg); the plain Python
:func:`~sbus.client.protocol.pack_publish` and :func:`~sbus.client.protocol.parse` are their
reference.
Every call takes the send(2)/recv(2) flags and passes them to the kernel, so
``MSG_DONTWAIT``, ``MSG_PEEK`` and friends behave as they do on a bare
socket; :meth:`Client.fileno` makes the client usable with select, poll,
epoll, :mod:`selectors` and asyncio.

Keys, patterns and payloads may be ``str`` (encoded as UTF-8, with lone
surrogates from ``surrogateescape`` mapped back to their bytes) or bytes-like.
"""
from __future__ import annotations

import errno
import socket
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from .._core.batch import Messages
from .._core.batch import pack_publish as _pack_publish
from .._core.batch import send_publish as _send_publish
from .._core.batch import take as _take
from ..errors import BacklogFullError, BusClosedError, MessageRefusedError, SbusError
from .core import GONE, Core
from .protocol import (
    MAX_MESSAGE,
    WHOAMI,
    ControlMessage,
    Credentials,
    Message,
    Text,
    _routing_key,
    pack_control,
    pack_subscribe,
    pack_unsubscribe,
    parse_stats,
)
from .reconnect import Reconnect
from .services import ServiceMethods

__all__ = ["Client"]


class Client(Core, ServiceMethods):
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
        super().__init__(address, max_message, buffered, reconnect)
        self._attach(self._connect())

    def _attach(self, sock: socket.socket) -> None:
        self._sock, self._fd = sock, sock.fileno()

    # -- the socket ----------------------------------------------------------

    def fileno(self) -> int:
        return self._socket().fileno()

    @property
    def socket(self) -> socket.socket:
        """The underlying socket, for setsockopt/fcntl/ioctl. Keep it blocking."""
        return self._socket()

    def close(self) -> None:
        """Send what is buffered, then close; idempotent. Later calls raise BusClosedError.

        A reconnecting client makes one attempt to deliver its backlog and
        drops what it cannot deliver at once (call :meth:`flush` first to wait).
        """
        if self._closed:
            return
        try:
            if len(self._out) or self.backlog:
                self._send_buffered(wait=False)
        finally:
            self._shut()

    def _shut(self) -> None:
        self._closed = True
        self._out.clear()
        self._requests.clear()
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

    def _socket(self) -> socket.socket:
        if self._sock is None:
            if self._closed:
                raise self._gone()
            self._reconnect(wait=True)
        return self._sock   # type: ignore[return-value]

    # -- losing and finding the broker (the state machine is the core's) -----------

    def _lost(self, exc: BaseException) -> None:
        """The connection failed: without a policy, raise BusClosedError;
        with one, keep what was not sent and fall through to reconnecting."""
        if self._policy is None:
            raise self._gone() from exc
        self._detach()
        self._lose(exc)

    def _reconnect(self, wait: bool, deadline: Optional[float] = None) -> bool:
        """Attempt to connect (when one is due, or waiting for it); True once
        connected, restored and the backlog sent. BusClosedError once the
        policy gives up; TimeoutError once ``deadline`` (monotonic) passes first."""
        if self._policy is None:
            raise self._gone()
        while True:
            while self._sock is None:
                pause = self._pause()
                if pause is None:
                    error = self._gave_up()
                    self._shut()
                    raise error
                if pause:
                    if not wait:
                        return False
                    if deadline is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError(f"{self.address}: no broker within the timeout")
                        pause = min(pause, left)
                    time.sleep(pause)
                    continue
                self._attempt()
            self._deliver_backlog()
            if self._sock is not None:
                return True

    def _attempt(self) -> None:
        try:
            self._attach(self._connect())
        except OSError as exc:
            self._attempt_failed(exc)
            return
        try:
            self._restore()
        except (OSError, SbusError, TimeoutError) as exc:
            self._out.clear()
            self._detach()
            self._attempt_failed(exc)
            refusal = self._refused_replay(exc)
            if refusal is not None:
                self._shut()
                raise refusal from exc
            return
        self._restored()

    def _restore(self) -> None:
        """Send the replay and wait for the answer to its whoami; messages
        arriving first are queued. A broker that hangs up refused the replay."""
        for packet in self._replay():
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
        while self._backlog and self._sock is not None:
            self._backlog.move_to(self._out)
            try:
                self._out.send(self._fd)
            except OSError as exc:
                if exc.errno not in GONE:
                    self._out.clear()
                    raise
                self._lost(exc)

    # -- sending ---------------------------------------------------------------

    def _failed_send(self, exc: OSError, packet: Optional[bytes]) -> None:
        """A failed send of ``packet``: raise, or with a policy keep the packet
        (a full backlog raises only if the broker is not back at once)."""
        self._send_failed(exc, packet)
        if self._sock is not None:
            self._lost(exc)
        if packet is not None:
            try:
                self._keep(packet)
            except BacklogFullError:
                if not self._reconnect(wait=False):
                    raise
                self._send_now(packet)
                return
        self._reconnect(wait=False)

    def _send_now(self, packet: bytes) -> None:
        try:
            self._socket().send(packet, socket.MSG_NOSIGNAL)
        except OSError as exc:
            self._failed_send(exc, packet)

    def send_packet(self, packet: bytes, flags: int = 0) -> None:
        """Send one raw protocol packet with send(2) ``flags`` (MSG_NOSIGNAL is always added)."""
        self._admit(packet)
        if self._buffered:
            while not self._pack(packet, flags):
                self.flush()
            return
        try:
            if self._sock is None:
                raise OSError(errno.EBADF, "disconnected")
            self._sock.send(packet, flags | socket.MSG_NOSIGNAL)
        except OSError as exc:
            self._failed_send(exc, packet)

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
            if flags == self._out_flags and self._out.add_publish(key, payload):
                return
            packet = _pack_publish(key, payload, self.max_message)
            while not self._pack(packet, flags):
                self.flush()
            return
        try:
            _send_publish(self._fd, key, payload, flags, self.max_message)
        except OSError as exc:
            self._failed_send(exc, _pack_publish(key, payload, self.max_message))

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
                raise self._gone() from None
            if exc.errno not in GONE:
                exc.sent = sent     # BlockingIOError: the rest stays packed
                raise
            if self._policy is None:
                total = done + len(out) + out.head - before
                out.clear()
                raise self._interrupted(sent, total) from exc
            if self._sock is not None:
                self._lost(exc)
            else:
                self._keep_outbox(out, sent)
            self._reconnect(wait=False)

    def flush(self) -> None:
        """Send what the buffered mode packed. A reconnecting client without
        a broker waits for one (as its policy allows) and sends the backlog."""
        self._send_buffered(wait=True)

    _unbuffer = flush

    def _send_buffered(self, wait: bool) -> None:
        if self._closed:
            raise self._gone()
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
                raise self._gone()
            item = self._inbox[0] if flags & socket.MSG_PEEK else self._inbox.popleft()
            if isinstance(item, BaseException):
                raise item
            return item
        if len(self._out):
            self.flush()
        while True:
            packet = self._read_one(flags, timeout)
            if not (type(packet) is ControlMessage and self._requests and self._late(packet)):
                return packet
            if flags & socket.MSG_PEEK:
                # Consume the late reply, so that peeking can see past it.
                self._read_one(flags & ~socket.MSG_PEEK, None)

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
            self._queue(self._read(self._in.slots, 0, None))
        except BusClosedError:
            return False
        return True

    def _queue(self, batch: List[Any]) -> None:
        """Queue a batch, late replies to abandoned queries left out."""
        if self._in.irregular and self._requests:
            batch = [m for m in batch if not (type(m) is ControlMessage and self._late(m))]
        if self._inbox:
            # After a reconnect, _read returns the first of the messages that
            # arrived while the replay was confirmed; the rest are queued.
            self._inbox.extendleft(reversed(batch))
        else:
            self._inbox.extend(batch)

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
                    raise self._gone()
                self._reconnect(wait=True, deadline=deadline)
                if self._inbox:     # queued while the replay was confirmed
                    return [self._inbox.popleft()]
            try:
                batch = self._in.receive(self._fd, limit, flags, -1.0 if deadline is None
                                         else max(0.0, deadline - time.monotonic()))
            except OSError as exc:
                if exc.errno not in GONE or self._closed:
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
        self._too_large(packet)
        if len(self._out):
            self.flush()
        request = self._asked(raw_key, packet, True)
        try:
            self._ask(packet, flags)
        except BaseException:
            self._unask(request)
            raise
        flags &= ~socket.MSG_PEEK
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                reply = self._read_one(flags, left)
                if type(reply) is ControlMessage and self._requests:
                    owner = self._answer(reply)
                    if owner is request:
                        return reply.payload
                    if owner is not None:
                        continue    # the late reply to an abandoned request
                self._inbox.append(reply)
        finally:
            self._abandon(request)

    def _ask(self, packet: bytes, flags: int) -> None:
        """Send a request now, never buffered; one the broker did not take is
        asked again of the next broker (see Core._restored)."""
        sock = self._socket()
        try:
            sock.send(packet, flags | socket.MSG_NOSIGNAL)
        except OSError as exc:
            self._send_failed(exc, None)
            self._lost(exc)

    def whoami(self, flags: int = 0, *, timeout: Optional[float] = None) -> Credentials:
        """Ask the broker for this client's credentials (``!/cred/GID/UID/PID...``)."""
        reply = self.query(WHOAMI, None, flags, timeout=timeout)
        return Credentials.parse(reply.decode("ascii", "replace"))

    def stats(self, flags: int = 0, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """The broker's counters: the JSON reply to ``CMSG stats``."""
        return parse_stats(self.query(b"stats", None, flags, timeout=timeout))
