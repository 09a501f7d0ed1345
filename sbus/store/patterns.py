"""Routing-key patterns as the store uses them: compiled once, matched many times.

The semantics are the spec's (and the broker's): ``*`` is a run of bytes
other than ``/`` that never gives bytes back (so ``*b`` matches nothing), a
trailing ``/`` matches ``/`` and anything after it, and the empty pattern
matches every key.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, List

from ..client.chunks import SUFFIX

Matcher = Callable[[bytes], bool]


def _never(key: bytes) -> bool:
    return False


def compile_pattern(pattern: bytes) -> Matcher:
    """A function telling whether a key matches ``pattern``."""
    if pattern == b"":
        return lambda key: True
    trailing = pattern.endswith(b"/")
    body = pattern[:-1] if trailing else pattern
    parts = []
    chunks = [c for c in re.split(rb"(\*+)", body) if c]
    for i, chunk in enumerate(chunks):
        if chunk.startswith(b"*"):
            following = chunks[i + 1] if i + 1 < len(chunks) else (b"/" if trailing else b"")
            # A star eats every non-'/' byte, so a literal other than '/'
            # right after it can never match.
            if following and not following.startswith(b"/"):
                return _never
            parts.append(rb"[^/]*")
        else:
            parts.append(re.escape(chunk))
    regex = re.compile(b"".join(parts) + (rb"/.*" if trailing else b""), re.S)
    fullmatch = regex.fullmatch
    return lambda key: fullmatch(key) is not None


def with_chunks(pattern: bytes, match: Matcher) -> Matcher:
    """``match``, and also the chunks of what it matches (docs/chunks.md): what
    a replay of ``pattern`` gives a client to reassemble. '' and a pattern
    ending in '/' match the chunk keys themselves."""
    if pattern == b"" or pattern.endswith(b"/"):
        return match
    cut = -len(SUFFIX)

    def matches(key: bytes) -> bool:
        return match(key) or (key.endswith(SUFFIX) and match(key[:cut]))
    return matches


def _segment_covers(outer: bytes, inner: bytes) -> bool:
    if b"*" not in outer:
        return outer == inner
    prefix, _, rest = outer.partition(b"*")
    if rest.strip(b"*"):
        return False        # a literal after a star: matches nothing
    return inner.startswith(prefix)


def covers(outer: bytes, inner: bytes) -> bool:
    """Does every key that ``inner`` matches also match ``outer``?

    Exact for the patterns one writes (``a/*/c``, ``a/``, ``''``); a pattern
    that matches nothing is never covered.
    """
    if outer == b"":
        return True
    if inner == b"":
        return False
    outer_open, inner_open = outer.endswith(b"/"), inner.endswith(b"/")
    o = (outer[:-1] if outer_open else outer).split(b"/")
    i = (inner[:-1] if inner_open else inner).split(b"/")
    if outer_open:
        # a/ covers keys below a: inner must be at least one segment deeper, or open at a.
        if len(i) < len(o) or (len(i) == len(o) and not inner_open):
            return False
    elif inner_open or len(i) != len(o):
        return False
    return all(_segment_covers(a, b) for a, b in zip(o, i))


class PatternSet:
    """The ``--record`` patterns: which ones a key matches, and whether a
    replay pattern is within them."""

    def __init__(self, patterns: Iterable[bytes]) -> None:
        self.patterns: List[bytes] = list(dict.fromkeys(patterns))
        self._matchers = [compile_pattern(p) for p in self.patterns]

    def matching(self, key: bytes) -> List[bytes]:
        return [p for p, m in zip(self.patterns, self._matchers) if m(key)]

    def covers(self, pattern: bytes) -> bool:
        return any(covers(p, pattern) for p in self.patterns)
