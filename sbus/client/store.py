"""Asking ``sbus store`` for recorded messages: replay, follow, last values, stats.

Each call opens a connection of its own to the same broker as ``client``
(its ``address`` and ``max_message``). The store answers on a private
``!/cred/...`` key of that connection, and its answers must not mix with the
messages ``client``'s own subscriptions bring: the public client API has no
way to give such messages back to it. The protocol is in docs/store.md and
:mod:`sbus.store.wire`; memory is bounded by the flow-control window
(``window`` answers of at most 64 KiB each), however long the range.

The conversation with the store is one plan (:func:`_replaying`, see
:mod:`sbus.client.steps`), run by :class:`Replay` over a blocking connection
and by :class:`AsyncReplay` over an asyncio one; ``Client.replay`` and
``Client.last`` of either client delegate here.
"""
from __future__ import annotations

import decimal
import json
import operator
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Union

from ..errors import SbusError
from ..store import wire
from ..store.segments import iter_records, parse_gap
from .chunks import SUFFIX, Reassembler
from .private import PrivateInbox

if TYPE_CHECKING:   # the contract; services.py imports this module
    from .services import BusClient
from .protocol import MAX_MESSAGE, Message, Text, encode
from .steps import ITEM, Plan, Run, Steps

__all__ = ["AsyncReplay", "Gap", "Replay", "StoreError", "alast", "areplay", "astore_stats",
           "from_ns", "last", "replay", "store_stats"]

# How long to wait for the store to take a request.
ANSWER_TIMEOUT = 10.0
# The reply key (sbus.client.private): <credentials>/store/<id>/answer.
KIND, ANSWER = "store", "answer"

# Seconds since the epoch. A Decimal or a str ("1764000000.123456789") is
# sent as it is written, exact to the nanosecond; a float holds today's
# epoch to about 240 ns only (docs/store.md, "since" and "until").
Time = Union[None, int, float, decimal.Decimal, str]


class StoreError(SbusError):
    """The store refused a request (the message says why) or did not answer."""


class Gap(NamedTuple):
    """Messages the store lost at this point of the log: ``lost`` of them
    (-1: unknown), because of ``reason`` (flood, disconnected, disk_full,
    retention); ``seq`` is the gap record's own seq (0 for retention)."""

    seq: int
    lost: int
    reason: str


def _seconds(t: Time) -> Optional[str]:
    """A bound as the request's decimal text, with every digit it was given."""
    if t is None:
        return None
    if isinstance(t, bool):
        raise TypeError("a time is seconds since the epoch, not a bool")
    if isinstance(t, (decimal.Decimal, str)):
        try:
            exact = decimal.Decimal(t)
        except decimal.InvalidOperation:
            raise ValueError(f"not a time in seconds since the epoch: {t!r}") from None
        if not exact.is_finite():
            raise ValueError(f"not a time in seconds since the epoch: {t!r}")
        return format(exact, "f")
    try:
        return str(operator.index(t))     # int, and numpy's integers
    except TypeError:
        return repr(float(t))   # float, and what float() takes (numpy's floats repr otherwise)


def from_ns(time_ns: int) -> decimal.Decimal:
    """``time_ns`` (a record's, as ``Replay.time_ns`` gives it) in seconds,
    exactly: a bound that finds that record."""
    return decimal.Decimal(time_ns).scaleb(-9)


class _Session:
    """The protocol state shared by the blocking and asyncio iterators."""

    def __init__(self, op: str, pattern: Text, since: Time, until: Time, after: Optional[int],
                 follow: bool, window: int, on_gap: Optional[Callable[[Gap], None]]) -> None:
        self.op = op
        self.fields = dict(pattern=encode(pattern), since=_seconds(since), until=_seconds(until),
                           after=after, follow=follow or None, window=window)
        self.window = window
        self.on_gap = on_gap
        self.id = ""            # the inbox's, once opened
        self.token = b""
        self.acked = 0
        self.buffer = b""
        self.ended = False
        self.seq = 0            # of the last message yielded
        self.time_ns = 0        # when the store received it (nanoseconds since the epoch)
        self.gaps = 0
        self.lost = 0
        self.first = self.last = 0
        self.chunks = Reassembler()     # chunked messages come back whole (docs/chunks.md)

    def open(self, credentials: Any) -> PrivateInbox:
        """The inbox the answers come to (sbus.client.private); its id is the request's."""
        inbox = PrivateInbox(credentials, KIND)
        self.id = inbox.id
        return inbox

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
        data, done = self.buffer, 0
        out: List[Any] = []
        for seq, time_ns, key, payload, offset, size in iter_records(data):
            out.append((seq, time_ns, self.gap(seq, payload) if key[:1] == b"!"
                        else Message(key, payload)))
            done = offset + size
        self.buffer = data[done:] if done < len(data) else b""
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
        """When the store received the last message yielded (seconds since
        the epoch, a float: to about 240 ns; :attr:`time_ns` is exact)."""
        return self._s.time_ns / 1e9

    @property
    def time_ns(self) -> int:
        """When the store received the last message yielded, in nanoseconds
        since the epoch, as the store has it: ``since=from_ns(it.time_ns)``
        finds that message again."""
        return self._s.time_ns

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


