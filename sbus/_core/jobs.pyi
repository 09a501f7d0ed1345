"""Batched deliveries of ``sbus queue`` (see jobs.pyx); twins in sbus.queue.wire."""
from typing import Deque, List, Tuple, Union

from .batch import Sink

InFlight = Union[Tuple[bytes, bytes], Tuple[bytes, bytes, int]]

def pack_jobs(tags: List[int], jobs: List[InFlight], limit: int) -> List[bytes]: ...
def parse_jobs(data: bytes) -> List[Tuple[int, int, bytes, bytes]]: ...

class Intake(Sink):
    room: int
    received: int
    def __init__(self, held: Deque[InFlight], room: int) -> None: ...
    def take_others(self) -> List[Tuple[bytes, bytes]]: ...
