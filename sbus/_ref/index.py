"""Plain-Python twin of the pattern index: a list scanned in full."""
from __future__ import annotations

from typing import Dict, List, Tuple

from .protocol import matches


class LinearIndex:
    """Every (owner, pattern) pair in one list, matched one by one."""

    def __init__(self) -> None:
        self._subs: Dict[int, Tuple[int, bytes]] = {}
        self._next = 1

    def add(self, owner: int, pattern: bytes) -> int:
        handle = self._next
        self._next += 1
        self._subs[handle] = (owner, pattern)
        return handle

    def remove(self, handle: int) -> None:
        del self._subs[handle]

    def match(self, key: bytes) -> List[int]:
        return sorted({owner for owner, pattern in self._subs.values() if matches(pattern, key)})

    def __len__(self) -> int:
        return len(self._subs)
