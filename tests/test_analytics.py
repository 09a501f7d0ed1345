"""sbus.analytics against a hand-made log, checked by plain Python over the same lines.

The log is built here, record by record, by a small simulation with its own
counters; every expected number below is recomputed from the JSON lines with
``json.loads`` and dictionaries, never taken from the code under test.  Spark
runs for real, in local mode, with one session shared by the whole file.
"""
from __future__ import annotations

import csv
import gzip
import json
import os
import random
import subprocess
import sys
from collections import Counter, defaultdict
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from sbus import logschema as ls

from support import ROOT

# PySpark warns about pandas versions it has not certified; nothing here uses pandas.
pytestmark = pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas")

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


def minute(timestamp: str) -> str:
    dt = datetime.fromisoformat(timestamp.replace("Z", "+00:00")).astimezone(timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M")


def weight(r):
    return 1.0 / r["sample_rate"]


def expected_prefix_traffic(depth):
    out = defaultdict(lambda: {"sampled": 0, "messages": 0.0, "bytes_in": 0.0,
                               "deliveries": 0.0, "bytes_out": 0.0})
    for r in of("message"):
        p = "/".join(r["key"].split("/")[:depth])
        o = out[p]
        o["sampled"] += 1
        o["messages"] += weight(r)
        o["bytes_in"] += r["size"] * weight(r)
        o["deliveries"] += r["fanout"] * weight(r)
        o["bytes_out"] += r["size"] * r["fanout"] * weight(r)
    return dict(out)


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


# --- Spark ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def log_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("logs") / "sbusd.log"
    path.write_text("\n".join(LINES) + "\n")
    return path


@pytest.fixture(scope="session")
def events(spark, log_file):
    from sbus.analytics import read_events

    df = read_events(spark, [str(log_file)]).cache()
    yield df
    df.unpersist()


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


def rows(df, key):
    return {key(r): r.asDict() for r in df.collect()}


# --- tests without Spark -------------------------------------------------------------

def test_logschema_is_one_consistent_schema():
    fields = ls.all_fields()  # raises if two events disagree on a type
    assert list(fields)[:5] == [name for name, _ in ls.COMMON_FIELDS]
    assert set(ls.EVENT_FIELDS) == {ls.BROKER_START, ls.BROKER_STOP, ls.CLIENT_CONNECT,
                                    ls.CLIENT_DISCONNECT, ls.SUBSCRIBE, ls.UNSUBSCRIBE,
                                    ls.FLOOD, ls.STATS, ls.MESSAGE}
    assert set(ls.DELTA_FIELDS) <= set(ls.TOTALS_FIELDS)
    assert len(set(ls.DISCONNECT_REASONS)) == len(ls.DISCONNECT_REASONS)


def test_docs_describe_every_event_and_field():
    doc = (ROOT / "docs" / "logging.md").read_text()
    assert f"Schema version: {ls.SCHEMA_VERSION}" in doc
    names = (set(ls.EVENT_FIELDS) | set(ls.all_fields()) | set(ls.TOTALS_FIELDS)
             | set(ls.CLIENT_COUNTER_FIELDS) | set(ls.DISCONNECT_REASONS) | set(ls.REFUSE_REASONS))
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/logging.md does not mention {missing}"


def test_importing_sbus_never_imports_pyspark():
    code = "import sys, sbus, sbus.logschema; assert 'pyspark' not in sys.modules, 'pyspark'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_hand_made_log_is_schema_conformant():
    """The oracle's input must itself follow the schema, or the comparison proves little."""
    for r in RECORDS:
        assert r["event"] and "timestamp" in r
        for name, tag in ls.EVENT_FIELDS.get(r["event"], ()):
            assert name in r, (r["event"], name)
    assert len(of("message")) > 100 and len(of("stats")) >= 10 and len(of("flood")) > 3


# --- Spark tests ---------------------------------------------------------------------

@pytest.mark.spark
def test_declared_schema_comes_from_logschema(spark):
    from sbus.analytics.schema import CORRUPT_COLUMN, record_schema

    schema = record_schema()
    assert schema.fieldNames() == [*ls.all_fields(), CORRUPT_COLUMN]
    assert schema["totals"].dataType.fieldNames() == list(ls.TOTALS_FIELDS)
    assert schema["clients"].dataType.elementType.fieldNames() == list(ls.CLIENT_COUNTER_FIELDS)
    assert schema["delta"].dataType.fieldNames() == list(ls.DELTA_FIELDS)


@pytest.mark.spark
def test_json_lines_parse_and_malformed_lines_are_counted(spark, log_file):
    from pyspark.sql import functions as F

    from sbus.analytics import line_summary, parse, read_lines
    from sbus.analytics.job import STATUS

    parsed = parse(read_lines(spark, [str(log_file)]))
    summary = line_summary(parsed)
    assert summary["lines"] == len(LINES)
    assert summary["malformed"] == len(MALFORMED)
    assert summary["blank"] == len(BLANK)
    assert summary["records"] == len(RECORDS)
    assert summary["schema_versions"] == {
        str(k): v for k, v in Counter(r["schema"] for r in RECORDS).items()}
    bad = {r["value"] for r in parsed.where(F.col(STATUS) == "malformed").collect()}
    assert bad == set(MALFORMED)
    # A parsed record keeps its values and types, including nested ones.
    first_stats = min(of("stats"), key=lambda r: (r["broker_pid"], r["timestamp"]))
    same_broker = F.col("broker_pid") == first_stats["broker_pid"]
    got = parsed.where((F.col("event") == "stats") & same_broker).orderBy("timestamp").first()
    assert got["totals"].asDict() == first_stats["totals"]
    assert [c.asDict() for c in got["clients"]] == [
        {k: c[k] for k in ls.CLIENT_COUNTER_FIELDS} for c in first_stats["clients"]]


@pytest.mark.spark
def test_event_counts(events):
    from sbus.analytics import event_counts

    got = {r["event"]: r["records"] for r in event_counts(events).collect()}
    assert got == dict(Counter(r["event"] for r in RECORDS))


@pytest.mark.spark
@pytest.mark.parametrize("depth", [1, 2])
def test_traffic_by_prefix(events, depth):
    from sbus.analytics import traffic_by_prefix

    got = rows(traffic_by_prefix(events, depth), key=lambda r: r["prefix"])
    want = expected_prefix_traffic(depth)
    assert set(got) == set(want)
    for prefix, w in want.items():
        g = got[prefix]
        assert g["sampled"] == w["sampled"], prefix
        for col in ("messages", "bytes_in", "deliveries", "bytes_out"):
            assert g[col] == pytest.approx(w[col]), (prefix, col)


@pytest.mark.spark
def test_client_traffic(events):
    from sbus.analytics import client_traffic

    got = rows(client_traffic(events), key=lambda r: (r["broker_pid"], r["client"]))
    want = expected_client_counters()
    assert set(got) == set(want)
    assert {src for src, _, _ in want.values()} == {"stats", "disconnect", None}
    for key, (src, counters, reason) in want.items():
        g = got[key]
        assert g["counters_from"] == src, key
        assert g["disconnect_reason"] == reason, key
        for col in ("msgs_in", "bytes_in", "msgs_out", "bytes_out", *ls.DROP_KINDS,
                    "subscriptions"):
            assert g[col] == (counters[col] if counters else None), (key, col)
    # Same client id on two brokers are two connections.
    assert (100, 1) in got and (200, 1) in got


@pytest.mark.spark
def test_top_publishers(events):
    from sbus.analytics import top_publishers

    per_proc = defaultdict(lambda: [0, 0, 0])
    for _, counters, _ in expected_client_counters().values():
        if counters:
            p = per_proc[(counters["pid"], counters["uid"])]
            p[0] += 1
            p[1] += counters["msgs_in"]
            p[2] += counters["bytes_in"]
    ranked = sorted(per_proc.items(), key=lambda kv: (-kv[1][1], -kv[1][2], kv[0]))[:3]
    got = [(r["pid"], r["uid"], r["msgs_in"], r["bytes_in"]) for r in
           top_publishers(events, 3).collect()]
    assert got == [(pid, uid, m, b) for (pid, uid), (_, m, b) in ranked]


@pytest.mark.spark
def test_throughput_per_minute(events):
    from pyspark.sql import functions as F

    from sbus.analytics import throughput

    want = defaultdict(Counter)
    for r in of("stats"):
        want[minute(r["timestamp"])].update(r["delta"])
        want[minute(r["timestamp"])]["stats_records"] += 1
    df = throughput(events, "1 minute").withColumn(
        "minute", F.date_format("time", "yyyy-MM-dd'T'HH:mm"))
    got = rows(df, key=lambda r: r["minute"])
    assert set(got) == set(want) and len(want) >= 3
    for m, w in want.items():
        g = got[m]
        for col in (*ls.DELTA_FIELDS, "stats_records"):
            assert g[col] == w[col], (m, col)
        assert g["drops"] == sum(w[k] for k in ls.DROP_KINDS)
        assert g["seconds"] == 60
        assert g["msgs_in_per_s"] == pytest.approx(w["msgs_in"] / 60)
    # Deltas add up to the broker's own cumulative totals.
    last = {}
    for r in of("stats"):
        if r["timestamp"] > last.get(r["broker_pid"], {"timestamp": ""})["timestamp"]:
            last[r["broker_pid"]] = r
    assert (sum(g["msgs_in"] for g in got.values())
            == sum(r["totals"]["msgs_in"] for r in last.values()))


@pytest.mark.spark
def test_disconnect_reasons(events):
    from sbus.analytics import disconnect_reasons

    want = Counter(r["reason"] for r in of("client_disconnect"))
    got = rows(disconnect_reasons(events), key=lambda r: r["reason"])
    assert {k: v["disconnects"] for k, v in got.items()} == dict(want)
    assert sum(v["share"] for v in got.values()) == pytest.approx(1.0)
    assert ls.DISCONNECT_USER_REFUSED in got and ls.DISCONNECT_FLOOD_ERROR in got


@pytest.mark.spark
def test_flood_actions(events):
    from sbus.analytics import flood_actions

    want = defaultdict(Counter)
    for r in of("flood"):
        w = want[(r["broker_pid"], r["client"])]
        w.update(flood_records=1, drops_soft=r["drops_soft"], drops_hard=r["drops_hard"],
                 blocks=r["blocks"])
        w["max_queued_bytes"] = max(w["max_queued_bytes"], r["queued_bytes"])
    for r in of("client_disconnect"):
        if r["reason"] == "flood_error":
            want[(r["broker_pid"], r["client"])]["flood_disconnects"] += 1
    got = rows(flood_actions(events), key=lambda r: (r["broker_pid"], r["client"]))
    assert set(got) == set(want)
    for key, w in want.items():
        for col in ("flood_records", "drops_soft", "drops_hard", "blocks", "flood_disconnects"):
            assert got[key][col] == w[col], (key, col)
        if w["flood_records"]:
            assert got[key]["max_queued_bytes"] == w["max_queued_bytes"]


@pytest.mark.spark
def test_fanout_distribution(events):
    from sbus.analytics import fanout_distribution

    sampled, est = Counter(), Counter()
    for r in of("message"):
        sampled[r["fanout"]] += 1
        est[r["fanout"]] += weight(r)
    got = rows(fanout_distribution(events), key=lambda r: r["fanout"])
    assert {k: v["sampled"] for k, v in got.items()} == dict(sampled)
    total = sum(est.values())
    for f, v in got.items():
        assert v["messages"] == pytest.approx(est[f])
        assert v["share"] == pytest.approx(est[f] / total)


@pytest.mark.spark
def test_subscription_churn(events):
    from pyspark.sql import functions as F

    from sbus.analytics import pattern_churn, subscription_churn

    per_min, per_pattern = defaultdict(Counter), defaultdict(Counter)
    clients = defaultdict(set)
    for r in of("subscribe") + of("unsubscribe"):
        col = ("subscribed" if r["event"] == "subscribe" else "unsubscribed") if r["accepted"] \
            else "refused"
        per_min[minute(r["timestamp"])][col] += 1
        per_pattern[r["pattern"]][col] += 1
        clients[r["pattern"]].add((r["broker_pid"], r["client"]))
    df = subscription_churn(events).withColumn(
        "minute", F.date_format("time", "yyyy-MM-dd'T'HH:mm"))
    got = rows(df, key=lambda r: r["minute"])
    assert set(got) == set(per_min)
    for m, w in per_min.items():
        assert (got[m]["subscribed"], got[m]["unsubscribed"], got[m]["refused"], got[m]["net"]) == (
            w["subscribed"], w["unsubscribed"], w["refused"], w["subscribed"] - w["unsubscribed"])
    got = rows(pattern_churn(events), key=lambda r: r["pattern"])
    assert set(got) == set(per_pattern)
    for p, w in per_pattern.items():
        assert (got[p]["subscribed"], got[p]["unsubscribed"], got[p]["refused"]) == (
            w["subscribed"], w["unsubscribed"], w["refused"])
        assert got[p]["clients"] == len(clients[p])


def read_csv_dir(path: Path) -> list:
    parts = sorted(path.glob("part-*.csv"))
    assert len(parts) == 1, parts
    with open(parts[0], newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.spark
def test_cli_writes_a_dataset_and_csv_when_asked(spark, log_file, tmp_path, capsys):
    from sbus.analytics import TABLES, read_malformed
    from sbus.analytics.cli import main

    out = tmp_path / "out"
    assert main([str(log_file), "--out", str(out), "--show", "5", "--csv"]) == 0
    printed = capsys.readouterr().out
    assert f"{len(MALFORMED)} malformed" in printed and "== disconnect_reasons" in printed
    assert not spark.sparkContext._jsc.sc().isStopped(), "main() stopped a session it did not start"
    day = "date=" + T0.date().isoformat()
    for name in [t.name for t in TABLES]:
        assert list((out / name / day).glob("*.parquet")), name
        read_csv_dir(out / "csv" / name / day)
    events = {r["event"]: int(r["records"]) for r in read_csv_dir(out / "csv" / "events" / day)}
    assert events == dict(Counter(r["event"] for r in RECORDS))
    manifest = json.loads((out / "_manifest.json").read_text())
    (entry,) = manifest["files"]
    assert entry["malformed"] == len(MALFORMED) and entry["lines"] == len(LINES)
    assert entry["blank"] == len(BLANK) and entry["days"] == [T0.date().isoformat()]
    assert sorted(r["line"] for r in read_csv_dir(out / "csv" / "malformed")) == sorted(MALFORMED)
    assert sorted(r["line"] for r in read_malformed(spark, str(out)).collect()) == sorted(MALFORMED)
    reasons = {r["reason"]: r["disconnects"] for r in
               spark.read.parquet(str(out / "disconnect_reasons")).collect()}
    assert reasons == dict(Counter(r["reason"] for r in of("client_disconnect")))


@pytest.mark.spark
def test_gz_directory_and_glob_inputs(spark, tmp_path):
    from sbus.analytics import event_counts, line_summary, parse, read_events, read_lines

    # The same lines, spread over a plain file, a nested .gz and a glob-matched file.
    d = tmp_path / "logs"
    (d / "old").mkdir(parents=True)
    third = len(LINES) // 3
    (d / "sbusd.log").write_text("\n".join(LINES[:third]) + "\n")
    with gzip.open(d / "old" / "sbusd.log.1.gz", "wt") as f:
        f.write("\n".join(LINES[third:2 * third]) + "\n")
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "sbusd-2.log").write_text("\n".join(LINES[2 * third:]) + "\n")
    paths = [str(d), str(other / "sbusd-*.log")]
    summary = line_summary(parse(read_lines(spark, paths)))
    assert (summary["lines"], summary["malformed"]) == (len(LINES), len(MALFORMED))
    got = {r["event"]: r["records"] for r in event_counts(read_events(spark, paths)).collect()}
    assert got == dict(Counter(r["event"] for r in RECORDS))
