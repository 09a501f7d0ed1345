"""The hand-made broker log the analytics tests read, and its plain-Python oracle.

``BrokerSim`` writes the records one broker run would, keeping its own
counters; ``LINES`` is one such log (two brokers, odd but valid records,
malformed and blank lines, shuffled), ``sim_log`` another broker's on any
day.  ``RECORDS``, ``of`` and ``expected_client_counters`` recompute what the
job must find from the JSON lines with ``json.loads`` and dictionaries, never
from the code under test; ``snapshot`` is what two datasets must agree on.
"""
from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sbus import logschema as ls

T0 = datetime(2026, 11, 21, 10, 0, 30, tzinfo=timezone.utc)

# --- the hand-made log ---------------------------------------------------------------

def ts(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def zero_counters(cid, pid, uid, gid):
    c = dict.fromkeys(ls.CLIENT_COUNTER_FIELDS, 0)
    c.update(client=cid, pid=pid, uid=uid, gid=gid)
    return c


class BrokerSim:
    """Writes the records one broker run would, with self-consistent counters."""

    KEYS = ["sensors/kitchen/temp", "sensors/hall/temp", "logs/web/error", "logs/db/info",
            "jobs/1/done", "solo", "a/b/", "!/cred/100/1000/7/inbox", "metrics/cpu/h1"]
    PATTERNS = ["sensors/", "logs/*/error", "", "jobs/", "solo"]

    def __init__(self, rng, broker_pid, sample_rate, start=0.0, with_start=True):
        self.rng, self.bp, self.rate, self.t = rng, broker_pid, sample_rate, start
        self.lines: list = []
        self.clients: dict = {}
        self.next_id = 1
        self.totals = dict.fromkeys(ls.TOTALS_FIELDS, 0)
        self.last = dict(self.totals)
        if with_start:
            self.emit(ls.BROKER_START, version="0.1.0", address="/run/sbus.socket",
                      pid=broker_pid, config={"stats_interval": 20, "log_messages": sample_rate,
                                              "backend": "epoll", "foreground": True})

    def emit(self, event, level="info", **fields):
        self.t += 0.00001  # unique timestamps: "the latest record" is then well defined
        rec = {"timestamp": ts(self.t), "level": level, "event": event, "schema": 1,
               "broker_pid": self.bp, **fields}
        self.lines.append(json.dumps(rec))

    def connect(self):
        cid, self.next_id = self.next_id, self.next_id + 1
        pid, uid = self.rng.choice([(501, 1000), (502, 1000), (777, 0), (900 + cid, 1001)])
        c = zero_counters(cid, pid, uid, 100)
        c["_since"] = self.t
        self.clients[cid] = c
        self.totals["connects"] += 1
        self.totals["clients"] += 1
        self.emit(ls.CLIENT_CONNECT, client=cid, pid=pid, uid=uid, gid=100)
        self.subscribe(c, self.rng.choice(self.PATTERNS))
        return c

    def subscribe(self, c, pattern, refuse=False):
        self.emit(ls.SUBSCRIBE, client=c["client"], pid=c["pid"], uid=c["uid"], pattern=pattern,
                  accepted=not refuse, reason=ls.REFUSE_CRED_MISMATCH if refuse else None)
        if not refuse:
            c["subscriptions"] += 1
            self.totals["subscriptions"] += 1

    def unsubscribe(self, c, pattern, refuse=False):
        self.emit(ls.UNSUBSCRIBE, client=c["client"], pid=c["pid"], uid=c["uid"], pattern=pattern,
                  accepted=not refuse, reason=ls.REFUSE_NOT_SUBSCRIBED if refuse else None)
        if not refuse:
            c["subscriptions"] -= 1
            self.totals["subscriptions"] -= 1

    def publish(self, c, key=None):
        key = key or self.rng.choice(self.KEYS)
        size = 5 + len(key) + self.rng.randrange(200)
        c["msgs_in"] += 1
        c["bytes_in"] += size
        self.totals["msgs_in"] += 1
        self.totals["bytes_in"] += size
        recipients = self.rng.sample(list(self.clients.values()), min(3, len(self.clients)))
        fanout = len(recipients) - (self.rng.random() < 0.3)  # and sometimes fewer
        for r in recipients[:fanout]:
            if self.rng.random() < 0.2:
                kind = self.rng.choice(ls.DROP_KINDS[:2])
                r[kind] += 1
                self.totals[kind] += 1
                continue
            r["msgs_out"] += 1
            r["bytes_out"] += size
            self.totals["msgs_out"] += 1
            self.totals["bytes_out"] += size
        if self.rng.random() < self.rate:
            self.emit(ls.MESSAGE, "debug", client=c["client"], pid=c["pid"], uid=c["uid"],
                      key=key, size=size, fanout=fanout, sample_rate=self.rate)

    def flood(self, c):
        self.emit(ls.FLOOD, "warning", client=c["client"], pid=c["pid"], uid=c["uid"],
                  interval_s=20.0, drops_soft=self.rng.randrange(5),
                  drops_hard=self.rng.randrange(3), blocks=self.rng.randrange(2),
                  queued_msgs=self.rng.randrange(50), queued_bytes=self.rng.randrange(9000),
                  soft=self.rng.choice(["discard", "error"]), hard="discard")

    def disconnect(self, c, reason, detail=None):
        del self.clients[c["client"]]
        self.totals["clients"] -= 1
        self.totals["disconnects"] += 1
        self.totals["subscriptions"] -= c["subscriptions"]
        counters = {k: v for k, v in c.items() if not k.startswith("_")}
        self.emit(ls.CLIENT_DISCONNECT, "warning" if reason != "eof" else "info",
                  client=c["client"], pid=c["pid"], uid=c["uid"], gid=c["gid"], reason=reason,
                  detail=detail, duration_s=round(self.t - c["_since"], 6), counters=counters)

    def deny(self, c, key, rule, action="drop", suppressed=0):
        """A publish the access policy denied (logged at most 10 a second:
        ``suppressed`` were left out before it)."""
        self.emit(ls.PUBLISH_DENIED, "warning", client=c["client"], pid=c["pid"], uid=c["uid"],
                  gid=c["gid"], key=key, rule=rule, action=action, suppressed=suppressed)

    def refuse_user(self):
        cid, self.next_id = self.next_id, self.next_id + 1
        self.emit(ls.CLIENT_DISCONNECT, "warning", client=cid, pid=4000 + cid, uid=666, gid=666,
                  reason=ls.DISCONNECT_USER_REFUSED, detail="uid 666", duration_s=0.0,
                  counters=zero_counters(cid, 4000 + cid, 666, 666))

    def stats(self):
        delta = {f: self.totals[f] - self.last[f] for f in ls.DELTA_FIELDS}
        self.last = dict(self.totals)
        uids = sorted({c["uid"] for c in self.clients.values()})
        self.emit(ls.STATS, interval_s=20.0, totals=self.totals, delta=delta,
                  clients=[{k: v for k, v in c.items() if not k.startswith("_")}
                           for c in self.clients.values()],
                  users=[dict(zip(ls.USER_FIELDS, (
                      uid, sum(c["uid"] == uid for c in self.clients.values()), 1024, 0,
                      64 << 20, 0, 64 << 20))) for uid in uids])

    def run(self, seconds, reasons):
        """Random traffic for ``seconds`` simulated seconds, stats every 20."""
        rng, end, next_stats = self.rng, self.t + seconds, self.t + 20
        while self.t < end:
            self.t += rng.uniform(0.05, 0.6)
            if self.t >= next_stats:
                for c in list(self.clients.values()):
                    if rng.random() < 0.3:
                        self.flood(c)
                self.stats()
                next_stats += 20
            x = rng.random()
            if x < 0.06 or len(self.clients) < 2:
                self.connect()
            elif x < 0.10:
                c = rng.choice(list(self.clients.values()))
                self.disconnect(c, rng.choice(reasons), detail=rng.choice([None, "why"]))
            elif x < 0.13:
                c = rng.choice(list(self.clients.values()))
                if rng.random() < 0.5:
                    self.subscribe(c, rng.choice(self.PATTERNS), refuse=rng.random() < 0.3)
                else:
                    self.unsubscribe(c, rng.choice(self.PATTERNS), refuse=rng.random() < 0.3)
            elif x < 0.14:
                self.refuse_user()
            else:
                self.publish(rng.choice(list(self.clients.values())))


MALFORMED = [
    '{"timestamp":"2026-11-21T10:00:31.000000Z","level":"info","event":"mess',  # truncated
    "Traceback (most recent call last):",                # stray stderr
    "[1, 2, 3]",                                         # JSON, not an object
    "42",
    "null",
    '{"event":"stats","schema":1}',                      # no timestamp
    '{"timestamp":"yesterday","event":"message"}',       # unparseable timestamp
    '{"timestamp":"2026-11-21T10:00:31Z","level":"info","schema":1}',  # no event
    '{"timestamp":"2026-11-21T10:00:31Z","event":"message","client":"seven","key":"x"}',
    '{"timestamp":"2026-11-21T10:00:31Z","event":"client_disconnect","client":3,'
    '"reason":"eof","counters":{"msgs_in":"many"}}',      # wrong type, nested
]

ODD_BUT_VALID = [
    # Unknown event, unknown fields (one nested), a newer schema version: all tolerated.
    '{"timestamp":"2026-11-21T10:00:40.5Z","level":"info","event":"cmsg_ignored","schema":1,'
    '"broker_pid":100,"client":1,"key":"x/y","extra":{"nested":[1,2]}}',
    '{"timestamp":"2026-11-21T10:00:41Z","level":"debug","event":"message","schema":2,'
    '"broker_pid":100,"client":1,"pid":501,"uid":1000,"key":"future/key","size":10,'
    '"fanout":2,"sample_rate":0.25,"future_field":true}',
    '{"timestamp":"2026-11-21T10:00:42+00:00","level":"info","event":"log_reopened",'
    '"schema":1,"broker_pid":100}',
    # An event outside the schema may reuse a field name with another type.
    '{"timestamp":"2026-11-21T10:00:43Z","level":"error","event":"accept_paused",'
    '"schema":1,"broker_pid":100,"clients":1021}',
    # The store's events (sbus store, its own pid): counted, never in the broker's tables.
    '{"timestamp":"2026-11-21T10:00:44Z","level":"info","event":"store_stats","schema":2,'
    '"broker_pid":300,"recorded":12,"bytes":1200,"records":12,"segments":1,"gaps":1,'
    '"disk_full":false,"missed_by_pattern":{"a/":3},"uptime_s":1.5}',
    '{"timestamp":"2026-11-21T10:00:45Z","level":"warning","event":"store_gap","schema":2,'
    '"broker_pid":300,"lost":7,"reason":"flood","seq":12}',
]

BLANK = ["", "   "]


def build_log():
    """(lines, number of malformed lines, number of blank lines), shuffled deterministically."""
    rng = random.Random(20261121)
    a = BrokerSim(rng, broker_pid=100, sample_rate=1.0)
    a.run(150, ["eof", "eof", "protocol_error", "flood_error", "oversize", "bang_misuse"])
    # Denials by the access policy: no randomness, so the other records stay as they were.
    first, last = list(a.clients.values())[0], list(a.clients.values())[-1]
    for key, rule, suppressed in (("power/off", 0, 0), ("power/off", 0, 4), ("power/on", 0, 0),
                                  ("billing/x", 3, 0)):
        a.deny(first, key, rule, suppressed=suppressed)
    a.deny(last, "billing/x", 3, "disconnect")
    for c in list(a.clients.values())[:-1]:
        a.disconnect(c, ls.DISCONNECT_SHUTDOWN)
    a.stats()
    late = a.connect()          # after the last stats: no counters anywhere
    a.publish(late)
    a.emit(ls.BROKER_STOP, reason="SIGTERM", uptime_s=a.t, totals=a.totals)
    # A second broker whose log was rotated: no broker_start, same client ids as the first.
    b = BrokerSim(rng, broker_pid=200, sample_rate=0.5, start=30.0, with_start=False)
    b.run(100, ["eof", "error", "cred_refused", "flood_error"])
    b.stats()
    lines = a.lines + b.lines + ODD_BUT_VALID + MALFORMED + BLANK
    rng.shuffle(lines)
    return lines


LINES = build_log()


def sim_log(seed: int, broker_pid: int, start: float, seconds: float) -> list:
    """Another broker's log from ``start`` seconds after T0 (86400: the next day):
    a rotated log, so no broker_start, and half the messages sampled.
    """
    sim = BrokerSim(random.Random(seed), broker_pid=broker_pid, sample_rate=0.5, start=start,
                    with_start=False)
    sim.run(seconds, ["eof", "error", "flood_error", "protocol_error"])
    sim.stats()
    return sim.lines


# --- the independent oracle ----------------------------------------------------------

def good_records():
    out = []
    for line in LINES:
        if line.strip() and line not in MALFORMED:
            out.append(json.loads(line))
    return out


RECORDS = good_records()


def of(event):
    return [r for r in RECORDS if r["event"] == event]


def expected_client_counters():
    """(broker_pid, client) -> (counters_from, counters dict or None, disconnect reason)."""
    out = {}
    for r in sorted(of("stats"), key=lambda r: r["timestamp"]):
        for c in r["clients"]:
            out[(r["broker_pid"], c["client"])] = ("stats", c, None)
    for r in of("client_connect"):
        out.setdefault((r["broker_pid"], r["client"]), (None, None, None))
    for r in of("client_disconnect"):
        out[(r["broker_pid"], r["client"])] = ("disconnect", r["counters"], r["reason"])
    return out


# --- what two datasets must agree on -------------------------------------------------

def snapshot(spark, out: Path) -> dict:
    """Every table of a dataset as rows (columns by name, floats to 6 places),
    with its malformed lines and per-file counts: what two runs must agree on.
    """
    from sbus.analytics import TABLES, read_malformed, read_table

    def canon(v):
        return round(v, 6) if isinstance(v, float) else v

    got = {}
    for t in TABLES:
        df = read_table(spark, str(out), t.name)
        got[t.name] = sorted((tuple(canon(v) for v in r) for r in df.select(
            *sorted(df.columns)).collect()), key=repr)
    got["malformed"] = sorted((r["source"].rsplit("/", 1)[-1], r["line"])
                              for r in read_malformed(spark, str(out)).collect())
    manifest = json.loads((out / "_manifest.json").read_text())
    got["files"] = sorted((Path(e["path"]).name, e["checksum"], tuple(e["days"]), e["lines"],
                           e["records"], e["malformed"], e["blank"], e["superseded_by"])
                          for e in manifest["files"])
    return got
