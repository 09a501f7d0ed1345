"""An asyncio sbus client on the event loop's reader/writer callbacks.

::

    async with sbus.aio.Client(address) as bus:
        await bus.subscribe("sensors/*")
        await bus.publish("sensors/t1", b"21.5")
        async for message in bus:
            ...

The socket is the blocking client's socket put in non-blocking mode. A send
that finds it full waits for ``add_writer`` readiness (back-pressure), and
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
import collections
import errno
import time
from typing import Any, AsyncIterator, Deque, Iterable, List, Optional, Tuple, Union

from . import reconnect as _reconnect
from .._core.batch import AsyncMessages, Inbox, Outbox, Sink, check_pattern
from .._core.batch import take as _take
from .._core.batch import pack_publish as _pack_publish
from .._core.batch import send_publish as _send_publish
from .sync import Client as _BlockingClient
from .protocol import (
    MAX_MESSAGE,
    WHOAMI,
    ControlMessage,
    Credentials,
    Message,
    Text,
    pack_control,
    pack_subscribe,
    pack_unsubscribe,
    parse_stats,
)
from ..errors import (
    BacklogFullError,
    BatchInterruptedError,
    BusClosedError,
    MessageRefusedError,
    MessageTooLargeError,
    SbusError,
)
from .reconnect import Reconnect

__all__ = ["Client", "ControlMessage", "Credentials", "Message", "Reconnect", "connect",
           "FLUSH_DELAY"]

FLUSH_DELAY = 0.002
"""Seconds a buffered client holds a packed message before sending it on its own."""

# Received messages queued before the reader callback stops reading: the
# rest waits in the socket, where it is the broker's back-pressure.
_INBOX_HIGH = 4096

_GONE = frozenset((errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF))

Received = Union[Message, ControlMessage]


class Client:
    """An asyncio connection to an sbus broker; create it inside a running loop.

    The arguments are those of :class:`sbus.Client`, and ``flush_delay``
    for the buffered mode. Connecting a unix socket does not wait for the
    broker, so the constructor is synchronous. With ``reconnect``, a lost
    connection is restored by a background task while publishers fill the
    backlog, receivers wait and queries are asked again of the new broker.
    """

    def __init__(self, address: Optional[str] = None, *, max_message: int = MAX_MESSAGE,
                 buffered: bool = False, flush_delay: float = FLUSH_DELAY,
                 reconnect: Union[None, bool, Reconnect] = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._policy = _reconnect.policy(reconnect)
        self._session = _reconnect.Session() if self._policy else None
        self._backlog = _reconnect.Backlog(self._policy.max_backlog) if self._policy else None
        self.buffered = buffered
        self.flush_delay = flush_delay
        self._bus: Optional[_BlockingClient] = None
        self._attach(_BlockingClient(address, max_message=max_message))
        self.address = self._bus.address
        self.max_message = max_message
        self._closed = False
        self._send_lock = asyncio.Lock()
        self._write_waiter: Optional[asyncio.Future] = None
        self._out = Outbox(max_message)
        self._out_flags = 0
        self._flush_timer: Optional[asyncio.TimerHandle] = None
        self._in = Inbox(max_message, Message, ControlMessage)
        # What was received and nobody took yet: messages, or the exception
        # a receive() should raise at that point.
        self._inbox: Deque[Union[Received, BaseException]] = collections.deque()
        self._receivers: List[asyncio.Future] = []
        self._sink_waiters = 0      # of the receivers, those in receive_into
        # One (key, future, request) per query() whose request was sent, in
        # request order (the broker answers in order); cancelled ones still
        # own a reply.
        self._queries: Deque[Tuple[bytes, asyncio.Future, bytes]] = collections.deque()
        self._reading = False
        self._eof = False
        self._reconnecting: Optional[asyncio.Task] = None
        self._connected: Optional[asyncio.Future] = None   # set while reconnecting
        # True while sends may go straight to the socket: connected, and no
        # backlog left to send before them.
        self._live = True
        self._delivering = False
        self._restoring: Optional[asyncio.Future] = None

    def _attach(self, bus: _BlockingClient) -> None:
        bus.socket.setblocking(False)
        self._bus = bus
        self._fd = bus.fileno()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        return self._bus is not None

    @property
    def backlog(self) -> int:
        """Bytes published while the broker was away and not yet sent."""
        return self._backlog.nbytes if self._backlog is not None else 0

    def fileno(self) -> int:
        if self._bus is None:
            raise BusClosedError("the client is closed" if self._closed else "not connected")
        return self._fd

    def close(self) -> None:
        """Close the connection; waiting senders, receivers and queries get BusClosedError.

        Buffered packets are sent if the socket takes them at once; ``await
        flush()`` first (or leave an ``async with`` block) to wait for the rest.
        """
        if self._closed:
            return
        if len(self._out) and self._bus is not None:
            try:
                self._out.send(self._fd, self._out_flags)
            except OSError:
                pass
        self._shut(BusClosedError("the client is closed"))

    def _shut(self, exc: BusClosedError) -> None:
        self._closed = True
        if self._reconnecting is not None and self._reconnecting is not asyncio.current_task():
            self._reconnecting.cancel()
        self._reconnecting = None
        self._cancel_timer()
        self._out.clear()
        self._detach()
        waiters = [self._write_waiter, self._connected, *self._receivers,
                   *(f for _, f, _ in self._queries)]
        self._write_waiter = self._connected = None
        self._receivers.clear()
        self._queries.clear()
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
        if self._bus is not None:
            self._bus.close()
            self._bus = None
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

    def __repr__(self) -> str:
        state = ("closed" if self._closed else "disconnected" if self._bus is None
                 else f"fd={self._fd}")
        return f"<sbus.aio.Client {self.address!r} {state}>"

    # -- sending ---------------------------------------------------------------

    def _gone(self, exc: Optional[BaseException] = None) -> BusClosedError:
        if self._closed:
            return BusClosedError("the client is closed")
        return BusClosedError("the broker closed the connection")

    async def send_packet(self, packet: bytes, flags: int = 0) -> None:
        """Send one raw packet, waiting while the socket is full (buffered:
        pack it behind the buffered messages)."""
        if len(packet) > self.max_message:
            raise MessageTooLargeError(
                f"packet of {len(packet)} bytes exceeds the bus limit of {self.max_message}")
        if self._closed:
            raise self._gone()
        if self._session is not None:
            if packet.startswith(b"SUB "):
                check_pattern(packet[4:])   # replayed on every reconnect: never a refused one
            if self._session.note(packet) and self._bus is None:
                return      # replayed once the broker is back
        if self.buffered:
            await self._pack(packet, flags)
            return
        if not self._live:
            return self._keep(packet)
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
            if self._closed or self._policy is None:
                raise self._gone()
            return self._keep(packet)
        try:
            self._bus.socket.send(packet, flags | 0x4000)   # MSG_NOSIGNAL
        except BlockingIOError:
            raise
        except OSError as exc:
            self._send_failed(exc, packet)

    def _send_failed(self, exc: OSError, packet: Optional[bytes]) -> None:
        if exc.errno == errno.EMSGSIZE:
            raise MessageTooLargeError(
                f"the kernel refused a {len(packet or b'')}-byte packet (socket send buffer "
                f"too small; see net.core.wmem_max)") from exc
        if exc.errno not in _GONE:
            raise exc
        if self._closed or self._policy is None:
            raise self._gone() from exc
        self._lost(exc)
        if packet is not None:
            self._keep(packet)

    def _keep(self, packet: bytes) -> None:
        if self._policy is None:
            raise self._gone()
        if not self._session.covers(packet):
            self._backlog.add(packet)

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

    async def _pack(self, packet: bytes, flags: int) -> None:
        if flags != self._out_flags and len(self._out):
            await self.flush()
        self._out_flags = flags
        while not self._out.add_packet(packet):
            await self.flush()
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
                self._lost_outbox(out)
                return
            before = out.head
            try:
                out.send(self._fd, self._out_flags)
            except BlockingIOError:
                await self._writable()
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise
                sent = done + out.head - before
                if self._closed or self._policy is None:
                    total = done + len(out) + out.head - before
                    out.clear()
                    self._fail(self._gone())
                    raise BatchInterruptedError(
                        f"the broker closed the connection after {sent} of {total} messages "
                        f"of the batch were sent", sent) from exc
                self._lost(exc)
                return

    def _keep_outbox(self, out: Outbox, done: int) -> None:
        """The broker is away: what ``out`` holds goes behind the backlog, in
        order, within max_backlog. BacklogFullError at the first packet that
        does not fit (``index`` and ``sent``: ``done`` plus the packets kept
        before it; it and the rest are not kept)."""
        try:
            for i, packet in enumerate(out.unsent()):
                if not self._session.covers(packet):
                    self._backlog.add(packet)
        except BacklogFullError as exc:
            exc.index = exc.sent = done + i
            raise
        finally:
            out.clear()

    def _lost_outbox(self, out: Optional[Outbox] = None) -> None:
        """Keep what the outbox (or ``out``) still owes, in front of the backlog."""
        if out is None:
            out = self._out
        unsent = [p for p in out.unsent() if not self._session.covers(p)]
        out.clear()
        for packet in reversed(unsent):
            self._backlog.packets.appendleft(packet)
            self._backlog.nbytes += len(packet)

    async def subscribe(self, pattern: Text, flags: int = 0) -> None:
        await self.send_packet(pack_subscribe(pattern), flags)

    async def unsubscribe(self, pattern: Text, flags: int = 0) -> None:
        await self.send_packet(pack_unsubscribe(pattern), flags)

    async def publish(self, key: Text, payload: Text = b"", flags: int = 0) -> None:
        """Publish one message (buffered: pack it). KeyRefusedError or
        MessageTooLargeError, before anything is sent, for a message the
        broker would refuse."""
        if self.buffered:
            if flags != self._out_flags and len(self._out):
                await self.flush()
            self._out_flags = flags
            if not self._out.add_publish(key, payload):
                await self.flush()
                self._out.add_publish(key, payload)
            if self._flush_timer is None:
                self._arm_timer()
            return
        if self._live and not len(self._out) and not self._send_lock.locked():
            try:
                return _send_publish(self._fd, key, payload, flags, self.max_message)
            except BlockingIOError:
                pass
            except OSError as exc:
                return self._send_failed(exc, _pack_publish(key, payload, self.max_message))
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
                self._lost_outbox(box)
        return count

    async def send_cmsg(self, key: Text, payload: Optional[Text] = None, flags: int = 0) -> None:
        await self.send_packet(pack_control(key, payload), flags)

    # -- receiving -------------------------------------------------------------

    async def receive(self) -> Received:
        """The next message; BusClosedError once the broker has closed the connection."""
        while not self._inbox:
            if self._closed or (self._eof and self._policy is None):
                raise self._gone()
            if not self._reading and self._bus is not None:
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
        if len(inbox) < max and not self._reading and self._bus is not None:
            self._read_until_empty()
        return _take(inbox, max)

    async def receive_into(self, sink: Sink, max: int = 64) -> List[Received]:
        """As :meth:`receive_many`, but the messages go to ``sink``, a C
        consumer (sbus._core.batch.Sink, such as the bridge's
        natswire.Exporter), with no Python object made for each. Waits for
        at least one packet; returns the control messages among them
        (usually none). Messages already read as objects (by receive(), or
        queued behind a control message) reach it by ``sink.add()``, in order."""
        while True:
            if self._inbox:
                items = await self.receive_many(max)
                sink.add([m for m in items if type(m) is Message])
                return [m for m in items if type(m) is not Message]
            if self._closed or (self._eof and self._policy is None):
                raise self._gone()
            if not self._reading and self._bus is not None:
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
        if not self._reading and self._bus is not None:
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
        return any(not f.done() for _, f, _ in self._queries)

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
        queued (so nothing overtakes what is); returns how many it took."""
        inbox = self._inbox
        taken = 0
        while self._bus is not None and len(inbox) < _INBOX_HIGH and taken < _INBOX_HIGH:
            try:
                batch = self._in.receive(self._fd, limit, 0, -1.0, sink)
            except BlockingIOError:
                return taken
            except OSError as exc:
                if exc.errno in _GONE and self._policy is not None:
                    self._lost(exc)
                    return taken
                inbox.append(exc)
                self._fail(BusClosedError(f"the connection failed: {exc}"))
                return taken
            taken += self._in.taken
            if not self._in.irregular:
                inbox.extend(batch)
                continue
            for item in batch:
                if type(item) is ControlMessage:
                    if not self._answer(item):
                        inbox.append(item)
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

    def _answer(self, reply: ControlMessage) -> bool:
        """Hand a control message to the oldest query with its key, if there is one."""
        for i, (key, fut, _) in enumerate(self._queries):
            if key == reply.key:
                del self._queries[i]
                if not fut.done():  # a cancelled query's reply is dropped
                    fut.set_result(reply.payload)
                return True
        return False

    def _fail(self, exc: BusClosedError) -> None:
        self._eof = True
        self._stop_reading()
        for _, fut, _ in self._queries:
            if not fut.done():
                fut.set_exception(exc)
        self._queries.clear()
        for fut in self._receivers:
            if not fut.done():
                fut.set_result(None)

    # -- losing and finding the broker ---------------------------------------------

    def _lost(self, exc: BaseException) -> None:
        """The broker went away: keep what was not sent, reconnect in the background."""
        if self._bus is None:
            return
        self._lost_outbox()
        self._detach()
        # The new broker is asked again what the old one left unanswered;
        # cancelled queries need no answer.
        self._queries = collections.deque(q for q in self._queries if not q[1].done())
        if self._restoring is not None and not self._restoring.done():
            self._restoring.set_exception(BusClosedError("the broker closed the connection"))
        if self._reconnecting is None:
            if self._connected is None:
                self._connected = self._loop.create_future()
            if self._policy.on_disconnect is not None:
                self._policy.on_disconnect(exc)
            self._reconnecting = self._loop.create_task(self._reconnect())
            self._reconnecting.add_done_callback(_retrieve)

    async def _reconnect(self) -> None:
        policy = self._policy
        failures = 0
        down_since = time.monotonic()
        try:
            while self._bus is None:
                if policy.exhausted(failures, time.monotonic() - down_since):
                    self._shut(BusClosedError(
                        f"{self.address}: no broker after {failures} attempts to reconnect"))
                    return
                await asyncio.sleep(policy.delay(failures))
                try:
                    self._attach(_BlockingClient(self.address, max_message=self.max_message))
                except OSError:
                    failures += 1
                    continue
                try:
                    await asyncio.wait_for(self._restore(), policy.confirm_timeout)
                except (OSError, SbusError, asyncio.TimeoutError):
                    self._detach()
                    failures += 1
                    continue
                failures = 0
                await self._deliver()
        finally:
            if self._reconnecting is asyncio.current_task():
                self._reconnecting = None
        connected, self._connected = self._connected, None
        if connected is not None and not connected.done():
            connected.set_result(None)
        if policy.on_reconnect is not None:
            policy.on_reconnect()

    async def _restore(self) -> None:
        """Replay the session, then wait for the answer to a whoami asked
        after it: then the subscriptions are in place."""
        self._eof = False
        fut = self._restoring = self._loop.create_future()
        entry = (WHOAMI, fut, b"")
        # First in line: the broker answers it before any re-asked query.
        self._queries.appendleft(entry)
        try:
            for packet in self._session.replay() + [pack_control(WHOAMI)]:
                while not self._out.add_packet(packet):
                    self._send_all()
            self._send_all()
            self._start_reading()
            await fut
        finally:
            self._restoring = None
            if entry in self._queries:
                self._queries.remove(entry)
            self._update_reading()

    def _send_all(self) -> None:
        try:
            self._out.send(self._fd)
        except OSError as exc:
            self._out.clear()
            raise BusClosedError(f"the new connection failed: {exc}") from exc

    async def _deliver(self) -> None:
        """Ask the queries the old broker never answered, then send the
        backlog (and what is published meanwhile) until it is empty."""
        backlog, out = self._backlog, self._out
        for _, _, request in self._queries:
            backlog.packets.appendleft(request)
            backlog.nbytes += len(request)
        if self._queries or self._receivers:
            self._start_reading()
        async with self._send_lock:
            self._delivering = True
            self._out_flags = 0
            try:
                while backlog.packets and self._bus is not None:
                    while backlog.packets and out.add_packet(backlog.packets[0]):
                        backlog.taken(1)
                    await self._drain(0)
            finally:
                self._delivering = False
            if self._bus is not None:
                self._live = True

    # -- requests to the broker --------------------------------------------------

    async def query(self, key: Text, payload: Optional[Text] = None, flags: int = 0) -> bytes:
        """Send a control message and return the payload of the broker's reply with that key.

        Messages that arrive first are kept for :meth:`receive`. Buffered
        packets are sent first.
        """
        packet = pack_control(key, payload)
        raw_key = packet[5:].partition(b"\0")[0]
        if len(self._out):
            await self.flush()
        if self._closed or (self._eof and self._policy is None):
            raise self._gone()
        # Registered before the request goes out, so its reply finds it; while
        # the broker is away, the reconnect asks the new one.
        fut = self._loop.create_future()
        entry = (raw_key, fut, packet)
        self._queries.append(entry)
        try:
            if self._live:
                await self._send_request(packet, flags)
        except BaseException:
            if entry in self._queries:     # never sent: no reply to wait for
                self._queries.remove(entry)
            raise
        self._start_reading()
        try:
            return await fut
        finally:
            self._update_reading()

    async def _send_request(self, packet: bytes, flags: int) -> None:
        async with self._send_lock:
            if len(self._out):
                await self._drain(0)
            while self._live:
                try:
                    self._bus.socket.send(packet, flags | 0x4000)   # MSG_NOSIGNAL
                    return
                except BlockingIOError:
                    await self._writable()
                except OSError as exc:
                    if exc.errno in _GONE and self._policy is not None and not self._closed:
                        self._lost(exc)
                        return
                    self._send_failed(exc, None)
            if self._policy is None:
                raise self._gone()

    async def whoami(self, flags: int = 0) -> Credentials:
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
