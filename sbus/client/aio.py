"""An asyncio sbus client on the event loop's reader/writer callbacks.

::

    async with sbus.aio.Client(address) as bus:
        await bus.subscribe("sensors/*")
        await bus.publish("sensors/t1", b"21.5")
        async for message in bus:
            ...

A driver over :class:`sbus.client.connection.Connection` (the protocol
state and its plans): it makes the syscalls on the event loop and awaits
where a plan waits; a reconnect runs in a background task. A full socket
makes a sender wait for ``add_writer`` readiness; senders go out in the
order they called (the send lock). An ``add_reader`` callback reads with
recvmmsg(2) until the socket is empty, only while someone waits, into the
queue receivers take from (so cancelling one loses nothing). Buffered mode
also sends ``flush_delay`` seconds after the first packed message. See
docs/clients.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import time
from typing import Any, AsyncIterator, List, Optional, Union

from .._core.batch import AsyncMessages, Outbox, Sink
from .._core.batch import pack_publish as _pack_publish
from .._core.batch import send_publish as _send_publish
from .._core.batch import take as _take
from ..errors import BusClosedError, MessageTooLargeError, SbusError
from . import chunks as _chunks
from . import connection as c
from .aioread import Reader
from .connection import Connection
from .driver import Driver, awaited, retrieve
from .protocol import MAX_MESSAGE, ControlMessage, Credentials, Message, Text
from .reconnect import Reconnect
from .services import AsyncServiceMethods

__all__ = ["Client", "ControlMessage", "Credentials", "Message", "Reconnect", "connect", "FLUSH_DELAY"]

FLUSH_DELAY = 0.002
"""Seconds a buffered client holds a packed message before sending it on its own."""

_DONTWAIT = int(socket.MSG_DONTWAIT)

Received = Union[Message, ControlMessage]


class Client(Reader, Driver, AsyncServiceMethods):
    """An asyncio connection to an sbus broker; create it inside a running loop.

    The arguments are those of :class:`sbus.Client`, and ``flush_delay``
    for the buffered mode; the constructor does not wait (a unix socket
    connects at once). The methods that talk to the broker are awaited.
    """

    _NAME = "sbus.aio.Client"

    def __init__(self, address: Optional[str] = None, *, max_message: int = MAX_MESSAGE,
                 buffered: bool = False, flush_delay: float = FLUSH_DELAY,
                 reconnect: Union[None, bool, Reconnect] = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.flush_delay = flush_delay
        self._send_lock = asyncio.Lock()
        self._write_waiter: Optional[asyncio.Future] = None
        self._flush_timer: Optional[asyncio.TimerHandle] = None
        self._receivers: List[asyncio.Future] = []
        self._sink_waiters = 0      # of the receivers, those in receive_into
        self._reading = False
        self._reconnecting: Optional[asyncio.Task] = None
        conn = Connection(address, max_message, buffered, reconnect, self._loop.create_future)
        conn.wake = self._wake
        self._start(conn)

    def _attach(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock, self._fd = sock, sock.fileno()

    def fileno(self) -> int:
        if self._sock is None:
            raise self._conn.gone() if self._conn.closed else BusClosedError("not connected")
        return self._fd

    def close(self) -> None:
        """Close; waiting senders, receivers and queries get BusClosedError.
        Buffered packets are sent if the socket takes them at once (``await
        flush()`` first, or leave ``async with``, to wait for the rest)."""
        conn = self._conn
        if conn.closed:
            return
        if len(self._out) and self._sock is not None:
            try:
                self._out.send(self._fd, conn.out_flags)
            except OSError:
                pass
        conn.closed = True
        self._shut(conn.gone())

    def _shut(self, exc: BusClosedError) -> None:
        waiters = self._conn.shut()
        if self._reconnecting is not None and self._reconnecting is not asyncio.current_task():
            self._reconnecting.cancel()
        self._reconnecting = None
        self._cancel_timer()
        self._detach()
        waiters += self._receivers
        self._receivers.clear()
        for fut in waiters:
            c.settle(fut, error=exc)

    def _unwatch(self) -> None:
        self._stop_reading()
        if self._write_waiter is not None:
            self._loop.remove_writer(self._fd)
            c.settle(self._write_waiter)    # its sender finds the socket gone
            self._write_waiter = None

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if not self._conn.closed and len(self._out):
            with contextlib.suppress(SbusError):
                await self.flush()
        self.close()

    # -- running the connection's plans: the syscalls, awaited -----------------------

    async def _run(self, plan: Any) -> Any:
        value = error = None
        locked = False
        try:
            while True:
                try:
                    action = plan.send(value) if error is None else plan.throw(error)
                except StopIteration as stop:
                    return stop.value
                value = error = None
                try:
                    value = await self._act(action)
                    locked = action[0] == c.LOCK or (locked and action[0] != c.UNLOCK)
                except BaseException as exc:    # the plan decides what it means
                    error = exc
        finally:
            if locked:      # the plan raised while it held the send lock
                self._send_lock.release()
            if self._reading:   # a query abandoned on the way out no longer needs it
                self._update_reading()

    async def _act(self, action: tuple) -> Any:
        op = action[0]
        if op == c.SEND or op == c.SEND_ONE:
            while True:
                try:
                    if op == c.SEND:
                        return self._send_box(action[1], action[2])
                    return self._send_one(action[1], action[2])
                except BlockingIOError:
                    await self._writable()
        elif op == c.WAIT:
            waiter, deadline = action[1], action[2]
            self._start_reading()
            try:
                # Shielded: a waiter may be shared (the reply inbox's opening).
                await asyncio.wait_for(asyncio.shield(waiter), None if deadline is None
                                       else max(0.0, deadline - time.monotonic()))
            finally:
                self._update_reading()
        elif op == c.LOCK:
            await self._send_lock.acquire()
        elif op == c.UNLOCK:
            self._send_lock.release()
        elif op == c.ARM:
            self._arm_timer()
        elif op == c.SLEEP:
            await asyncio.sleep(action[1])
        elif op == c.DELIVER:
            if self._conn.requests or self._receivers:
                self._start_reading()
            async with self._send_lock:
                await self._run(self._conn.deliver())
        elif op != c.RECONNECT:
            self._act_now(action)
        return False    # RECONNECT: the background task does

    def _reconnect_later(self) -> None:
        if self._reconnecting is None:
            self._reconnecting = self._loop.create_task(self._reconnect())
            self._reconnecting.add_done_callback(retrieve)

    async def _reconnect(self) -> None:
        try:
            await self._run(self._conn.reconnecting(True))
        finally:
            if self._reconnecting is asyncio.current_task():
                self._reconnecting = None

    # -- sending -------------------------------------------------------------------

    async def _writable(self) -> None:
        fut = self._loop.create_future()
        self._write_waiter = fut
        self._loop.add_writer(self._fd, c.settle, fut)
        try:
            await fut
        finally:
            if self._write_waiter is fut:
                self._write_waiter = None
                self._loop.remove_writer(self._fd)

    def _unbuffer(self) -> None:
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self._flush_timer is None:
            self._flush_timer = self._loop.call_later(self.flush_delay, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None

    def _on_timer(self) -> None:
        self._flush_timer = None
        if self._send_lock.locked():    # its holder may not send what was packed meanwhile
            self._arm_timer()
        elif len(self._out):    # an error is raised again by the next call that sends
            self._loop.create_task(self.flush()).add_done_callback(retrieve)

    async def flush(self) -> None:
        """Send what the buffered mode packed, waiting while the socket is full."""
        self._cancel_timer()
        await self._run(self._conn.flush())

    async def publish(self, key: Text, payload: Text = b"", flags: int = 0) -> None:
        """Publish one message (buffered: pack it), as chunks if one packet
        cannot hold it (docs/chunks.md). KeyRefusedError, before anything is
        sent, for a key the broker would refuse."""
        conn = self._conn
        try:
            if conn.buffered:
                if flags != conn.out_flags or not self._out.add_publish(key, payload):
                    return await self._run(conn.publish_buffered(
                        _pack_publish(key, payload, self.max_message), flags))
                if self._flush_timer is None:
                    self._arm_timer()
                return
            if conn.live and not len(self._out) and not self._send_lock.locked():
                try:
                    return _send_publish(self._fd, key, payload, flags, self.max_message)
                except BlockingIOError:
                    pass
                except OSError as exc:
                    return await self._run(conn.failed_send(
                        exc, _pack_publish(key, payload, self.max_message)))
            conn.check_open()
            packet = _pack_publish(key, payload, self.max_message)
        except MessageTooLargeError:    # as chunks (docs/chunks.md)
            return await self._run(_chunks.publish(conn, key, payload, flags))
        await self._run(conn.send_now(packet, flags))

    def publish_nowait(self, key: Text, payload: Text = b"", flags: int = 0) -> None:
        """Publish without waiting, for code that cannot await (a finalizer):
        sent at once if the socket takes it, else packed to go with the next
        flush (the flush timer's, flush(), leaving ``async with``, close())."""
        conn = self._conn
        conn.check_open()
        if conn.live and not len(self._out) and not self._send_lock.locked():
            try:
                return _send_publish(self._fd, key, payload, flags, self.max_message)
            except BlockingIOError:
                pass
        if not conn.pack(_pack_publish(key, payload, self.max_message), flags):
            raise BlockingIOError(errno.EAGAIN, "the outbox is full: await flush() first")
        self._arm_timer()

    async def publish_packed(self, box: Outbox, flags: int = 0) -> int:
        """Send ``box``, an Outbox packed elsewhere (sbus._core.natswire), as
        :meth:`publish_many` sends its own; how many were sent or kept."""
        self._cancel_timer()
        return await self._run(self._conn.publish_packed(box, flags))

    # -- receiving -----------------------------------------------------------------

    async def receive(self) -> Received:
        """The next message; BusClosedError once the broker has closed the connection."""
        inbox = self._inbox
        while not inbox:
            self._conn.check_open()
            if not self._reading and self._sock is not None:
                self._read_until_empty()    # no future when something is there already
                if inbox:
                    break
            await self._wait_readable(False)
        item = inbox.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    async def receive_many(self, max: int = 64) -> List[Received]:
        """Up to ``max`` messages: at least one, as many as are queued or
        readable at once. An error ends the list and is raised by the next call."""
        inbox = self._inbox
        if not self._reading:
            try:
                batch = self._in.take_batch(max, None, _DONTWAIT)    # the usual call, all in C
            except OSError as exc:
                batch = self._failed(exc)
            if batch:
                return batch
            if batch is None and not inbox and self._sock is not None:
                self._read_until_empty()    # the batch take_batch() held, first
        if not inbox or isinstance(inbox[0], BaseException):
            inbox.appendleft(await self.receive())  # waits, or raises the error
        if len(inbox) < max and not self._reading and self._sock is not None:
            self._read_until_empty()
        return _take(inbox, max)

    async def receive_into(self, sink: Sink, max: int = 64) -> List[Received]:
        """As :meth:`receive_many`, but plain messages go to ``sink`` (a C
        :class:`sbus._core.batch.Sink`), queued ones by ``sink.add()``, in
        order; returns the control messages. It does not yield to the loop
        when packets are there already (see docs/clients.md)."""
        while True:
            if self._inbox:
                items = await self.receive_many(max)
                sink.add([m for m in items if type(m) is Message])
                return [m for m in items if type(m) is not Message]
            self._conn.check_open()
            if not self._reading and self._sock is not None:
                if self._read_until_empty(max, sink):
                    return []
                if self._inbox:
                    continue
            await self._wait_readable(True)

    async def batches(self, max: int = 64) -> AsyncIterator[List[Received]]:
        """:meth:`receive_many` until the broker closes the connection:
        ``async for batch in bus.batches()``."""
        while True:
            try:
                batch = await self.receive_many(max)
            except BusClosedError:
                return
            yield batch

    def __aiter__(self) -> AsyncIterator[Received]:
        """``async for``: a queued message comes without a coroutine or future
        (:class:`sbus._core.batch.AsyncMessages`), the rest by :meth:`__anext__`."""
        return AsyncMessages(self._inbox, Message, self.__anext__)

    async def __anext__(self) -> Received:
        """:meth:`receive`; StopAsyncIteration once the broker has closed the connection."""
        inbox = self._inbox
        if inbox and type(inbox[0]) is Message:
            return inbox.popleft()
        try:
            return await self.receive()
        except BusClosedError:
            raise StopAsyncIteration from None


for _name in Driver.PLANNED:
    setattr(Client, _name, awaited(getattr(Driver, _name)))


async def connect(address: Optional[str] = None, *, max_message: int = MAX_MESSAGE,
                  **options: Any) -> Client:
    """``Client(address)``, for symmetry with asyncio's ``open_*`` functions."""
    return Client(address, max_message=max_message, **options)
