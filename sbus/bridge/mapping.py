"""How an sbus routing key travels through NATS: a subject and a header.

Both directions are pure functions of bytes; docs/bridge.md shows examples.

Header ``Sbus-Key``: the key percent-encoded. Bytes 0x21-0x7E other than
``%`` stand for themselves; every other byte (space, control bytes, ``%``,
bytes >= 0x80) is ``%XX`` with two upper-case hex digits. A header value
therefore holds no CR, LF or whitespace, and decodes back to the exact key.

Subject: ``PREFIX.`` followed by the key's ``/``-separated segments, one NATS
token each. Within a token the same percent-encoding applies, and ``.``,
``*`` and ``>`` are escaped too (NATS reserves them). A token cannot be
empty, so an empty segment (a leading, doubled or trailing ``/``, or the
empty key) is the token ``%`` alone, which no escape can produce.
"""
from __future__ import annotations

from typing import Optional

HEADER = "Sbus-Key"
DEFAULT_PREFIX = "sbus"
EMPTY_TOKEN = "%"

_HEX = "0123456789ABCDEF"


def _table(reserved: bytes) -> list:
    out = []
    for b in range(256):
        if 0x21 <= b <= 0x7E and b != 0x25 and b not in reserved:
            out.append(chr(b))
        else:
            out.append("%" + _HEX[b >> 4] + _HEX[b & 15])
    return out


_HEADER_TABLE = _table(b"")
_TOKEN_TABLE = _table(b".*>")


class UnmappableError(ValueError):
    """A header value or subject that names no valid sbus key."""


def encode_header(key: bytes) -> str:
    """The ``Sbus-Key`` header value of ``key``."""
    if key.isascii() and key.isalnum():
        return key.decode("ascii")
    table = _HEADER_TABLE
    return "".join([table[b] for b in key])


def _unescape(text: str, what: str) -> bytes:
    """Percent-decoding, strict: only printable ASCII, every ``%`` followed by two hex digits."""
    if not text.isascii():
        raise UnmappableError(f"{what} is not ASCII")
    raw = text.encode("ascii")
    if b"%" not in raw:
        if not raw.isalnum() and any(b < 0x21 or b > 0x7E for b in raw):
            raise UnmappableError(f"{what} holds a space or control byte")
        return raw
    out = bytearray()
    i, n = 0, len(raw)
    while i < n:
        b = raw[i]
        if b == 0x25:
            pair = raw[i + 1:i + 3]
            if len(pair) != 2 or not all(c in b"0123456789ABCDEFabcdef" for c in pair):
                raise UnmappableError(f"{what} has a bad escape at {i}")
            out.append(int(pair, 16))
            i += 3
            continue
        if b < 0x21 or b > 0x7E:
            raise UnmappableError(f"{what} holds a space or control byte")
        out.append(b)
        i += 1
    return bytes(out)


def _check_key(key: bytes, what: str) -> bytes:
    if b"\0" in key:
        raise UnmappableError(f"{what} decodes to a key with a NUL byte")
    return key


def decode_header(value: str) -> bytes:
    """The key an ``Sbus-Key`` header value names; UnmappableError if none."""
    return _check_key(_unescape(value, "the Sbus-Key header"), "the Sbus-Key header")


def encode_token(segment: bytes) -> str:
    if not segment:
        return EMPTY_TOKEN
    if segment.isascii() and segment.isalnum():
        return segment.decode("ascii")
    table = _TOKEN_TABLE
    return "".join([table[b] for b in segment])


def key_to_subject(key: bytes, prefix: str = DEFAULT_PREFIX) -> str:
    """The NATS subject a key is published on: ``prefix`` + its escaped segments."""
    return prefix + "." + ".".join([encode_token(s) for s in key.split(b"/")])


def subject_to_key(subject: str, prefix: str = DEFAULT_PREFIX) -> bytes:
    """The key a subject maps back to (for a message without ``Sbus-Key``);
    UnmappableError for a subject outside ``prefix`` or with a bad token."""
    head = prefix + "."
    if not subject.startswith(head):
        raise UnmappableError(f"the subject is not under {prefix!r}")
    segments = []
    for token in subject[len(head):].split("."):
        if token == EMPTY_TOKEN:
            segments.append(b"")
        elif not token:
            raise UnmappableError("the subject has an empty token")
        else:
            segments.append(_unescape(token, "a subject token"))
    return _check_key(b"/".join(segments), "the subject")


def is_private(key: bytes) -> bool:
    """Keys starting with '!' (``!/cred/...``) name local credentials and stay home."""
    return key[:1] == b"!"


def subjects_overlap(a: str, b: str) -> bool:
    """Whether some subject matches both NATS subjects (``*`` and ``>`` wildcards).

    Two overlapping --import subjects would make NATS deliver a message
    twice, once for each subscription, so the bridge refuses them.
    """
    ta, tb = a.split("."), b.split(".")
    for i in range(max(len(ta), len(tb))):
        x = ta[i] if i < len(ta) else None
        y = tb[i] if i < len(tb) else None
        if x == ">" or y == ">":
            return x is not None and y is not None
        if x is None or y is None:
            return False
        if x != y and x != "*" and y != "*":
            return False
    return True


def check_import(subject: str) -> Optional[str]:
    """Why ``subject`` is no valid --import subject, or None."""
    tokens = subject.split(".")
    if not subject or any(not t for t in tokens):
        return "a NATS subject has no empty tokens"
    if any(c.isspace() for c in subject):
        return "a NATS subject has no whitespace"
    for i, t in enumerate(tokens):
        if ">" in t and (t != ">" or i != len(tokens) - 1):
            return "'>' must be a whole token, the last"
        if "*" in t and t != "*":
            return "'*' must be a whole token"
    return None
