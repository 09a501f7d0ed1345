"""Plain-Python twin of sbus._core.protocol, written straight from the spec.

It is the test oracle: property tests compare the compiled code with it.
Keep it obvious rather than fast.
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

# The spec's regular expressions, with DOTALL since payloads may hold newlines.
_SUB = re.compile(rb"^SUB ([^\x00]*)(\x00.*)?$", re.S)
_UNSUB = re.compile(rb"^UNSUB ([^\x00]*)(\x00.*)?$", re.S)
_MSG = re.compile(rb"^MSG ([^\x00]*)\x00(.*)$", re.S)
_CMSG = re.compile(rb"^CMSG ([^\x00]*)(\x00(.*))?$", re.S)


def parse(packet: bytes) -> Tuple[Optional[str], Optional[bytes], Optional[bytes]]:
    """(verb, key, payload) as the spec's regular expressions read a packet."""
    m = _MSG.match(packet)
    if m:
        return ("MSG", m.group(1), m.group(2))
    m = _SUB.match(packet)
    if m:
        return ("SUB", m.group(1), m.group(2)[1:] if m.group(2) else None)
    m = _UNSUB.match(packet)
    if m:
        return ("UNSUB", m.group(1), m.group(2)[1:] if m.group(2) else None)
    m = _CMSG.match(packet)
    if m:
        return ("CMSG", m.group(1), m.group(3))
    return (None, None, None)


def matches(pattern: bytes, key: bytes) -> bool:
    """Does the routing-key pattern match the key?

    Written as a regular expression per the spec: '*' is a possessive run of
    non-'/' bytes (it "matches until the next '/'", so it never gives bytes
    back: '*b' cannot match), a trailing '/' is '/' followed by anything, and
    the empty pattern matches every key.
    """
    if pattern == b"":
        return True
    trailing = pattern.endswith(b"/")
    body = pattern[:-1] if trailing else pattern
    parts = []
    for chunk in re.split(rb"(\*)", body):
        if chunk == b"*":
            parts.append(rb"(?>[^/]*)")   # atomic group: no backtracking
        elif chunk:
            parts.append(re.escape(chunk))
    regex = b"".join(parts) + (rb"/.*" if trailing else b"")
    return re.fullmatch(regex, key, re.S) is not None


def cred_form(key: bytes):
    """(gid, uid, pid, prefix_len) of a '!/cred/G/U/P/' prefix (None for an
    empty field), or None when the key has no well-formed prefix."""
    m = re.match(rb"!/cred/([0-9]*)/([0-9]*)/([0-9]*)/", key)
    if not m:
        return None
    values = [int(g) if g else None for g in m.groups()]
    if any(v is not None and v > 0xFFFFFFFF for v in values):
        return None
    return (*values, m.end())


def check_key(key: bytes, is_pattern: bool = False) -> str:
    """'ok', 'bang_misuse' or 'cred_malformed' under the '!' rules: a '!' with
    only '/' or an end beside it may only begin a !/cred/ form, at the start
    of the key or of the rest of a !/cred/ key."""
    first = True
    while key.startswith(b"!/cred/"):
        form = cred_form(key)
        if form is None and not first and is_pattern:
            # nested forms in patterns may use '*' for a field
            star = re.match(rb"!/cred/([0-9]*|\*)/([0-9]*|\*)/([0-9]*|\*)/", key)
            form = (None, None, None, star.end()) if star else None
        if form is None:
            return "cred_malformed"
        key = key[form[3]:]
        first = False
    for i, byte in enumerate(key):
        if byte != ord("!"):
            continue
        left = i == 0 or key[i - 1] == ord("/")
        right = i + 1 == len(key) or key[i + 1] == ord("/")
        if left and right:
            return "bang_misuse"
    return "ok"
