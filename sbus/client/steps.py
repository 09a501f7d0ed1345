"""A service's plan, run over either client: its logic written once, the waiting twice.

A plan is a generator that yields the client calls it needs,
``(method, timeout, *args)`` (a public method of
:class:`sbus.client.services.BusClient`; ``timeout`` None for none), and
``(ITEM, value)`` for each value it hands out, or ``(ITEMS, values)`` for
a list of them at once (handed out one by one without resuming the plan:
a consumer's batch of jobs costs no generator round trip per job); a
call's result is sent back,
its exception thrown in (a ``TimeoutError`` once the timeout passed).
:class:`Steps` iterates a plan: ``for`` over a blocking client, which makes
the call; ``async for`` over an asyncio one, which awaits it. The consumer of
``sbus queue`` (:mod:`.consume`) and the store's replay (:mod:`.store`) are
plans; the services' contract says what they may call.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Generator, Optional, Tuple

__all__ = ["ITEM", "ITEMS", "Plan", "Run", "Steps", "adrive", "drive"]

ITEM = "item"
ITEMS = "items"

Plan = Generator[Tuple[Any, ...], Any, Any]


def drive(plan: Plan, act: Callable[[Tuple[Any, ...]], Any]) -> Any:
    """Run ``plan`` to its end, ``act(action)`` making each action it yields:
    the result is sent back, an exception thrown in. The plan's return value.
    The loop of a blocking driver (the client's connection plans, sbus fds)."""
    value = error = None
    while True:
        try:
            action = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as stop:
            return stop.value
        value = error = None
        try:
            value = act(action)
        except BaseException as exc:    # the plan decides what it means
            error = exc


async def adrive(plan: Plan, act: Callable[[Tuple[Any, ...]], Awaitable[Any]]) -> Any:
    """:func:`drive` with each action awaited."""
    value = error = None
    while True:
        try:
            action = plan.send(value) if error is None else plan.throw(error)
        except StopIteration as stop:
            return stop.value
        value = error = None
        try:
            value = await act(action)
        except BaseException as exc:    # the plan decides what it means
            error = exc


class Steps:
    """Iterates ``self._plan`` over ``self._client``; see the module docstring.
    A subclass takes its own actions in :meth:`_special` (True if it did)."""

    _plan: Plan
    _client: Any
    # The rest of an (ITEMS, values) list, last first; a tuple while none is left.
    _items: Any = ()

    def _special(self, action: Tuple[Any, ...]) -> bool:
        return False

    def _next_call(self, value: Any, error: Optional[BaseException]) -> Tuple[Any, ...]:
        """Run the plan to its next client call or item. An error the plan
        does not handle ends it (StopIteration after it)."""
        while True:
            action = self._plan.send(value) if error is None else self._plan.throw(error)
            value = error = None
            if not self._special(action):
                return action

    def __iter__(self) -> "Steps":
        return self

    def _take_items(self, values: list) -> bool:
        """Keep an (ITEMS, values) list to hand out; whether it has any. A
        subclass that made ``_items`` a list keeps that list (its iterator
        may hold it)."""
        if not values:
            return False
        values.reverse()
        if type(self._items) is list:
            self._items.extend(values)
        else:
            self._items = values
        return True

    def __next__(self) -> Any:
        if self._items:
            return self._items.pop()
        value = error = None
        while True:
            action = self._next_call(value, error)
            if action[0] is ITEM:
                return action[1]
            if action[0] is ITEMS:
                if self._take_items(action[1]):
                    return self._items.pop()
                continue
            value = error = None
            try:
                method = getattr(self._client, action[0])
                value = (method(*action[2:]) if action[1] is None
                         else method(*action[2:], timeout=action[1]))
            except BaseException as exc:    # the plan decides what it means
                error = exc

    def __aiter__(self) -> "Steps":
        return self

    async def __anext__(self) -> Any:
        if self._items:
            return self._items.pop()
        import asyncio  # here: a blocking client's import of this module needs none
        value = error = None
        while True:
            try:
                action = self._next_call(value, error)
            except StopIteration:
                raise StopAsyncIteration from None
            if action[0] is ITEM:
                return action[1]
            if action[0] is ITEMS:
                if self._take_items(action[1]):
                    return self._items.pop()
                continue
            value = error = None
            try:
                value = await asyncio.wait_for(getattr(self._client, action[0])(*action[2:]),
                                               action[1])
            except BaseException as exc:    # the plan decides what it means
                error = exc


class Run(Steps):
    """A plan over a client, as it is."""

    def __init__(self, client: Any, plan: Plan) -> None:
        self._client, self._plan = client, plan
