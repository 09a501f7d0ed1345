"""Messages of any size: the chunking convention, with no I/O (docs/chunks.md).

A payload whose ``MSG`` packet would exceed the broker's ``--max-message``
goes out as chunks: packets on a *derived* key, the message's key followed
by :data:`SUFFIX`, each payload a fixed :data:`HEADER` (publisher id,
message number, index and count, total size and offset) and a slice of the
message. The key's front is kept, so a chunk of a ``!/cred/...`` message
is as private as the message, and it crosses a leaf, the store and the
bridge as any packet does; the reserved last segment is how a subscriber
that does not use this library tells a chunk from a message.

:class:`Chunker` splits a payload into packets; :class:`Reassembler` takes
chunks as they are received and gives back whole messages, or reports each
message it cannot complete (a chunk lost, the publisher gone, a memory
bound) as lost: counted, logged and passed to ``on_lost``, never delivered
truncated or spliced. Both clients drive them through
:class:`sbus.client.connection.Connection`; :func:`publish` and
:func:`subscribing` are the plans they run.
"""
from __future__ import annotations

import logging
import os
import struct
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

from .._core.batch import check_publish_key
from ..errors import MessageTooLargeError
from .protocol import Message, Text, encode

__all__ = ["HEADER", "MAGIC", "MAX_MESSAGE_BYTES", "MAX_TOTAL_BYTES", "SUFFIX", "TIMEOUT",
           "Chunker", "Lost", "Reassembler", "chunk_key", "chunk_pattern", "is_chunk_key"]

SUFFIX = b"/.sbus-chunk"
"""The last segment of every chunk's key: ``KEY`` + SUFFIX carries chunks of a message on ``KEY``."""
MAGIC = b"SBC1"
# magic, publisher id, message number, index, count, total bytes, offset: big-endian.
HEADER = struct.Struct(">4s16sQIIQQ")

# The reassembly defaults, each in this one place (docs/chunks.md, "Bounds").
MAX_MESSAGE_BYTES = 256 << 20   # the largest message one publisher may have in reassembly
MAX_TOTAL_BYTES = 1 << 30       # all publishers' messages in reassembly together
TIMEOUT = 30.0                  # seconds without a chunk before a message is lost

log = logging.getLogger("sbus.chunks")


def chunk_key(key: bytes) -> bytes:
    return key + SUFFIX


def is_chunk_key(key: bytes) -> bool:
    return key.endswith(SUFFIX)


def chunk_pattern(pattern: bytes) -> Optional[bytes]:
    """The pattern that also brings the chunks of what ``pattern`` matches;
    None if ``pattern`` brings them itself ('' and a trailing '/' match any
    suffix; any other pattern is anchored at the end of the key)."""
    if pattern == b"" or pattern.endswith(b"/"):
        return None
    return pattern + SUFFIX


def subscribing(conn: Any, packet: bytes, flags: int) -> Any:
    """The plan of a ``SUB``/``UNSUB``: the packet, then its chunk pattern's."""
    yield from conn.send_packet(packet, flags)
    verb, _, pattern = packet.partition(b" ")
    extra = chunk_pattern(pattern)
    if extra is not None:
        yield from conn.send_packet(verb + b" " + extra, flags)


class Chunker:
    """Splits payloads into chunk packets for one publisher (one connection):
    a random 16-byte publisher id, made on first use, and message numbers
    counting up from 1."""

    def __init__(self, max_message: int) -> None:
        self.max_message = max_message
        self.publisher = b""
        self.number = 0

    def data_size(self, key: bytes) -> int:
        """Message bytes one chunk on ``key`` carries."""
        return self.max_message - 5 - len(key) - len(SUFFIX) - HEADER.size

    def packets(self, key: bytes, payload: bytes) -> Iterator[bytes]:
        """The ``MSG`` packets of one message, in order; MessageTooLargeError
        at once if the key leaves no room for data."""
        step = self.data_size(key)
        if step <= 0:
            raise MessageTooLargeError(f"a {len(key)}-byte key leaves no room for a chunk "
                                       f"under the bus limit of {self.max_message}")
        if not self.publisher:
            self.publisher = os.urandom(16)
        self.number += 1
        return self._packets(key, payload, step, self.number)

    def _packets(self, key: bytes, payload: bytes, step: int, number: int) -> Iterator[bytes]:
        total = len(payload)
        count = (total + step - 1) // step
        head = b"MSG " + chunk_key(key) + b"\0"
        view = memoryview(payload)
        pack, publisher = HEADER.pack, self.publisher
        for index in range(count):
            offset = index * step
            yield b"".join((head, pack(MAGIC, publisher, number, index, count, total, offset),
                            view[offset:offset + step]))


