"""Consumers of an ``sbus queue`` service: jobs with ``ack()`` and ``nack()``.

``consume(client, pattern)`` (blocking client) and ``consume_async(client,
pattern)`` (asyncio client) follow the convention of docs/queues.md through
the clients' public API only:

- make a private inbox (``sbus.client.private``), subscribe to it, and say
  hello on ``sbus/queue/hello`` naming the inbox, the prefetch and PATTERN;
- say hello again every third of the lease the welcome grants: that is the
  lease renewal, and it finds a restarted service (whose welcome brings a new
  token, which the consumer takes);
- yield each job delivered to the inbox; ``job.ack()`` tells the service it
  is done, ``job.nack()`` gives it back (``requeue=False``: drop it);
- on leaving (the generator closed or garbage-collected), say bye, so that
  the jobs not acknowledged go to other consumers at once.

The generator owns the client's receiving while it runs: messages that are
not for its inbox are skipped, so give it a client of its own. The blocking
twin renews the lease from a thread with a connection of its own, so a job
may take longer than a lease; the ``--ack-timeout`` of the service still
bounds it. A ``Client.consume(pattern, prefetch=...)`` method is
``return consume(self, pattern, prefetch)`` (``consume_async`` in the
asyncio client).
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator, Callable, Iterator, Optional

from ..queue import wire
from ..queue.defaults import PREFETCH, RENEWALS_PER_LEASE
from ..errors import SbusError
from .private import PrivateInbox
from .protocol import ControlMessage

# Seconds between hellos while no service has answered.
HELLO_RETRY = 1.0
# How long to wait for the broker's whoami reply.
REPLY_TIMEOUT = 10.0


class Job:
    """One delivery: ``key`` and ``payload`` as published, ``deliveries`` (1
    the first time; more means it was given out before and not acknowledged),
    and ``tag``, the service's name for this delivery. Settle it once, with
    ``ack()`` or ``nack()``; with the asyncio client, await them."""

    __slots__ = ("key", "payload", "deliveries", "tag", "_settle", "settled")

    def __init__(self, key: bytes, payload: bytes, deliveries: int, tag: int,
                 settle: Callable[[str, int], object]) -> None:
        self.key, self.payload, self.deliveries, self.tag = key, payload, deliveries, tag
        self._settle = settle
        self.settled = False

    @property
    def redelivered(self) -> bool:
        return self.deliveries > 1

    def ack(self):
        """Done: the service forgets the job."""
        return self._once(wire.ACK)

    def nack(self, requeue: bool = True):
        """Not done: the job goes to a consumer again, or with ``requeue=False``
        is dropped (counted as rejected)."""
        return self._once(wire.NACK if requeue else wire.REJECT)

    def _once(self, verb: str):
        if self.settled:
            raise RuntimeError(f"job {self.tag} is already settled")
        self.settled = True
        return self._settle(verb, self.tag)

    def __repr__(self) -> str:
        return (f"Job(key={self.key!r}, payload={self.payload[:40]!r}, "
                f"deliveries={self.deliveries}, tag={self.tag})")


class _Session:
    """What both twins know: the inbox, the hello, the current token and control key."""

    def __init__(self, inbox: PrivateInbox, pattern: str, prefetch: int) -> None:
        if prefetch < 1:
            raise ValueError("prefetch must be 1 or more")
        self.inbox = inbox
        self.hello = wire.pack_hello(prefetch, inbox.prefix, pattern)
        self.token: Optional[str] = None
        self.control = ""
        self.lease = 0.0

    @property
    def renew_every(self) -> float:
        return self.lease / RENEWALS_PER_LEASE if self.token else HELLO_RETRY

    def take(self, message, settle) -> Optional[Job]:
        """A job from a received message, or None after noting a welcome or
        an expiry (or for anything else)."""
        if type(message) is ControlMessage:
            return None
        suffix = self.inbox.suffix_of(message.key)
        try:
            if suffix == b"job" and self.token is not None:
                tag, deliveries, key, payload = wire.parse_job(message.payload)
                token, control = self.token, self.control
                return Job(key, payload, deliveries, tag,
                           lambda verb, tag: settle(control, wire.pack_control(verb, token, tag)))
            if suffix == b"welcome":
                welcome = wire.parse_welcome(message.payload)
                self.token, self.control, self.lease = welcome.token, welcome.control, welcome.lease
            elif suffix == b"expired" and message.payload.decode("ascii", "replace") == self.token:
                self.token = None   # forgotten: the next hello, at once, makes us known again
        except wire.WireError:
            pass    # only the service writes to the inbox; it does not send garbage
        return None

    def bye(self) -> Optional[tuple]:
        return (self.control, wire.pack_control(wire.BYE, self.token)) if self.token else None


def consume(client, pattern: str, prefetch: int = PREFETCH) -> Iterator[Job]:
    """Jobs of the ``sbus queue`` service for ``pattern``, for a blocking
    :class:`sbus.client.sync.Client`, as they come, forever."""
    session = _Session(PrivateInbox(client.whoami(timeout=REPLY_TIMEOUT), "queue"), pattern,
                       prefetch)
    client.subscribe(session.inbox.pattern)
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(client, session, stop),
                               name="sbus-consume-renew", daemon=True)
    client.publish(wire.HELLO_KEY, session.hello)
    next_hello = time.monotonic() + HELLO_RETRY
    try:
        while True:
            if session.token is None and time.monotonic() >= next_hello:
                client.publish(wire.HELLO_KEY, session.hello)
                next_hello = time.monotonic() + HELLO_RETRY
            try:
                message = client.receive(timeout=None if session.token else HELLO_RETRY)
            except TimeoutError:
                continue
            known = session.token
            job = session.take(message, client.publish)
            if session.token is None and known is not None:
                next_hello = 0.0
            if session.token is not None and renewer.ident is None:
                renewer.start()
            if job is not None:
                yield job
    finally:
        stop.set()
        goodbye = session.bye()
        try:
            if goodbye:
                client.publish(*goodbye)
            client.unsubscribe(session.inbox.pattern)
        except Exception:   # noqa: BLE001 - the connection may be what ended the loop
            pass


def _renew(client, session: _Session, stop: threading.Event) -> None:
    """Hello every third of the lease, from a connection of this thread's own
    (the blocking client is not shared between threads)."""
    from .sync import Client
    try:
        with Client(client.address, max_message=client.max_message, reconnect=True) as own:
            while not stop.wait(session.renew_every):
                own.publish(wire.HELLO_KEY, session.hello)
    except (OSError, SbusError):
        pass    # the broker is gone for good: no lease to renew


async def consume_async(client, pattern: str, prefetch: int = PREFETCH) -> AsyncIterator[Job]:
    """As :func:`consume`, for an asyncio :class:`sbus.client.aio.Client`;
    ``await job.ack()``."""
    session = _Session(PrivateInbox(await client.whoami(), "queue"), pattern, prefetch)
    await client.subscribe(session.inbox.pattern)

    async def renew() -> None:
        while True:
            await client.publish(wire.HELLO_KEY, session.hello)
            await asyncio.sleep(session.renew_every)

    renewer = asyncio.ensure_future(renew())
    try:
        while True:
            message = await client.receive()
            known = session.token
            job = session.take(message, client.publish)
            if session.token is None and known is not None:
                await client.publish(wire.HELLO_KEY, session.hello)
            if job is not None:
                yield job
    finally:
        renewer.cancel()
        goodbye = session.bye()
        try:
            if goodbye:
                await client.publish(*goodbye)
            await client.unsubscribe(session.inbox.pattern)
        except Exception:   # noqa: BLE001 - the connection may be what ended the loop
            pass
