"""What the clients offer of the services beside the broker, as methods.

Each is a door to a module of its own, which holds the logic and the
convention on the bus: :mod:`.store` (``sbus store``'s replay and last
values), :mod:`.requests` (request/reply, docs/requests.md) and
:mod:`.consume` (``sbus queue``'s jobs, docs/queues.md). ``ServiceMethods``
is mixed into the blocking ``Client``, ``AsyncServiceMethods`` into the
asyncio one.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

from . import consume as _consume
from . import requests as _requests
from . import store as _store
from .protocol import Message, Text


class ServiceMethods:
    def replay(self, pattern: Text, since=None, until=None, after=None, **options: Any) -> _store.Replay:
        """What ``sbus store`` recorded on ``pattern``: :func:`sbus.client.store.replay`."""
        return _store.replay(self, pattern, since, until, after, **options)

    def last(self, pattern: Text, **options: Any) -> List[Message]:
        """The last recorded message of each key: :func:`sbus.client.store.last`."""
        return _store.last(self, pattern, **options)

    def serve(self, pattern: Text, handler: Callable[..., Any], count: Optional[int] = None) -> int:
        """Answer the requests on ``pattern``: :func:`sbus.client.requests.serve`."""
        return _requests.serve(self, pattern, handler, count)

    def consume(self, pattern: str, prefetch: int = _consume.PREFETCH) -> _consume.Consumer:
        """``for`` the jobs of ``sbus queue`` on ``pattern``: :func:`sbus.client.consume.consume`."""
        return _consume.Consumer(self, pattern, prefetch)


class AsyncServiceMethods:
    async def replay(self, pattern: Text, since=None, until=None, after=None,
                     **options: Any) -> _store.AsyncReplay:
        """What ``sbus store`` recorded on ``pattern``: :func:`sbus.client.store.areplay`."""
        return await _store.areplay(self, pattern, since, until, after, **options)

    async def last(self, pattern: Text, **options: Any) -> List[Message]:
        """The last recorded message of each key: :func:`sbus.client.store.alast`."""
        return await _store.alast(self, pattern, **options)

    async def serve(self, pattern: Text, handler: Callable[..., Any],
                    concurrency: int = _requests.CONCURRENCY) -> None:
        """Answer the requests on ``pattern``: :func:`sbus.client.requests.serve_async`."""
        await _requests.serve_async(self, pattern, handler, concurrency)

    def consume(self, pattern: str, prefetch: int = _consume.PREFETCH) -> _consume.Consumer:
        """``async for`` the jobs of ``sbus queue``: :func:`sbus.client.consume.consume`."""
        return _consume.Consumer(self, pattern, prefetch)
