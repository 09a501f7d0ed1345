"""The job's output as an incremental dataset: files read once, days merged exactly.

Three logs: day one (2026-11-21, with malformed and blank lines), day two
(2026-11-22), and a log that spans midnight between them.  One dataset is
built run by run as an operator would; it must end equal to a dataset built
in one run over everything, and the job's own report must show what each run
read.  Expected per-day counts come from the lines themselves, read with json.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from support.analytics_log import LINES, MALFORMED, expected_client_counters, sim_log, snapshot

pytestmark = [
    pytest.mark.spark,
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas"),
]

DAY1, DAY2 = "2026-11-21", "2026-11-22"
DAY2_LINES = sim_log(seed=2, broker_pid=300, start=86400.0, seconds=90)
# From 23:59:00 to 00:01:30: T0 is 10:00:30, so midnight is 50370 s after it.
MIDNIGHT_LINES = sim_log(seed=3, broker_pid=400, start=50370.0 - 60, seconds=150)


def records(lines):
    return [json.loads(ln) for ln in lines if ln.strip() and ln not in MALFORMED]


def events_per_day(*logs):
    return Counter((r["timestamp"][:10], r["event"]) for lines in logs for r in records(lines))


def write(path: Path, lines) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def files_of(out: Path) -> dict:
    """Every data file of a dataset and its content hash (CSV included)."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def job(spark, paths, out, **kw):
    from sbus.analytics import run

    printed = []
    summary = run(spark, [str(p) for p in paths], str(out), show=0, echo=printed.append, **kw)
    summary["printed"] = "\n".join(printed)
    return summary


def names(uris):
    return sorted(u.rsplit("/", 1)[-1] for u in uris)


@pytest.fixture(scope="module")
def story(spark, tmp_path_factory):
    """The runs, in order, with what each reported and the dataset after it."""
    tmp = tmp_path_factory.mktemp("incremental")
    logs = tmp / "logs"
    day1 = write(logs / "day1.log", LINES)
    day2 = write(logs / "day2.log", DAY2_LINES)
    midnight = write(tmp / "late" / "midnight.log", MIDNIGHT_LINES)
    inc = tmp / "inc"
    s = {"tmp": tmp, "inc": inc}
    s["r1"] = job(spark, [day1], inc)
    s["after_r1"], s["snap_r1"] = files_of(inc), snapshot(spark, inc)
    s["r2"] = job(spark, [day1], inc)                       # the same file again
    s["after_r2"] = files_of(inc)
    s["r3"] = job(spark, [logs], inc)                       # the directory: day1 and day2
    s["snap_r3"] = snapshot(spark, inc)
    s["r4"] = job(spark, [midnight], inc)                   # spans the end of day one
    s["snap_r4"], s["after_r4"] = snapshot(spark, inc), files_of(inc)
    s["r5"] = job(spark, [midnight], inc)                   # and again
    s["snap_r5"], s["after_r5"] = snapshot(spark, inc), files_of(inc)
    s["two"] = job(spark, [day1, day2], tmp / "two")
    s["snap_two"] = snapshot(spark, tmp / "two")
    s["all"] = job(spark, [logs, midnight], tmp / "all", csv=True)
    s["snap_all"] = snapshot(spark, tmp / "all")
    return s


def test_two_runs_over_two_days_equal_one_run_over_both(story):
    assert story["snap_r3"] == story["snap_two"]
    days = {d for f in story["snap_two"]["files"] for d in f[2]}
    assert days == {DAY1, DAY2}


def test_rerunning_a_file_already_read_changes_nothing(story):
    r2 = story["r2"]
    assert r2["files_read"] == [] and names(r2["files_skipped"]) == ["day1.log"]
    assert r2["days"] == []
    assert story["after_r2"] == story["after_r1"]


def test_the_second_run_reads_only_the_new_file(story):
    r3 = story["r3"]
    assert names(r3["files_read"]) == ["day2.log"]
    assert names(r3["files_skipped"]) == ["day1.log"]
    assert r3["days"] == [DAY2]
    assert "read: " in r3["printed"] and "day2.log" in r3["printed"]
    assert r3["lines"] == len(DAY2_LINES)  # what it parsed is that file alone


