"""The sbus wire protocol as the client library speaks it: packet types,
packing and parsing, in plain Python.

Every side that builds or reads packets in Python imports them from here: the
two clients, the bridge, the ``sbus`` command and the broker's option table
(for ``MAX_MESSAGE``). The compiled batch code in :mod:`sbus._core.batch` packs
and parses the same packets; tests hold it to :func:`pack_publish` and
:func:`parse`.
"""
from __future__ import annotations

import json
from typing import Any, Dict, NamedTuple, Optional, Union

from .._core.batch import check_pattern
from ..errors import ProtocolError

__all__ = [
    "ControlMessage",
    "Credentials",
    "Message",
    "MAX_MESSAGE",
    "Text",
    "WHOAMI",
    "encode",
    "pack_control",
    "pack_publish",
    "pack_subscribe",
    "pack_unsubscribe",
    "parse",
    "parse_stats",
]

MAX_MESSAGE = 409600    # bytes: sbusd's default --max-message; a client's buffer must match the broker's
WHOAMI = b"!/cred/whoami"
FRAMES = b"link/frames"     # asks for frames: sbusd's transport between its own processes

Text = Union[str, bytes, bytearray, memoryview]

def encode(text: Text) -> bytes:
    """``text`` as bytes: str is encoded as UTF-8 (surrogateescape), bytes-like is copied."""
    if isinstance(text, str):
        return text.encode("utf-8", "surrogateescape")
    return bytes(text)


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _routing_key(key: Text, what: str) -> bytes:
    raw = encode(key)
    if b"\0" in raw:
        raise ValueError(f"a routing {what} cannot contain NUL: {raw!r}")
    return raw


class Message(NamedTuple):
    """A published message, exactly as the publisher sent it."""

    key: bytes
    payload: bytes

    @property
    def key_str(self) -> str:
        return _decode(self.key)

    @property
    def text(self) -> str:
        """The payload decoded as UTF-8 (surrogateescape)."""
        return _decode(self.payload)

    # Tuple equality would make Message(k, p) == ControlMessage(k, p).
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(self)))


class ControlMessage(NamedTuple):
    """A control message from the broker (``CMSG key\\0payload``); never from another client."""

    key: bytes
    payload: bytes

    @property
    def key_str(self) -> str:
        return _decode(self.key)

    @property
    def text(self) -> str:
        return _decode(self.payload)

    __eq__ = Message.__eq__
    __ne__ = Message.__ne__
    __hash__ = Message.__hash__


class Credentials(NamedTuple):
    """The reply to ``!/cred/whoami``: ``str()`` is the prefix for this client's secret keys.

    ``gid``, ``uid`` and ``pid`` come from the first ``!/cred/GID/UID/PID``
    triple; a broker behind other brokers may append more, which only
    ``text`` keeps.
    """

    text: str
    gid: int
    uid: int
    pid: int

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str) -> "Credentials":
        parts = text.split("/")
        if len(parts) < 5 or parts[0] != "!" or parts[1] != "cred" or not all(
                p.isdigit() for p in parts[2:5]):
            raise ProtocolError(f"malformed credentials from the broker: {text!r}")
        return cls(text, int(parts[2]), int(parts[3]), int(parts[4]))


def pack_subscribe(pattern: Text) -> bytes:
    """``SUB pattern``; KeyRefusedError for a pattern the broker would refuse."""
    raw = encode(pattern)
    check_pattern(raw)
    return b"SUB " + raw


def pack_unsubscribe(pattern: Text) -> bytes:
    return b"UNSUB " + _routing_key(pattern, "key pattern")


def pack_publish(key: Text, payload: Text = b"") -> bytes:
    """``MSG key\\0payload``: the plain-Python reference for the compiled packing."""
    return b"".join((b"MSG ", _routing_key(key, "key"), b"\0", encode(payload)))


def pack_control(key: Text, payload: Optional[Text] = None) -> bytes:
    """``CMSG key``, or ``CMSG key\\0payload`` when a payload is given."""
    raw = _routing_key(key, "key")
    if payload is None:
        return b"CMSG " + raw
    return b"".join((b"CMSG ", raw, b"\0", encode(payload)))


def parse(packet: bytes) -> Union[Message, ControlMessage]:
    """A packet the broker sent, as a Message or ControlMessage; ProtocolError otherwise."""
    if packet.startswith(b"MSG "):
        key, sep, payload = packet[4:].partition(b"\0")
        if not sep:
            raise ProtocolError(f"MSG packet without NUL after the key: {packet[:64]!r}")
        return Message(key, payload)
    if packet.startswith(b"CMSG "):
        key, _, payload = packet[5:].partition(b"\0")
        return ControlMessage(key, payload)
    raise ProtocolError(f"unknown packet type: {packet[:64]!r}")


def parse_stats(payload: bytes) -> Dict[str, Any]:
    """The payload of the broker's ``CMSG stats`` reply, as a dict."""
    try:
        stats = json.loads(payload)
    except ValueError as exc:
        raise ProtocolError(f"the broker's stats reply is not JSON: {payload[:64]!r}") from exc
    if not isinstance(stats, dict):
        raise ProtocolError(f"the broker's stats reply is not a JSON object: {payload[:64]!r}")
    return stats
