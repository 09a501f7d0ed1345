"""What a plan waits on: a future's methods without a loop for the blocking
driver (the asyncio driver uses :class:`asyncio.Future`), and the one way a
waiter is settled, whichever kind it is."""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["Waiter", "settle"]


class Waiter:
    """What the blocking driver waits on: a future's methods, without a loop."""

    __slots__ = ("_done", "_result", "_error")

    def __init__(self) -> None:
        self._done, self._result, self._error = False, None, None

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any) -> None:
        self._done, self._result = True, result

    def set_exception(self, error: BaseException) -> None:
        self._done, self._error = True, error

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result


def settle(waiter: Any, result: Any = None, error: Optional[BaseException] = None) -> None:
    if waiter is not None and not waiter.done():
        if error is None:
            waiter.set_result(result)
        else:
            waiter.set_exception(error)
