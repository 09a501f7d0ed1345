"""Batched deliveries of ``sbus queue`` (see jobs.pyx); twins in sbus.queue.wire."""
from typing import List, Tuple, Union

InFlight = Union[Tuple[bytes, bytes], Tuple[bytes, bytes, int]]

def pack_jobs(tags: List[int], jobs: List[InFlight], limit: int) -> List[bytes]: ...
def parse_jobs(data: bytes) -> List[Tuple[int, int, bytes, bytes]]: ...
