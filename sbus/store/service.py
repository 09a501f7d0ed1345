"""The store's loop: record what matches, answer requests, count everything.

One thread. Each turn reads a batch from the broker, appends its recorded
messages to the log with one write(2) (requests in the batch are handled in
their place, after the messages before them are written), then gives each
session with room in its window a few answers, then does what is due:
the periodic fsync, the broker's count of messages it dropped for the store,
retention, the stats record.
"""
from __future__ import annotations

import json
import os
import secrets
import select
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import logschema as schema
from ..access import askers as access
from ..access.askers import Askers
from ..client.protocol import MAX_MESSAGE, ControlMessage, Message, parse_stats
from ..client.reconnect import Reconnect
from ..client.sync import Client
from ..errors import ProtocolError
from ..runner import STOPPED, ready
from . import wire
from .patterns import PatternSet, compile_pattern, with_chunks
from .patterns import covers as _covers
from .segments import GAP_KEY, HEADER, RECORD, DiskFull, Log, gap_payload, pack_record

SESSION_IDLE_S = 60.0       # a session waiting this long for an ack is dropped
MAX_SESSIONS = 256
DROP_CHECK_S = 1.0          # how often the broker is asked what it dropped for us
DROP_ASK_AGAIN_S = 10.0     # a question about drops unanswered this long is asked again
DISK_RETRY_S = 1.0          # how often a full disk is tried again
RETENTION_CHECK_S = 1.0
SCAN_BUDGET = 4 << 20       # log bytes one session may read per turn
RECEIVE_BATCH = 1024


@dataclass
class Settings:
    address: str
    directory: str
    patterns: List[bytes]
    fsync: str = "100"
    segment_bytes: int = 64 << 20
    max_bytes: Optional[int] = None
    max_age_s: Optional[float] = None
    request_key: bytes = wire.REQUEST_KEY
    stats_interval: float = 10.0
    max_message: int = MAX_MESSAGE
    flood: str = "discard"      # or "block": the broker's hard mode for the data connection
    policy: Optional[str] = None    # --policy FILE: who may be answered what (docs/policy.md)


@dataclass
class Session:
    token: bytes
    request: wire.Request
    matches: Callable[[bytes], bool]
    position: Tuple[int, int] = (0, 0)
    stop: Optional[Tuple[Tuple[int, int], int]] = None     # until: where (and which seq) to end
    every_key: bool = False     # the pattern covers all that is recorded: no key to check
    last_sent: int = 0          # seq of the last record read for it
    sent: int = 0               # data answers sent
    acked: int = 0
    active: float = field(default_factory=time.monotonic)
    pending: bytes = b""        # records read, not yet sent (a record may be cut)
    items: Optional[List[Tuple[int, int, int]]] = None   # last: (seq, segment, offset)
    done: bool = False          # everything read: end once pending is sent


class Counters(dict):
    """The store's counters; also its stats answer and log records."""

    NAMES = ("recorded", "recorded_bytes", "gaps", "lost_flood", "lost_unknown",
             "missed_disk_full", "requests", "requests_refused", "sessions_opened",
             "sessions_expired", "answers", "replayed", "retention_segments",
             "retention_records", "retention_bytes", "private_skipped", "policy_refused")

    def __init__(self) -> None:
        super().__init__((n, 0) for n in self.NAMES)


