"""The blocking client's receive_many in C (see syncrecv.pyx)."""
from typing import Any, List, Optional

def receive_many(self: Any, max: int = 64, *, timeout: Optional[float] = None,
                 flags: int = 0) -> List[Any]: ...
