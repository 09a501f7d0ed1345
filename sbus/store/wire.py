"""What requests to the store and its answers look like (docs/store.md).

A request is an ordinary message on the store's request key (``REQUEST_KEY``
unless the store was given another): fields ``name=value`` separated by NUL
bytes, so a pattern may hold any byte a routing key may. Every request but
``ack`` and ``cancel`` names a ``reply`` key, which must be a private
``!/cred/...`` key, and an ``id`` the answers repeat.

An answer is a message on that reply key. Its payload is one header line,
``KIND ID N\\n`` (ASCII), then a body:

- ``ok ID 0``: the request is taken; the body is fields (NUL-separated)
  ``session=TOKEN``, ``first=SEQ``, ``last=SEQ``. Acks and cancels name the
  session by this token, which only the requester can read.
- ``data ID N``: the N-th batch (1, 2, ...) of records. The bodies of a
  session's data answers, in order, are one stream of records in the log's
  own format (:mod:`sbus.store.segments`); a record may go on in the next batch.
- ``end ID N``: no more answers; body ``last=SEQ``: the last seq sent.
- ``error ID 0``: the request was refused; the body says why (UTF-8).
- ``stats ID 0``: the body is the store's counters as a JSON object.

Flow control: the store sends at most ``window`` data answers beyond the
last one acknowledged with ``op=ack``, ``session=TOKEN``, ``n=N``.
"""
from __future__ import annotations

import decimal
from typing import Dict, List, NamedTuple, Optional, Tuple

REQUEST_KEY = b"sbus/store/request"
DEFAULT_WINDOW = 8          # data answers in flight per session
MAX_WINDOW = 256
BATCH_BYTES = 64 * 1024     # record bytes per data answer (less near --max-message)

OPS = ("replay", "last", "stats", "ack", "cancel")
OK, DATA, END, ERROR, STATS = b"ok", b"data", b"end", b"error", b"stats"


class RequestError(ValueError):
    """A request the store cannot take; the message is the error answer."""


class Request(NamedTuple):
    op: str
    id: bytes = b""
    reply: bytes = b""
    pattern: bytes = b""
    since_ns: Optional[int] = None
    until_ns: Optional[int] = None
    after: int = 0
    follow: bool = False
    window: int = DEFAULT_WINDOW
    session: bytes = b""
    n: int = 0


def encode_fields(fields: List[Tuple[str, bytes]]) -> bytes:
    return b"\0".join(name.encode() + b"=" + value for name, value in fields)


def decode_fields(payload: bytes) -> Dict[str, bytes]:
    out = {}
    for item in payload.split(b"\0"):
        if not item:
            continue
        name, sep, value = item.partition(b"=")
        if not sep:
            raise RequestError(f"field without '=': {item[:40]!r}")
        out[name.decode("ascii", "replace")] = value
    return out


def _int(fields: Dict[str, bytes], name: str, default: int, low: int = 0,
         high: int = 1 << 63) -> int:
    raw = fields.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise RequestError(f"{name} is not an integer: {raw[:40]!r}") from None
    if not low <= value <= high:
        raise RequestError(f"{name} out of range ({low}..{high}): {value}")
    return value


# Enough digits for any time_ns (19) with room for a fraction below the nanosecond.
_EXACT = decimal.Context(prec=60, traps=[decimal.InvalidOperation, decimal.Inexact])


def _time_ns(fields: Dict[str, bytes], name: str) -> Optional[int]:
    """A bound in whole nanoseconds, read as an exact decimal: a float holds
    today's epoch seconds to about 240 ns only, and the store stamps a whole
    batch with one time, so a record's own time given back must find it.
    The bounds are inclusive: a fraction of a nanosecond rounds inward
    (``since`` up, ``until`` down)."""
    raw = fields.get(name)
    if raw is None or raw == b"":
        return None
    try:
        seconds = _EXACT.create_decimal(raw.decode("ascii"))
        if not seconds.is_finite() or len(raw) > 64:
            raise ValueError(raw)
        ns = _EXACT.multiply(seconds, decimal.Decimal(1_000_000_000))
        rounding = decimal.ROUND_CEILING if name == "since" else decimal.ROUND_FLOOR
        value = int(ns.to_integral_value(rounding=rounding))
    except (ValueError, UnicodeDecodeError, ArithmeticError):
        raise RequestError(f"{name} is not a time in seconds since the epoch: {raw[:40]!r}") from None
    if abs(value) >= 1 << 63:
        raise RequestError(f"{name} out of range: {raw[:40]!r}")
    return value


def reply_key_of(payload: bytes) -> Tuple[bytes, bytes]:
    """(reply, id) of a request, as far as they can be read: where an
    error answer can go. Empty reply: nowhere."""
    try:
        fields = decode_fields(payload)
    except RequestError:
        fields = {}
        for item in payload.split(b"\0"):
            name, _, value = item.partition(b"=")
            fields.setdefault(name.decode("ascii", "replace"), value)
    reply = fields.get("reply", b"")
    return (reply if reply.startswith(b"!/cred/") else b""), fields.get("id", b"")[:64]


def parse_request(payload: bytes) -> Request:
    """The request in a message's payload; RequestError says what is wrong."""
    fields = decode_fields(payload)
    op = fields.get("op", b"").decode("ascii", "replace")
    if op not in OPS:
        raise RequestError(f"unknown op {op!r}; ops: {' '.join(OPS)}")
    if op in ("ack", "cancel"):
        session = fields.get("session", b"")
        if not session:
            raise RequestError(f"{op} without session")
        return Request(op, session=session, n=_int(fields, "n", 0))
    reply = fields.get("reply", b"")
    if not reply.startswith(b"!/cred/"):
        raise RequestError("reply must be a private key (!/cred/...)")
    ident = fields.get("id", b"")
    if len(ident) > 64 or b" " in ident or b"\n" in ident:
        raise RequestError("id: at most 64 bytes, no space or newline")
    if op == "stats":
        return Request(op, ident, reply)
    if "pattern" not in fields:
        raise RequestError(f"{op} without pattern")
    since, until = _time_ns(fields, "since"), _time_ns(fields, "until")
    follow = fields.get("follow", b"0") not in (b"0", b"")
    if follow and until is not None:
        raise RequestError("follow and until do not go together")
    return Request(op, ident, reply, fields["pattern"], since, until, _int(fields, "after", 0),
                   follow and op == "replay", _int(fields, "window", DEFAULT_WINDOW, 1, MAX_WINDOW))


def request(op: str, **fields) -> bytes:
    """A request payload from keyword fields (bytes, str, int, float or bool)."""
    out = [("op", op.encode())]
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = b"1" if value else b"0"
        elif isinstance(value, (int, float)):
            value = repr(value).encode()
        elif isinstance(value, str):
            value = value.encode("utf-8", "surrogateescape")
        out.append((name, bytes(value)))
    return encode_fields(out)


def answer(kind: bytes, ident: bytes, n: int, body: bytes = b"") -> bytes:
    return b"%s %s %d\n%s" % (kind, ident, n, body)


def parse_answer(payload: bytes) -> Tuple[bytes, bytes, int, bytes]:
    """(kind, id, n, body) of an answer; ValueError if it is not one."""
    head, sep, body = payload.partition(b"\n")
    parts = head.split(b" ")
    if not sep or len(parts) != 3:
        raise ValueError(f"not a store answer: {payload[:40]!r}")
    return parts[0], parts[1], int(parts[2]), body
