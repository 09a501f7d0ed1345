"""A blocking sbus client: one connected ``SOCK_SEQPACKET`` socket, one packet per message.

A driver over :class:`sbus.client.connection.Connection` (the protocol
state and its plans): it makes the blocking syscalls, reconnecting inside the
call that needs the broker. Calls pass their send(2)/recv(2) flags to the
kernel (``MSG_DONTWAIT``, ``MSG_PEEK``...); :meth:`Client.fileno` serves
select, poll and epoll. Keys, patterns and payloads may be ``str`` (UTF-8,
surrogateescape) or bytes-like. See docs/clients.md.
"""
from __future__ import annotations

import select
import socket
import time
from typing import Any, Iterator, List, Optional, Union

from .._core import syncrecv as _syncrecv
from .._core.batch import Messages
from .._core.batch import pack_publish as _pack_publish
from .._core.batch import send_publish as _send_publish
from .._core.batch import take as _take
from ..errors import BusClosedError, MessageTooLargeError
from . import chunks as _chunks
from . import connection as c
from .connection import GONE, Connection
from .driver import Driver
from .protocol import MAX_MESSAGE, ControlMessage, Message, Text
from .reconnect import Reconnect
from .services import ServiceMethods
from .steps import drive

__all__ = ["Client"]

Received = Union[Message, ControlMessage]
_PEEK = int(socket.MSG_PEEK)    # a plain int: an IntFlag's & is Python code, per call


