"""Patterns written for another bus, which sbus reads literally and which
then match nothing the user meant; ``sbus sub`` warns about them.

sbus patterns: ``*`` is a run of bytes other than ``/`` (greedy, so nothing
may follow it within its segment), a trailing ``/`` matches everything
below, and ``''`` matches every key.
"""
from __future__ import annotations

from typing import NamedTuple, Optional


class Foreign(NamedTuple):
    """Why a pattern is probably not what its user meant, and the sbus pattern
    that most likely is."""

    why: str
    meant: str

    def text(self, pattern: str) -> str:
        return f"pattern {pattern!r} {self.why}; {self.meant!r} {_does(self.meant)}"


def _does(pattern: str) -> str:
    if pattern == "":
        return "matches every key"
    if pattern.endswith("/"):
        return f"matches every key under {pattern}"
    return "matches any one segment in place of each '*'"


def _under(segments) -> str:
    """The sbus pattern for every key under ``segments`` ('' for all keys)."""
    head = "/".join(segments)
    return head + "/" if head else ""


def foreign(pattern: str) -> Optional[Foreign]:
    """What is wrong with ``pattern``, or None if it reads as an sbus pattern."""
    segments = pattern.split("/")
    # MQTT: '+' is one level, '#' (last) all the levels below.
    if (segments[-1] == "#" or "+" in segments) and "#" not in segments[:-1]:
        body = ["*" if s == "+" else s for s in segments]
        meant = _under(body[:-1]) if body[-1] == "#" else "/".join(body)
        return Foreign("is MQTT's: sbus reads '#' and '+' literally", meant)
    # NATS: '.' separates tokens, '*' is one token, '>' (last) all the rest.
    # 'file.*' is a fine sbus pattern, so a '*' counts only before the last token.
    tokens = pattern.split(".")
    if "/" not in pattern and (tokens[-1] == ">" or "*" in tokens[:-1]):
        meant = _under(tokens[:-1]) if tokens[-1] == ">" else "/".join(tokens)
        return Foreign("is NATS's: sbus separates segments with '/' and reads '>' literally",
                       meant)
    if pattern == "*":
        return Foreign("matches only keys without a '/': '*' stops at '/'", "")
    if segments[-1] == "**":
        return Foreign("does what '*' does: '*' stops at '/', even doubled",
                       _under(segments[:-1]))
    for i, s in enumerate(segments):
        star = s.find("*")
        if star >= 0 and s.rstrip("*") != s[:star]:
            fixed = segments[:i] + [s[:star] + "*"] + segments[i + 1:]
            return Foreign("never matches: '*' takes the rest of its segment, so nothing "
                           "can follow it there", "/".join(fixed))
    return None
