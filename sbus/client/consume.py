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
  is done, at once (a held ack would hold back the next job's credit and,
  past ``--ack-timeout``, get a finished job done again), ``job.nack()``
  gives it back (``requeue=False``: drop it);
- on leaving (the generator closed or garbage-collected), say bye, so that
  the jobs not acknowledged go to other consumers at once.

The generator owns the client's receiving while it runs: messages that are
not for its inbox are skipped, so give it a client of its own. The blocking
twin renews the lease from a thread with a connection of its own, so a job
may take longer than a lease; the ``--ack-timeout`` of the service still
bounds it. ``Client.consume(pattern, prefetch=...)`` of either client
delegates here.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator, Callable, Iterator, List, Optional, Tuple

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


Packet = Tuple[str, bytes]     # (key, payload) to publish


class _Session:
    """What both twins know: the inbox, the hello, the current token and control key."""

    def __init__(self, inbox: PrivateInbox, pattern: str, prefetch: int) -> None:
        if prefetch < 1:
            raise ValueError("prefetch must be 1 or more")
        self.inbox = inbox
        self.prefetch = prefetch
        self.hello = wire.pack_hello(prefetch, inbox.prefix, pattern)
        self.token: Optional[str] = None
        self.control = ""
        self.lease = 0.0

    @property
    def renew_every(self) -> float:
        return self.lease / RENEWALS_PER_LEASE if self.token else HELLO_RETRY

    def jobs(self, batch, send) -> List[Job]:
        """The jobs among received messages, after noting welcomes and expiries.
        ``send((key, payload))`` is how a job's settlement reaches the bus."""
        out = []
        for message in batch:
            if type(message) is ControlMessage:
                continue
            suffix = self.inbox.suffix_of(message.key)
            try:
                if suffix == b"job" and self.token is not None:
                    tag, deliveries, key, payload = wire.parse_job(message.payload)
                    token, control = self.token, self.control
                    out.append(Job(key, payload, deliveries, tag,
                                   lambda verb, tag, token=token, control=control:
                                   send((control, wire.pack_control(verb, token, tag)))))
                elif suffix == b"welcome":
                    welcome = wire.parse_welcome(message.payload)
                    self.token, self.control = welcome.token, welcome.control
                    self.lease = welcome.lease
                elif suffix == b"expired" and message.payload.decode("ascii", "replace") == self.token:
                    self.token = None   # forgotten: the next hello, at once, makes us known again
            except wire.WireError:
                pass    # only the service writes to the inbox; it does not send garbage
        return out

    def bye(self) -> Optional[Packet]:
        return (self.control, wire.pack_control(wire.BYE, self.token)) if self.token else None


def consume(client, pattern: str, prefetch: int = PREFETCH) -> Iterator[Job]:
    """Jobs of the ``sbus queue`` service for ``pattern``, for a blocking
    :class:`sbus.client.sync.Client`, as they come, forever."""
    session = _Session(PrivateInbox(client.whoami(timeout=REPLY_TIMEOUT), "queue"), pattern,
                       prefetch)

    def send(packet: Optional[Packet]) -> None:
        if packet is not None:
            client.publish(*packet)

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
                batch = client.receive_many(session.prefetch,
                                            timeout=None if session.token else HELLO_RETRY)
            except TimeoutError:
                continue
            known = session.token
            jobs = session.jobs(batch, send)
            if session.token is None and known is not None:
                next_hello = 0.0
            if session.token is not None and renewer.ident is None:
                renewer.start()
            yield from jobs
    finally:
        stop.set()
        try:
            send(session.bye())
            client.unsubscribe(session.inbox.pattern)
        except (OSError, SbusError):
            pass    # the connection may be what ended the loop


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

    async def send(packet: Optional[Packet]) -> None:
        if packet is not None:
            await client.publish(*packet)

    async def renew() -> None:
        while True:
            await client.publish(wire.HELLO_KEY, session.hello)
            await asyncio.sleep(session.renew_every)

    await client.subscribe(session.inbox.pattern)
    renewer = asyncio.ensure_future(renew())
    try:
        while True:
            batch = await client.receive_many(session.prefetch)
            known = session.token
            jobs = session.jobs(batch, send)
            if session.token is None and known is not None:
                await client.publish(wire.HELLO_KEY, session.hello)
            for job in jobs:
                yield job
    finally:
        renewer.cancel()
        try:
            await send(session.bye())
            await client.unsubscribe(session.inbox.pattern)
        except (OSError, SbusError):
            pass    # the connection may be what ended the loop
