"""The leaf link's per-message path in C (see linkpath.pyx)."""
from typing import Callable, List, Optional

from .batch import Inbox, Outbox, Sink

class LinkInbox(Inbox):
    frames: int

class FrameSender:
    frames: int
    def __init__(self, max_message: int) -> None: ...
    def send(self, box: Outbox, fd: int) -> int: ...

class Relay(Sink):
    spill: List[bytes]
    sent: int
    hold: bool
    error: Optional[OSError]
    pumped: int
    batches: int
    drained: bool
    def __init__(self, box: Outbox, fd: int,
                 private: Callable[[bytes, bytes], Optional[bytes]]) -> None: ...
    def flush(self) -> None: ...
    def pump(self, inbox: Inbox, fd: int, limit: int, batches: int) -> list: ...
    def take_spill(self) -> List[bytes]: ...
