"""Consumers of an ``sbus queue`` service: jobs with ``ack()`` and ``nack()``.

``consume(client, pattern)`` returns a :class:`Consumer`, iterated with
``for`` over a blocking client and ``async for`` over an asyncio one (then
``await job.ack()``). It follows the convention of docs/queues.md through
the client's public methods only (:class:`sbus.client.services.BusClient`):

- make a private inbox (``sbus.client.private``), subscribe to it, and say
  hello on ``sbus/queue/hello`` naming the inbox, the prefetch and PATTERN;
- say hello again every third of the lease the welcome grants: that is the
  lease renewal, and it finds a restarted service (whose welcome brings a new
  token, which the consumer takes);
- hand out each job delivered to the inbox; ``job.ack()`` tells the service
  it is done: acks are held to go out together, one control message naming
  many tags, when the consumer is about to wait for more jobs, once half the
  prefetch is held, or ACK_DELAY after the first (the renewer's timer: a
  held ack must not hold back credit, nor, past ``--ack-timeout``, get a
  finished job done again); ``job.nack()`` gives it back at once
  (``requeue=False``: drop it);
- on leaving, say bye, so that the jobs not acknowledged go to other
  consumers at once: on ``close()``/``aclose()``, and when the loop is left
  by ``break``, ``return`` or an exception, as the consumer is dropped (an
  asyncio client then sends the held acks and the bye without waiting:
  ``publish_nowait``). Where something else keeps the consumer alive, close
  it, or ``async with contextlib.aclosing(bus.consume(...)) as jobs``.

The plan (:func:`_consuming`: the steps and what they decide,
:mod:`sbus.client.steps`) and the renewer's (:func:`_renewing`) are written
once; the two clients differ only in how they wait. The consumer owns the client's receiving while it runs:
messages that are not for its inbox are skipped, so give it a client of its
own. A blocking client's renewer is a thread with a connection of its own (the
client is not shared between threads), so a job may take longer than a
lease; an asyncio client's is a task on the same client. The service's
``--ack-timeout`` still bounds a job.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterable, List, Optional, Tuple, Union

from .._core.jobs import Acks, Feed, Job, Settler, jobs_from, pack_puts
from ..errors import SbusError, ServiceRefusedError
from ..queue import wire
from ..queue.defaults import PREFETCH, RENEWALS_PER_LEASE
from .private import PrivateInbox

if TYPE_CHECKING:   # the contract; services.py imports this module
    from .services import BusClient
from .protocol import ControlMessage
from .steps import ITEMS, Plan, Run, Steps

__all__ = ["Consumer", "consume", "consume_async", "job_packets"]

# Seconds between hellos while no service has answered.
HELLO_RETRY = 1.0
# The longest an ack waits to go out with others (one control message names
# many tags): short against any --ack-timeout, and credit comes back as soon.
ACK_DELAY = 0.02
# Seconds a closing consumer waits for the renewer thread to stop.
RENEWER_JOIN = 1.0
# How long to wait for the broker's whoami reply.
REPLY_TIMEOUT = 10.0
# How long a leaving consumer waits for the broker to answer a whoami sent
# after its last acks and bye: the answer says they were read.
BYE_CONFIRM = 2.0

Packet = Tuple[str, bytes]     # (key, payload) to publish
_PUT_SUFFIX = wire.PUT_SUFFIX.encode()
# What the plans yield besides client calls and (ITEMS, jobs) (see .steps).
NAP, RENEW = "nap", "renew"


class _Done:
    """What ``await job.ack()`` awaits when nothing is sent: done at once."""

    def __await__(self):
        return iter(())


_DONE = _Done()


class _Session:
    """The consumer's state, shared by its plan, its jobs' settling and its
    renewer (never the Consumer itself, so that dropping it drops the last
    reference and leaves at once): the inbox, the hello, the current token
    and control key, the held acks."""

    def __init__(self, client: BusClient, pattern: str, prefetch: int, awaited: bool) -> None:
        if prefetch < 1:
            raise ValueError("prefetch must be 1 or more")
        self.client, self.pattern, self.prefetch = client, pattern, prefetch
        self.awaited = awaited
        self.inbox: Optional[PrivateInbox] = None
        self.hello = b""
        self.token: Optional[str] = None
        self.control = ""
        self.lease = 0.0
        # Half the prefetch held goes at once: the service refills the rest
        # of the credit while the consumer works on the other half.
        self.acks = Acks(ACK_DELAY, prefetch // 2)
        self.wake: Callable[[], None] = _nothing        # the renewer's, once it runs
        self.stopped = False
        self._settle: Optional[Callable[[str, int], Any]] = None   # for the token's jobs

    def open(self, credentials: Any) -> None:
        self.inbox = PrivateInbox(credentials, "queue")
        self.hello = wire.pack_hello(self.prefetch, self.inbox.prefix, self.pattern, batch=True)

    @property
    def renew_every(self) -> float:
        return self.lease / RENEWALS_PER_LEASE if self.token else HELLO_RETRY

    def jobs(self, batch: List[Any]) -> List[Job]:
        """The jobs among received messages, after noting welcomes and expiries."""
        out: List[Job] = []
        for message in batch:
            if type(message) is ControlMessage:
                continue
            suffix = self.inbox.suffix_of(message.key)
            try:
                if suffix == b"jobs" and self.token is not None:
                    out.extend(jobs_from(message.payload, self._settle or self._settler()))
                elif suffix == b"job" and self.token is not None:
                    tag, deliveries, key, payload = wire.parse_job(message.payload)
                    out.append(Job(key, payload, deliveries, tag, self._settle or self._settler()))
                elif suffix == b"welcome":
                    welcome = wire.parse_welcome(message.payload)
                    if (welcome.token, welcome.control) != (self.token, self.control):
                        self._settle = None
                    self.token, self.control = welcome.token, welcome.control
                    self.lease = welcome.lease
                elif suffix == b"expired" and message.payload.decode("ascii", "replace") == self.token:
                    self.token = None   # forgotten: the next hello, at once, makes us known again
                    self._settle = None
                elif suffix == b"refused":
                    # Said again at every hello: waiting would not change it.
                    raise ServiceRefusedError(
                        f"sbus queue {self.pattern!r} refused us: "
                        f"{message.payload.decode('utf-8', 'replace')}")
            except ValueError:
                pass    # only the service writes to the inbox; it does not send garbage
        return out

    def _settler(self) -> Callable[[str, int], Any]:
        """How the jobs delivered under the current token are settled: with
        that token, even once a new one has come. What it returns is what
        ``job.ack()`` returns: None, or for an asyncio client an awaitable."""
        acks, token, control, client = self.acks, self.token, self.control, self.client

        def other(verb: str, tag: int) -> Any:     # nack, reject: the acks held go first
            packets = [acks.take(), (control, wire.pack_control(verb, token, tag))]
            return client.publish_many([p for p in packets if p is not None])

        # An ack is held in C (jobs.Settler): a consumer acks every job.
        settle = Settler(acks, control, token, client.publish,
                         _DONE if self.awaited else None, self, other)
        self._settle = settle
        return settle

    def leaving(self) -> List[Packet]:
        """What says goodbye: the held acks, then the bye."""
        self.stopped = True
        bye = (self.control, wire.pack_control(wire.BYE, self.token)) if self.token else None
        return [p for p in (self.acks.take(), bye) if p is not None]


def _nothing() -> None:
    pass


def _consuming(s: _Session) -> Generator[Tuple[Any, ...], Any, None]:
    """The consumer's plan: the client calls it makes and the jobs it hands out."""
    s.open((yield ("whoami", REPLY_TIMEOUT)))
    yield ("subscribe", None, s.inbox.pattern)
    yield ("publish", None, wire.HELLO_KEY, s.hello)
    next_hello = time.monotonic() + HELLO_RETRY
    renewing = False
    while True:
        if s.token is None and time.monotonic() >= next_hello:
            yield ("publish", None, wire.HELLO_KEY, s.hello)
            next_hello = time.monotonic() + HELLO_RETRY
        held = s.acks.take()    # about to wait: what is done goes now
        if held is not None:
            yield ("publish", None, *held)
        try:
            batch = yield ("receive_many", None if s.token else HELLO_RETRY, s.prefetch)
        except TimeoutError:
            continue
        known = s.token
        jobs = s.jobs(batch)
        if s.token is None and known is not None:
            next_hello = 0.0
        if s.token is not None and not renewing:
            renewing = True
            yield (RENEW,)
        if jobs:
            yield (ITEMS, jobs)     # handed out one by one by Steps, the plan not resumed