def _wait_writable(fd: int) -> None:
    """Until the broker has room for a packet from us (or the socket fails,
    which the next send reports)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    poller.poll()


class Client(Driver, ServiceMethods):
    """A connection to an sbus broker.

    ``address`` uses the sbusd syntax (a path, ``/dev/unix/abstract/HEX`` or
    ``/dev/fd/N``, which adopts descriptor N); None means ``$SBUS_ADDRESS``,
    else ``/run/sbus.socket``. ``max_message`` must match the broker's limit.

    ``buffered=True`` packs published messages (and the packets between them)
    to send with one sendmmsg(2) when full, on :meth:`flush`, before a query,
    a receive or iteration, and on :meth:`close`. ``reconnect=True`` (or a
    :class:`~sbus.client.reconnect.Reconnect`) rides out a broker restart.
    Messages read ahead are queued for :meth:`receive`; ``pending`` counts
    them (a poller watching :meth:`fileno` does not see them: drain it first)."""

    def __init__(self, address: Optional[str] = None, *, max_message: int = MAX_MESSAGE,
                 buffered: bool = False, reconnect: Union[None, bool, Reconnect] = None) -> None:
        self._start(Connection(address, max_message, buffered, reconnect))
        self._in.outbox = self._out     # Inbox.take_batch leaves a call that must flush first to us

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
        """Send what is buffered, then close; later calls raise BusClosedError. A
        reconnecting client makes one attempt to deliver its backlog (flush() waits)."""
        if self._conn.closed:
            return
        try:
            if len(self._out) or self.backlog:
                self._run(self._conn.flush(reconnect=False))
        finally:
            self._shut(None)

    def _shut(self, error: Any) -> None:
        self._conn.shut()
        self._detach()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- running the connection's plans: the syscalls, blocking ----------------------

    def _run(self, plan: Any) -> Any:
        return drive(plan, self._act)

    def _act(self, action: tuple) -> Any:
        op = action[0]
        if op == c.SEND:
            if self._conn.framer is None:
                return action[1].send(self._fd, action[2])
            return self._send_frames(action[1], action[2])
        if op == c.SEND_ONE:
            return self._send_one(action[1], action[2])
        if op == c.WAIT:
            waiter, deadline = action[1], action[2]
            while not waiter.done():
                batch = self._read(self._in.slots, action[3], deadline)
                self._inbox.extend(batch)
        elif op == c.SLEEP:
            time.sleep(action[1])
        elif op == c.RECONNECT:
            return self._run(self._conn.reconnecting(action[1], action[2]))
        elif op == c.DELIVER:
            self._run(self._conn.deliver())
        else:
            self._act_now(action)
        return None

    def _send_frames(self, box: Any, flags: int) -> None:
        """The box in frames (take_frames). Frames go out MSG_DONTWAIT, so a
        call that may block waits for room, as a blocking sendmmsg would; the
        box keeps what is still owed (``head``) across the wait."""
        while True:
            try:
                self._send_box(box, flags)
                return
            except BlockingIOError:
                if flags & socket.MSG_DONTWAIT:
                    raise
                _wait_writable(self._fd)

    # -- sending -------------------------------------------------------------------

    def publish(self, key: Text, payload: Text = b"", flags: int = 0) -> None:
        """Publish one message, as chunks if one packet cannot hold it
        (docs/chunks.md). KeyRefusedError, before anything is sent, for a key
        the broker would refuse."""
        conn = self._conn
        try:
            if conn.buffered:
                if flags == conn.out_flags and self._out.add_publish(key, payload):
                    return
                packet = _pack_publish(key, payload, self.max_message)
            else:
                return _send_publish(self._fd, key, payload, flags, self.max_message)
        except MessageTooLargeError:    # as chunks (docs/chunks.md)
            return self._run(_chunks.publish(conn, key, payload, flags))
        except OSError as exc:
            return self._run(conn.failed_send(exc, _pack_publish(key, payload, self.max_message)))
        self._run(conn.publish_buffered(packet, flags))

    def flush(self) -> None:
        """Send what the buffered mode packed. A reconnecting client without
        a broker waits for one (as its policy allows) and sends the backlog."""
        self._run(self._conn.flush(reconnect=True))

    _unbuffer = flush

    # -- receiving -----------------------------------------------------------------

    def receive(self, flags: int = 0, *, timeout: Optional[float] = None) -> Received:
        """The next message, from the client's queue or else recv(2) with
        ``flags`` (MSG_PEEK, MSG_DONTWAIT...). TimeoutError past ``timeout``
        seconds; BusClosedError once the broker closed the connection;
        MessageTooLargeError for an oversized packet (dropped)."""
        inbox = self._inbox
        if not inbox:
            if len(self._out):
                self.flush()
            deadline = None if timeout is None else time.monotonic() + timeout
            while not inbox:
                if flags & _PEEK:
                    return self._peek(flags, deadline)
                batch = self._read(1, flags, deadline)
                if len(batch) == 1:
                    return batch[0]
                inbox.extend(batch)     # a frame (take_frames): many messages in one packet
        elif self._conn.closed:
            raise self._conn.gone()
        item = inbox[0] if flags & _PEEK else inbox.popleft()
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

    receive_many = _syncrecv.receive_many     # in C, calling _receive_many past its usual call

    def _receive_many(self, max: int, timeout: Optional[float], flags: int) -> List[Received]:
        """receive_many past its usual call (sbus._core.syncrecv)."""
        if flags & _PEEK:
            raise ValueError("receive_many does not peek; use receive(MSG_PEEK)")
        self._triage(self._in.held())
        inbox = self._inbox
        if not inbox:
            if len(self._out):
                self.flush()
            deadline = None if timeout is None else self._in.deadline    # set by take_batch()
            while not inbox:
                batch = self._read(max, flags, deadline)
                if 0 < len(batch) <= max:
                    return batch    # only messages, in order: no need to queue them
                inbox.extend(batch)     # more than max: frames (take_frames) hold many
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
        """Messages until the broker closes the connection, read in batches
        into the queue, taken from it in C (:class:`sbus._core.batch.Messages`)."""
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
        """What one recvmmsg returns if it is plain messages; else (and after a
        reconnect) it is triaged into the queue and the list is empty. The
        deadline (monotonic) covers reconnecting too."""
        conn = self._conn
        if self._sock is None:
            conn.check_open()
            self._run(conn.reconnecting(True, deadline))
            if self._inbox:     # queued while the replay was confirmed
                return []
        left = -1.0     # no deadline
        if deadline is not None:    # not max(): it parses keywords, a fifth of what a call costs
            left = deadline - time.monotonic()
            left = left if left > 0.0 else 0.0
        try:
            batch = self._in.receive(self._fd, limit, flags, left)
        except OSError as exc:
            return self._failed(exc)
        if raw or not self._in.irregular:   # replies are irregular (Inbox.route)
            return batch
        self._triage(batch)
        return []

    def _failed(self, exc: OSError) -> List[Any]:
        if exc.errno not in GONE or self._conn.closed:
            raise exc
        self._lost(exc)
        return []
