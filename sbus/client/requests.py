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

Both clients delegate here: :func:`ask` and :func:`serve` (blocking client),
:func:`ask_async` and :func:`serve_async` (asyncio client). :class:`Replies`,
a client's inbox and the requests waiting on it, is shared by both and does
no I/O; the asyncio client routes every batch it reads through
:meth:`Replies.route`, so many requests are in flight on one connection.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Awaitable, Callable, Dict, List, NamedTuple, Optional, Union

from .._core.batch import check_publish_key, pack_publish
from ..errors import HandlerError, MessageRefusedError, RequestTimeoutError
from .private import PrivateInbox, is_private, local_form
from .protocol import Credentials, Message, Text, encode

__all__ = ["CONCURRENCY", "REQUEST_TIMEOUT", "IncomingRequest", "Replies", "ask",
           "ask_async", "pack_reply", "pack_request", "parse_reply", "parse_request",
           "serve", "serve_async"]

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

    __slots__ = ("inbox", "waiting", "opening", "_prefix", "_reply_prefix", "_next")

    def __init__(self) -> None:
        self.inbox: Optional[PrivateInbox] = None
        self.waiting: Dict[bytes, Any] = {}
        self.opening: Optional[asyncio.Future] = None
        self._prefix = b"\xff"      # no key starts with it before open()
        self._reply_prefix = b""
        self._next = 0

    def open(self, credentials: Credentials) -> None:
        self.inbox = PrivateInbox(credentials, KIND)
        # Replies are addressed to the inbox as whoami says (nested behind a
        # leaf or a private bridge) and arrive in the local form.
        self._reply_prefix = self.inbox.prefix.encode()
        self._prefix = local_form(self._reply_prefix)

    def expect(self, waiter: Any) -> bytes:
        """A new correlation id, its reply awaited by ``waiter``; returns the reply key."""
        self._next += 1
        correlation = b"%d" % self._next
        self.waiting[correlation] = waiter
        return self._reply_prefix + correlation

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


def _timed_out(key: Text, timeout: float) -> RequestTimeoutError:
    return RequestTimeoutError(f"no reply to a request on {key!r} within {timeout:g} s")


# -- the blocking client ------------------------------------------------------------

def ask(client, key: Text, payload: Text, timeout: float) -> bytes:
    """:meth:`sbus.client.sync.Client.request`: publish a request on ``key``
    and return the reply's body. RequestTimeoutError once ``timeout``
    (seconds) passes unanswered; HandlerError (the server's text) if the
    server's handler raised. Messages that arrive meanwhile are queued
    for ``receive()``, in order. After a timeout the inbox is dropped (a new
    one is made for the next request), so a late reply is not received."""
    replies = client._replies
    if replies is None:
        replies = Replies()
        replies.open(client.whoami(timeout=timeout))
        client.subscribe(replies.inbox.pattern)
        client._replies = replies
    reply_to = replies.expect(True)
    deadline = time.monotonic() + timeout
    held: List[Any] = []
    try:
        client.publish(key, pack_request(reply_to, payload))
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                client._replies = None
                client.unsubscribe(replies.inbox.pattern)
                raise _timed_out(key, timeout)
            try:
                batch = client.receive_many(64, timeout=left)
            except TimeoutError:
                continue
            for i, m in enumerate(batch):
                if type(m) is not Message or replies.correlation(m.key) is None:
                    held.append(m)
                elif m.key == local_form(reply_to):
                    held.extend(batch[i + 1:])
                    return parse_reply(m.payload)
                # else: the late reply to an earlier request, dropped
    finally:
        replies.forget(reply_to)
        client._requeue(held)


def _answer(handler: Callable[[IncomingRequest], Reply], request: IncomingRequest) -> bytes:
    try:
        return pack_reply(handler(request))
    except Exception as exc:    # the asker raises it; the server goes on
        return pack_error(exc)


def _reply(client, request: IncomingRequest, packed: bytes) -> None:
    """Publish a reply; one the broker would refuse (too large) becomes an error reply."""
    try:
        client.publish(request.reply_to, packed)
    except MessageRefusedError as exc:
        client.publish(request.reply_to, pack_error(exc))


