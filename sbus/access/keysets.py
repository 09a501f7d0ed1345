"""Routing-key patterns as sets of keys: match a key, and compare patterns.

The spec's pattern syntax, read as a set of keys (``sbus._ref.protocol.matches``
is the oracle; the tests hold this module to it):

- The empty pattern is every key.
- Otherwise a pattern is a *body*, then optionally a trailing ``/`` that
  matches ``/`` and anything after it. The body is ``/``-separated segments.
- ``*`` matches a run of non-``/`` bytes and never gives any back, so a ``*``
  followed by anything but ``/``, another ``*`` or the end of the body matches
  nothing (``a*b`` is no key at all), and ``**`` is ``*``.

So every pattern that matches something is a *product*: a key matches when it
has the right number of ``/``-separated segments and each of the first ones
matches its segment, where a segment is either a literal (``ab``: exactly
``ab``) or a prefix (``ab*``: ``ab`` and anything without ``/`` after it). That
makes the questions the access policy asks about two patterns (do their key
sets meet? is one inside the other?) a comparison of lengths and segments, and
"is there a key in these sets but in none of those?" a walk over segment
positions (``find_key``).
"""
from __future__ import annotations

from typing import FrozenSet, List, Optional, Sequence, Set, Tuple

# One segment: (literal, prefix). prefix False: exactly the literal; True: the
# literal followed by any bytes other than '/'.
Segment = Tuple[bytes, bool]
_ANY: Segment = (b"", True)
_SLASH = ord("/")
# Bytes find_key may put after a literal to stand for "something else": never
# '/', '*' or '!' (which would make a key the broker refuses or reads specially).
_FRESH = b"xyzqwXYZ0123456789_-.~" + bytes(b for b in range(1, 256) if b not in b"/*!xyzqwXYZ0123456789_-.~")


class KeySet:
    """The keys one pattern matches. ``segs`` constrain the first segments; a
    key must have between ``min_len`` and ``max_len`` (None: no limit)
    segments. ``dead``: the pattern matches no key."""

    __slots__ = ("pattern", "segs", "min_len", "max_len", "dead")

    def __init__(self, pattern: bytes) -> None:
        self.pattern = pattern
        self.dead = False
        if pattern == b"":
            self.segs: Tuple[Segment, ...] = ()
            self.min_len, self.max_len = 1, None
            return
        trailing = pattern.endswith(b"/")
        body = pattern[:-1] if trailing else pattern
        segs = []
        for part in body.split(b"/"):
            star = part.find(b"*")
            if star < 0:
                segs.append((part, False))
            elif part[star:].strip(b"*"):
                self.dead = True        # '*' then a literal byte: the star ate it
                segs.append((part[:star], True))
            else:
                segs.append((part[:star], True))
        self.segs = tuple(segs)
        if trailing:
            self.min_len, self.max_len = len(segs) + 1, None
        else:
            self.min_len = self.max_len = len(segs)

    def __repr__(self) -> str:
        return f"KeySet({self.pattern!r})"

    def seg(self, i: int) -> Segment:
        """The constraint on segment ``i`` (anything past the ones written)."""
        return self.segs[i] if i < len(self.segs) else _ANY

    def matches(self, key: bytes) -> bool:
        """Whether the pattern matches ``key`` (as ``sbus._ref.protocol.matches``)."""
        if self.dead:
            return False
        parts = key.split(b"/")
        n = len(parts)
        if n < self.min_len or (self.max_len is not None and n > self.max_len):
            return False
        for (lit, prefix), part in zip(self.segs, parts):
            if not (part.startswith(lit) if prefix else part == lit):
                return False
        return True

    def accepts_length(self, n: int) -> bool:
        return self.min_len <= n and (self.max_len is None or n <= self.max_len)


def seg_matches(seg: Segment, part: bytes) -> bool:
    lit, prefix = seg
    return part.startswith(lit) if prefix else part == lit


def seg_meets(a: Segment, b: Segment) -> bool:
    """Whether some segment matches both."""
    (la, pa), (lb, pb) = a, b
    if pa and pb:
        return la.startswith(lb) or lb.startswith(la)
    if pa:
        return lb.startswith(la)
    if pb:
        return la.startswith(lb)
    return la == lb


def seg_within(a: Segment, b: Segment) -> bool:
    """Whether every segment ``a`` matches, ``b`` matches too."""
    (la, pa), (lb, pb) = a, b
    return la.startswith(lb) if pb else (not pa and la == lb)


