"""The queue's state, without I/O: held jobs, consumers, credit, leases, counters.

Every method takes the time (``time.monotonic()`` seconds) from its caller
and returns what must be sent; the service (``sbus.queue.service``) does the
sending. Fairness is by credit: a consumer may hold ``prefetch``
unacknowledged jobs, and jobs go round the consumers that have credit left,
one each in turn.
"""
from __future__ import annotations

import collections
from typing import Deque, Dict, List, Optional, Tuple

from .._core.inflight import Held, InFlight
from ..client.private import new_id

# Why a consumer left (``queue_consumer_leave.reason``).
LEFT_BYE = "bye"                  # it said so
LEFT_LEASE = "lease"              # no word from it for a whole lease
LEFT_ACK_TIMEOUT = "ack_timeout"  # a job it held went unacknowledged for --ack-timeout
LEFT_POLICY = "policy"            # a reloaded access policy no longer lets it read the jobs
LEAVE_REASONS = (LEFT_BYE, LEFT_LEASE, LEFT_ACK_TIMEOUT, LEFT_POLICY)

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
    "policy_refused",  # hellos the access policy refused, and consumers a reload revoked
)


# A job is the tuple it arrived as, ``(key, payload)`` (a Message), while it
# has never been given out; held again after that, and in flight from its
# second delivery on, it is ``(key, payload, deliveries)``. No object is
# made per job: the service keeps the one the client read.
Job = Tuple  # (key, payload) or (key, payload, deliveries)


def deliveries(job: Job) -> int:
    """How often an in-flight job has been given out, this delivery included."""
    return job[2] if len(job) > 2 else 1


class Consumer:
    """One consumer: its jobs in flight (tag -> job, in the order given
    out, an InFlight in C) and, per handful given out at once, the last tag
    and its ack deadline."""

    __slots__ = ("token", "inbox", "prefetch", "lease_until", "batch", "in_flight",
                 "deadlines", "delivered", "acked", "ready")

    def __init__(self, token: str, inbox: str, prefetch: int, lease_until: float,
                 batch: bool = False) -> None:
        self.token = token
        self.inbox = inbox
        self.prefetch = prefetch
        self.lease_until = lease_until
        self.batch = batch          # takes ``jobs`` batches (wire.JOBS)
        self.in_flight = InFlight()
        # (last tag, ack deadline) of each handful given out, oldest first;
        # tags only grow, so the oldest job in flight has the first deadline
        # not before its tag.
        self.deadlines: Deque[Tuple[int, float]] = collections.deque()
        self.delivered = 0
        self.acked = 0
        self.ready = False          # queued in Queue._ready

    @property
    def credit(self) -> int:
        return self.prefetch - len(self.in_flight)

    def overdue(self, now: float) -> bool:
        """Whether a job in flight has passed its ack deadline."""
        oldest = self.in_flight.oldest
        if oldest is None:
            self.deadlines.clear()
            return False
        deadlines = self.deadlines
        while deadlines[0][0] < oldest:
            deadlines.popleft()
        return deadlines[0][1] <= now