class Store:
    def __init__(self, settings: Settings, logger) -> None:
        self.s = settings
        self.logger = logger
        # Loaded before anything else: a file that does not load stops the
        # store before it opens its log (PolicyError, FILE:LINE: reason).
        self.askers = Askers(settings.policy) if settings.policy else None
        self.started = time.monotonic()
        self.recording = PatternSet(settings.patterns)
        self.counters = Counters()
        self.missed_by_pattern: Dict[str, int] = {}
        self.sessions: Dict[bytes, Session] = {}
        self.disk_full_since: Optional[float] = None
        self.disk_missed = 0
        self.disk_retry_at = 0.0
        # The broker's client id -> its drops counted so far, for each of
        # this process's connections the broker listed last time.
        self.drops_seen: Dict[Any, int] = {}
        self.broker_uptime = 0.0
        self.drops_asked: Optional[float] = None    # when, if unanswered
        self.reconnected = False
        now = time.monotonic()
        self.next_drop_check = now + DROP_CHECK_S
        self.next_retention = now
        self.next_stats = now + settings.stats_interval if settings.stats_interval else None
        self.log = Log(settings.directory, segment_bytes=settings.segment_bytes,
                       fsync=settings.fsync)
        rec = self.log.recovery
        self.emit(schema.STORE_RECOVER, segments=rec.segments, records=rec.records,
                  bytes=rec.bytes, torn=bool(rec.cut_bytes), cut_bytes=rec.cut_bytes,
                  cut_segment=rec.cut_segment, first_seq=self.log.first_seq,
                  last_seq=self.log.last_seq, keys=len(self.log.last_values),
                  level="warning" if rec.cut_bytes else "info")
        self.bus: Optional[Client] = None
        self.requests: Optional[Client] = None
        self.wake = -1          # readable when the loop has a signal to act on

    # -- logging and counters -----------------------------------------------------

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        getattr(self.logger, level)(event, **fields)

    def stats(self) -> Dict[str, Any]:
        log = self.log
        out: Dict[str, Any] = dict(self.counters)
        out.update(segments=len(log.segments), bytes=log.bytes, records=log.records,
                   first_seq=log.first_seq, last_seq=log.last_seq, keys=len(log.last_values),
                   sessions=len(self.sessions), syncs=log.syncs,
                   disk_full=self.disk_full_since is not None,
                   missed_by_pattern=dict(self.missed_by_pattern),
                   uptime_s=round(time.monotonic() - self.started, 3))
        return out

    # -- the loop -----------------------------------------------------------------

    def connect(self, patterns: List[bytes], hard: str = "discard") -> Client:
        def lost(exc: BaseException) -> None:
            self.emit(schema.STORE_BROKER_LOST, level="warning", address=self.s.address,
                      error=str(exc))

        def back() -> None:
            self.reconnected = True
            self.emit(schema.STORE_BROKER_BACK, address=self.s.address)

        policy = Reconnect(give_up_after=None, max_delay=1.0, on_disconnect=lost,
                           on_reconnect=back)
        bus = Client(self.s.address, max_message=self.s.max_message, reconnect=policy)
        bus.reassemble = False      # chunks are recorded as they travel (docs/chunks.md)
        # Queue what we cannot take at once; beyond the broker's per-client
        # limit, discard (and count: the drop count becomes a gap record) so
        # that publishers never wait for the disk, or block them (--flood block).
        bus.send_cmsg("blocking/soft/queue")
        bus.send_cmsg(f"blocking/hard/{hard}")
        for pattern in patterns:
            bus.subscribe(pattern)
        bus.whoami(timeout=10.0)
        return bus

    def run(self, stopping: Callable[[], bool], wake: int = -1) -> str:
        """Record and answer until ``stopping()``, asked between turns, is
        true; ``wake`` (sbus.runner.Runner's) ends a wait when it is readable."""
        self.wake = wake
        # Two connections: recorded messages on one, requests (and acks) on
        # the other, so that a flood of data neither delays nor drops them.
        self.bus = self.connect(self.recording.patterns, self.s.flood)
        self.requests = requests = self.connect([self.s.request_key])
        self.emit(schema.STORE_START, version=_version(), path=self.s.directory,
                  address=self.s.address,
                  record=" ".join(p.decode("utf-8", "backslashreplace") for p in self.s.patterns),
                  request_key=self.s.request_key.decode("utf-8", "backslashreplace"),
                  fsync=self.s.fsync, segment_bytes=self.s.segment_bytes,
                  max_bytes=self.s.max_bytes, max_age_s=self.s.max_age_s, flood=self.s.flood)
        # connect() had whoami answered after the SUBs: both are in place.
        ready(self.logger, "store",
              request_key=self.s.request_key.decode("utf-8", "backslashreplace"))
        while not stopping():
            self.wait_readable(self.wait())
            asked = _take(requests, RECEIVE_BATCH)
            if asked:
                # Messages published before a request are in the data
                # socket already: record them first, so the answer sees them.
                for _ in range(64):
                    if not self.take_data():
                        break
                for m in asked:
                    if type(m) is Message and m.key == self.s.request_key:
                        self.on_request(m.payload)
                    elif type(m) is ControlMessage and m.key == b"stats":
                        self.on_broker_stats(m.payload)
            else:
                self.take_data()
            self.serve()
            self.housekeeping()
        return STOPPED

    def wait_readable(self, timeout: float) -> None:
        buses = (self.bus, self.requests)
        if timeout <= 0 or any(b.pending for b in buses):
            return
        poller = select.poll()     # not select(2): no limit on the descriptor
        if self.wake >= 0:
            poller.register(self.wake, select.POLLIN)
        if not all(b.connected for b in buses):
            # The clients reconnect while they are read: no busy loop meanwhile.
            poller.poll(min(timeout, 0.1) * 1000)
            return
        try:
            for b in buses:
                poller.register(b.fileno(), select.POLLIN)
        except (OSError, ValueError):
            return  # a connection was lost: the next read reconnects
        poller.poll(timeout * 1000)

    def take_data(self) -> int:
        """Record one batch from the data connection; how many messages it had."""
        batch = _take(self.bus, RECEIVE_BATCH)
        request_key = self.s.request_key
        # Messages are (key, payload) tuples already. Not recorded: control
        # messages, '!' keys, and requests a --record pattern happens to match.
        entries = [m for m in batch if type(m) is Message and m.key[:1] != b"!"
                   and m.key != request_key]
        if len(entries) != len(batch):
            self.counters["private_skipped"] += sum(
                1 for m in batch if type(m) is Message and m.key[:1] == b"!")
        self.record(entries)
        return len(batch)

    def stop(self, reason: str) -> None:
        try:
            self.log.close()
        finally:
            for bus in (self.bus, self.requests):
                if bus is not None:
                    bus.close()
            self.emit(schema.STORE_STOP, reason=reason, **self.stats())

    def wait(self) -> float:
        if any(self.sendable(s) for s in self.sessions.values()):
            return 0.0
        now = time.monotonic()
        due = [0.5, self.next_drop_check - now, self.next_retention - now]
        sync = self.log.sync_due()
        if sync is not None:
            due.append(sync)
        if self.next_stats is not None:
            due.append(self.next_stats - now)
        return max(0.0, min(due))

    # -- recording ------------------------------------------------------------------

    def record(self, entries: List[Tuple[bytes, bytes]]) -> None:
        if not entries:
            return
        if self.disk_full_since is not None and time.monotonic() < self.disk_retry_at:
            self.missed(entries)
            return
        try:
            if self.disk_full_since is not None:
                self.log.append([(GAP_KEY, gap_payload(self.disk_missed, "disk_full"))])
                self.emit(schema.STORE_DISK_RESUMED, level="warning", missed=self.disk_missed,
                          full_s=round(time.monotonic() - self.disk_full_since, 3),
                          missed_by_pattern=dict(self.missed_by_pattern))
                self.counters["gaps"] += 1
                self.disk_full_since = None
                self.disk_missed = 0
            self.log.append(entries)
        except DiskFull as exc:
            if self.disk_full_since is None:
                self.disk_full_since = time.monotonic()
                self.emit(schema.STORE_DISK_FULL, level="error", error=str(exc),
                          path=self.s.directory)
            self.disk_retry_at = time.monotonic() + DISK_RETRY_S
            self.missed(entries)
            return
        self.counters["recorded"] += len(entries)
        self.counters["recorded_bytes"] += sum(len(k) + len(p) for k, p in entries)

    def missed(self, entries: List[Tuple[bytes, bytes]]) -> None:
        self.disk_missed += len(entries)
        self.counters["missed_disk_full"] += len(entries)
        by = self.missed_by_pattern
        for key, _ in entries:
            for p in self.recording.matching(key):
                name = p.decode("utf-8", "backslashreplace")
                by[name] = by.get(name, 0) + 1

    def gap(self, lost: int, reason: str) -> None:
        try:
            self.log.append([(GAP_KEY, gap_payload(lost, reason))])
        except DiskFull:
            self.disk_missed += max(lost, 0)
        self.counters["gaps"] += 1
        self.counters["lost_unknown" if lost < 0 else "lost_flood"] += max(lost, 1 if lost < 0 else 0)
        self.emit(schema.STORE_GAP, level="warning", lost=lost, reason=reason,
                  seq=self.log.last_seq)

    # -- housekeeping -----------------------------------------------------------------

    def housekeeping(self) -> None:
        now = time.monotonic()
        if self.log.sync_due() == 0.0:
            self.log.sync()
        if self.reconnected:
            # Whatever was published while we were away is not in the log.
            self.reconnected = False
            self.drops_asked = None     # the question may have gone with the connection
            self.gap(-1, "disconnected")
        if now >= self.next_drop_check:
            self.next_drop_check = now + DROP_CHECK_S
            self.check_drops()
        if now >= self.next_retention:
            self.next_retention = now + RETENTION_CHECK_S
            self.retention()
        if self.next_stats is not None and now >= self.next_stats:
            self.next_stats = now + self.s.stats_interval
            self.emit(schema.STORE_STATS, **self.stats())
        for token, session in list(self.sessions.items()):
            if now - session.active > SESSION_IDLE_S and session.sent > session.acked:
                del self.sessions[token]
                self.counters["sessions_expired"] += 1

    def check_drops(self) -> None:
        """Ask the broker what it dropped for us; the answer is taken in its
        place among the requests (on_broker_stats). Not waited for: while a
        --flood block store holds the bus the broker reads no one, so the
        answer comes only once the store has read on, and a store waiting
        for it past --block-timeout is closed as one that stopped reading.
        Asked on the request connection: on the data one the answer would
        wait behind everything queued for us."""
        now = time.monotonic()
        if self.drops_asked is not None and now - self.drops_asked < DROP_ASK_AGAIN_S:
            return
        try:
            self.requests.send_cmsg("stats")
        except OSError:
            return      # the connection is lost: its reconnect is a gap of its own
        self.drops_asked = now

    def on_broker_stats(self, payload: bytes) -> None:
        """The broker's counters: each drop for one of our connections not
        counted yet becomes a gap. Counted per connection, so an answer that
        still lists a connection since replaced counts nothing twice."""
        self.drops_asked = None
        try:
            stats = parse_stats(payload)
            uptime = float(stats.get("uptime_s", 0.0))
            clients = [c for c in stats.get("clients", ()) if c.get("pid") == os.getpid()]
            drops = {c.get("client"): sum(int(c.get(k, 0)) for k in schema.DROP_KINDS)
                     for c in clients}
        except (ProtocolError, AttributeError, TypeError, ValueError):
            # Only a broken broker answers so; nothing is lost by it: the
            # counts are cumulative, and the next answer has them all.
            return
        if uptime < self.broker_uptime:
            self.drops_seen.clear()     # another broker: its client ids start again
        self.broker_uptime = uptime
        seen = self.drops_seen
        new = sum(max(0, n - seen.get(ident, 0)) for ident, n in drops.items())
        # Only the connections listed: one gone is never listed again.
        self.drops_seen = {ident: max(n, seen.get(ident, 0)) for ident, n in drops.items()}
        if new:
            self.gap(new, "flood")

    def retention(self) -> None:
        if self.s.max_bytes is None and self.s.max_age_s is None:
            return
        self.log.roll_if_over(self.s.max_bytes)
        segments, records, size = self.log.expire(self.s.max_bytes, self.s.max_age_s)
        if segments:
            c = self.counters
            c["retention_segments"] += segments
            c["retention_records"] += records
            c["retention_bytes"] += size
            self.emit(schema.STORE_RETENTION, segments=segments, records=records, bytes=size,
                      first_seq=self.log.first_seq)

    # -- requests ------------------------------------------------------------------------

    def on_request(self, payload: bytes) -> None:
        self.counters["requests"] += 1
        try:
            req = wire.parse_request(payload)
            if req.op == "ack":
                self.on_ack(req)
            elif req.op == "cancel":
                self.sessions.pop(req.session, None)
            elif req.op == "stats":
                self.answer(req.reply, wire.answer(wire.STATS, req.id, 0,
                                                   json.dumps(self.stats()).encode()))
            else:
                self.open_session(req)
        except wire.RequestError as exc:
            self.refuse(payload, str(exc))

    def refuse(self, payload: bytes, why: str) -> None:
        self.counters["requests_refused"] += 1
        reply, ident = wire.reply_key_of(payload)
        self.emit(schema.STORE_REQUEST_REFUSED, level="info", error=why,
                  reply=reply.decode("utf-8", "backslashreplace"))
        if reply:
            self.answer(reply, wire.answer(wire.ERROR, ident.replace(b" ", b"_").replace(b"\n", b"_"),
                                           0, why.encode()))

    def answer(self, reply: bytes, payload: bytes) -> None:
        self.counters["answers"] += 1
        self.requests.publish(reply, payload)

    # -- the access policy (SIGUSR1, between turns) ------------------------------------

    def reload_policy(self) -> bool:
        return access.reload(self.askers, self.logger, self.revoke)

    def revoke(self) -> int:
        """End, with an error answer, every session the policy now in force
        refuses: a follower stops getting what it may no longer read at once,
        as a subscription sbusd's reload revokes does."""
        ended = 0
        for token, session in list(self.sessions.items()):
            req = session.request
            refusal = self.askers.refusal(req.reply, req.pattern)
            if refusal is None:
                continue
            del self.sessions[token]
            ended += 1
            self.counters["policy_refused"] += 1
            self.emit(schema.STORE_REQUEST_REFUSED, error=str(refusal),
                      reply=req.reply.decode("utf-8", "backslashreplace"))
            self.answer(req.reply, wire.answer(wire.ERROR, req.id, 0,
                                               str(refusal).encode()))
        return ended

    def on_ack(self, req: wire.Request) -> None:
        session = self.sessions.get(req.session)
        if session is None:
            return      # ended, expired or never ours: nothing to do
        session.acked = max(session.acked, min(req.n, session.sent))
        session.active = time.monotonic()

    def open_session(self, req: wire.Request) -> None:
        if not self.recording.covers(req.pattern):
            raise wire.RequestError(
                "pattern not recorded: %s (recorded: %s)" % (
                    req.pattern.decode("utf-8", "backslashreplace"),
                    ", ".join(repr(p.decode("utf-8", "backslashreplace"))
                              for p in self.recording.patterns)))
        if self.askers is not None:
            refusal = self.askers.refusal(req.reply, req.pattern)
            if refusal is not None:
                self.counters["policy_refused"] += 1
                raise wire.RequestError(str(refusal))
        if len(self.sessions) >= MAX_SESSIONS:
            raise wire.RequestError(f"busy: {MAX_SESSIONS} sessions open")
        token = secrets.token_hex(8).encode()
        session = Session(token, req, _cached(with_chunks(req.pattern, compile_pattern(req.pattern))),
                          last_sent=req.after)
        if req.op == "last":
            session.items = sorted(v for k, v in self.log.last_values.items()
                                   if session.matches(k))
        else:
            log = self.log
            session.position, first = log.seek(req.after, req.since_ns)
            session.last_sent = first - 1
            if req.until_ns is not None:
                session.stop = log.seek_after_time(session.position, req.until_ns)
            session.every_key = all(_covers(req.pattern, p) for p in self.recording.patterns)
        self.sessions[token] = session
        self.counters["sessions_opened"] += 1
        self.answer(req.reply, wire.answer(wire.OK, req.id, 0, wire.encode_fields([
            ("session", token), ("first", b"%d" % self.log.first_seq),
            ("last", b"%d" % self.log.last_seq)])))

    # -- answering ---------------------------------------------------------------------------

    def at_end(self, session: Session) -> bool:
        return session.position == (session.stop[0] if session.stop else self.log.end())

    def sendable(self, session: Session) -> bool:
        if session.sent - session.acked >= session.request.window:
            return False
        return bool(session.pending) or not (session.done or (
            session.items is None and self.at_end(session)))

    def serve(self) -> None:
        for token, session in list(self.sessions.items()):
            out = []
            limit = max(1024, min(wire.BATCH_BYTES,
                                  self.s.max_message - len(session.request.reply) - 128))
            while session.sent - session.acked < session.request.window:
                if len(session.pending) < limit and not session.done:
                    self.fill(session, limit)
                if not session.pending:
                    break
                body, session.pending = session.pending[:limit], session.pending[limit:]
                session.sent += 1
                out.append((session.request.reply,
                            wire.answer(wire.DATA, session.request.id, session.sent, body)))
            if session.done and not session.pending:
                out.append((session.request.reply, wire.answer(
                    wire.END, session.request.id, session.sent, b"last=%d" % session.last_sent)))
                del self.sessions[token]
            if out:
                self.counters["answers"] += len(out)
                self.requests.publish_many(out)

    def fill(self, session: Session, limit: int) -> None:
        """Read matching records into ``session.pending`` until it holds
        ``limit`` bytes, the scan budget is spent, or the log ends."""
        req = session.request
        parts = [session.pending]
        have = len(session.pending)
        if session.items is not None:
            while session.items and have < limit:
                seq, first, offset = session.items.pop(0)
                try:
                    record = self.log.record_at(first, offset)
                except KeyError:
                    continue        # removed by retention since the request
                parts.append(record)
                have += len(record)
                session.last_sent = seq
                self.counters["replayed"] += 1
            session.done = not session.items
            session.pending = b"".join(parts)
            return
        log = self.log
        scanned = 0
        unpack = RECORD.unpack_from
        matches = session.matches
        while have < limit and scanned < SCAN_BUDGET:
            if log.expired(session.position):
                lost = log.first_seq - session.last_sent - 1
                session.position = log.start()
                if lost > 0:
                    parts.append(pack_record(0, time.time_ns(), GAP_KEY,
                                             gap_payload(lost, "retention")))
                    have += len(parts[-1])
            data, position, last = log.read(session.position, wire.BATCH_BYTES, session.stop)
            if not data:
                session.done = not req.follow or session.stop is not None
                break
            scanned += len(data)
            self.counters["replayed"] += last - session.last_sent
            if session.every_key:
                # Every record in range is wanted, notes included: no parsing.
                parts.append(data)
                have += len(data)
            else:
                pos, end = 0, len(data)
                while pos < end:
                    size, _, _, _, key_len = unpack(data, pos)
                    key = data[pos + HEADER:pos + HEADER + key_len]
                    if key[:1] == b"!" or matches(key):
                        parts.append(data[pos:pos + size])
                        have += size
                    pos += size
            session.position, session.last_sent = position, last
        session.pending = b"".join(parts)


def _take(bus: Client, limit: int) -> list:
    """What the client has or the socket holds now, up to ``limit``."""
    try:
        return bus.receive_many(limit, timeout=0)
    except TimeoutError:
        return []


def _cached(matches: Callable[[bytes], bool]) -> Callable[[bytes], bool]:
    """``matches`` remembering its answers for up to 64k keys (keys repeat)."""
    seen: Dict[bytes, bool] = {}

    def cached(key: bytes) -> bool:
        hit = seen.get(key)
        if hit is None:
            hit = matches(key)
            if len(seen) < 65536:
                seen[key] = hit
        return hit

    return cached


def _version() -> str:
    from .. import __version__
    return __version__
