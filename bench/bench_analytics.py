#!/usr/bin/env python3
"""How long the analytics job takes on a large synthetic log, against a baseline.

    bench/bench_analytics.py [--lines 1000000] [--master local[2]] [--quick]

Generates a synthetic log with tools/gen_synthetic_log.py (cached under
$SBUS_BENCH_CACHE, default /tmp/sbus-bench, keyed by size, seed and the
generator's source), runs the job on it into a fresh dataset, checks the
per-event counts it wrote against the generator's own, then measures the
baseline in the same session: read the file, parse every line with the
declared schema, count the rows -- the least any job over this input does.
Prints one JSON line, a human summary on stderr, and writes the JSON to
bench/results/analytics-<UTC time>.json.

``seconds`` is the job's wall time (list and checksum the input, read and
parse it once, write what the dataset keeps of it and the day tables, update
the manifest), ``baseline_s`` the baseline's, ``ratio`` their quotient (the target is at
most 2); ``rerun_s`` is a second run over the same file, which must find
nothing new.  ``jvm_cpu_s`` is the CPU the JVM used for the job and
``load_avg`` the machine's 1-minute load before and after: on a shared
machine the wall times stretch, the CPU time less so.

Both are timed in the same state: each runs twice, in the order baseline,
job (into a scratch dataset), baseline, job, and the figures are the second
runs, when the JVM has compiled the code both share and each query's own
generated code is cached.  ``baseline_s``, ``baseline_jvm_cpu_s`` and
``cpu_ratio`` (CPU seconds, which a busy machine distorts less) compare those;
the first runs are reported as ``baseline_cold_s`` and ``job_cold_s``
(``cold_ratio``): the baseline's first run also compiles the parser's code,
which the job's first run, coming after it, then finds ready.  The session's
start-up is reported apart as ``session_start_s``.  The input
is left uncompressed: a .gz file cannot be split, so it would be parsed by
one core whatever the master.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import gen_synthetic_log  # noqa: E402

SEED = 1


def cached_log(lines: int, seed: int = SEED) -> tuple[Path, dict]:
    """The synthetic log and what the generator says it wrote, generating it if needed."""
    source = Path(gen_synthetic_log.__file__).read_bytes()
    tag = hashlib.sha256(source).hexdigest()[:12]
    cache = Path(os.environ.get("SBUS_BENCH_CACHE", "/tmp/sbus-bench"))
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / f"synthetic-{lines}-s{seed}-{tag}.jsonl"
    meta = log.with_suffix(".meta.json")
    if log.exists() and meta.exists():
        return log, json.loads(meta.read_text())
    tmp = log.with_suffix(".partial")
    started = time.perf_counter()
    info = gen_synthetic_log.generate(tmp, lines, seed=seed, gz=False)
    info["generate_s"] = round(time.perf_counter() - started, 2)
    tmp.rename(log)  # only a complete file is ever found in the cache
    meta.write_text(json.dumps(info))
    return log, info


def run(lines: int = 1_000_000, master: str = "local[2]", seed: int = SEED) -> dict:
    """Run the job and the baseline once on a ``lines``-line log; return (and save) the figures."""
    from pyspark.sql import functions as F

    from sbus.analytics import job
    from sbus.analytics.schema import CORRUPT_COLUMN, record_schema

    log, info = cached_log(lines, seed)
    out = tempfile.mkdtemp(prefix="sbus-analytics-bench-")
    load_before = os.getloadavg()[0]
    try:
        t0 = time.perf_counter()
        spark = job.spark_session(master, app_name="sbus-bench", conf={
            "spark.ui.enabled": "false",
            # The parsed log is cached; 1 GiB (the default) would spill it to disk.
            "spark.driver.memory": "3g",
        })
        spark.sparkContext.setLogLevel("ERROR")
        jvm_pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
        options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT_COLUMN}

        def baseline() -> tuple[float, float, int]:
            started, cpu_started = time.perf_counter(), _cpu_seconds(jvm_pid)
            rows = (
                spark.read.text(str(log))
                .select(F.from_json("value", record_schema(corrupt_column=True), options)
                        .alias("r"))
                .where(F.col("r").isNotNull())  # the whole record: no field can be pruned
                .count())
            return time.perf_counter() - started, _cpu_seconds(jvm_pid) - cpu_started, rows

        t1 = time.perf_counter()
        cold_s, _, _ = baseline()
        started = time.perf_counter()
        job.run(spark, [str(log)], os.path.join(out, "cold"), show=0, echo=lambda _: None)
        job_cold_s = time.perf_counter() - started
        baseline_s, baseline_cpu, baseline_rows = baseline()
        dataset = os.path.join(out, "warm")
        cpu0 = _cpu_seconds(jvm_pid)
        t2 = time.perf_counter()
        summary = job.run(spark, [str(log)], dataset, show=0, echo=lambda _: None)
        t3 = time.perf_counter()
        cpu = _cpu_seconds(jvm_pid) - cpu0
        rerun = job.run(spark, [str(log)], dataset, show=0, echo=lambda _: None)
        t4 = time.perf_counter()
        counted = {}
        for r in job.read_table(spark, dataset, "events").collect():
            counted[r["event"]] = counted.get(r["event"], 0) + r["records"]
        spark.stop()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    seconds = t3 - t2
    result = {
        "lines": summary["lines"],
        "seconds": round(seconds, 2),
        "lines_per_s": round(summary["lines"] / seconds),
        "baseline_s": round(baseline_s, 2),
        "ratio": round(seconds / baseline_s, 2),
        "cpu_ratio": round(cpu / baseline_cpu, 2),
        "baseline_cold_s": round(cold_s, 2),
        "job_cold_s": round(job_cold_s, 2),
        "cold_ratio": round(job_cold_s / cold_s, 2),
        "baseline_jvm_cpu_s": round(baseline_cpu, 2),
        "rerun_s": round(t4 - t3, 2),
        "session_start_s": round(t1 - t0, 2),
        # CPU the JVM used for the job: unlike `seconds`, not inflated when
        # other processes compete for the cores.
        "jvm_cpu_s": round(cpu, 2),
        "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "malformed": summary["malformed"],
        "log_mb": round(log.stat().st_size / 1e6, 1),
        "checked": (counted == info["events"] and summary["malformed"] == info["malformed"]
                    and baseline_rows > 0 and rerun["files_read"] == []),
        "master": master,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "commit": _commit(),
        "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if "generate_s" in info:
        result["generate_s"] = info["generate_s"]
    RESULTS.mkdir(exist_ok=True)
    name = f"analytics-{result['when'].replace(':', '')}.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--quick", action="store_true", help="100,000 lines instead")
    a = p.parse_args(argv)
    result = run(100_000 if a.quick else a.lines, a.master)
    print(f"analytics job: {result['lines']} lines in {result['seconds']} s on {a.master} "
          f"({result['lines_per_s']} lines/s, {result['jvm_cpu_s']} s of JVM CPU); "
          f"baseline (read + parse + count) {result['baseline_s']} s: ratio {result['ratio']} "
          f"(target <= 2), CPU ratio {result['cpu_ratio']}; first runs: job "
          f"{result['job_cold_s']} s, baseline {result['baseline_cold_s']} s; "
          f"re-run {result['rerun_s']} s; session start "
          f"{result['session_start_s']} s; load {result['load_avg'][0]} -> "
          f"{result['load_avg'][1]} on {result['cpus']} CPUs",
          file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["checked"] else 1


if __name__ == "__main__":
    sys.exit(main())
