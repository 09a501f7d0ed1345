"""What the services beside the broker need of a client, and the clients' doors to them.

:class:`BusClient` is the contract: the service modules (:mod:`.store`,
``sbus store``'s replay and last values; :mod:`.requests`, request/reply,
docs/requests.md; :mod:`.consume`, ``sbus queue``'s jobs, docs/queues.md)
use a client through these public methods and nothing else. On
:class:`sbus.Client` they return their results; on :class:`sbus.aio.Client`
they are coroutine functions, to await (:class:`AsyncBusClient` adds the one
that never waits). Replies reach their waiters in the client's connection
state (:meth:`sbus.client.connection.Connection.triage`), the one place
either driver routes them; a service never reads for another.

``ServiceMethods`` is mixed into the blocking ``Client``,
``AsyncServiceMethods`` into the asyncio one: each method is a door to a module.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Protocol, Tuple, runtime_checkable

from . import consume as _consume
from . import proof as _proof
from . import requests as _requests
from . import store as _store
from .protocol import Message, Text


@runtime_checkable
class BusClient(Protocol):
    """The public methods a service module uses (see the module docstring)."""

    address: str
    max_message: int

    @property
    def closed(self) -> bool: ...
    def whoami(self, flags: int = 0, *, timeout: Optional[float] = None) -> Any: ...
    def subscribe(self, pattern: Text, flags: int = 0) -> Any: ...
    def unsubscribe(self, pattern: Text, flags: int = 0) -> Any: ...
    def publish(self, key: Text, payload: Text = b"", flags: int = 0) -> Any: ...
    def publish_many(self, messages: Iterable[Tuple[Text, Text]], flags: int = 0) -> Any: ...
    def receive(self) -> Any: ...
    def receive_many(self, max: int = 64) -> Any: ...
    def batches(self, max: int = 64) -> Any: ...
    def close(self) -> None: ...


@runtime_checkable
class AsyncBusClient(BusClient, Protocol):
    """:class:`BusClient` as the asyncio client has it, and a publish for
    code that cannot await (a consumer left by ``break``)."""

    def publish_nowait(self, key: Text, payload: Text = b"", flags: int = 0) -> None: ...


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

    def produce(self, key: Text, payloads: Iterable[bytes]) -> int:
        """Give ``sbus queue`` ``payloads`` as jobs on ``key``, many to a packet
        (:func:`sbus.client.consume.job_packets`); raises as ``publish_many``
        (``index`` counts packets). Returns how many packets went out."""
        return self.publish_many(_consume.job_packets(key, payloads, self.max_message))

    def serve_proofs(self, pattern: Text, count: Optional[int] = None) -> _proof.Run:
        """``for`` each peer proved on ``pattern``: :func:`sbus.client.proof.serve_proofs`."""
        return _proof.serve_proofs(self, pattern, count)


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

    async def produce(self, key: Text, payloads: Iterable[bytes]) -> int:
        """Give ``sbus queue`` ``payloads`` as jobs on ``key``, many to a packet
        (:func:`sbus.client.consume.job_packets`); raises as ``publish_many``
        (``index`` counts packets). Returns how many packets went out."""
        return await self.publish_many(_consume.job_packets(key, payloads, self.max_message))

    def serve_proofs(self, pattern: Text, count: Optional[int] = None) -> _proof.Run:
        """``async for`` each peer proved on ``pattern``: :func:`sbus.client.proof.serve_proofs`."""
        return _proof.serve_proofs(self, pattern, count)
