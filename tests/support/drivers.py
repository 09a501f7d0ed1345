"""Both clients behind one synchronous face, for the behaviour specification.

``Clients(kind)`` makes ``sbus.Client`` (kind "sync") or ``sbus.aio.Client``
(kind "aio") on real addresses; an asyncio client is wrapped in
:class:`AioDriver`, which runs each of its coroutines to completion on one
event loop, turns a ``timeout=`` argument into ``asyncio.wait_for`` (which
cancels the call, as a timeout abandons it in the blocking client) and
iterates with ``async for``. Nothing is simulated: every call is the
client's own, on its own socket.
"""
from __future__ import annotations

import asyncio
import inspect
import socket
from typing import Any, Iterator, List, Tuple

from sbus import Client, aio

KINDS = ("sync", "aio")
TIMEOUT = 5.0


class AioDriver:
    """An ``sbus.aio.Client`` driven from synchronous code on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *args: Any, **kwargs: Any) -> None:
        self._loop = loop
        self.client = self._run(self._make(*args, **kwargs))

    @staticmethod
    async def _make(*args: Any, **kwargs: Any) -> aio.Client:
        return aio.Client(*args, **kwargs)

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, timeout: Any = None, **kwargs: Any) -> Any:
            coro = attr(*args, **kwargs)
            return self._run(coro if timeout is None else asyncio.wait_for(coro, timeout))
        return call

    def fileno(self) -> int:
        return self.client.fileno()

    def __repr__(self) -> str:
        return repr(self.client)

    def __iter__(self):
        it = self.client.__aiter__()
        while True:
            try:
                yield self._run(_next(it))
            except StopAsyncIteration:
                return

    def __enter__(self) -> "AioDriver":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._run(self.client.__aexit__(*exc_info))


async def _next(it: Any) -> Any:
    return await it.__anext__()


class Clients:
    """Factory for clients of one kind, all closed by :meth:`close_all`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.loop = asyncio.new_event_loop() if kind == "aio" else None
        self._made: List[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        c = Client(*args, **kwargs) if self.loop is None else AioDriver(self.loop, *args, **kwargs)
        self._made.append(c)
        return c

    def close_all(self) -> None:
        for c in self._made:
            c.close()
        if self.loop is not None:
            self.loop.run_until_complete(asyncio.sleep(0))    # let cancelled tasks finish
            self.loop.close()


def clients_of(kind: str) -> Iterator[Clients]:
    """The body of a ``connect`` fixture parametrised over :data:`KINDS`:
    a factory for clients of ``kind``, all closed at teardown."""
    clients = Clients(kind)
    yield clients
    clients.close_all()


def client_on_a_pair(connect: Clients) -> Iterator[Tuple[Any, socket.socket]]:
    """The body of a ``pair`` fixture: a client made by ``connect`` on one end
    of a SOCK_SEQPACKET pair (via /dev/fd/N) and the raw other end, for what
    the broker cannot be made to do on cue."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client = connect(f"/dev/fd/{ours.detach()}")
    theirs.settimeout(TIMEOUT)
    yield client, theirs
    theirs.close()


def subscriber(connect: Clients, address: str, *patterns: str) -> Any:
    """A client made by ``connect`` on address, subscribed to patterns."""
    c = connect(address)
    for p in patterns:
        c.subscribe(p)
    c.whoami(timeout=TIMEOUT)   # the broker has registered the patterns once this returns
    return c
