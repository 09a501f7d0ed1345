"""Asking ``sbus store`` for recorded messages: replay, follow, last values, stats.

Each call opens a connection of its own to the same broker as ``client``
(its ``address`` and ``max_message``). The store answers on a private
``!/cred/...`` key of that connection, and its answers must not mix with the
messages ``client``'s own subscriptions bring: the public client API has no
way to give such messages back to it. The protocol is in docs/store.md and
:mod:`sbus.store.wire`; memory is bounded by the flow-control window
(``window`` answers of at most 64 KiB each), however long the range.

``Client.replay``/``Client.last`` can delegate here::

    def replay(self, pattern, since=None, until=None, after=None, **options):
        from .store import replay
        return replay(self, pattern, since, until, after, **options)
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Union

from ..errors import SbusError
from ..store import wire
from ..store.segments import HEADER, RECORD, parse_gap
from .protocol import MAX_MESSAGE, Message, Text, encode

__all__ = ["AsyncReplay", "Gap", "Replay", "StoreError", "alast", "areplay", "astore_stats",
           "last", "replay", "store_stats"]

# How long to wait for the store to take a request.
ANSWER_TIMEOUT = 10.0

Time = Union[None, int, float]


class StoreError(SbusError):
    """The store refused a request (the message says why) or did not answer."""


class Gap(NamedTuple):
    """Messages the store lost at this point of the log: ``lost`` of them
    (-1: unknown), because of ``reason`` (flood, disconnected, disk_full,
    retention); ``seq`` is the gap record's own seq (0 for retention)."""

    seq: int
    lost: int
    reason: str


def _seconds(t: Time) -> Optional[float]:
    if t is None:
        return None
    return float(t)


