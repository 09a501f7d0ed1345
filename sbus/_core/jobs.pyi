"""Batched deliveries of ``sbus queue`` (see jobs.pyx); twins in sbus.queue.wire."""
from typing import Any, Callable, Deque, List, Optional, Tuple, Union

from .batch import Sink

InFlight = Union[Tuple[bytes, bytes], Tuple[bytes, bytes, int]]

def pack_jobs(tags: List[int], jobs: List[InFlight], limit: int) -> List[bytes]: ...
def parse_jobs(data: bytes) -> List[Tuple[int, int, bytes, bytes]]: ...

class Intake(Sink):
    room: int
    received: int
    def __init__(self, held: Deque[InFlight], room: int) -> None: ...
    def take_others(self) -> List[Tuple[bytes, bytes]]: ...

class Job:
    key: bytes
    payload: bytes
    deliveries: int
    tag: int
    settled: bool
    def __init__(self, key: bytes, payload: bytes, deliveries: int, tag: int,
                 settle: Callable[[str, int], Any]) -> None: ...
    @property
    def redelivered(self) -> bool: ...
    def ack(self) -> Any: ...
    def nack(self, requeue: bool = True) -> Any: ...

def jobs_from(data: bytes, settle: Callable[[str, int], Any]) -> List[Job]: ...

Packet = Tuple[str, bytes]

class Acks:
    due: Optional[float]
    started: int
    watched: bool
    limit: int
    def __init__(self, delay: float, limit: int) -> None: ...
    def add(self, control: str, token: str, tag: int) -> Union[None, bool, Packet]: ...
    def take(self) -> Optional[Packet]: ...
