"""A blocking sbus client: one connected ``SOCK_SEQPACKET`` socket, one packet per message.

A driver over :class:`sbus.client.connection.Connection`, which holds the
protocol state and plans what to send, keep, wait for or raise; this module
makes the blocking syscalls and runs the plans, reconnecting inside the call
that needs the broker. Batches go through :mod:`sbus._core.batch`
(sendmmsg/recvmmsg). Every call takes the send(2)/recv(2) flags and passes
them to the kernel, so ``MSG_DONTWAIT``, ``MSG_PEEK`` and friends behave as
they do on a bare socket; :meth:`Client.fileno` makes the client usable with
select, poll, epoll, :mod:`selectors` and asyncio.

Keys, patterns and payloads may be ``str`` (encoded as UTF-8, with lone
surrogates from ``surrogateescape`` mapped back to their bytes) or bytes-like.
"""
from __future__ import annotations

import errno
import socket
import time
from typing import Any, Iterator, List, Optional, Union

from .._core.batch import Messages
from .._core.batch import pack_publish as _pack_publish
from .._core.batch import send_publish as _send_publish
from .._core.batch import take as _take
from ..errors import BusClosedError
from . import connection as c
from .connection import GONE, Connection
from .driver import Driver
from .protocol import MAX_MESSAGE, ControlMessage, Message, Text
from .reconnect import Reconnect
from .services import ServiceMethods

__all__ = ["Client"]

Received = Union[Message, ControlMessage]