def _renewing(s: _Session) -> Generator[Tuple[Any, ...], Any, None]:
    """The renewer's plan: a hello every third of the lease, and held acks
    once due. It is woken when an ack is held while nobody watches
    (``Acks.watched``); while jobs stream in, it looks again every
    ACK_DELAY instead of being woken for each batch acknowledged."""
    acks = s.acks
    seen = acks.started
    next_hello = time.monotonic() + s.renew_every
    while not s.stopped:
        now = time.monotonic()
        if now >= next_hello:
            yield ("publish", None, wire.HELLO_KEY, s.hello)
            next_hello = now + s.renew_every
        due = acks.due
        if due is not None and now >= due:
            packet = acks.take()
            if packet is not None:
                yield ("publish", None, *packet)
            due = None
        streaming, seen = acks.started != seen, acks.started
        acks.watched = streaming or due is not None
        if not acks.watched and acks.due is not None:
            continue    # held before the flag went down: nobody woke us for it
        until = due or (now + ACK_DELAY if streaming else next_hello)
        yield (NAP, max(0.0, min(next_hello, until) - now))


def _saying_bye(s: _Session) -> Plan:
    """Leaving: the held acks and the bye, then a whoami whose answer says the
    broker has read them (a client that closes with deliveries unread could
    otherwise lose what it sent last)."""
    for packet in s.leaving():
        yield ("publish", None, *packet)
    if s.inbox is not None:
        yield ("unsubscribe", None, s.inbox.pattern)
        yield ("whoami", BYE_CONFIRM)


