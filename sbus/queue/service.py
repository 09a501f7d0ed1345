"""The service's I/O: one asyncio client of sbusd, a reader, a sender and a clock.

The reader takes packets off the bus and feeds ``state.Queue``; it never
awaits a send, so the service drains its socket even while its own
deliveries wait (the broker may be holding the bus for it, see FLOOD below).
What the state returns to send is queued for the sender task, which hands it
to the broker with ``publish_many``. The clock expires leases and ack
deadlines and writes the periodic ``queue_stats`` record.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .. import __version__
from .. import logschema as schema
from .._core.jobs import Intake, pack_jobs
from ..access import askers as access
from ..client.aio import Client
from ..client.private import PrivateInbox
from ..client.protocol import MAX_MESSAGE
from ..client.reconnect import Reconnect
from ..errors import BacklogFullError, MessageRefusedError
from ..runner import STOPPED, ready
from . import state as st
from . import wire
from .defaults import ACK_TIMEOUT, LEASE, MAX_HELD, PREFETCH, STATS_INTERVAL

# The service's flood mode at the broker: when it falls behind by a whole
# broker queue (8 MiB or 65536 messages by default), publishers wait instead
# of jobs being discarded. The reader never waits on anything but the socket,
# so such a wait lasts as long as one read of the backlog.
FLOOD = ("echo/off", "blocking/soft/queue", "blocking/hard/block")
# Packets read at once.
BATCH = 256
# The largest ``jobs`` payload: a consumer starts on a batch once all of it
# is there, so a batch is a few hundred small jobs, not all a consumer may hold.
JOBS_PACKET = 32 << 10
# How often the clock looks for expired leases and ack deadlines, as a
# fraction of the shorter of the two.
TICK_FRACTION = 0.25
MAX_TICK = 1.0
# Seconds between queue_drop records of one reason (drops in between are summed).
DROP_LOG_INTERVAL = 1.0
# A consumer the policy refuses may say hello every second: its refusal is
# logged once a REFUSAL_LOG_INTERVAL (counted every time).
REFUSAL_LOG_INTERVAL = 60.0
MAX_REFUSALS_LOGGED = 1024
# Why jobs were dropped (queue_drop.reason).
DROP_FULL = "full"          # --max-held were waiting
DROP_OVERSIZE = "oversize"  # too large to deliver within the broker's --max-message
HELLO = wire.HELLO_KEY.encode()
STATE = wire.STATE_KEY.encode()
PUTS = wire.PUT_SUFFIX.encode()


@dataclass
class Settings:
    address: str
    pattern: str
    prefetch: int = PREFETCH
    ack_timeout: float = ACK_TIMEOUT
    lease: float = LEASE
    max_held: int = MAX_HELD
    stats_interval: float = STATS_INTERVAL
    max_message: int = MAX_MESSAGE
    askers: Optional[access.Askers] = None   # --policy FILE, loaded (docs/policy.md)


class QueueService:
    """Create inside a running loop, then ``await run(stop)``."""

    def __init__(self, settings: Settings, log) -> None:
        self.settings = settings
        self.log = log
        s = settings
        self.queue = st.Queue(s.prefetch, s.ack_timeout, s.lease, s.max_held)
        self.pattern = s.pattern.encode("utf-8", "surrogateescape")
        self.bus: Optional[Client] = None
        self.inbox: Optional[PrivateInbox] = None
        self._control = b""
        self._out: List[Tuple[str, bytes]] = []
        self._state_asked: List[str] = []     # inboxes that asked for the state this batch
        self._wake = asyncio.Event()
        self._started = time.monotonic()
        self._last_stats: Optional[dict] = None
        self._drops: Dict[str, list] = {}     # reason -> [count, first key, its size]
        self._drops_logged = float("-inf")
        self._refusals_logged: Dict[str, float] = {}   # inbox -> when its refusal was logged

    async def _open(self) -> None:
        s = self.settings
        policy = Reconnect(
            give_up_after=None, max_delay=2.0,
            on_disconnect=lambda exc: self.log.warning(
                schema.QUEUE_BUS_LOST, address=s.address, error=str(exc)),
            on_reconnect=lambda: self.log.info(schema.QUEUE_BUS_BACK, address=s.address))
        self.bus = Client(s.address, max_message=s.max_message, reconnect=policy)
        for cmsg in FLOOD:
            await self.bus.send_cmsg(cmsg)
        self.inbox = PrivateInbox(await self.bus.whoami(), "queue")
        self._control = self.inbox.key(wire.CONTROL).encode()
        for pattern in (self.inbox.pattern, wire.HELLO_KEY, wire.STATE_KEY, s.pattern):
            await self.bus.subscribe(pattern)
        if s.pattern and not s.pattern.endswith("/"):
            # A pattern anchored at the key's end does not match the keys
            # of producers' batches; its twin matches exactly theirs.
            await self.bus.subscribe(s.pattern + wire.PUT_SUFFIX)
        await self.bus.whoami()     # answered in order: the SUBs are in place

    # -- the reader --------------------------------------------------------------

    async def _read(self) -> None:
        bus, q = self.bus, self.queue
        # The most a job's key and payload may take: what a delivery adds
        # must fit within the broker's --max-message.
        room = self.settings.max_message - len(b"MSG \0") - wire.DELIVERY_OVERHEAD
        # The jobs go to q.held in C. A batch's key is in the pattern's
        # namespace when the pattern is a prefix; the twin above when not.
        prefix = self.pattern if self.pattern.endswith(b"/") else b""
        intake = Intake(q.held, room, prefix)
        counts = q.counts
        while True:
            await bus.receive_into(intake, BATCH)   # control messages: none for us
            now = time.monotonic()
            counts["received"] += intake.received
            intake.received = 0
            for key, payload in intake.take_others():
                if key == self._control:
                    self._on_control(payload, now)
                elif key.startswith(wire.PREFIX):
                    self._on_request(key, payload, now)
                elif self.inbox.suffix_of(key) is not None:
                    counts["bad_requests"] += 1     # in our inbox, but not the control key
                elif key.endswith(PUTS):
                    # what is left of a producer's batch from a malformed
                    # record, or one on a key outside the pattern
                    self._bad(key, wire.WireError(f"a batch of jobs not in records: {payload[:40]!r}"))
                elif len(key) + len(payload) > room:
                    counts["oversize"] += 1
                    self._dropped(DROP_OVERSIZE, 1, key, len(payload), now)
                else:
                    q.add(key, payload)
            self._dispatch(now)
            if self._state_asked:
                state = wire.pack_state(self.state())
                for inbox in self._state_asked:
                    self._send(inbox + wire.STATE, state)
                self._state_asked.clear()
            if self._out:
                # receive_into returns at once while packets wait: without
                # this the sender would run only once the socket is empty,
                # and consumers would wait for their jobs (and their credit)
                # for as long as a backlog takes to read.
                await asyncio.sleep(0)

    def _on_request(self, key: bytes, payload: bytes, now: float) -> None:
        q = self.queue
        try:
            if key == HELLO:
                prefetch, inbox, pattern, batch = wire.parse_hello(payload)
                if pattern != self.pattern:
                    return
                if self.settings.askers is not None and self._refused(inbox, now):
                    return
                c, new = q.join(inbox, prefetch, now, batch)
                if new:
                    self.log.info(schema.QUEUE_CONSUMER_JOIN, inbox=inbox, prefetch=c.prefetch)
                self._send(inbox + wire.WELCOME,
                           wire.pack_welcome(c.token, q.lease, self.inbox.key(wire.CONTROL)))
            elif key == STATE:
                inbox, pattern = wire.parse_state_request(payload)
                if pattern == self.pattern:
                    # Answered after this batch's dispatch and trim, so the
                    # state never shows jobs the same batch already dropped.
                    self._state_asked.append(inbox)
        except wire.WireError as exc:
            self._bad(key, exc)

    def _on_control(self, payload: bytes, now: float) -> None:
        q = self.queue
        try:
            verb, token, args = wire.parse_control(payload)
            c = q.heard(token, now)
            if c is None:
                q.counts["late_acks"] += verb != wire.BYE
            elif verb in (wire.ACK, wire.NACK, wire.REJECT):
                q.settle_args(c, args, verb)
            elif verb == wire.BYE:
                self._left(q.bye(c))
        except wire.WireError as exc:
            self._bad(self._control, exc)

    # -- the access policy ---------------------------------------------------------

    def _refused(self, inbox: str, now: float) -> bool:
        """Whether the policy refuses the consumer at ``inbox`` the jobs: it
        must be allowed to read every key the queue's pattern matches, as a
        subscription to it would be. A refused consumer is told why (and
        leaves, if it was here); its refusal is logged once a minute at most,
        as it may say hello again and again."""
        refusal = self.settings.askers.refusal(inbox.encode("ascii", "surrogateescape"),
                                               self.pattern)
        if refusal is None:
            return False
        q = self.queue
        q.counts["policy_refused"] += 1
        known = q.at_inbox(inbox)
        if known is not None:
            self._left(q.revoke(known))
        if now - self._refusals_logged.get(inbox, float("-inf")) >= REFUSAL_LOG_INTERVAL:
            if len(self._refusals_logged) >= MAX_REFUSALS_LOGGED:
                self._refusals_logged.clear()
            self._refusals_logged[inbox] = now
            self.log.warning(schema.QUEUE_CONSUMER_REFUSED, inbox=inbox, uid=refusal.uid,
                             rule=refusal.rule, reason=refusal.why)
        self._send(inbox + wire.REFUSED, refusal.why.encode())
        return True

    def reload_policy(self) -> bool:
        """SIGUSR1, between turns: the file again, and every consumer it no
        longer lets read the jobs is told so and leaves; its jobs go to others."""
        def revoke() -> int:
            now = time.monotonic()
            before = self.queue.counts["policy_refused"]
            for c in list(self.queue.consumers.values()):
                self._refused(c.inbox, now)
            self._dispatch(now)
            return self.queue.counts["policy_refused"] - before
        return access.reload(self.settings.askers, self.log, revoke)

    def _bad(self, key: bytes, exc: Exception) -> None:
        self.queue.counts["bad_requests"] += 1
        self.log.debug(schema.QUEUE_BAD_REQUEST, key=key.decode("utf-8", "replace"), detail=str(exc))

    def _left(self, departure: st.Departure) -> None:
        c, reason, requeued = departure
        level = self.log.info if reason == st.LEFT_BYE else self.log.warning
        level(schema.QUEUE_CONSUMER_LEAVE, inbox=c.inbox, reason=reason, requeued=requeued,
              delivered=c.delivered, acked=c.acked)
        if reason not in (st.LEFT_BYE, st.LEFT_POLICY):
            # A consumer that is alive after all learns to say hello again.
            self._send(c.inbox + wire.EXPIRED, c.token.encode())

    # -- sending -------------------------------------------------------------------

    def _send(self, key: str, payload: bytes) -> None:
        self._out.append((key, payload))
        self._wake.set()

    def _dispatch(self, now: float) -> None:
        q = self.queue
        out = self._out
        for c, first, jobs in q.dispatch(now):
            if c.batch:
                key = (c.inbox + wire.JOBS).encode()
                limit = min(JOBS_PACKET, self.settings.max_message - len(b"MSG \0") - len(key))
                out.extend((key, p) for p in pack_jobs(first, jobs, limit))
            else:
                key = (c.inbox + wire.JOB).encode()
                out.extend((key, wire.pack_job(tag, st.deliveries(job), job[0], job[1]))
                           for tag, job in enumerate(jobs, first))
        if out:
            self._wake.set()
        dropped = q.trim()
        if dropped:
            self._dropped(DROP_FULL, len(dropped), dropped[0][0], len(dropped[0][1]), now)

    def _dropped(self, reason: str, count: int, key: bytes, size: int, now: float) -> None:
        """Note drops; one queue_drop record per reason and DROP_LOG_INTERVAL
        carries them, with the key and size of the first."""
        pending = self._drops.get(reason)
        if pending is None:
            self._drops[reason] = [count, key, size]
        else:
            pending[0] += count
        self._log_drops(now)

    def _log_drops(self, now: float, force: bool = False) -> None:
        if not self._drops or (now - self._drops_logged < DROP_LOG_INTERVAL and not force):
            return
        q = self.queue
        for reason, (count, key, size) in self._drops.items():
            self.log.warning(schema.QUEUE_DROP, reason=reason, count=count,
                             key=key.decode("utf-8", "replace"), size=size, held=len(q.held),
                             dropped=q.counts["dropped"], oversize=q.counts["oversize"])
        self._drops.clear()
        self._drops_logged = now

    async def _write(self) -> None:
        bus = self.bus
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._out:
                batch, self._out = self._out, []
                while batch:
                    try:
                        await bus.publish_many(batch)
                        break
                    except (MessageRefusedError, BacklogFullError) as exc:
                        # Sizes are checked on arrival, so this is the reconnect
                        # backlog overflowing while the broker is away; a lost
                        # delivery comes back by its ack timeout.
                        refused = getattr(exc, "index", None) or 0
                        self.queue.counts["undelivered"] += 1
                        batch = batch[refused + 1:]

    # -- the clock -------------------------------------------------------------------

    async def _tick(self) -> None:
        s, q = self.settings, self.queue
        interval = min(MAX_TICK, TICK_FRACTION * min(s.lease, s.ack_timeout))
        next_stats = time.monotonic() + s.stats_interval
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for departure in q.expire(now):
                self._left(departure)
            self._dispatch(now)
            self._log_drops(now)
            if s.stats_interval and now >= next_stats:
                next_stats = now + s.stats_interval
                snapshot = self.state()
                if snapshot != self._last_stats:
                    self._last_stats = snapshot
                    self.log.info(schema.QUEUE_STATS, **snapshot)

    def state(self) -> dict:
        """What ``sbus/queue/state`` answers: docs/queues.md "State"."""
        return {"pattern": self.settings.pattern, **self.queue.snapshot()}

    # -- start and stop ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> str:
        """Serve until ``stop`` is set; the reason it ended."""
        await self._open()
        s = self.settings
        self.log.info(schema.QUEUE_START, version=__version__, address=s.address,
                      pattern=s.pattern, control=self.inbox.key(wire.CONTROL),
                      prefetch=s.prefetch, ack_timeout_s=s.ack_timeout, lease_s=s.lease,
                      max_held=s.max_held)
        ready(self.log, "queue", pattern=s.pattern)     # _open() saw the SUBs in place
        tasks = [asyncio.ensure_future(t) for t in (self._read(), self._write(), self._tick())]
        stopping = asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                if t in done:
                    t.result()      # a task that ended raises here
            return STOPPED
        finally:
            for t in (stopping, *tasks):
                t.cancel()
            await asyncio.gather(stopping, *tasks, return_exceptions=True)
            self.bus.close()

    def stopped(self, reason: str) -> None:
        self._log_drops(time.monotonic(), force=True)
        q = self.queue
        self.log.info(schema.QUEUE_STOP, reason=reason,
                      uptime_s=round(time.monotonic() - self._started, 3), held=len(q.held),
                      in_flight=q.in_flight(), **q.counts)