class Client(Driver, ServiceMethods):
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
        self._start(Connection(address, max_message, buffered, reconnect))

    def _attach(self, sock: socket.socket) -> None:
        self._sock, self._fd = sock, sock.fileno()

    def fileno(self) -> int:
        return self._socket().fileno()

    @property
    def socket(self) -> socket.socket:
        """The underlying socket, for setsockopt/fcntl/ioctl. Keep it blocking."""
        return self._socket()

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._conn.check_open()
            self._run(self._conn.reconnecting(True))
        return self._sock   # type: ignore[return-value]

    def close(self) -> None:
        """Send what is buffered, then close; idempotent. Later calls raise BusClosedError.

        A reconnecting client makes one attempt to deliver its backlog and
        drops what it cannot deliver at once (call :meth:`flush` first to wait).
        """
        if self._conn.closed:
            return
        try:
            if len(self._out) or self.backlog:
                self._run(self._conn.flush(reconnect=False))
        finally:
            self._conn.shut()
            self._detach()

    def _detach(self) -> None:
        sock, self._sock, self._fd = self._sock, None, -1
        self._conn.up = self._conn.live = False
        if sock is not None:
            sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- running the connection's plans: the syscalls, blocking ----------------------

    def _run(self, plan: Any) -> Any:
        value = error = None
        while True:
            try:
                action = plan.send(value) if error is None else plan.throw(error)
            except StopIteration as stop:
                return stop.value
            value = error = None
            try:
                value = self._act(action)
            except BaseException as exc:    # the plan decides what it means
                error = exc

    def _act(self, action: tuple) -> Any:
        op = action[0]
        if op == c.SEND:
            return action[1].send(self._fd, action[2])
        if op == c.SEND_ONE:
            if self._sock is None:
                raise OSError(errno.EBADF, "disconnected")
            return self._sock.send(action[1], action[2] | socket.MSG_NOSIGNAL)
        if op == c.WAIT:
            waiter, deadline = action[1], action[2]
            while not waiter.done():
                batch = self._read(self._in.slots, action[3], deadline)
                self._inbox.extend(batch)
        elif op == c.SLEEP:
            time.sleep(action[1])
        elif op == c.CONNECT:
            self._connect()
        elif op == c.DETACH:
            self._detach()
        elif op == c.LOST:
            self._lost(action[1])
        elif op == c.RECONNECT:
            return self._run(self._conn.reconnecting(action[1], action[2]))
        elif op == c.DELIVER:
            self._run(self._conn.deliver())
        elif op == c.SHUT:
            self._conn.shut()
            self._detach()
        return None

    def _lost(self, exc: BaseException) -> None:
        if self._conn.lost(exc):
            self._detach()
            self._conn.lose(exc)

    # -- sending -------------------------------------------------------------------

    def publish(self, key: Text, payload: Text = b"", flags: int = 0) -> None:
        """Publish one message. KeyRefusedError or MessageTooLargeError, before
        anything is sent, for a message the broker would refuse."""
        conn = self._conn
        if conn.buffered:
            if flags == conn.out_flags and self._out.add_publish(key, payload):
                return
            return self._run(conn.publish_buffered(
                _pack_publish(key, payload, self.max_message), flags))
        try:
            _send_publish(self._fd, key, payload, flags, self.max_message)
        except OSError as exc:
            self._run(conn.failed_send(exc, _pack_publish(key, payload, self.max_message)))

    def flush(self) -> None:
        """Send what the buffered mode packed. A reconnecting client without
        a broker waits for one (as its policy allows) and sends the backlog."""
        self._run(self._conn.flush(reconnect=True))

    _unbuffer = flush

    # -- receiving -----------------------------------------------------------------

    def receive(self, flags: int = 0, *, timeout: Optional[float] = None) -> Received:
        """The next message, from the client's queue or else recv(2) with ``flags``.

        ``MSG_PEEK`` leaves the message to be received again; ``MSG_DONTWAIT``
        raises BlockingIOError if none is ready. ``timeout`` (seconds) raises
        TimeoutError. BusClosedError means the broker closed the connection;
        MessageTooLargeError means an oversized packet was received and dropped.
        """
        inbox = self._inbox
        if not inbox:
            if len(self._out):
                self.flush()
            deadline = None if timeout is None else time.monotonic() + timeout
            while not inbox:
                if flags & socket.MSG_PEEK:
                    return self._peek(flags, deadline)
                batch = self._read(1, flags, deadline)
                if batch:
                    return batch[0]
        elif self._conn.closed:
            raise self._conn.gone()
        item = inbox[0] if flags & socket.MSG_PEEK else inbox.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def _peek(self, flags: int, deadline: Optional[float]) -> Received:
        while True:
            item = self._read(1, flags, deadline, raw=True)[0]
            if isinstance(item, BaseException):
                raise item
            if not (type(item) is ControlMessage and self._conn.requests
                    and self._conn.late(item)):
                return item
            # Consume the late reply, so that peeking can see past it.
            self._read(1, flags & ~socket.MSG_PEEK, None, raw=True)

    def receive_many(self, max: int = 64, *, timeout: Optional[float] = None,
                     flags: int = 0) -> List[Received]:
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
            deadline = None if timeout is None else time.monotonic() + timeout
            while not inbox:
                batch = self._read(max, flags, deadline)
                if batch:
                    return batch    # only messages, in order: no need to queue them
        if isinstance(inbox[0], BaseException):
            raise inbox.popleft()
        return _take(inbox, max)

    def batches(self, max: int = 64) -> Iterator[List[Received]]:
        """:meth:`receive_many` until the broker closes the connection: lists
        of up to ``max`` messages, as they arrive."""
        while True:
            try:
                yield self.receive_many(max)
            except BusClosedError:
                return

    def __iter__(self) -> Iterator[Received]:
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
            self._inbox.extend(self._read(self._in.slots, 0, None))
        except BusClosedError:
            return False
        return True

    def _read(self, limit: int, flags: int, deadline: Optional[float],
              raw: bool = False) -> List[Any]:
        """What one recvmmsg returns when it is plain messages; else (and
        after a reconnect) it is triaged into the queue and the list is empty.
        A lost connection raises BusClosedError, or with a reconnect policy is
        restored first; the deadline (monotonic) covers the reconnecting too."""
        conn = self._conn
        if self._sock is None:
            conn.check_open()
            self._run(conn.reconnecting(True, deadline))
            if self._inbox:     # queued while the replay was confirmed
                return []
        try:
            batch = self._in.receive(self._fd, limit, flags, -1.0 if deadline is None
                                     else max(0.0, deadline - time.monotonic()))
        except OSError as exc:
            if exc.errno not in GONE or conn.closed:
                raise
            self._lost(exc)
            return []
        if raw or (not self._in.irregular and conn.replies is None):
            return batch
        end = conn.triage(batch)
        if end is not None:
            self._lost(end)
        return []
