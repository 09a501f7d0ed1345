"""An asyncio sbus client on the event loop's reader/writer callbacks.

::

    async with sbus.aio.Client(address) as bus:
        await bus.subscribe("sensors/*")
        await bus.publish("sensors/t1", b"21.5")
        async for message in bus:
            ...

A driver over the I/O-free :class:`sbus.client.core.Core`, which holds the
state and decides what to send, keep or raise; this module does the
syscalls on the event loop. The socket is opened by
:func:`~sbus.client.core.open_socket` and put in non-blocking mode; a
reconnect runs in a background task. A send that finds it full waits for ``add_writer`` readiness (back-pressure), and
senders go out in the order they called. Packets are read with recvmmsg(2)
until the socket is empty, by an ``add_reader`` callback only while someone
waits for one, into a queue that receivers take from after they wake, so
cancelling a receiver never loses a message; a receiver that finds the queue
empty first reads the socket directly, so a busy consumer needs no future
per message.

``buffered=True`` packs published messages (and the packets sent between
them, in order) into the compiled outbox and sends them with one sendmmsg(2)
when it is full, before a query, on :meth:`Client.flush` and :meth:`close`,
and at the latest ``flush_delay`` seconds (default 2 ms) after the first of
them was packed, once the loop gets to run.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any, AsyncIterator, Iterable, List, Optional, Tuple, Union

from .._core.batch import AsyncMessages, Outbox, Sink
from .._core.batch import pack_publish as _pack_publish
from .._core.batch import send_publish as _send_publish
from .._core.batch import take as _take
from ..errors import BusClosedError, MessageRefusedError, SbusError
from .core import GONE, Core, Request
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
from .services import AsyncServiceMethods

__all__ = ["Client", "ControlMessage", "Credentials", "Message", "Reconnect", "connect",
           "FLUSH_DELAY"]

FLUSH_DELAY = 0.002
"""Seconds a buffered client holds a packed message before sending it on its own."""

# Received messages queued before the reader callback stops reading: the
# rest waits in the socket, where it is the broker's back-pressure.
_INBOX_HIGH = 4096

Received = Union[Message, ControlMessage]


class Client(Core, AsyncServiceMethods):
    """An asyncio connection to an sbus broker; create it inside a running loop.

    The arguments are those of :class:`sbus.Client`, and ``flush_delay``
    for the buffered mode. Connecting a unix socket does not wait for the
    broker, so the constructor is synchronous. With ``reconnect``, a lost
    connection is restored by a background task while publishers fill the
    backlog, receivers wait and queries are asked again of the new broker.
    """

    _NAME = "sbus.aio.Client"

    def __init__(self, address: Optional[str] = None, *, max_message: int = MAX_MESSAGE,
                 buffered: bool = False, flush_delay: float = FLUSH_DELAY,
                 reconnect: Union[None, bool, Reconnect] = None) -> None:
        self._loop = asyncio.get_running_loop()
        super().__init__(address, max_message, buffered, reconnect)
        self.flush_delay = flush_delay
        self._send_lock = asyncio.Lock()
        self._write_waiter: Optional[asyncio.Future] = None
        self._flush_timer: Optional[asyncio.TimerHandle] = None
        self._receivers: List[asyncio.Future] = []
        self._sink_waiters = 0      # of the receivers, those in receive_into
        self._reading = False
        self._eof = False
        self._reconnecting: Optional[asyncio.Task] = None
        self._connected: Optional[asyncio.Future] = None   # set while reconnecting
        # True while sends may go straight to the socket: connected, and no
        # backlog left to send before them.
        self._live = True
        self._delivering = False
        self._restoring: Optional[asyncio.Future] = None
        self._attach(self._connect())

    def _attach(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock, self._fd = sock, sock.fileno()

    def fileno(self) -> int:
        if self._sock is None:
            raise self._gone() if self._closed else BusClosedError("not connected")
        return self._fd

    def close(self) -> None:
        """Close the connection; waiting senders, receivers and queries get BusClosedError.

        Buffered packets are sent if the socket takes them at once; ``await
        flush()`` first (or leave an ``async with`` block) to wait for the rest.
        """
        if self._closed:
            return
        if len(self._out) and self._sock is not None:
            try:
                self._out.send(self._fd, self._out_flags)
            except OSError:
                pass
        self._closed = True
        self._shut(self._gone())

    def _shut(self, exc: BusClosedError) -> None:
        self._closed = True
        if self._reconnecting is not None and self._reconnecting is not asyncio.current_task():
            self._reconnecting.cancel()
        self._reconnecting = None
        self._cancel_timer()
        self._out.clear()
        self._detach()
        waiters = [self._write_waiter, self._connected, *self._receivers,
                   *(r.waiter for r in self._requests)]
        self._write_waiter = self._connected = None
        self._receivers.clear()
        self._requests.clear()
        for fut in waiters:
            if fut is not None and not fut.done():
                fut.set_exception(exc)

    def _detach(self) -> None:
        self._stop_reading()
        if self._write_waiter is not None:
            self._loop.remove_writer(self._fd)
            if not self._write_waiter.done():
                self._write_waiter.set_result(None)    # its sender finds the socket gone
            self._write_waiter = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._fd = -1
        self._live = False

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if not self._closed and len(self._out):
            try:
                await self.flush()
            except SbusError:
                pass
        self.close()

    # -- sending ---------------------------------------------------------------

    async def send_packet(self, packet: bytes, flags: int = 0) -> None:
        """Send one raw packet, waiting while the socket is full (buffered:
        pack it behind the buffered messages)."""
        if self._closed:
            raise self._gone()
        if self._admit(packet) and self._sock is None:
            return      # replayed once the broker is back
        if self._buffered:
            while not self._pack(packet, flags):
                await self.flush()
            self._arm_timer()
            return
        if not self._live:
            return self._keep_while_away(packet)
        if not self._send_lock.locked() and not len(self._out):
            try:
                return self._send_now(packet, flags)
            except BlockingIOError:
                pass
        async with self._send_lock:
            if len(self._out):
                await self._drain(0)
            while True:
                try:
                    return self._send_now(packet, flags)
                except BlockingIOError:
                    await self._writable()

    def _send_now(self, packet: bytes, flags: int) -> None:
        """One send(2); BlockingIOError if the socket is full."""
        if not self._live:
            return self._keep_while_away(packet)
        try:
            self._sock.send(packet, flags | socket.MSG_NOSIGNAL)
        except BlockingIOError:
            raise
        except OSError as exc:
            self._failed_send(exc, packet)

    def _failed_send(self, exc: OSError, packet: Optional[bytes]) -> None:
        self._send_failed(exc, packet)
        self._lost(exc)
        if packet is not None:
            self._keep(packet)

    def _keep_while_away(self, packet: bytes) -> None:
        if self._closed or self._policy is None:
            raise self._gone()
        self._keep(packet)

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
        if not len(self._out):
            return
        if self._send_lock.locked():
            # The holder may never send what was packed meanwhile (a query's
            # request, publish_packed's own box): look again later.
            self._arm_timer()
            return
        task = self._loop.create_task(self._flush_quietly())
        task.add_done_callback(_retrieve)

    async def _flush_quietly(self) -> None:
        # an error here is raised again by the next call that sends
        try:
            await self.flush()
        except SbusError:
            pass

    async def flush(self) -> None:
        """Send what the buffered mode packed, waiting while the socket is full."""
        self._cancel_timer()
        if not len(self._out):
            if self._closed:
                raise self._gone()
            return
        async with self._send_lock:
            await self._drain(0)

    async def _drain(self, done: int, out: Optional[Outbox] = None) -> None:
        """sendmmsg the outbox (or ``out``), waiting for writability; ``done``:
        messages of this batch sent before it (for BatchInterruptedError)."""
        if out is None:
            out = self._out
        while len(out):
            if not self._live and not self._delivering:
                if self._closed or self._policy is None:
                    out.clear()
                    raise self._gone()
                self._keep_owed(out)
                return
            before = out.head
            try:
                out.send(self._fd, self._out_flags)
            except BlockingIOError:
                await self._writable()
            except OSError as exc:
                if exc.errno not in GONE:
                    raise
                if self._closed or self._policy is None:
                    sent, total = done + out.head - before, done + len(out) + out.head - before
                    out.clear()
                    self._fail(self._gone())
                    raise self._interrupted(sent, total) from exc
                self._lost(exc)
                return

    async def subscribe(self, pattern: Text, flags: int = 0) -> None:
        await self.send_packet(pack_subscribe(pattern), flags)

    async def unsubscribe(self, pattern: Text, flags: int = 0) -> None:
        await self.send_packet(pack_unsubscribe(pattern), flags)

    async def publish(self, key: Text, payload: Text = b"", flags: int = 0) -> None:
        """Publish one message (buffered: pack it). KeyRefusedError or
        MessageTooLargeError, before anything is sent, for a message the
        broker would refuse."""
        if self._buffered:
            if flags != self._out_flags or not self._out.add_publish(key, payload):
                packet = _pack_publish(key, payload, self.max_message)
                while not self._pack(packet, flags):
                    await self.flush()
            if self._flush_timer is None:
                self._arm_timer()
            return
        if self._live and not len(self._out) and not self._send_lock.locked():
            try:
                return _send_publish(self._fd, key, payload, flags, self.max_message)
            except BlockingIOError:
                pass
            except OSError as exc:
                return self._failed_send(exc, _pack_publish(key, payload, self.max_message))
        if self._closed:
            raise self._gone()
        await self.send_packet(_pack_publish(key, payload, self.max_message), flags)

    async def publish_many(self, messages: Iterable[Tuple[Text, Text]], flags: int = 0) -> int:
        """Publish (key, payload) pairs in order with sendmmsg(2), waiting
        while the socket is full; returns how many were published. Refusals
        and failures as :meth:`sbus.Client.publish_many` reports them."""
        if self._closed:
            raise self._gone()
        await self.flush()
        items = iter(messages)
        out = self._out
        packed = 0
        async with self._send_lock:
            self._out_flags = flags
            while True:
                try:
                    packed += out.pack_many(items, packed)
                except MessageRefusedError as exc:
                    await self._drain(exc.index - len(out))
                    exc.sent = exc.index
                    raise
                if not self._live and self._policy is not None:
                    self._keep_outbox(out, packed - len(out))
                else:
                    await self._drain(packed - len(out))
                if out.exhausted:
                    return packed

    async def publish_packed(self, box: Outbox, flags: int = 0) -> int:
        """Send the packets of ``box``, an Outbox packed elsewhere (by
        sbus._core.natswire, straight from NATS frames), in order and as
        :meth:`publish_many` sends its own: waiting while the socket is
        full; kept for the new connection when the broker is away (with
        ``reconnect``; BacklogFullError, as for publish_many, for what does
        not fit). Returns how many were sent or kept; the box is empty
        afterwards."""
        if self._closed:
            box.clear()
            raise self._gone()
        await self.flush()
        count = len(box)
        async with self._send_lock:
            self._out_flags = flags
            if not self._live and self._policy is not None:
                self._keep_outbox(box, 0)
                return count
            await self._drain(0, box)
            if len(box):    # owed when the connection broke: before what is kept since
                self._keep_owed(box)
        return count

    async def send_cmsg(self, key: Text, payload: Optional[Text] = None, flags: int = 0) -> None:
        await self.send_packet(pack_control(key, payload), flags)

    # -- receiving -------------------------------------------------------------

    async def receive(self) -> Received:
        """The next message; BusClosedError once the broker has closed the connection."""
        while not self._inbox:
            if self._closed or (self._eof and self._policy is None):
                raise self._gone()
            if not self._reading and self._sock is not None:
                self._read_until_empty()    # no future when something is there already
                if self._inbox:
                    break
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

    async def receive_many(self, max: int = 64) -> List[Received]:
        """Up to ``max`` messages: at least one, as many as are queued or
        readable at once. An error ends the list and is raised by the next call."""
        inbox = self._inbox
        if not inbox or isinstance(inbox[0], BaseException):
            inbox.appendleft(await self.receive())  # waits, or raises the error
        if len(inbox) < max and not self._reading and self._sock is not None:
            self._read_until_empty()
        return _take(inbox, max)

    async def receive_into(self, sink: Sink, max: int = 64) -> List[Received]:
        """As :meth:`receive_many`, but the messages go to ``sink``, a C
        consumer (sbus._core.batch.Sink, such as the bridge's
        natswire.Exporter), with no Python object made for each. Waits for
        at least one packet and takes at most ``max``; returns the control
        messages among them (usually none). Like a stream's read, it returns
        without yielding to the event loop when packets are there already: a
        loop of it that feeds another task must yield itself. Messages
        already read as objects (by receive(), or queued behind a control
        message) reach it by ``sink.add()``, in order."""
        while True:
            if self._inbox:
                items = await self.receive_many(max)
                sink.add([m for m in items if type(m) is Message])
                return [m for m in items if type(m) is not Message]
            if self._closed or (self._eof and self._policy is None):
                raise self._gone()
            if not self._reading and self._sock is not None:
                if self._read_until_empty(max, sink):
                    return []
                if self._inbox:
                    continue
            fut = self._loop.create_future()
            self._receivers.append(fut)
            self._sink_waiters += 1
            self._start_reading()
            try:
                await fut
            finally:
                self._sink_waiters -= 1
                if fut in self._receivers:
                    self._receivers.remove(fut)
                self._update_reading()

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
        """``async for``: a queued message is returned without a coroutine or
        future (see :class:`sbus._core.batch.AsyncMessages`); the rest goes
        through :meth:`__anext__`."""
        return AsyncMessages(self._inbox, Message, self.__anext__)

    async def __anext__(self) -> Received:
        """The next message, as :meth:`receive` returns it; StopAsyncIteration
        once the broker has closed the connection."""
        inbox = self._inbox
        if inbox and type(inbox[0]) is Message:
            return inbox.popleft()
        try:
            return await self.receive()
        except BusClosedError:
            raise StopAsyncIteration from None

    def _start_reading(self) -> None:
        if not self._reading and self._sock is not None:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def _update_reading(self) -> None:
        """Read only while someone waits: an unread socket is the broker's back-pressure."""
        if not self._receivers and not self._querying():
            self._stop_reading()

    def _querying(self) -> bool:
        return any(r.waiter is not None and not r.waiter.done() for r in self._requests)

    def _on_readable(self) -> None:
        if self._sink_waiters == len(self._receivers) > 0 and not self._querying():
            # Only receive_into waits: it reads into its sink itself.
            for fut in self._receivers:
                if not fut.done():
                    fut.set_result(None)
            self._stop_reading()
            return
        self._read_until_empty()
        if self._inbox:
            for fut in self._receivers:
                if not fut.done():
                    fut.set_result(None)
        self._update_reading()

    def _read_until_empty(self, limit: int = 64, sink: Optional[Sink] = None) -> int:
        """recvmmsg until EAGAIN (or the queue is long); replies go to their
        queries. With a ``sink``, plain messages go to it until something is
        queued (so nothing overtakes what is) or ``limit`` went to it, so its
        owner acts on each batch before the next is read; returns how many it took."""
        inbox = self._inbox
        taken = 0
        most = _INBOX_HIGH if sink is None else limit
        while self._sock is not None and len(inbox) < _INBOX_HIGH and taken < most:
            try:
                batch = self._in.receive(self._fd, min(limit, most - taken), 0, -1.0, sink)
            except BlockingIOError:
                return taken
            except OSError as exc:
                if exc.errno in GONE and self._policy is not None:
                    self._lost(exc)
                    return taken
                inbox.append(exc)
                self._fail(BusClosedError(f"the connection failed: {exc}"))
                return taken
            taken += self._in.taken
            if self._replies is not None:
                batch = self._replies.route(batch)
            if not self._in.irregular:
                inbox.extend(batch)
                continue
            for item in batch:
                if type(item) is ControlMessage:
                    request = self._answer(item) if self._requests else None
                    if request is None:
                        inbox.append(item)
                    elif request.waiter is not None and not request.waiter.done():
                        request.waiter.set_result(item.payload)  # an abandoned one's is dropped
                elif type(item) is BusClosedError:
                    if self._policy is not None and not self._closed:
                        self._lost(item)
                    else:
                        inbox.append(item)
                        self._fail(item)
                    return taken
                else:
                    inbox.append(item)
            if sink is not None and inbox:
                return taken
        return taken

    def _fail(self, exc: BusClosedError) -> None:
        self._eof = True
        self._stop_reading()
        for request in self._requests:
            if request.waiter is not None and not request.waiter.done():
                request.waiter.set_exception(exc)
        self._requests.clear()
        for fut in self._receivers:
            if not fut.done():
                fut.set_result(None)

    # -- losing and finding the broker (the state machine is the core's) -----------

    def _lost(self, exc: BaseException) -> None:
        """The broker went away: keep what was not sent, reconnect in the background."""
        if self._sock is None:
            return
        self._detach()
        self._lose(exc)
        if self._restoring is not None and not self._restoring.done():
            self._restoring.set_exception(self._gone())
        if self._reconnecting is None:
            if self._connected is None:
                self._connected = self._loop.create_future()
            self._reconnecting = self._loop.create_task(self._reconnect())
            self._reconnecting.add_done_callback(_retrieve)

    async def _reconnect(self) -> None:
        try:
            while self._sock is None:
                pause = self._pause()
                if pause is None:
                    self._shut(self._gave_up())
                    return
                if pause:
                    await asyncio.sleep(pause)
                    continue
                try:
                    self._attach(self._connect())
                except OSError as exc:
                    self._attempt_failed(exc)
                    continue
                try:
                    await asyncio.wait_for(self._restore(), self._policy.confirm_timeout)
                except (OSError, SbusError, asyncio.TimeoutError) as exc:
                    self._detach()
                    self._attempt_failed(exc)
                    refusal = self._refused_replay(exc)
                    if refusal is not None:
                        return self._shut(refusal)
                    continue
                self._restored()
                await self._deliver()
        finally:
            if self._reconnecting is asyncio.current_task():
                self._reconnecting = None
        connected, self._connected = self._connected, None
        if connected is not None and not connected.done():
            connected.set_result(None)

    async def _restore(self) -> None:
        """Send the replay, then wait for the answer to its whoami: then the
        subscriptions are in place."""
        self._eof = False
        fut = self._restoring = self._loop.create_future()
        whoami = Request(WHOAMI, b"", fut)
        # First in line: the broker answers it before any request asked again.
        self._requests.appendleft(whoami)
        try:
            for packet in self._replay():
                while not self._out.add_packet(packet):
                    self._send_all()
            self._send_all()
            self._start_reading()
            await fut
        finally:
            self._restoring = None
            self._unask(whoami)
            self._update_reading()

    def _send_all(self) -> None:
        try:
            self._out.send(self._fd)
        except OSError as exc:
            self._out.clear()
            raise BusClosedError(f"the new connection failed: {exc}") from exc

    async def _deliver(self) -> None:
        """Send the backlog (with the requests asked again first, and what
        is published meanwhile) until it is empty."""
        if self._requests or self._receivers:
            self._start_reading()
        async with self._send_lock:
            self._delivering = True
            self._out_flags = 0
            try:
                while self._backlog and self._sock is not None:
                    self._backlog.move_to(self._out)
                    await self._drain(0)
            finally:
                self._delivering = False
            if self._sock is not None:
                self._live = True

    # -- requests to the broker --------------------------------------------------

    async def query(self, key: Text, payload: Optional[Text] = None, flags: int = 0) -> bytes:
        """Send a control message and return the payload of the broker's reply with that key.

        Messages that arrive first are kept for :meth:`receive`. Buffered
        packets are sent first. A reply that comes after the query was
        cancelled is dropped.
        """
        raw_key = _routing_key(key, "key")
        packet = pack_control(raw_key, payload)
        self._too_large(packet)
        if len(self._out):
            await self.flush()
        if self._closed or (self._eof and self._policy is None):
            raise self._gone()
        # Registered before the request goes out, so its reply finds it; while
        # the broker is away, the reconnect asks the new one.
        fut = self._loop.create_future()
        request = self._asked(raw_key, packet, fut)
        try:
            if self._live:
                await self._send_request(packet, flags)
        except BaseException:
            self._unask(request)
            raise
        self._start_reading()
        try:
            return await fut
        finally:
            self._abandon(request)
            self._update_reading()

    async def _send_request(self, packet: bytes, flags: int) -> None:
        async with self._send_lock:
            if len(self._out):
                await self._drain(0)
            while self._live:
                try:
                    self._sock.send(packet, flags | socket.MSG_NOSIGNAL)
                    return
                except BlockingIOError:
                    await self._writable()
                except OSError as exc:
                    self._send_failed(exc, None)
                    self._lost(exc)
                    return
            if self._policy is None:
                raise self._gone()

    async def whoami(self, flags: int = 0) -> Credentials:
        """Ask the broker for this client's credentials (``!/cred/GID/UID/PID...``)."""
        reply = await self.query(WHOAMI, None, flags)
        return Credentials.parse(reply.decode("ascii", "replace"))

    async def stats(self, flags: int = 0) -> dict:
        """The broker's counters: the JSON reply to ``CMSG stats``."""
        return parse_stats(await self.query(b"stats", None, flags))

def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _retrieve(task: "asyncio.Task") -> None:
    """Mark a background task's exception as seen; the next call reports the state."""
    if not task.cancelled():
        task.exception()


async def connect(address: Optional[str] = None, *, max_message: int = MAX_MESSAGE,
                  **options: Any) -> Client:
    """``Client(address)``, for symmetry with asyncio's ``open_*`` functions."""
    return Client(address, max_message=max_message, **options)
