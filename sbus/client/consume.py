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
  is done: acks are held to go out together, one control message naming
  many tags, when the generator is about to wait for more jobs, once half
  the prefetch is held, or ACK_DELAY after the first (a timer: a held ack
  must not hold back credit, nor, past ``--ack-timeout``, get a finished
  job done again); ``job.nack()`` gives
  it back at once (``requeue=False``: drop it);
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

from .._core.jobs import Acks, Job, jobs_from
from ..errors import SbusError
from ..queue import wire
from ..queue.defaults import PREFETCH, RENEWALS_PER_LEASE
from .private import PrivateInbox
from .protocol import ControlMessage

# Seconds between hellos while no service has answered.
HELLO_RETRY = 1.0
# The longest an ack waits to go out with others (one control message names
# many tags): short against any --ack-timeout, and credit comes back as soon.
ACK_DELAY = 0.02
# Seconds the generator waits, when it ends, for the renewer thread to stop.
RENEWER_JOIN = 1.0
# How long to wait for the broker's whoami reply.
REPLY_TIMEOUT = 10.0
# How long a leaving consumer waits for the broker to answer a whoami sent
# after its last acks and bye. A client that closes with deliveries unread
# makes the broker's next read of it fail (ECONNRESET) before the packets it
# sent last are read, and they are lost: the answer says they were read.
BYE_CONFIRM = 2.0


Packet = Tuple[str, bytes]     # (key, payload) to publish


