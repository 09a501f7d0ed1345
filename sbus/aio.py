"""An asyncio sbus client on the event loop's reader/writer callbacks.

::

    async with sbus.aio.Client(address) as bus:
        await bus.subscribe("sensors/*")
        await bus.publish("sensors/t1", b"21.5")
        async for message in bus:
            ...

The socket is the blocking client's socket put in non-blocking mode. A send
that finds it full waits for ``add_writer`` readiness (back-pressure), and
senders go out in the order they called. Packets are read by an
``add_reader`` callback only while someone waits for one, into a queue that
receivers take from after they wake, so cancelling a receiver never loses a
message.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Any, Deque, List, Optional, Tuple, Union

from .client import (
    MAX_MESSAGE,
    WHOAMI,
    Client as _BlockingClient,
    ControlMessage,
    Credentials,
    Message,
    Text,
    pack_control,
    pack_publish,
    pack_subscribe,
    pack_unsubscribe,
    parse_stats,
)
from .errors import BusClosedError, SbusError

__all__ = ["Client", "ControlMessage", "Credentials", "Message", "connect"]

# Packets read per readiness callback: enough to amortise the wake-up and
# the add_reader/remove_reader pair, few enough not to starve the loop.
_READ_BATCH = 64

Received = Union[Message, ControlMessage]


class Client:
    """An asyncio connection to an sbus broker; create it inside a running loop.

    The arguments are those of :class:`sbus.Client`. Connecting a unix
    socket does not wait for the broker, so the constructor is synchronous.
    """

    def __init__(self, address: Optional[str] = None, *, max_message: int = MAX_MESSAGE) -> None:
        self._loop = asyncio.get_running_loop()
        self._bus = _BlockingClient(address, max_message=max_message)
        self._bus.socket.setblocking(False)
        self._fd = self._bus.fileno()
        self._send_lock = asyncio.Lock()
        self._write_waiter: Optional[asyncio.Future] = None
        # What the reader callback received and nobody took yet: messages,
        # or the exception a receive() should raise at that point.
        self._inbox: Deque[Union[Received, BaseException]] = collections.deque()
        self._receivers: List[asyncio.Future] = []
        # One future per query() whose request was sent, in request order
        # (the broker answers in order); cancelled ones still own a reply.
        self._queries: Deque[Tuple[bytes, asyncio.Future]] = collections.deque()
        self._reading = False
        self._eof = False

    @property
    def address(self) -> str:
        return self._bus.address

    @property
    def max_message(self) -> int:
        return self._bus.max_message

    @property
    def closed(self) -> bool:
        return self._bus.closed

    def fileno(self) -> int:
        return self._bus.fileno()

    def close(self) -> None:
        """Close the connection; waiting senders, receivers and queries get BusClosedError."""
        if self._bus.closed:
            return
        self._stop_reading()
        if self._write_waiter is not None:
            self._loop.remove_writer(self._fd)
        self._bus.close()
        waiters = [self._write_waiter, *self._receivers, *(f for _, f in self._queries)]
        self._write_waiter = None
        self._receivers.clear()
        self._queries.clear()
        for fut in waiters:
            if fut is not None and not fut.done():
                fut.set_exception(BusClosedError("the client is closed"))

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<sbus.aio.Client {self.address!r} {'closed' if self.closed else f'fd={self._fd}'}>"

    # -- sending ---------------------------------------------------------------

    async def send_packet(self, packet: bytes, flags: int = 0) -> None:
        """Send one raw packet, waiting while the socket is full."""
        if not self._send_lock.locked():
            try:
                return self._bus.send_packet(packet, flags)
            except BlockingIOError:
                pass
        async with self._send_lock:
            while True:
                try:
                    return self._bus.send_packet(packet, flags)
                except BlockingIOError:
                    await self._writable()

    async def _writable(self) -> None:
        fut = self._loop.create_future()
        self._write_waiter = fut
        self._loop.add_writer(self._fd, _wake, fut)
        try:
            await fut
        finally:
            if self._write_waiter is fut:
                self._write_waiter = None
                self._loop.remove_writer(self._fd)

    async def subscribe(self, pattern: Text, flags: int = 0) -> None:
        await self.send_packet(pack_subscribe(pattern), flags)

    async def unsubscribe(self, pattern: Text, flags: int = 0) -> None:
        await self.send_packet(pack_unsubscribe(pattern), flags)

    async def publish(self, key: Text, payload: Text = b"", flags: int = 0) -> None:
        await self.send_packet(pack_publish(key, payload), flags)

    async def send_cmsg(self, key: Text, payload: Optional[Text] = None, flags: int = 0) -> None:
        await self.send_packet(pack_control(key, payload), flags)

    # -- receiving -------------------------------------------------------------

    async def receive(self) -> Received:
        """The next message; BusClosedError once the broker has closed the connection."""
        while not self._inbox:
            if self._eof or self._bus.closed:
                raise BusClosedError("the broker closed the connection" if self._eof
                                     else "the client is closed")
            fut = self._loop.create_future()
            self._receivers.append(fut)
            self._start_reading()
            try:
                await fut
            finally:
                if fut in self._receivers:
                    self._receivers.remove(fut)
                self._update_reading()
        item = self._inbox.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def __aiter__(self) -> "Client":
        return self

    async def __anext__(self) -> Received:
        try:
            return await self.receive()
        except BusClosedError:
            raise StopAsyncIteration from None

    def _start_reading(self) -> None:
        if not self._reading and not self._eof and not self._bus.closed:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def _update_reading(self) -> None:
        """Read only while someone waits: an unread socket is the broker's back-pressure."""
        if not self._receivers and not any(not fut.done() for _, fut in self._queries):
            self._stop_reading()

    def _on_readable(self) -> None:
        for _ in range(_READ_BATCH):
            try:
                # The socket is non-blocking: this is one recv(2) or BlockingIOError.
                packet = self._bus.receive()
            except BlockingIOError:
                break
            except SbusError as exc:
                self._inbox.append(exc)
                if isinstance(exc, BusClosedError):
                    self._fail(exc)
                    break
                continue  # an oversized or malformed packet, already consumed
            except OSError as exc:
                self._inbox.append(exc)
                self._fail(BusClosedError(f"the connection failed: {exc}"))
                break
            if type(packet) is ControlMessage and self._answer(packet):
                continue
            self._inbox.append(packet)
        if self._inbox:
            for fut in self._receivers:
                if not fut.done():
                    fut.set_result(None)
        self._update_reading()

    def _answer(self, reply: ControlMessage) -> bool:
        """Hand a control message to the oldest query with its key, if there is one."""
        for i, (key, fut) in enumerate(self._queries):
            if key == reply.key:
                del self._queries[i]
                if not fut.done():  # a cancelled query's reply is dropped
                    fut.set_result(reply.payload)
                return True
        return False

    def _fail(self, exc: BusClosedError) -> None:
        self._eof = True
        self._stop_reading()
        for _, fut in self._queries:
            if not fut.done():
                fut.set_exception(exc)
        self._queries.clear()

    # -- requests to the broker --------------------------------------------------

    async def query(self, key: Text, payload: Optional[Text] = None, flags: int = 0) -> bytes:
        """Send a control message and return the payload of the broker's reply with that key.

        Messages that arrive first are kept for :meth:`receive`.
        """
        packet = pack_control(key, payload)
        raw_key = packet[5:].partition(b"\0")[0]
        await self.send_packet(packet, flags)
        if self._eof:
            raise BusClosedError("the broker closed the connection")
        # No callback can run between the send and this append, so the reply
        # cannot be read before its future exists.
        fut = self._loop.create_future()
        self._queries.append((raw_key, fut))
        self._start_reading()
        try:
            return await fut
        finally:
            self._update_reading()

    async def whoami(self, flags: int = 0) -> Credentials:
        reply = await self.query(WHOAMI, None, flags)
        return Credentials.parse(reply.decode("ascii", "replace"))

    async def stats(self, flags: int = 0) -> dict:
        """The broker's counters: the JSON reply to ``CMSG stats``."""
        return parse_stats(await self.query(b"stats", None, flags))


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def connect(address: Optional[str] = None, *, max_message: int = MAX_MESSAGE) -> Client:
    """``Client(address)``, for symmetry with asyncio's ``open_*`` functions."""
    return Client(address, max_message=max_message)