_READY = object()      # what the plan hands out first: the store took the request


def _replaying(s: _Session, request_key: bytes, timeout: float) -> Plan:
    """A replay's plan on its own connection (see .steps): ask, then hand out
    the messages of the store's answers, acknowledging them as the window says."""
    inbox = s.open((yield ("whoami", timeout)))
    yield ("subscribe", None, inbox.pattern)
    yield ("publish", None, request_key, s.request(inbox.key(ANSWER)))
    while not s.token:
        yield from _answer(s, request_key, timeout)
    yield (ITEM, _READY)
    while True:
        for seq, time_ns, message in s.records():
            if type(message) is Message:
                if message.key.endswith(SUFFIX):
                    message = s.chunks.feed(message.key, message.payload)
                    if message is None:     # more of it to come, or lost (docs/chunks.md)
                        continue
                s.seq, s.time_ns = seq, time_ns
                yield (ITEM, message)
        if s.ended:
            return
        # The store keeps answering while it has data; a follower waits.
        yield from _answer(s, request_key, None if s.fields["follow"] else timeout)


def _answer(s: _Session, request_key: bytes, timeout: Optional[float]) -> Plan:
    try:
        m = yield ("receive", timeout)
    except TimeoutError:
        raise StoreError(f"no answer from the store on {request_key.decode()!r} "
                         f"within {timeout:g} s") from None
    if type(m) is Message:
        ack = s.take(m.payload)
        if ack is not None:
            yield ("publish", None, request_key, ack)


def _cancelling(s: _Session, request_key: bytes) -> Plan:
    if not s.ended and s.token:
        yield ("publish", None, request_key, wire.request("cancel", session=s.token))