class _Session:
    """What both twins know: the inbox, the hello, the current token and control key."""

    def __init__(self, inbox: PrivateInbox, pattern: str, prefetch: int) -> None:
        if prefetch < 1:
            raise ValueError("prefetch must be 1 or more")
        self.inbox = inbox
        self.prefetch = prefetch
        self.hello = wire.pack_hello(prefetch, inbox.prefix, pattern, batch=True)
        self.token: Optional[str] = None
        self.control = ""
        self.lease = 0.0
        # Half the prefetch held goes at once: the service refills the rest
        # of the credit while the consumer works on the other half.
        self.acks = Acks(ACK_DELAY, prefetch // 2)
        self._settle: Optional[Callable[[str, int], object]] = None   # for the token's jobs

    @property
    def renew_every(self) -> float:
        return self.lease / RENEWALS_PER_LEASE if self.token else HELLO_RETRY

    def jobs(self, batch, send, hold) -> List[Job]:
        """The jobs among received messages, after noting welcomes and expiries.
        ``send(packet...)`` is how a nack or reject reaches the bus (the acks
        held go before it); ``hold(held)`` is told of each ack held by
        ``Acks.add``, whose answer it gets: None, True (the first held since
        the last went out), or a packet to send first (and the first)."""
        out: List[Job] = []
        for message in batch:
            if type(message) is ControlMessage:
                continue
            suffix = self.inbox.suffix_of(message.key)
            try:
                if suffix == b"jobs" and self.token is not None:
                    out.extend(jobs_from(message.payload, self._settle or self._settler(send, hold)))
                elif suffix == b"job" and self.token is not None:
                    tag, deliveries, key, payload = wire.parse_job(message.payload)
                    out.append(Job(key, payload, deliveries, tag,
                                   self._settle or self._settler(send, hold)))
                elif suffix == b"welcome":
                    welcome = wire.parse_welcome(message.payload)
                    if (welcome.token, welcome.control) != (self.token, self.control):
                        self._settle = None
                    self.token, self.control = welcome.token, welcome.control
                    self.lease = welcome.lease
                elif suffix == b"expired" and message.payload.decode("ascii", "replace") == self.token:
                    self.token = None   # forgotten: the next hello, at once, makes us known again
                    self._settle = None
            except ValueError:
                pass    # only the service writes to the inbox; it does not send garbage
        return out

    def _settler(self, send, hold) -> Callable[[str, int], object]:
        """How the jobs delivered under the current token are settled: with
        that token, even once a new one has come."""
        acks, token, control = self.acks, self.token, self.control
        add = acks.add

        def settle(verb: str, tag: int):
            if verb == wire.ACK:
                return hold(add(control, token, tag))
            return send(acks.take(), (control, wire.pack_control(verb, token, tag)))

        self._settle = settle
        return settle

    def bye(self) -> Optional[Packet]:
        return (self.control, wire.pack_control(wire.BYE, self.token)) if self.token else None


def consume(client, pattern: str, prefetch: int = PREFETCH) -> Iterator[Job]:
    """Jobs of the ``sbus queue`` service for ``pattern``, for a blocking
    :class:`sbus.client.sync.Client`, as they come, forever."""
    session = _Session(PrivateInbox(client.whoami(timeout=REPLY_TIMEOUT), "queue"), pattern,
                       prefetch)

    def send(*packets: Optional[Packet]) -> None:
        for packet in packets:
            if packet is not None:
                client.publish(*packet)

    def hold(held) -> None:
        if held is None:
            return
        if held is not True:
            client.publish(*held)   # the acks of an earlier token, or half the prefetch
        if not session.acks.watched:
            wake.set()          # the renewer sends held acks when they are due

    client.subscribe(session.inbox.pattern)
    stop, wake = threading.Event(), threading.Event()
    renewer = threading.Thread(target=_renew, args=(client, session, stop, wake),
                               name="sbus-consume-renew", daemon=True)
    client.publish(wire.HELLO_KEY, session.hello)
    next_hello = time.monotonic() + HELLO_RETRY
    try:
        while True:
            if session.token is None and time.monotonic() >= next_hello:
                client.publish(wire.HELLO_KEY, session.hello)
                next_hello = time.monotonic() + HELLO_RETRY
            send(session.acks.take())   # about to wait: what is done goes now
            try:
                batch = client.receive_many(session.prefetch,
                                            timeout=None if session.token else HELLO_RETRY)
            except TimeoutError:
                continue
            known = session.token
            jobs = session.jobs(batch, send, hold)
            if session.token is None and known is not None:
                next_hello = 0.0
            if session.token is not None and renewer.ident is None:
                renewer.start()
            yield from jobs
    finally:
        stop.set()
        wake.set()
        if renewer.ident is not None:
            renewer.join(RENEWER_JOIN)
        try:
            send(session.acks.take(), session.bye())
            client.unsubscribe(session.inbox.pattern)
            client.whoami(timeout=BYE_CONFIRM)
        except (OSError, SbusError):
            pass    # the connection may be what ended the loop (TimeoutError is an OSError)


def _renew(client, session: _Session, stop: threading.Event, wake: threading.Event) -> None:
    """Hello every third of the lease, and held acks once due, from a
    connection of this thread's own (the blocking client is not shared
    between threads; the service knows a consumer by its token, not its
    connection). ``wake`` is set when an ack is held while nobody watches
    (``Acks.watched``), and to stop."""
    from .sync import Client
    acks = session.acks
    seen = acks.started
    try:
        with Client(client.address, max_message=client.max_message, reconnect=True) as own:
            next_hello = time.monotonic() + session.renew_every
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_hello:
                    own.publish(wire.HELLO_KEY, session.hello)
                    next_hello = now + session.renew_every
                due = acks.due
                if due is not None and now >= due:
                    packet = acks.take()
                    if packet is not None:
                        own.publish(*packet)
                    due = None
                # While jobs stream in, look again every ACK_DELAY instead of
                # being woken for each batch acknowledged.
                streaming, seen = acks.started != seen, acks.started
                acks.watched = streaming or due is not None
                if not acks.watched and acks.due is not None:
                    continue    # held before the flag went down: nobody woke us for it
                until = due or (now + ACK_DELAY if streaming else next_hello)
                wake.wait(max(0.0, min(next_hello, until) - now))
                wake.clear()
    except (OSError, SbusError):
        pass    # the broker is gone for good: no lease to renew


async def consume_async(client, pattern: str, prefetch: int = PREFETCH) -> AsyncIterator[Job]:
    """As :func:`consume`, for an asyncio :class:`sbus.client.aio.Client`;
    ``await job.ack()``."""
    session = _Session(PrivateInbox(await client.whoami(), "queue"), pattern, prefetch)

    timer: List[Optional[asyncio.TimerHandle]] = [None]

    async def send(*packets: Optional[Packet]) -> None:
        for packet in packets:
            if packet is not None:
                await client.publish(*packet)

    def due() -> None:
        timer[0] = None
        asyncio.ensure_future(send(session.acks.take()))

    async def hold(held) -> None:
        if held is not None and held is not True:
            await client.publish(*held)     # the acks of an earlier token, or half the prefetch
        if timer[0] is None:
            timer[0] = asyncio.get_running_loop().call_later(ACK_DELAY, due)

    async def renew() -> None:
        while True:
            await client.publish(wire.HELLO_KEY, session.hello)
            await asyncio.sleep(session.renew_every)

    await client.subscribe(session.inbox.pattern)
    renewer = asyncio.ensure_future(renew())
    try:
        while True:
            await send(session.acks.take())     # about to wait: what is done goes now
            batch = await client.receive_many(session.prefetch)
            known = session.token
            jobs = session.jobs(batch, send, hold)
            if session.token is None and known is not None:
                await client.publish(wire.HELLO_KEY, session.hello)
            for job in jobs:
                yield job
    finally:
        renewer.cancel()
        if timer[0] is not None:
            timer[0].cancel()
        try:
            await send(session.acks.take(), session.bye())
            await client.unsubscribe(session.inbox.pattern)
            await asyncio.wait_for(client.whoami(), BYE_CONFIRM)
        except (OSError, SbusError, asyncio.TimeoutError):
            pass    # the connection may be what ended the loop
