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


# ---- private keys across hosts (sbus bridge --private) -----------------------
#
# A bridged host's identity is a !/cred/ form that names no process on any
# broker: the host id in the gid field, uid 4294967295 ((uid_t)-1, which the
# kernel gives no process) and pid 0. A key under another host's identity
# therefore reaches, on any broker, the bridge alone (it holds the broker's
# link place), which carries it on that host's private subject.

NO_ONE = 4294967295
MAX_HOST_ID = 4294967295
CRED = b"!/cred/"


def host_identity(host_id: int) -> bytes:
    """The nesting prefix of a bridged host: what its processes' whoami starts with."""
    return b"!/cred/%d/%d/0" % (host_id, NO_ONE)


def host_pattern() -> str:
    """The bridge's local subscription: every host's identity, its own included."""
    return f"!/cred/*/{NO_ONE}/0/"


def private_prefix(subject_prefix: str) -> str:
    """The first token(s) of private subjects: apart from the public ones, so a
    NATS permission can name them (``sbus-private`` for ``sbus``)."""
    return subject_prefix + "-private"


def parse_host_id(text: str) -> int:
    """A --host-id: a decimal number 0..4294967295 without leading zeros (it is
    a subject token and a !/cred/ field, spelled one way); ValueError if not."""
    if not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0") \
            or int(text) > MAX_HOST_ID:
        raise ValueError(f"a host id is a number from 0 to {MAX_HOST_ID} "
                         f"without leading zeros, not {text!r}")
    return int(text)


def cred_fields(key: bytes):
    """(gid, uid, pid, length of the form with its '/') of a key's leading
    ``!/cred/G/U/P/`` form, a field None when empty; None if malformed."""
    if not key.startswith(CRED):
        return None
    parts = key[len(CRED):].split(b"/", 3)
    if len(parts) < 4:
        return None
    fields = []
    for part in parts[:3]:
        if part and (not part.isdigit() or len(part) > 10 or int(part) > NO_ONE):
            return None
        fields.append(int(part) if part else None)
    return fields[0], fields[1], fields[2], len(CRED) + sum(len(p) + 1 for p in parts[:3])


def host_of(key: bytes):
    """(host id, the key after the host's identity) for a key under a host's
    identity (``!/cred/H/4294967295/0/REST``), else None."""
    form = cred_fields(key)
    if form is None or form[0] is None or form[1] != NO_ONE or form[2] != 0:
        return None
    return form[0], key[form[3]:]


def names_a_process(key: bytes) -> bool:
    """True for ``!/cred/G/U/P/...`` with all three fields, not a host's identity:
    what the receiving bridge may publish for a process of its host."""
    form = cred_fields(key)
    return form is not None and None not in form[:3] and form[1] != NO_ONE


def private_subject(prefix: str, to_host: int, from_host: int, rest: bytes) -> str:
    """``PREFIX-private.TO.FROM.`` and the tokens of ``rest`` (the key after
    the destination host's identity)."""
    return key_to_subject(rest, f"{private_prefix(prefix)}.{to_host}.{from_host}")