def _asking_stats(request_key: bytes, timeout: float) -> Plan:
    inbox = PrivateInbox((yield ("whoami", timeout)), KIND)
    yield ("subscribe", None, inbox.pattern)
    yield ("publish", None, request_key, wire.request("stats", id=inbox.id,
                                                      reply=inbox.key(ANSWER)))
    deadline = time.monotonic() + timeout
    while True:
        try:
            m = yield ("receive", max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise StoreError(f"no answer from the store within {timeout:g} s") from None
        if type(m) is Message:
            kind, _, _, body = wire.parse_answer(m.payload)
            if kind == wire.ERROR:
                raise StoreError(body.decode("utf-8", "replace"))
            yield (ITEM, json.loads(body))


def _own(client: BusClient, awaited: bool) -> Any:
    """A connection of the replay's own, of the kind of ``client``."""
    if awaited:
        from .aio import Client
    else:
        from .sync import Client  # type: ignore[assignment]
    return Client(client.address, max_message=getattr(client, "max_message", MAX_MESSAGE))


class Replay(_Position, Steps):
    """An iterator of the recorded :class:`Message`s, in store order.

    After each message, ``seq`` and ``time`` are its sequence number and
    when the store received it: keep ``seq`` to resume with ``after=``.
    Where the log has a gap, ``on_gap(Gap)`` is called (``gaps`` and ``lost``
    count them). With ``follow``, the iteration goes on with messages as the
    store records them, until :meth:`close`. Closing the iterator (or
    leaving its ``with`` block) closes its connection. The plan is
    :func:`_replaying`; :class:`AsyncReplay` runs it over an asyncio client.
    """

    _awaited = False

    def __init__(self, client: BusClient, op: str, pattern: Text, since: Time = None,
                 until: Time = None, after: Optional[int] = None, *, follow: bool = False,
                 window: int = wire.DEFAULT_WINDOW, request_key: Text = wire.REQUEST_KEY,
                 timeout: float = ANSWER_TIMEOUT, on_gap: Optional[Callable[[Gap], None]] = None
                 ) -> None:
        self._s = _Session(op, pattern, since, until, after, follow, window, on_gap)
        self._request_key = encode(request_key)
        self._client = _own(client, self._awaited)
        self._plan = _replaying(self._s, self._request_key, timeout)
        if not self._awaited:
            try:
                Steps.__next__(self)     # _READY: the store took the request
            except BaseException:
                self._client.close()
                raise

    def __next__(self) -> Message:
        try:
            return Steps.__next__(self)
        except StopIteration:
            self.close()
            raise

    def close(self) -> None:
        if self._client.closed:
            return
        try:
            for _ in Run(self._client, _cancelling(self._s, self._request_key)):
                pass
        except (OSError, SbusError):
            pass
        self._client.close()

    def __enter__(self) -> "Replay":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def replay(client: BusClient, pattern: Text, since: Time = None, until: Time = None,
           after: Optional[int] = None, **options: Any) -> Replay:
    """The recorded messages whose keys match ``pattern``, in store order:
    received at or after ``since`` and at or before ``until`` (seconds since
    the epoch: a Decimal or a decimal str is exact to the nanosecond, as
    :func:`from_ns` makes one), with a seq greater than ``after``. ``follow=True`` goes on
    live, with no gap or repeat at the seam (the store sends both parts).
    Options: ``follow``, ``window``, ``request_key``, ``timeout``, ``on_gap``."""
    return Replay(client, "replay", pattern, since, until, after, **options)


def last(client: BusClient, pattern: Text, **options: Any) -> List[Message]:
    """The last recorded message of each key matching ``pattern``, in store order."""
    with Replay(client, "last", pattern, **options) as it:
        return list(it)


def store_stats(client: BusClient, *, request_key: Text = wire.REQUEST_KEY,
                timeout: float = ANSWER_TIMEOUT) -> Dict[str, Any]:
    """The store's counters (the same as its ``store_stats`` log records)."""
    with _own(client, False) as bus:
        return next(Run(bus, _asking_stats(encode(request_key), timeout)))


# -- asyncio -----------------------------------------------------------------------------


class AsyncReplay(Replay):
    """:class:`Replay` for :class:`sbus.client.aio.Client`: ``async for``,
    ``await close()``, ``async with``. Made by :func:`areplay`."""

    _awaited = True

    @classmethod
    async def open(cls, client: BusClient, *args: Any, **options: Any) -> "AsyncReplay":
        self = cls(client, *args, **options)
        try:
            await Steps.__anext__(self)     # _READY: the store took the request
        except BaseException:
            self._client.close()
            raise
        return self

    async def __anext__(self) -> Message:
        try:
            return await Steps.__anext__(self)
        except StopAsyncIteration:
            await self.close()
            raise

    async def close(self) -> None:   # type: ignore[override]
        if self._client.closed:
            return
        try:
            async for _ in Run(self._client, _cancelling(self._s, self._request_key)):
                pass
        except (OSError, SbusError):
            pass
        self._client.close()

    async def __aenter__(self) -> "AsyncReplay":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


async def areplay(client: BusClient, pattern: Text, since: Time = None, until: Time = None,
                  after: Optional[int] = None, **options: Any) -> AsyncReplay:
    """:func:`replay` for the asyncio client: ``async for m in await areplay(bus, "news/")``."""
    return await AsyncReplay.open(client, "replay", pattern, since, until, after, **options)


async def alast(client: BusClient, pattern: Text, **options: Any) -> List[Message]:
    """:func:`last` for the asyncio client."""
    it = await AsyncReplay.open(client, "last", pattern, **options)
    async with it:
        return [m async for m in it]


async def astore_stats(client: BusClient, *, request_key: Text = wire.REQUEST_KEY,
                       timeout: float = ANSWER_TIMEOUT) -> Dict[str, Any]:
    """:func:`store_stats` for the asyncio client."""
    bus = _own(client, True)
    try:
        return await Run(bus, _asking_stats(encode(request_key), timeout)).__anext__()
    finally:
        bus.close()