def meet(sets: Sequence[KeySet]) -> bool:
    """Whether some key is in every one of ``sets`` (True for none)."""
    if any(s.dead for s in sets):
        return False
    lo = max((s.min_len for s in sets), default=1)
    highs = [s.max_len for s in sets if s.max_len is not None]
    if highs and min(highs) < lo:
        return False
    # Segment constraints of these kinds are satisfiable together exactly when
    # they are pairwise (equal literals, prefixes along one chain).
    width = max((len(s.segs) for s in sets), default=0)
    for i in range(width):
        segs = [s.segs[i] for s in sets if i < len(s.segs)]
        for x in range(len(segs)):
            for y in range(x + 1, len(segs)):
                if not seg_meets(segs[x], segs[y]):
                    return False
    return True


def within(a: KeySet, b: KeySet) -> bool:
    """Whether every key ``a`` matches, ``b`` matches too."""
    if a.dead:
        return True
    if b.dead:
        return False
    if a.min_len < b.min_len:
        return False
    if b.max_len is not None and (a.max_len is None or a.max_len > b.max_len):
        return False
    # Every position b constrains exists in every key of a (b.min_len covers
    # its segments), and both sets are products, so inclusion is per segment.
    return all(seg_within(a.seg(i), b.segs[i]) for i in range(len(b.segs)))


class TooComplex(Exception):
    """find_key gave up: proving the answer would take more than its budget."""


def _fresh(literals: Set[bytes]) -> int:
    used = set()
    for lit in literals:
        used.update(lit)
    for b in _FRESH:
        if b not in used:
            return b
    raise TooComplex("every byte occurs in the literals of one position")


# The walk's bound on distinct (position, survivors) states: far above what
# real policies need, low enough that a SUB is decided in milliseconds.
BUDGET = 20000


def find_key(inside: Sequence[KeySet], outside: Sequence[KeySet] = (),
             budget: Optional[int] = None) -> Optional[bytes]:
    """A key every set of ``inside`` matches and no set of ``outside`` does,
    or None if there is none. Raises TooComplex past ``budget`` steps
    (default ``BUDGET``).

    The walk chooses the key's segments one by one. Whether a segment matches
    a constraint depends only on which of the position's literals it equals
    or starts with, so each literal, each literal followed by a byte none of
    them uses, and such a byte alone stand for every segment there. The
    state is the position and the ``outside`` sets still matching so far;
    past every set's written segments and length bounds all lengths behave
    alike, so the walk stops there.
    """
    inside = list(inside)
    if not meet(inside):
        return None
    outside = [o for o in outside if meet(inside + [o])]
    if any(within(s, o) for s in inside for o in outside):
        return None
    lo = max((s.min_len for s in inside), default=1)
    highs = [s.max_len for s in inside if s.max_len is not None]
    hi = min(highs) if highs else None
    cap = max([s.max_len if s.max_len is not None else s.min_len
               for s in inside + outside] + [lo])
    failed: Set[Tuple[int, FrozenSet[int]]] = set()
    steps = [0]
    limit = BUDGET if budget is None else budget

    def walk(i: int, alive: FrozenSet[int], parts: List[bytes]) -> Optional[List[bytes]]:
        if i >= 1 and lo <= i and (hi is None or i <= hi):
            if not any(outside[j].accepts_length(i) for j in alive):
                return parts
        if i > cap or (hi is not None and i >= hi):
            return None     # a longer key fares no better (see above)
        if (i, alive) in failed:
            return None
        steps[0] += 1
        if steps[0] > limit:
            raise TooComplex(f"more than {limit} steps")
        need = [s.segs[i] for s in inside if i < len(s.segs)]
        live = [j for j in alive if i < len(outside[j].segs)]
        literals = {lit for lit, _ in need} | {outside[j].segs[i][0] for j in live}
        fresh = bytes([_fresh(literals)])
        tried: Set[FrozenSet[int]] = set()
        for cand in sorted(literals | {lit + fresh for lit in literals} | {fresh}):
            if not all(seg_matches(s, cand) for s in need):
                continue
            still = frozenset(j for j in alive
                              if i >= len(outside[j].segs) or seg_matches(outside[j].segs[i], cand))
            if still in tried:
                continue
            tried.add(still)
            found = walk(i + 1, still, parts + [cand])
            if found is not None:
                return found
        failed.add((i, alive))
        return None

    found = walk(0, frozenset(range(len(outside))), [])
    return None if found is None else b"/".join(found)

