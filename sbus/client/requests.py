"""Requests and replies between clients: the convention of docs/requests.md.

A request is an ordinary ``MSG`` on a public key whose payload starts with a
header line naming where the answer goes::

    REQ <reply key>\\n<body>

The reply key is the asker's private inbox (:mod:`sbus.client.private`,
kind ``reply``) plus a correlation id: ``!/cred/GID/UID/PID/reply/ID/N``.
A server publishes its answer there, the payload starting with a status line::

    OK\\n<body>          the handler's result
    ERR\\n<text>         the handler raised; the asker raises HandlerError(text)

The broker hands the reply to the asker alone and drops it if the asker has
gone. A server answers only requests whose reply key is a private key, so a
request cannot make it publish on a public key; any other packet on its
pattern is ignored.

:class:`Replies` is a client's reply inbox and the requests waiting on it;
it does no I/O. A client's :class:`~sbus.client.connection.Connection`
holds one and routes every batch either driver reads through
:meth:`Replies.route`, so many requests are in flight on one asyncio client;
its ``request`` plan asks (``Client.request`` of either client). The
clients' ``serve`` delegates to :func:`serve` (blocking) and
:func:`serve_async` (asyncio).
"""
from __future__ import annotations

import asyncio
import inspect
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, NamedTuple, Optional, Union

from .._core.batch import check_publish_key
from ..errors import BusClosedError, HandlerError, MessageRefusedError, RequestTimeoutError
from .private import PrivateInbox, is_private

if TYPE_CHECKING:   # the contract; services.py imports this module
    from .services import BusClient
from .protocol import Credentials, Message, Text, encode
from .steps import ITEM, Plan, Run

__all__ = ["CONCURRENCY", "REQUEST_TIMEOUT", "IncomingRequest", "Replies", "pack_reply",
           "pack_request", "parse_reply", "parse_request", "serve", "serve_async"]

# Seconds a request waits for its reply unless told otherwise.
REQUEST_TIMEOUT = 5.0
# Requests an asyncio server's handlers work on at once, unless told otherwise.
CONCURRENCY = 64
# The inbox kind (one key segment) under the asker's credentials.
KIND = "reply"

REQUEST_MARK = b"REQ "
OK = b"OK\n"
ERR = b"ERR\n"

Reply = Union[None, str, bytes, bytearray, memoryview]


class IncomingRequest(NamedTuple):
    """A request as a server's handler gets it: the ``key`` it was published
    on, its ``payload`` (the body, header removed) and ``reply_to``."""

    key: bytes
    payload: bytes
    reply_to: bytes


def pack_request(reply_to: Text, body: Text = b"") -> bytes:
    return REQUEST_MARK + encode(reply_to) + b"\n" + encode(body)


def parse_request(message: Message) -> Optional[IncomingRequest]:
    """The request a message carries; None if it is not one a server may answer
    (no header, or a reply key that is not a private key the broker relays)."""
    payload = message.payload
    if not payload.startswith(REQUEST_MARK):
        return None
    end = payload.find(b"\n", len(REQUEST_MARK))
    if end < 0:
        return None
    reply_to = payload[len(REQUEST_MARK):end]
    if not is_private(reply_to):
        return None
    try:
        check_publish_key(reply_to)
    except MessageRefusedError:
        return None
    return IncomingRequest(message.key, payload[end + 1:], reply_to)


def pack_reply(result: Reply) -> bytes:
    return OK if result is None else OK + encode(result)


def pack_error(exc: BaseException) -> bytes:
    return ERR + f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")


def parse_reply(payload: bytes) -> bytes:
    """The body of an ``OK`` reply; HandlerError for an ``ERR`` reply or a
    payload that follows neither form."""
    if payload.startswith(OK):
        return payload[len(OK):]
    if payload.startswith(ERR):
        raise HandlerError(payload[len(ERR):].decode("utf-8", "replace"))
    raise HandlerError(f"malformed reply: {payload[:60]!r}")