# A consumer, the first tag of a run of consecutive tags, and its jobs in order.
Delivery = Tuple[Consumer, int, List[Job]]
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
        self.held = Held()     # in C: the reader (jobs.Intake) appends to it
        self._held_again = 0    # of the held, jobs given out before (3-tuples)
        self.consumers: Dict[str, Consumer] = {}
        self._by_inbox: Dict[str, str] = {}
        # Consumers with credit, in the order they are served.
        self._ready: Deque[Consumer] = collections.deque()
        self._next_tag = 1
        self.counts = dict.fromkeys(COUNTERS, 0)

    # -- jobs ------------------------------------------------------------------

    def add(self, key: bytes, payload: bytes) -> None:
        self.held.append((key, payload))
        self.counts["received"] += 1

    def trim(self) -> List[Job]:
        """Drop the oldest held jobs beyond ``max_held`` (call after ``dispatch``)."""
        held = self.held
        if len(held) <= self.max_held:
            return []
        dropped = held.take(len(held) - self.max_held)
        if self._held_again:
            self._held_again -= sum(len(job) > 2 for job in dropped)
        self.counts["dropped"] += len(dropped)
        return dropped

    def dispatch(self, now: float) -> List[Delivery]:
        """Give held jobs to consumers with credit, one each in turn round the
        consumers; what each got, under consecutive tags."""
        held, ready = self.held, self._ready
        consumers = self.consumers
        got: Dict[Consumer, List[Job]] = {}
        while held and ready:
            # One round: every ready consumer, in turn, as many times as the
            # least credit among them allows (and the held jobs).
            turn = []
            for c in ready:
                if consumers.get(c.token) is c and c.credit - len(got.get(c, ())) > 0:
                    turn.append(c)
                else:
                    c.ready = False
            ready.clear()
            if not turn:
                break
            width = len(turn)
            rounds = min(c.credit - len(got.get(c, ())) for c in turn)
            take = min(len(held), rounds * width)
            held.deal(take, [got.setdefault(c, []) for c in turn])    # one each in turn, in C
            # Who got the last job of a partial round goes to the back.
            served = take % width
            for c in turn[served:] + turn[:served]:
                if c.credit - len(got[c]) > 0:
                    ready.append(c)
                else:
                    c.ready = False
        out: List[Delivery] = []
        counts = self.counts
        deadline = now + self.ack_timeout
        for c, jobs in got.items():
            if self._held_again:
                jobs = self._again(jobs)
            first = self._next_tag
            self._next_tag = first + len(jobs)
            c.in_flight.add(first, jobs)
            c.deadlines.append((self._next_tag - 1, deadline))
            c.delivered += len(jobs)
            counts["delivered"] += len(jobs)
            out.append((c, first, jobs))
        return out

    def _again(self, jobs: List[Job]) -> List[Job]:
        """Jobs given out before: their delivery count goes up."""
        out = []
        for job in jobs:
            if len(job) > 2:
                job = (job[0], job[1], job[2] + 1)
                self._held_again -= 1
                self.counts["redelivered"] += 1
            out.append(job)
        return out

    def _requeue(self, jobs: List[Job]) -> None:
        # Handed-back jobs go first: they have waited longest.
        again = [job if len(job) > 2 else (job[0], job[1], 1) for job in jobs]
        self._held_again += len(again)
        self.held.requeue(again)

    def _credit_back(self, c: Consumer) -> None:
        if not c.ready and c.credit > 0 and self.consumers.get(c.token) is c:
            c.ready = True
            self._ready.append(c)

    # -- consumers ---------------------------------------------------------------

    def join(self, inbox: str, prefetch: int, now: float,
             batch: bool = False) -> Tuple[Consumer, bool]:
        """A hello: the consumer at this inbox (its lease renewed, its
        prefetch and batch updated if it was known already), and whether it is new."""
        granted = self.prefetch if prefetch <= 0 else min(prefetch, self.prefetch)
        token = self._by_inbox.get(inbox)
        if token is not None:
            c = self.consumers[token]
            c.prefetch, c.lease_until, c.batch = granted, now + self.lease, batch
            self._credit_back(c)
            return c, False
        c = Consumer(new_id(), inbox, granted, now + self.lease, batch)
        self.consumers[c.token] = c
        self._by_inbox[inbox] = c.token
        self.counts["consumers_joined"] += 1
        self._credit_back(c)
        return c, True

    def _leave(self, c: Consumer, reason: str) -> Departure:
        del self.consumers[c.token]
        del self._by_inbox[c.inbox]
        jobs = c.in_flight.clear()
        c.deadlines.clear()
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
        self._settled(c, c.in_flight.pop_tags(tags), len(tags), verb)

    def settle_args(self, c: Consumer, args: bytes, verb: str) -> None:
        """``settle`` with the tags as a control message names them
        (wire.WireError, nothing settled, for malformed ones). An ack or a
        reject lets its jobs go in C: only a nack needs them back."""
        if verb == "nack":
            jobs, named = c.in_flight.settle(args)
            self._settled(c, jobs, named, verb)
        else:
            settled, named = c.in_flight.drop(args)
            self._settled(c, settled, named, verb)

    def _settled(self, c: Consumer, jobs, named: int, verb: str) -> None:
        """``jobs``: the jobs settled, or (an ack or a reject) how many."""
        counts = self.counts
        settled = jobs if type(jobs) is int else len(jobs)
        counts["late_acks"] += named - settled
        if verb == "ack":
            c.acked += settled
            counts["acked"] += settled
        elif verb == "nack":
            self._requeue(jobs)
            counts["nacked"] += settled
        else:
            counts["rejected"] += settled
        self._credit_back(c)

    def bye(self, c: Consumer) -> Departure:
        return self._leave(c, LEFT_BYE)

    def revoke(self, c: Consumer) -> Departure:
        """The policy no longer lets ``c`` read the jobs: its jobs go back."""
        return self._leave(c, LEFT_POLICY)

    def at_inbox(self, inbox: str) -> Optional[Consumer]:
        token = self._by_inbox.get(inbox)
        return None if token is None else self.consumers[token]

    def expire(self, now: float) -> List[Departure]:
        """Consumers whose lease ran out or who held a job past --ack-timeout;
        their jobs go back to the front of the queue."""
        gone = []
        for c in list(self.consumers.values()):
            if c.lease_until <= now:
                gone.append(self._leave(c, LEFT_LEASE))
            elif c.overdue(now):
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