class Consumer(Steps):
    """The jobs of ``sbus queue`` on a pattern, as they come, forever: ``for``
    over a blocking client, ``async for`` over an asyncio one; see the module
    docstring. ``close()`` (blocking) or ``await aclose()`` says goodbye."""

    def __init__(self, client: BusClient, pattern: str, prefetch: int = PREFETCH) -> None:
        awaited = inspect.iscoroutinefunction(client.receive_many)
        self._s = _Session(client, pattern, prefetch, awaited)
        self._client = client
        self._plan = _consuming(self._s)
        self._renewer: Any = None
        self._left = False
        self._items: List[Job] = []     # the batch at hand, last first (Steps)

    def __iter__(self) -> Any:
        """Jobs of a batch come out of ``Feed`` in C; the plan runs between batches."""
        return Feed(self._items, self.__next__)

    def _special(self, action: Tuple[Any, ...]) -> bool:
        if action[0] is not RENEW:
            return False
        self._renewer = (_renew_task if self._s.awaited else _renew_thread)(self._s)
        return True

    def close(self) -> None:
        """Say goodbye, and wait for the broker to have read it."""
        if self._left:
            return
        s = self._leave()
        if self._renewer is not None:
            self._renewer.join(RENEWER_JOIN)
        try:
            for _ in Run(s.client, _saying_bye(s)):
                pass
        except (OSError, SbusError):
            pass    # the connection may be what ended the loop (TimeoutError is an OSError)

    def _leave(self) -> _Session:
        self._left = True
        self._items.clear()     # the jobs not handed out go to others with the bye
        self._plan.close()
        s = self._s
        s.stopped = True
        s.wake()
        return s

    async def aclose(self) -> None:
        """Say goodbye, and wait for the broker to have read it."""
        if self._left:
            return
        s = self._leave()
        try:
            async for _ in Run(s.client, _saying_bye(s)):
                pass
        except (OSError, SbusError):
            pass    # the connection may be what ended the loop

    async def __aenter__(self) -> "Consumer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        """Left by ``break``, ``return`` or an exception: say goodbye now.
        An asyncio client cannot wait here: it sends without waiting."""
        if self._left:
            return
        if not self._s.awaited:
            try:
                return self.close()
            except Exception:   # at interpreter exit, say
                return
        s = self._leave()
        try:
            for packet in s.leaving():
                s.client.publish_nowait(*packet)
        except (OSError, SbusError, RuntimeError):
            pass    # the client or its loop is gone already


def _renew_thread(s: _Session) -> threading.Thread:
    """The blocking client's renewer: a thread with a connection of its own."""
    wake = threading.Event()

    def run() -> None:
        from .sync import Client
        try:
            with Client(s.client.address, max_message=s.client.max_message,
                        reconnect=True) as own:
                for action in _renewing(s):
                    if action[0] is NAP:
                        wake.wait(action[1])
                        wake.clear()
                    else:
                        own.publish(*action[2:])
        except (OSError, SbusError):
            pass    # the broker is gone for good: no lease to renew

    s.wake = wake.set
    thread = threading.Thread(target=run, name="sbus-consume-renew", daemon=True)
    thread.start()
    return thread


def _renew_task(s: _Session) -> "asyncio.Task":
    """The asyncio client's renewer: a task on the same client."""
    wake = asyncio.Event()

    async def run() -> None:
        try:
            for action in _renewing(s):
                if action[0] is NAP:
                    try:
                        await asyncio.wait_for(wake.wait(), action[1])
                    except TimeoutError:
                        pass
                    wake.clear()
                else:
                    await s.client.publish(*action[2:])
        except (OSError, SbusError):
            pass

    s.wake = wake.set
    return asyncio.ensure_future(run())


def job_packets(key: Union[str, bytes], payloads: Iterable[bytes],
                max_message: int = 0) -> List[Tuple[bytes, bytes]]:
    """The packets (key, payload) that give ``payloads`` to ``sbus queue`` as
    jobs on ``key``, in order: a producer's batches of at most
    ``wire.PUT_PACKET`` bytes (docs/queues.md, "Producers' batches"), a job
    too large for one alone as a plain job. What ``Client.produce`` publishes;
    ``max_message``, the broker's, bounds a batch's packet too."""
    k = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else bytes(key)
    batch_key = k + _PUT_SUFFIX
    limit = wire.PUT_PACKET
    if max_message:
        limit = min(limit, max_message - len(b"MSG \0") - len(batch_key))
    return pack_puts(k, batch_key, payloads if type(payloads) is list else list(payloads), limit)


def consume(client: BusClient, pattern: str, prefetch: int = PREFETCH) -> Consumer:
    """Jobs of the ``sbus queue`` service for ``pattern``: a :class:`Consumer`."""
    return Consumer(client, pattern, prefetch)


consume_async = consume     # the name the asyncio client's method once called
