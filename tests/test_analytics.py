"""sbus.analytics against a hand-made log, checked by plain Python over the same lines.

The log is built record by record by a small simulation with its own counters
(tests/support/analytics_log.py); every expected number below is recomputed
from the JSON lines with ``json.loads`` and dictionaries, never taken from the
code under test.  Spark runs for real, in local mode, with one session shared
by the whole file.
"""
from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path

import pytest

from sbus import logschema as ls

from support import ROOT
from support.analytics_log import BLANK, LINES, MALFORMED, RECORDS, T0, expected_client_counters, of

# PySpark warns about pandas versions it has not certified; nothing here uses pandas.
pytestmark = pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas")


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


def rows(df, key):
    return {key(r): r.asDict() for r in df.collect()}


# --- tests without Spark -------------------------------------------------------------

def test_logschema_is_one_consistent_schema():
    fields = ls.all_fields()  # raises if two events disagree on a type
    assert list(fields)[:5] == [name for name, _ in ls.COMMON_FIELDS]
    assert set(ls.EVENT_FIELDS) == {ls.BROKER_START, ls.BROKER_STOP, ls.CLIENT_CONNECT,
                                    ls.CLIENT_DISCONNECT, ls.SUBSCRIBE, ls.UNSUBSCRIBE,
                                    ls.FLOOD, ls.STATS, ls.MESSAGE, ls.PUBLISH_DENIED}
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
        for name, _tag in ls.EVENT_FIELDS.get(r["event"], ()):
            assert name in r, (r["event"], name)
    # Lower bounds: enough of each event for the comparisons below to mean something.
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
def test_publish_denials(events):
    from sbus.analytics import publish_denials

    want: dict = defaultdict(lambda: {"denials": 0, "keys": set(), "suppressed": 0, "at": []})
    for r in of("publish_denied"):
        w = want[(r["uid"], r["rule"], r["action"])]
        w["denials"] += 1
        w["keys"].add(r["key"])
        w["suppressed"] += r["suppressed"]
        w["at"].append(r["timestamp"])
    assert len(want) >= 2
    got = rows(publish_denials(events), key=lambda r: (r["uid"], r["rule"], r["action"]))
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        assert (g["denials"], g["keys"], g["suppressed"]) == (
            w["denials"], len(w["keys"]), w["suppressed"]), k
        assert g["first_at"].strftime("%H:%M:%S.%f") == min(w["at"])[11:26], k
        assert g["last_at"].strftime("%H:%M:%S.%f") == max(w["at"])[11:26], k


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
    assert "--log-messages" not in printed      # it has message records
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
def test_a_log_without_message_sampling_says_what_to_turn_on(spark, tmp_path, capsys):
    """make run's log (no --log-messages): the per-key traffic and fan-out
    tables are empty for want of samples, and say so (issue 38)."""
    from sbus.analytics import sampled
    from sbus.analytics.cli import main
    from sbus.analytics.job import NOT_SAMPLED

    log = tmp_path / "sbusd.log"
    log.write_text("".join(json.dumps(r) + "\n" for r in RECORDS if r["event"] != "message"))
    out = tmp_path / "out"
    assert main([str(log), "--out", str(out), "--show", "5"]) == 0
    printed = capsys.readouterr().out
    for table in ("traffic_by_prefix1", "traffic_by_prefix2", "traffic_by_key", "fanout"):
        section = printed.split(f"== {table}:")[1].split("\n== ")[0]
        assert "(no rows)" in section and NOT_SAMPLED in section, table
    section = printed.split("== client_traffic:")[1].split("\n== ")[0]
    assert NOT_SAMPLED not in section       # the stats records fill it
    assert not sampled(spark, str(out))
    assert printed.count("--log-messages RATE") == 4


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