def publish(conn: Any, key: Text, payload: Text, flags: int) -> Any:
    """The plan of a publish too large for one packet: every chunk sent in
    order while the send lock is held, so no other packet of this client
    comes between them; kept for the next broker while this one is away."""
    from . import connection as c
    raw, data = encode(key), encode(payload)
    if 5 + len(raw) + len(data) <= conn.max_message:
        # It fits: the refusal was the kernel's (a send buffer too small), not the bus's.
        raise MessageTooLargeError(f"the kernel refused a {5 + len(raw) + len(data)}-byte "
                                   f"packet (socket send buffer too small)")
    check_publish_key(chunk_key(raw))
    packets = conn.chunker.packets(raw, data)
    if conn.closed:
        raise conn.gone()
    yield (c.LOCK,)
    if len(conn.out):
        yield from conn.send_out(conn.out, conn.out_flags)
    for packet in packets:
        if not conn.live:
            conn.keep(packet)
            continue
        try:
            yield (c.SEND_ONE, packet, flags)
        except BlockingIOError:
            raise       # MSG_DONTWAIT: the rest is not sent, receivers count the message lost
        except OSError as exc:
            conn.send_failed(exc, packet)
            yield (c.LOST, exc)
            conn.keep(packet)
    yield (c.UNLOCK,)
    if not conn.live:
        yield (c.RECONNECT, False, None)


class Lost(NamedTuple):
    """A chunked message that will not be delivered, and why."""

    key: bytes
    publisher: bytes
    number: int
    received: int       # bytes of it that had come
    total: int
    reason: str


class _Partial:
    __slots__ = ("key", "number", "count", "total", "next", "size", "parts", "seen", "dead",
                 "held")

    def __init__(self, key: bytes, number: int, count: int, total: int, now: float) -> None:
        self.key, self.number, self.count, self.total = key, number, count, total
        self.next = self.size = self.held = 0     # held: bytes counted in pending_bytes
        self.parts: List[memoryview] = []
        self.seen = now
        self.dead = False       # lost already: its remaining chunks are dropped quietly