def test_a_file_spanning_midnight_adds_to_both_days_and_rerunning_keeps_them_whole(story, spark):
    from pyspark.sql import functions as F

    from sbus.analytics import read_table

    r4, r5 = story["r4"], story["r5"]
    assert names(r4["files_read"]) == ["midnight.log"] and r4["days"] == [DAY1, DAY2]
    assert r5["files_read"] == [] and r5["days"] == []
    assert story["after_r5"] == story["after_r4"]
    # Each day is the aggregate of every file that covers it ...
    assert story["snap_r4"] == story["snap_all"]
    # ... checked against the lines themselves.
    got = Counter()
    for r in read_table(spark, str(story["inc"]), "events").select(
            F.date_format("date", "yyyy-MM-dd").alias("d"), "event", "records").collect():
        got[(r["d"], r["event"])] += r["records"]
    want = events_per_day(LINES, DAY2_LINES, MIDNIGHT_LINES)
    assert {d for d, _ in want} == {DAY1, DAY2}
    assert got == want


def test_merged_view_over_days_is_the_whole_log(story, spark):
    """Across days, a connection that spans midnight is one row with its final counters."""
    from sbus.analytics import read_table

    inc = str(story["inc"])
    per_day = read_table(spark, inc, "client_traffic").collect()
    merged = {(r["broker_pid"], r["client"]): r for r in
              read_table(spark, inc, "client_traffic", merged=True).collect()}
    assert len(per_day) > len(merged)  # some connections were seen on both days
    spanning = {(r["broker_pid"], r["client"]) for r in per_day if r["broker_pid"] == 400}
    assert spanning
    midnight = [json.loads(ln) for ln in MIDNIGHT_LINES]
    for key in spanning:
        final = [r for r in midnight if r["event"] == "client_disconnect"
                 and (r["broker_pid"], r["client"]) == key]
        if final:
            assert merged[key]["counters_from"] == "disconnect"
            assert merged[key]["msgs_in"] == final[-1]["counters"]["msgs_in"]
    # The hand-made day-one log alone, merged, is what test_analytics expects of it.
    want = expected_client_counters()
    day1_only = {k: v for k, v in merged.items() if k[0] in (100, 200)}
    assert set(day1_only) == set(want)
    for key, (src, counters, _) in want.items():
        assert day1_only[key]["counters_from"] == src
        assert day1_only[key]["msgs_in"] == (counters["msgs_in"] if counters else None)


def test_csv_only_when_asked(story):
    assert not (story["inc"] / "csv").exists()
    csv_days = sorted(p.name for p in (story["tmp"] / "all" / "csv" / "events").glob("date=*"))
    assert csv_days == [f"date={DAY1}", f"date={DAY2}"]


def test_a_growing_log_replaces_what_was_read_of_it(spark, tmp_path):
    """Read at noon and again at night, the live log counts once, in full."""
    live = tmp_path / "logs" / "sbusd.log"
    half = len(DAY2_LINES) // 2
    write(live, DAY2_LINES[:half])
    first = job(spark, [live], tmp_path / "inc")
    write(live, DAY2_LINES)
    second = job(spark, [live], tmp_path / "inc")
    assert names(second["files_read"]) == ["sbusd.log"]
    assert names(second["files_replaced"]) == ["sbusd.log"]
    assert first["lines"] == half and second["lines"] == len(DAY2_LINES)
    # Then rotated and compressed: the same content, already read.
    with gzip.open(live.with_name("sbusd.log.1.gz"), "wt") as f:
        f.write("\n".join(DAY2_LINES) + "\n")
    live.unlink()
    third = job(spark, [live.parent], tmp_path / "inc")
    assert third["files_read"] == [] and names(third["files_skipped"]) == ["sbusd.log.1.gz"]
    job(spark, [live.with_name("sbusd.log.1.gz")], tmp_path / "whole")
    got, want = snapshot(spark, tmp_path / "inc"), snapshot(spark, tmp_path / "whole")
    assert [f[1:] for f in got["files"] if f[-1] is None] == [f[1:] for f in want["files"]]
    for name in want:
        if name != "files":
            assert got[name] == want[name], name