class Replies:
    """A client's reply inbox and the requests waiting on it (correlation id ->
    waiter). Made on a client's first request; the inbox is known once the
    broker said who the client is (:meth:`open`)."""

    __slots__ = ("inbox", "credentials", "waiting", "opening", "_prefix", "_reply_prefix",
                 "_next")

    def __init__(self, opening: Any) -> None:
        self.inbox: Optional[PrivateInbox] = None
        self.credentials: Optional[Credentials] = None
        self.waiting: Dict[bytes, Any] = {}
        self.opening = opening      # a waiter, done once the inbox is subscribed
        self._prefix = b"\xff"      # no key starts with it before open()
        self._reply_prefix = b""
        self._next = 0

    def open(self, credentials: Credentials) -> None:
        self.credentials = credentials
        self.inbox = PrivateInbox(credentials, KIND)
        # Replies are addressed to the inbox as whoami says (nested behind a
        # leaf or a private bridge) and arrive in the local form.
        self._reply_prefix = self.inbox.key(b"")
        self._prefix = self.inbox.local

    def expect(self, waiter: Any) -> bytes:
        """A new correlation id, its reply awaited by ``waiter``; returns the reply key."""
        self._next += 1
        correlation = b"%d" % self._next
        self.waiting[correlation] = waiter
        return self.inbox.key(correlation)

    def forget(self, reply_key: bytes) -> None:
        self.waiting.pop(reply_key[len(self._reply_prefix):], None)

    def correlation(self, key: bytes) -> Optional[bytes]:
        """The correlation id of a key in the inbox; None for any other key."""
        return key[len(self._prefix):] if key.startswith(self._prefix) else None

    def route(self, batch: List[Any]) -> List[Any]:
        """Hand replies in ``batch`` to their futures (a late one is dropped);
        returns the rest, in order."""
        prefix = self._prefix
        if not any(type(m) is Message and m.key.startswith(prefix) for m in batch):
            return batch
        rest = []
        for m in batch:
            if type(m) is Message and m.key.startswith(prefix):
                fut = self.waiting.pop(m.key[len(prefix):], None)
                if fut is not None and not fut.done():
                    fut.set_result(m.payload)
            else:
                rest.append(m)
        return rest


def timed_out(key: Text, timeout: float) -> RequestTimeoutError:
    return RequestTimeoutError(f"no reply to a request on {key!r} within {timeout:g} s")


def _serving(pattern: Text, count: Optional[int], others: bool = False) -> Plan:
    """A server's plan (see .steps): the requests on ``pattern``, one at a
    time, until the broker closes the connection or ``count`` were handed
    out; with ``others``, also every other message, as it is."""
    yield ("subscribe", None, pattern)
    handed = 0
    while handed != count:
        try:
            message = yield ("receive", None)
        except BusClosedError:
            return
        request = parse_request(message) if type(message) is Message else None
        if request is not None:
            handed += 1
            yield (ITEM, request)
        elif others and type(message) is Message:
            yield (ITEM, message)


def _replying(request: IncomingRequest, packed: bytes) -> Plan:
    """Publish a reply; one the broker would refuse (too large) becomes an error reply."""
    try:
        yield ("publish", None, request.reply_to, packed)
    except MessageRefusedError as exc:
        yield ("publish", None, request.reply_to, pack_error(exc))


def serve(client: BusClient, pattern: Text, handler: Callable[[IncomingRequest], Reply],
          count: Optional[int] = None) -> int:
    """:meth:`sbus.client.sync.Client.serve`: answer the requests on
    ``pattern`` one at a time, until the broker closes the connection or
    ``count`` were answered; returns how many were."""
    answered = 0
    for request in Run(client, _serving(pattern, count)):
        try:
            packed = pack_reply(handler(request))
        except Exception as exc:    # the asker raises it; the server goes on
            packed = pack_error(exc)
        for _ in Run(client, _replying(request, packed)):
            pass
        answered += 1
    return answered


async def serve_async(client: BusClient, pattern: Text,
                      handler: Callable[[IncomingRequest], Union[Reply, Awaitable[Reply]]],
                      concurrency: int = CONCURRENCY,
                      others: Optional[Callable[[Message], Awaitable[None]]] = None) -> None:
    """:meth:`sbus.client.aio.Client.serve`: answer the requests on
    ``pattern`` until the broker closes the connection; a coroutine handler
    runs as a task, at most ``concurrency`` at once (reading waits for a
    free slot). A plain function is called inline. ``others`` is awaited
    with each message that is no request (``sbus serve`` answers its state
    requests there: a server reads all its client's messages)."""
    if concurrency < 1:
        raise ValueError("concurrency must be 1 or more")
    is_async = (inspect.iscoroutinefunction(handler)
                or inspect.iscoroutinefunction(type(handler).__call__))
    slots = asyncio.Semaphore(concurrency)
    tasks: set = set()

    async def one(request: IncomingRequest) -> None:
        try:
            try:
                result = handler(request)
                packed = pack_reply(await result if inspect.isawaitable(result) else result)
            except Exception as exc:    # the asker raises it; the server goes on
                packed = pack_error(exc)
            async for _ in Run(client, _replying(request, packed)):
                pass
        finally:
            if is_async:
                slots.release()

    try:
        async for request in Run(client, _serving(pattern, None, others is not None)):
            if type(request) is Message:
                await others(request)   # type: ignore[misc]
                continue
            if not is_async:
                await one(request)
                continue
            await slots.acquire()
            task = asyncio.ensure_future(one(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        for task in tasks:
            task.cancel()