def serve(client, pattern: Text, handler: Callable[[IncomingRequest], Reply],
          count: Optional[int] = None) -> int:
    """:meth:`sbus.client.sync.Client.serve`: answer the requests on
    ``pattern`` one at a time, until the broker closes the connection or
    ``count`` were answered; returns how many were."""
    client.subscribe(pattern)
    answered = 0
    if count == 0:
        return 0
    for message in client:
        request = parse_request(message) if type(message) is Message else None
        if request is None:
            continue
        _reply(client, request, _answer(handler, request))
        answered += 1
        if answered == count:
            break
    return answered


# -- the asyncio client -------------------------------------------------------------

async def _open_async(client) -> Replies:
    replies = client._replies
    if replies is None:
        replies = client._replies = Replies()
        replies.opening = client._loop.create_future()
        try:
            replies.open(await client.whoami())
            await client.subscribe(replies.inbox.pattern)
        except BaseException as exc:
            client._replies = None
            replies.opening.set_exception(exc)
            replies.opening.exception()     # seen: the first asker raises it
            raise
        replies.opening.set_result(None)
    elif not replies.opening.done():
        await asyncio.shield(replies.opening)
    return replies


def _expire(fut: asyncio.Future, key: Text, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(_timed_out(key, timeout))


async def ask_async(client, key: Text, payload: Text, timeout: float) -> bytes:
    """:meth:`sbus.client.aio.Client.request`; any number may be in flight at once.

    The future is also one of the client's requests (``Core._asked``): the
    client keeps reading while it waits, fails it if the connection ends, and
    after a reconnect publishes the request again to the new broker."""
    replies = client._replies
    if replies is None or not replies.opening.done():
        replies = await _open_async(client)
    loop = client._loop
    fut = loop.create_future()
    reply_to = replies.expect(fut)
    packet = pack_publish(key, pack_request(reply_to, payload), client.max_message)
    request = client._asked(reply_to, packet, fut)
    timer = loop.call_later(timeout, _expire, fut, key, timeout)
    try:
        await client.send_packet(packet)
        client._start_reading()
        return parse_reply(await fut)
    finally:
        timer.cancel()
        replies.forget(reply_to)
        client._unask(request)
        client._update_reading()


async def _reply_async(client, request: IncomingRequest, packed: bytes) -> None:
    try:
        await client.publish(request.reply_to, packed)
    except MessageRefusedError as exc:
        await client.publish(request.reply_to, pack_error(exc))


async def _answer_async(handler, request: IncomingRequest) -> bytes:
    try:
        result = handler(request)
        if inspect.isawaitable(result):
            result = await result
        return pack_reply(result)
    except Exception as exc:    # the asker raises it; the server goes on
        return pack_error(exc)


async def serve_async(client, pattern: Text,
                      handler: Callable[[IncomingRequest], Union[Reply, Awaitable[Reply]]],
                      concurrency: int = CONCURRENCY) -> None:
    """:meth:`sbus.client.aio.Client.serve`: answer the requests on
    ``pattern`` until the broker closes the connection; a coroutine handler
    runs as a task, at most ``concurrency`` at once (reading waits for a
    free slot). A plain function is called inline."""
    if concurrency < 1:
        raise ValueError("concurrency must be 1 or more")
    await client.subscribe(pattern)
    is_async = (inspect.iscoroutinefunction(handler)
                or inspect.iscoroutinefunction(type(handler).__call__))
    slots = asyncio.Semaphore(concurrency)
    tasks: set = set()

    async def one(request: IncomingRequest) -> None:
        try:
            await _reply_async(client, request, await _answer_async(handler, request))
        finally:
            slots.release()

    try:
        async for batch in client.batches():
            for message in batch:
                request = parse_request(message) if type(message) is Message else None
                if request is None:
                    continue
                if not is_async:
                    await _reply_async(client, request, await _answer_async(handler, request))
                    continue
                await slots.acquire()
                task = asyncio.ensure_future(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
    finally:
        for task in tasks:
            task.cancel()
