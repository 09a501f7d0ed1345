"""The queue's state, without I/O: held jobs, consumers, credit, leases, counters.

Every method takes the time (``time.monotonic()`` seconds) from its caller
and returns what must be sent; the service (``sbus.queue.service``) does the
sending. Fairness is by credit: a consumer may hold ``prefetch``
unacknowledged jobs, and jobs go round the consumers that have credit left,
one each in turn.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

from ..client.private import new_id

# Why a consumer left (``queue_consumer_leave.reason``).
LEFT_BYE = "bye"                  # it said so
LEFT_LEASE = "lease"              # no word from it for a whole lease
LEFT_ACK_TIMEOUT = "ack_timeout"  # a job it held went unacknowledged for --ack-timeout
LEAVE_REASONS = (LEFT_BYE, LEFT_LEASE, LEFT_ACK_TIMEOUT)

# Cumulative counters since the service started (the log and the state reply).
COUNTERS = (
    "received",      # jobs taken off the bus
    "delivered",     # deliveries to consumers, first ones and again
    "redelivered",   # deliveries of a job given out before
    "acked",         # jobs acknowledged
    "nacked",        # jobs handed back to be given out again
    "rejected",      # jobs handed back to be dropped
    "dropped",       # jobs dropped because --max-held were already waiting
    "oversize",      # jobs dropped on arrival: too large to deliver (wire.DELIVERY_OVERHEAD)
    "undelivered",   # deliveries the broker refused or the reconnect backlog could not keep
    "late_acks",     # acks, nacks and rejects of tags no longer given out
    "consumers_joined",
    "consumers_lost",  # consumers that left by lease or ack timeout, not by bye
    "bad_requests",  # payloads that do not follow the convention
)


@dataclass
class Job:
    key: bytes
    payload: bytes
    deliveries: int = 0     # times given out so far


@dataclass
class Consumer:
    token: str
    inbox: str
    prefetch: int
    lease_until: float
    in_flight: Dict[int, Tuple[Job, float]] = field(default_factory=dict)  # tag -> job, deadline
    delivered: int = 0
    acked: int = 0
    ready: bool = False     # queued in Queue._ready

    @property
    def credit(self) -> int:
        return self.prefetch - len(self.in_flight)


Delivery = Tuple[str, int, Job]          # inbox, tag, job
Departure = Tuple[Consumer, str, int]    # consumer, reason, jobs handed back


class Queue:
    """``prefetch``: the most a consumer may hold; ``ack_timeout`` and ``lease``
    in seconds; ``max_held``: jobs waiting for a consumer before the oldest
    is dropped."""

    def __init__(self, prefetch: int, ack_timeout: float, lease: float, max_held: int) -> None:
        self.prefetch = prefetch
        self.ack_timeout = ack_timeout
        self.lease = lease
        self.max_held = max_held
        self.held: Deque[Job] = collections.deque()
        self.consumers: Dict[str, Consumer] = {}
        self._by_inbox: Dict[str, str] = {}
        # Consumers with credit, in the order they are served.
        self._ready: Deque[Consumer] = collections.deque()
        self._next_tag = 1
        self.counts = dict.fromkeys(COUNTERS, 0)

    # -- jobs ------------------------------------------------------------------

    def add(self, key: bytes, payload: bytes) -> None:
        self.held.append(Job(key, payload))
        self.counts["received"] += 1

    def trim(self) -> List[Job]:
        """Drop the oldest held jobs beyond ``max_held`` (call after ``dispatch``)."""
        dropped = []
        while len(self.held) > self.max_held:
            dropped.append(self.held.popleft())
        self.counts["dropped"] += len(dropped)
        return dropped

    def dispatch(self, now: float) -> List[Delivery]:
        """Give held jobs to consumers with credit, round the consumers in turn."""
        out: List[Delivery] = []
        held, ready, counts = self.held, self._ready, self.counts
        while held and ready:
            c = ready.popleft()
            if self.consumers.get(c.token) is not c or c.credit <= 0:
                c.ready = False
                continue
            job = held.popleft()
            tag = self._next_tag
            self._next_tag += 1
            if job.deliveries:
                counts["redelivered"] += 1
            job.deliveries += 1
            c.in_flight[tag] = (job, now + self.ack_timeout)
            c.delivered += 1
            counts["delivered"] += 1
            out.append((c.inbox, tag, job))
            if c.credit > 0:
                ready.append(c)
            else:
                c.ready = False
        return out

    def _requeue(self, jobs: List[Job]) -> None:
        # Handed-back jobs go first: they have waited longest.
        self.held.extendleft(reversed(jobs))

    def _credit_back(self, c: Consumer) -> None:
        if not c.ready and c.credit > 0 and self.consumers.get(c.token) is c:
            c.ready = True
            self._ready.append(c)

    # -- consumers ---------------------------------------------------------------

    def join(self, inbox: str, prefetch: int, now: float) -> Tuple[Consumer, bool]:
        """A hello: the consumer at this inbox (its lease renewed and its
        prefetch updated if it was known already), and whether it is new."""
        granted = self.prefetch if prefetch <= 0 else min(prefetch, self.prefetch)
        token = self._by_inbox.get(inbox)
        if token is not None:
            c = self.consumers[token]
            c.prefetch, c.lease_until = granted, now + self.lease
            self._credit_back(c)
            return c, False
        c = Consumer(new_id(), inbox, granted, now + self.lease)
        self.consumers[c.token] = c
        self._by_inbox[inbox] = c.token
        self.counts["consumers_joined"] += 1
        self._credit_back(c)
        return c, True

    def _leave(self, c: Consumer, reason: str) -> Departure:
        del self.consumers[c.token]
        del self._by_inbox[c.inbox]
        jobs = [job for job, _ in c.in_flight.values()]
        c.in_flight.clear()
        self._requeue(jobs)
        if reason in (LEFT_LEASE, LEFT_ACK_TIMEOUT):
            self.counts["consumers_lost"] += 1
        return c, reason, len(jobs)

    def heard(self, token: str, now: float) -> Optional[Consumer]:
        """The consumer with this token, its lease renewed; None if unknown."""
        c = self.consumers.get(token)
        if c is not None:
            c.lease_until = now + self.lease
        return c

    def settle(self, c: Consumer, tags: List[int], verb: str) -> None:
        """``ack``, ``nack`` (give out again) or ``reject`` (drop) these tags."""
        back = []
        for tag in tags:
            entry = c.in_flight.pop(tag, None)
            if entry is None:
                self.counts["late_acks"] += 1
                continue
            if verb == "ack":
                c.acked += 1
                self.counts["acked"] += 1
            elif verb == "nack":
                back.append(entry[0])
                self.counts["nacked"] += 1
            else:
                self.counts["rejected"] += 1
        self._requeue(back)
        self._credit_back(c)

    def bye(self, c: Consumer) -> Departure:
        return self._leave(c, LEFT_BYE)

    def expire(self, now: float) -> List[Departure]:
        """Consumers whose lease ran out or who held a job past --ack-timeout;
        their jobs go back to the front of the queue."""
        gone = []
        for c in list(self.consumers.values()):
            if c.lease_until <= now:
                gone.append(self._leave(c, LEFT_LEASE))
            elif any(deadline <= now for _, deadline in c.in_flight.values()):
                gone.append(self._leave(c, LEFT_ACK_TIMEOUT))
        return gone

    # -- what it looks like ------------------------------------------------------

    def in_flight(self) -> int:
        return sum(len(c.in_flight) for c in self.consumers.values())

    def snapshot(self) -> dict:
        """Held, in flight (per consumer) and the counters: the state reply and stats record."""
        return {
            "held": len(self.held),
            "in_flight": self.in_flight(),
            # Never the tokens: whoever asks for the state must not be able to ack.
            "consumers": [{"inbox": c.inbox, "prefetch": c.prefetch,
                           "in_flight": len(c.in_flight), "delivered": c.delivered,
                           "acked": c.acked} for c in self.consumers.values()],
            **self.counts,
        }
