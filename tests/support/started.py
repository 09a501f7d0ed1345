"""What a factory fixture started, ended at its teardown."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, TypeVar

from .seconduser import make_public_dir

T = TypeVar("T")


class Started:
    """The things a factory fixture started (``add``) and the world-reachable
    directories it made for their sockets (``public_dir``). ``end`` ends
    every thing, in the order started, then removes the directories, so a
    test that fails half-way leaves nothing running."""

    def __init__(self) -> None:
        self.things: list = []
        self.dirs: list[Path] = []

    def __len__(self) -> int:
        return len(self.things)

    def add(self, thing: T) -> T:
        self.things.append(thing)
        return thing

    def public_dir(self) -> Path:
        d = make_public_dir()
        self.dirs.append(d)
        return d

    def end(self, how: Callable = lambda thing: thing.stop()) -> None:
        for thing in self.things:
            how(thing)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