class Reassembler:
    """Chunks in, whole messages out, per publisher (see the module docstring).

    A publisher's chunks come in order (the broker keeps one client's packets
    in order to each receiver), so a chunk that is not the next one expected
    means the ones between were lost. Memory: a message is refused at its
    first chunk if its total exceeds ``max_message_bytes`` or would take the
    bytes in reassembly over ``max_total_bytes``; a message with no chunk
    for ``timeout`` seconds is lost (looked at as chunks come, and by
    :meth:`expire`). Counters: ``messages``, ``lost``, ``lost_bytes``,
    ``dropped`` (chunks thrown away) and ``pending_bytes``.
    """

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_total_bytes: int = MAX_TOTAL_BYTES, timeout: float = TIMEOUT,
                 on_lost: Optional[Callable[[Lost], None]] = None) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_total_bytes = max_total_bytes
        self.timeout = timeout
        self.on_lost = on_lost
        self.partials: Dict[bytes, _Partial] = {}
        self.pending_bytes = 0      # announced totals of the messages in reassembly
        self.messages = self.lost = self.lost_bytes = self.dropped = 0
        self._swept = time.monotonic()

    def stats(self) -> Dict[str, int]:
        return {"messages": self.messages, "lost": self.lost, "lost_bytes": self.lost_bytes,
                "dropped": self.dropped, "pending_bytes": self.pending_bytes,
                "pending": sum(not p.dead for p in self.partials.values())}

    def feed_batch(self, batch: List[Any]) -> List[Any]:
        """``batch`` with each chunk replaced by the message it completes, if any."""
        out: List[Any] = []
        for item in batch:
            if type(item) is Message and item.key.endswith(SUFFIX):
                whole = self.feed(item.key, item.payload)
                if whole is not None:
                    out.append(whole)
            else:
                out.append(item)
        return out

    def feed(self, key: bytes, payload: bytes, now: Optional[float] = None) -> Optional[Message]:
        """Take one chunk (``key`` ends with SUFFIX); the whole message once
        this chunk completes it, else None."""
        now = time.monotonic() if now is None else now
        if now - self._swept >= min(1.0, self.timeout):
            self.expire(now)
        base = key[:-len(SUFFIX)]
        if len(payload) < HEADER.size or payload[:4] != MAGIC:
            self.dropped += 1
            log.warning("chunk on %r dropped: not a chunk header", key)
            return None
        _, publisher, number, index, count, total, offset = HEADER.unpack_from(payload)
        data = memoryview(payload)[HEADER.size:]
        if index >= count or offset + len(data) > total:
            self.dropped += 1
            log.warning("chunk on %r dropped: index %d of %d, %d bytes at %d of %d",
                        key, index, count, len(data), offset, total)
            return None
        p = self.partials.get(publisher)
        if p is not None and (p.number != number or p.key != base):
            # The publisher's next message began: this one's missing chunks are gone.
            if not p.dead:
                self._lose(publisher, p, f"chunk {p.next} of {p.count} never came")
            del self.partials[publisher]
            p = None
        if p is None:
            p = self.partials[publisher] = _Partial(base, number, count, total, now)
            if index != 0:
                return self._lose(publisher, p, f"its first {index} chunks never came",
                                  drop=True)
            if total > self.max_message_bytes:
                return self._lose(publisher, p, f"larger than the bound of "
                                  f"{self.max_message_bytes} bytes a message", drop=True)
            if self.pending_bytes + total > self.max_total_bytes:
                return self._lose(publisher, p, f"would take reassembly over its bound of "
                                  f"{self.max_total_bytes} bytes", drop=True)
            self.pending_bytes += total
            p.held = total
        elif p.dead:
            self.dropped += 1
            if index == count - 1:
                del self.partials[publisher]
            return None
        elif index != p.next or offset != p.size or count != p.count or total != p.total:
            return self._lose(publisher, p, f"chunk {p.next} of {p.count} never came "
                              f"(chunk {index} came)", drop=True)
        p.parts.append(data)
        p.next += 1
        p.size += len(data)
        p.seen = now
        if p.next < p.count:
            return None
        del self.partials[publisher]
        if p.size != p.total:
            return self._lose(publisher, p, f"its chunks hold {p.size} bytes, not {p.total}")
        self.pending_bytes -= p.held
        self.messages += 1
        return Message(base, b"".join(p.parts))

    def expire(self, now: Optional[float] = None) -> None:
        """Lose every message that had no chunk for ``timeout`` seconds."""
        now = time.monotonic() if now is None else now
        self._swept = now
        for publisher, p in list(self.partials.items()):
            if now - p.seen >= self.timeout:
                del self.partials[publisher]
                if not p.dead:
                    self._lose(publisher, p, f"no chunk for {self.timeout:g} s "
                               f"(the publisher stopped mid-message)")

    def _lose(self, publisher: bytes, p: _Partial, reason: str, drop: bool = False) -> None:
        """Report ``p`` lost; ``drop``: the chunk that showed it is thrown away too."""
        self.pending_bytes -= p.held
        self.dropped += len(p.parts) + drop
        lost = Lost(p.key, publisher, p.number, p.size, p.total, reason)
        p.dead, p.parts, p.held = True, [], 0
        self.lost += 1
        self.lost_bytes += p.total
        log.warning("chunked message %d of publisher %s on %r lost: %s (%d of %d bytes came)",
                    p.number, publisher.hex(), p.key, reason, p.size, p.total)
        if self.on_lost is not None:
            self.on_lost(lost)
