"""The day tables the driver finishes (``daytables``) equal Spark's (``transforms``).

Up to ``job.DRIVER_ROWS`` stored rows, the driver writes a run's stored rows
and finishes its day tables; above it, Spark does both.  Two datasets are
built here from the same logs, run by run, one each way; the stored rows and
every table must agree in rows and in column types, so a day written either
way reads like any other, and a run of either kind merges into it.  The logs
are the analytics tests' hand-made one, two simulated ones across midnight, and
lines with the null and odd values where SQL's rules show.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from support.analytics_log import LINES, sim_log

pytestmark = [
    pytest.mark.spark,
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas"),
]


def _line(t: str, event: str, **fields) -> str:
    return json.dumps({"timestamp": f"2026-11-21T{t}Z", "level": "info", "event": event,
                       "schema": 2, "broker_pid": 900, **fields})


# Nulls where the tables group, sum, rank and count distinct; equal lines,
# which a stored row keeps once with their number.
ODD_LINES = [
    _line("11:00:00", "subscribe", client=1, pattern="a/#"),                # accepted unknown
    _line("11:00:01", "unsubscribe", client=1, pattern="a/#"),              # accepted unknown
    _line("11:00:02", "subscribe", client=2, pattern="a/#", accepted=False),
    _line("11:05:00", "subscribe", client=2, pattern="n/#"),                # only unknowns
    _line("11:00:03", "subscribe", pattern="b/#", accepted=True),           # no client
    _line("11:00:04", "subscribe", client=3, accepted=True),                # no pattern
    _line("11:00:05", "client_disconnect", client=4, pid=7,
          counters={"msgs_in": 2, "msgs_out": 1}),                          # no reason
    _line("11:00:05", "client_disconnect", client=4, pid=7,
          counters={"msgs_in": 2, "msgs_out": 1}),                          # the same again
    _line("11:00:06", "client_disconnect", client=5, reason="flood_error", duration_s=1.5,
          counters={"msgs_in": 3}),
    _line("11:00:07", "flood", client=5, drops_soft=2, soft="drop"),        # no pid, no hard
    _line("11:00:08", "flood", drops_hard=1, queued_msgs=9),                # no client
    _line("11:00:09", "stats", clients=[{"client": 6, "pid": 8, "msgs_in": 1},
                                        {"pid": 9, "msgs_in": 2}]),         # one without id
    _line("11:00:10", "stats"),                                             # no delta, no list
    *[_line("11:00:16", "stats", delta={"msgs_in": 5, "drops_soft": 1})] * 2,  # twice
    *[_line("11:00:17", "flood", client=8, drops_soft=3, blocks=1)] * 2,
    *[_line("11:00:18", "subscribe", client=8, pattern="d/#", accepted=True)] * 2,
    _line("11:00:11", "message", key="x/y/z", size=5, fanout=None),         # no fan-out
    _line("11:00:12", "message", fanout=2, sample_rate=0.5),                # no key, no size
    _line("11:00:13", "message", key="x//", size=1, fanout=1, sample_rate=7.0),
    _line("11:00:19", "publish_denied", client=2, uid=7, key="p/x", rule=0, action="drop",
          suppressed=0),
    *[_line("11:00:20", "publish_denied", client=2, uid=7, key="p/x", rule=0,
            action="drop", suppressed=3)] * 2,                              # twice
    _line("11:00:21", "publish_denied", client=2, uid=7, rule=0, action="drop"),  # no key
    _line("11:00:22", "publish_denied", client=3, key="q", action="disconnect"),  # no uid, rule
    _line("11:00:14", "client_connect", client=10, uid=5),                  # publisher: no pid
    _line("11:00:15", "client_disconnect", client=10, uid=5, reason="eof",
          counters={"msgs_in": 4, "bytes_in": 40}),
]
DAY2 = sim_log(seed=2, broker_pid=300, start=86400.0, seconds=90)
MIDNIGHT = sim_log(seed=3, broker_pid=400, start=50370.0 - 60, seconds=150)  # 23:59 to 00:01:30


def _write(path: Path, lines) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
    return a == b


def _rows(spark, out: Path, name: str) -> list:
    return _sorted(spark.read.parquet(str(out / name)))


def _sorted(df) -> list:
    return sorted((tuple(r) for r in df.select(*sorted(df.columns)).collect()), key=repr)


def _assert_same(got: list, want: list, what: str) -> None:
    assert len(got) == len(want) and want, what
    for g, w in zip(got, want):
        assert all(_same(a, b) for a, b in zip(g, w)), (what, g, w)


@pytest.fixture(scope="module")
def runs(spark, tmp_path_factory):
    """The same runs into two datasets, one way each: {way: (dataset, run summaries)}."""
    from sbus.analytics import job

    tmp = tmp_path_factory.mktemp("daytables")
    day1 = _write(tmp / "logs" / "day1.log", LINES + ODD_LINES)
    day2 = _write(tmp / "logs" / "day2.log", DAY2)
    midnight = _write(tmp / "late" / "midnight.log", MIDNIGHT)
    ways = {}
    default = job.DRIVER_ROWS
    try:
        for way, limit in (("driver", default), ("spark", -1)):
            job.DRIVER_ROWS = limit
            out = tmp / way
            # The second run merges into days the first one wrote.
            ways[way] = (out, [job.run(spark, [str(p) for p in paths], str(out), show=0,
                                       echo=lambda _: None)
                               for paths in ([day1, day2], [midnight])])
    finally:
        job.DRIVER_ROWS = default
    return ways


@pytest.fixture(scope="module")
def datasets(runs):
    return {way: out for way, (out, _) in runs.items()}


def test_each_run_reports_the_way_it_took(runs):
    for way, (_, summaries) in runs.items():
        assert [s["tables_by"] for s in summaries] == [way, way]
    sizes = [[s["stored_rows"] for s in summaries] for _, summaries in runs.values()]
    assert sizes[0] == sizes[1] and all(sizes[0])


def test_the_size_is_stored_rows_and_the_connections_they_list(spark, tmp_path):
    """What is measured against DRIVER_ROWS, and the way taken on either side of it."""
    from sbus.analytics import job
    from sbus.analytics.dataset import PARTIALS, Store

    log = _write(tmp_path / "a.log", LINES + ODD_LINES)
    first = job.run(spark, [str(log)], str(tmp_path / "a"), show=0, echo=lambda _: None)
    stored = job.read_stored(spark, Store(spark, str(tmp_path / "a"))).collect()
    listed = sum(len(r["clients"]) for r in stored if r["clients"])
    assert listed and first["stored_rows"] == len(stored) + listed
    default = job.DRIVER_ROWS
    try:
        job.DRIVER_ROWS = first["stored_rows"]
        at = job.run(spark, [str(log)], str(tmp_path / "b"), show=0, echo=lambda _: None)
        job.DRIVER_ROWS = first["stored_rows"] - 1
        above = job.run(spark, [str(log)], str(tmp_path / "c"), show=0, echo=lambda _: None)
    finally:
        job.DRIVER_ROWS = default
    assert (first["tables_by"], at["tables_by"], above["tables_by"]) == ("driver", "driver",
                                                                          "spark")
    # Spark's writer names its files part-NNNNN-<uuid>...; the driver's, part-<uuid>.parquet.
    names = {d: {p.name.count("-") for p in (tmp_path / d / PARTIALS).rglob("part-*")}
             for d in "bc"}
    assert names["b"] == {5} and min(names["c"]) > 5


def test_the_logs_are_small_enough_for_the_driver():
    from sbus.analytics import job

    assert len(LINES + ODD_LINES + DAY2 + MIDNIGHT) < job.DRIVER_ROWS


@pytest.mark.parametrize("name", [
    "events", "traffic_by_prefix1", "traffic_by_prefix2", "traffic_by_key", "client_traffic",
    "throughput", "disconnect_reasons", "flood_actions", "top_publishers", "fanout",
    "subscription_churn", "pattern_churn", "denials"])
def test_driver_and_spark_write_the_same_table(spark, datasets, name):
    from sbus.analytics import TABLES

    assert name in {t.name for t in TABLES}
    by_driver = spark.read.parquet(str(datasets["driver"] / name))
    by_spark = spark.read.parquet(str(datasets["spark"] / name))
    assert by_driver.schema == by_spark.schema
    _assert_same(_rows(spark, datasets["driver"], name), _rows(spark, datasets["spark"], name),
                 name)


def test_driver_and_spark_store_the_same_rows(spark, datasets):
    from sbus.analytics.dataset import PARTIALS, Store
    from sbus.analytics.job import read_stored

    stored = {w: read_stored(spark, Store(spark, str(out))) for w, out in datasets.items()}
    _assert_same(_sorted(stored["driver"]), _sorted(stored["spark"]), "stored rows")
    # Both keep one partition per file and day, under the same names: day one's
    # file, day two's, and the midnight file's two days.
    folders = {w: sorted(str(p.relative_to(out)) for p in (out / PARTIALS).glob("*/*"))
               for w, out in datasets.items()}
    assert folders["driver"] == folders["spark"] and len(folders["driver"]) == 4


def test_every_table_is_compared():
    from sbus.analytics import TABLES

    compared = test_driver_and_spark_write_the_same_table.pytestmark[0].args[1]
    assert sorted(compared) == sorted(t.name for t in TABLES)


def test_odd_values_reach_the_tables(spark, datasets):
    """The odd lines are in the tables both ways, with SQL's null rules."""
    from sbus.analytics import read_table

    out = str(datasets["driver"])
    patterns = {r["pattern"]: r for r in read_table(spark, out, "pattern_churn").collect()}
    assert patterns["a/#"]["refused"] == 1 and patterns[None]["clients"] == 1
    assert patterns["b/#"]["clients"] == 0  # no client: counted, not distinct
    assert (patterns["n/#"]["subscribed"], patterns["n/#"]["unsubscribed"]) == (None, 0)
    reasons = {r["reason"]: r for r in read_table(spark, out, "disconnect_reasons").collect()}
    assert reasons["unknown"]["disconnects"] == 2 and reasons["unknown"]["avg_duration_s"] is None
    floods = read_table(spark, out, "flood_actions").collect()
    assert any(r["client"] is None and r["drops_hard"] == 1 for r in floods)
    kicked = [r for r in floods if r["broker_pid"] == 900 and r["client"] == 5]
    assert kicked[0]["flood_disconnects"] == 1 and kicked[0]["soft_mode"] == "drop"
    keys = {r["prefix"] for r in read_table(spark, out, "traffic_by_prefix2").collect()}
    assert "x/y" in keys and "x/" in keys