class _Session:
    """The protocol state shared by the blocking and asyncio iterators."""

    def __init__(self, op: str, pattern: Text, since: Time, until: Time, after: Optional[int],
                 follow: bool, window: int, on_gap: Optional[Callable[[Gap], None]]) -> None:
        self.op = op
        self.fields = dict(pattern=encode(pattern), since=_seconds(since), until=_seconds(until),
                           after=after, follow=follow or None, window=window)
        self.window = window
        self.on_gap = on_gap
        self.id = secrets.token_hex(4)
        self.token = b""
        self.acked = 0
        self.buffer = b""
        self.ended = False
        self.seq = 0            # of the last message yielded
        self.time = 0.0         # when the store received it (seconds since the epoch)
        self.gaps = 0
        self.lost = 0
        self.first = self.last = 0

    def reply_key(self, credentials: Any) -> str:
        return f"{credentials}/sbus/store/{self.id}"

    def request(self, reply: str) -> bytes:
        return wire.request(self.op, id=self.id, reply=reply, **self.fields)

    def take(self, payload: bytes) -> Optional[bytes]:
        """Digest one answer; the ack request to send, if one is due.
        Raises StoreError for an error answer."""
        try:
            kind, ident, n, body = wire.parse_answer(payload)
        except ValueError:
            return None
        if ident.decode("ascii", "replace") != self.id:
            return None
        if kind == wire.ERROR:
            raise StoreError(f"the store refused the request: {body.decode('utf-8', 'replace')}")
        if kind == wire.OK:
            fields = wire.decode_fields(body)
            self.token = fields.get("session", b"")
            self.first = int(fields.get("first", b"0"))
            self.last = int(fields.get("last", b"0"))
        elif kind == wire.DATA:
            self.buffer = self.buffer + body if self.buffer else body
            if n - self.acked >= max(1, self.window // 2):
                self.acked = n
                return wire.request("ack", session=self.token, n=n)
        elif kind == wire.END:
            self.ended = True
        return None

    def records(self) -> List[Any]:
        """The whole records in the buffer: (seq, time_ns, Message) each,
        or (seq, time_ns, Gap) for a note from the store."""
        data, pos, end = self.buffer, 0, len(self.buffer)
        out: List[Any] = []
        append = out.append
        unpack = RECORD.unpack_from
        while end - pos >= HEADER:
            size, _, seq, time_ns, key_len = unpack(data, pos)
            if end - pos < size:
                break
            k = pos + HEADER + key_len
            key = data[pos + HEADER:k]
            if key[:1] == b"!":
                append((seq, time_ns, self.gap(seq, data[k:pos + size])))
            else:
                append((seq, time_ns, Message(key, data[k:pos + size])))
            pos += size
        self.buffer = data[pos:] if pos < end else b""
        return out

    def gap(self, seq: int, payload: bytes) -> Gap:
        lost, reason = parse_gap(payload)
        self.gaps += 1
        self.lost += max(lost, 0)
        g = Gap(seq, lost, reason)
        if self.on_gap is not None:
            self.on_gap(g)
        return g


class _Position:
    """What an iteration has reached (both iterators)."""

    _s: _Session

    @property
    def seq(self) -> int:
        """The seq of the last message yielded (resume with ``after=seq``)."""
        return self._s.seq

    @property
    def time(self) -> float:
        """When the store received the last message yielded (seconds since the epoch)."""
        return self._s.time

    @property
    def gaps(self) -> int:
        """Gaps met so far."""
        return self._s.gaps

    @property
    def lost(self) -> int:
        """Messages those gaps lost, as far as known."""
        return self._s.lost

    @property
    def first(self) -> int:
        """The first seq in the log when the store took the request."""
        return self._s.first

    @property
    def last(self) -> int:
        """The last seq in the log when the store took the request."""
        return self._s.last


class Replay(_Position):
    """An iterator of the recorded :class:`Message`s, in store order.

    After each message, ``seq`` and ``time`` are its sequence number and
    when the store received it: keep ``seq`` to resume with ``after=``.
    Where the log has a gap, ``on_gap(Gap)`` is called (``gaps`` and ``lost``
    count them). With ``follow``, the iteration goes on with messages as the
    store records them, until :meth:`close`. Closing the iterator (or
    leaving its ``with`` block) closes its connection.
    """

    def __init__(self, client: Any, op: str, pattern: Text, since: Time = None,
                 until: Time = None, after: Optional[int] = None, *, follow: bool = False,
                 window: int = wire.DEFAULT_WINDOW, request_key: Text = wire.REQUEST_KEY,
                 timeout: float = ANSWER_TIMEOUT, on_gap: Optional[Callable[[Gap], None]] = None
                 ) -> None:
        from .sync import Client
        self._s = _Session(op, pattern, since, until, after, follow, window, on_gap)
        self._request_key = encode(request_key)
        self._timeout = timeout
        self._bus = Client(client.address, max_message=getattr(client, "max_message", MAX_MESSAGE))
        try:
            reply = self._s.reply_key(self._bus.whoami(timeout=timeout))
            self._bus.subscribe(reply)
            self._bus.publish(self._request_key, self._s.request(reply))
            while not self._s.token:
                self._next_answer(timeout)
        except BaseException:
            self._bus.close()
            raise
        self._it = self._generate()

    def _next_answer(self, timeout: Optional[float]) -> None:
        try:
            m = self._bus.receive(timeout=timeout)
        except TimeoutError:
            raise StoreError(f"no answer from the store on {self._request_key.decode()!r} "
                             f"within {timeout:g} s") from None
        if type(m) is Message:
            ack = self._s.take(m.payload)
            if ack is not None:
                self._bus.publish(self._request_key, ack)

    def _generate(self) -> Iterator[Message]:
        s = self._s
        while True:
            for seq, time_ns, message in s.records():
                if type(message) is Message:
                    s.seq, s.time = seq, time_ns / 1e9
                    yield message
            if s.ended:
                return
            # The store keeps answering while it has data; a follower waits.
            self._next_answer(None if s.fields["follow"] else self._timeout)

    def __iter__(self) -> "Replay":
        return self

    def __next__(self) -> Message:
        try:
            return next(self._it)
        except StopIteration:
            self.close()
            raise

    def close(self) -> None:
        if self._bus.closed:
            return
        if not self._s.ended and self._s.token:
            try:
                self._bus.publish(self._request_key,
                                  wire.request("cancel", session=self._s.token))
            except (OSError, SbusError):
                pass
        self._bus.close()

    def __enter__(self) -> "Replay":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def replay(client: Any, pattern: Text, since: Time = None, until: Time = None,
           after: Optional[int] = None, **options: Any) -> Replay:
    """The recorded messages whose keys match ``pattern``, in store order:
    received at or after ``since`` and at or before ``until`` (seconds since
    the epoch), with a seq greater than ``after``. ``follow=True`` goes on
    live, with no gap or repeat at the seam (the store sends both parts).
    Options: ``follow``, ``window``, ``request_key``, ``timeout``, ``on_gap``."""
    return Replay(client, "replay", pattern, since, until, after, **options)


def last(client: Any, pattern: Text, **options: Any) -> List[Message]:
    """The last recorded message of each key matching ``pattern``, in store order."""
    with Replay(client, "last", pattern, **options) as it:
        return list(it)


def store_stats(client: Any, *, request_key: Text = wire.REQUEST_KEY,
                timeout: float = ANSWER_TIMEOUT) -> Dict[str, Any]:
    """The store's counters (the same as its ``store_stats`` log records)."""
    from .sync import Client
    ident = secrets.token_hex(4)
    with Client(client.address, max_message=getattr(client, "max_message", MAX_MESSAGE)) as bus:
        reply = f"{bus.whoami(timeout=timeout)}/sbus/store/{ident}"
        bus.subscribe(reply)
        bus.publish(request_key, wire.request("stats", id=ident, reply=reply))
        deadline = time.monotonic() + timeout
        while True:
            try:
                m = bus.receive(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise StoreError(f"no answer from the store within {timeout:g} s") from None
            if type(m) is not Message:
                continue
            return _stats_answer(m.payload, ident)


def _stats_answer(payload: bytes, ident: str) -> Dict[str, Any]:
    kind, got, _, body = wire.parse_answer(payload)
    if kind == wire.ERROR:
        raise StoreError(body.decode("utf-8", "replace"))
    return json.loads(body)


# -- asyncio -----------------------------------------------------------------------------


class AsyncReplay(_Position):
    """:class:`Replay` for :class:`sbus.client.aio.Client`: ``async for``,
    ``await close()``, ``async with``. Made by :func:`areplay`."""

    def __init__(self, s: _Session, bus: Any, request_key: bytes, timeout: float) -> None:
        self._s, self._bus, self._request_key, self._timeout = s, bus, request_key, timeout
        self._ready: List[Any] = []
        self._i = 0

    @classmethod
    async def open(cls, client: Any, op: str, pattern: Text, since: Time = None,
                   until: Time = None, after: Optional[int] = None, *, follow: bool = False,
                   window: int = wire.DEFAULT_WINDOW, request_key: Text = wire.REQUEST_KEY,
                   timeout: float = ANSWER_TIMEOUT,
                   on_gap: Optional[Callable[[Gap], None]] = None) -> "AsyncReplay":
        from .aio import Client
        s = _Session(op, pattern, since, until, after, follow, window, on_gap)
        bus = Client(client.address, max_message=getattr(client, "max_message", MAX_MESSAGE))
        self = cls(s, bus, encode(request_key), timeout)
        try:
            reply = s.reply_key(await asyncio.wait_for(bus.whoami(), timeout))
            await bus.subscribe(reply)
            await bus.publish(self._request_key, s.request(reply))
            while not s.token:
                await self._next_answer(timeout)
        except BaseException:
            bus.close()
            raise
        return self

    async def _next_answer(self, timeout: Optional[float]) -> None:
        try:
            m = await asyncio.wait_for(self._bus.receive(), timeout)
        except asyncio.TimeoutError:
            raise StoreError(f"no answer from the store within {timeout:g} s") from None
        if type(m) is Message:
            ack = self._s.take(m.payload)
            if ack is not None:
                await self._bus.publish(self._request_key, ack)

    def __aiter__(self) -> "AsyncReplay":
        return self

    async def __anext__(self) -> Message:
        s = self._s
        while True:
            while self._i < len(self._ready):
                seq, time_ns, message = self._ready[self._i]
                self._i += 1
                if type(message) is Message:
                    s.seq, s.time = seq, time_ns / 1e9
                    return message
            self._ready, self._i = s.records(), 0
            if self._ready:
                continue
            if s.ended:
                await self.close()
                raise StopAsyncIteration
            await self._next_answer(None if s.fields["follow"] else self._timeout)

    async def close(self) -> None:
        if self._bus.closed:
            return
        if not self._s.ended and self._s.token:
            try:
                await self._bus.publish(self._request_key,
                                        wire.request("cancel", session=self._s.token))
            except (OSError, SbusError):
                pass
        self._bus.close()

    async def __aenter__(self) -> "AsyncReplay":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


async def areplay(client: Any, pattern: Text, since: Time = None, until: Time = None,
                  after: Optional[int] = None, **options: Any) -> AsyncReplay:
    """:func:`replay` for the asyncio client: ``async for m in await areplay(bus, "news/")``."""
    return await AsyncReplay.open(client, "replay", pattern, since, until, after, **options)


async def alast(client: Any, pattern: Text, **options: Any) -> List[Message]:
    """:func:`last` for the asyncio client."""
    it = await AsyncReplay.open(client, "last", pattern, **options)
    async with it:
        return [m async for m in it]


async def astore_stats(client: Any, *, request_key: Text = wire.REQUEST_KEY,
                       timeout: float = ANSWER_TIMEOUT) -> Dict[str, Any]:
    """:func:`store_stats` for the asyncio client."""
    from .aio import Client
    ident = secrets.token_hex(4)
    bus = Client(client.address, max_message=getattr(client, "max_message", MAX_MESSAGE))
    try:
        reply = f"{await asyncio.wait_for(bus.whoami(), timeout)}/sbus/store/{ident}"
        await bus.subscribe(reply)
        await bus.publish(request_key, wire.request("stats", id=ident, reply=reply))
        while True:
            m = await asyncio.wait_for(bus.receive(), timeout)
            if type(m) is Message:
                return _stats_answer(m.payload, ident)
    except asyncio.TimeoutError:
        raise StoreError(f"no answer from the store within {timeout:g} s") from None
    finally:
        bus.close()
