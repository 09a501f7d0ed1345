#!/usr/bin/env python3
"""How long the analytics job takes on a large synthetic log, against a baseline.

    bench/bench_analytics.py [--lines 1000000] [--master local[2]] [--quick]
                             [--rounds 4] [--no-fresh]

Generates a synthetic log with tools/gen_synthetic_log.py (cached under
$SBUS_BENCH_CACHE, default /tmp/sbus-bench, keyed by size, seed and the
generator's source), runs the job on it into a fresh dataset, checks the
per-event counts it wrote against the generator's own, and measures the
baseline: read the file, parse every line with the declared schema, count
the rows -- the least a job that reads the lines as text does (the JSON
source's parse, below, is faster).  Prints one JSON line,
a human summary on stderr, and writes the JSON to
bench/results/analytics-<UTC time>.json.

``seconds`` is the job's wall time (list and checksum the input, read and
parse it once, write what the dataset keeps of it and the day tables, update
the manifest), ``baseline_s`` the baseline's, ``ratio`` their quotient (the
target is at most 2); ``rerun_s`` is a run over the same file again, which
must find nothing new.  ``jvm_cpu_s`` is the CPU the JVM used for the job
and ``load_avg`` the machine's 1-minute load before and after: on a shared
machine the wall times stretch, the CPU time less so.  ``job_jit_s`` and
``baseline_jit_s`` (per round, and ``*_fresh_jit_s`` in new JVMs) are the
seconds HotSpot's JIT compilers spent meanwhile, summed over their threads,
which share the cores with the work: much of a short run's cost.

Both are timed in the same state, in one session: ``--rounds`` rounds of
baseline then job (each job into a new dataset).  The first round is the
cold one (``baseline_cold_s``, ``job_cold_s``, ``cold_ratio``: the job's
first run finds the parser's code compiled by the baseline's); the headline
figures are the medians of the other rounds, when the JVM has compiled what
both run (``baseline_s``, ``seconds``, ``cpu_ratio`` from the CPU seconds,
which a busy machine distorts less); every round is listed in ``job_runs_s``
and ``baseline_runs_s``.  Unless ``--no-fresh``, each also runs once alone
in a new JVM, as two spark-submit runs would (``baseline_fresh_s``,
``job_fresh_s``, ``fresh_ratio``; start-up not counted).  ``baseline_json_s``
is the same parse through Spark's JSON source, which reads the bytes without
a text column first and is faster, but drops blank lines without a trace
(the job counts them): what the job's own pass could come closer to.  The session's
start-up is reported apart as ``session_start_s``.  The input is left
uncompressed: a .gz file cannot be split, so it would be parsed by one core
whatever the master.
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
from typing import NamedTuple

from harness import ROOT, cpu_seconds, results_path

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


def run(lines: int = 1_000_000, master: str = "local[2]", seed: int = SEED,
        rounds: int = 4, fresh: bool = True) -> dict:
    """Time the job and the baseline on a ``lines``-line log; return (and save) the figures."""
    from sbus.analytics import job

    log, info = cached_log(lines, seed)
    out = tempfile.mkdtemp(prefix="sbus-analytics-bench-")
    load_before = os.getloadavg()[0]
    try:
        t0 = time.perf_counter()
        spark, jvm = _session(master)
        t1 = time.perf_counter()
        base_runs, job_runs, json_runs = [], [], []
        for i in range(rounds):
            base_runs.append(_timed(jvm, lambda: _baseline(spark, log)))
            json_runs.append(_timed(jvm, lambda: _json_baseline(spark, log)))
            dataset = os.path.join(out, f"run{i}")
            job_runs.append(_timed(jvm, lambda: job.run(
                spark, [str(log)], dataset, show=0, echo=lambda _: None)))
        summary = job_runs[-1].result
        started = time.perf_counter()
        rerun = job.run(spark, [str(log)], dataset, show=0, echo=lambda _: None)
        rerun_s = time.perf_counter() - started
        counted = {}
        for r in job.read_table(spark, dataset, "events").collect():
            counted[r["event"]] = counted.get(r["event"], 0) + r["records"]
        spark.stop()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    warm_job, warm_base = job_runs[1:], base_runs[1:]
    seconds, cpu = _median(r.seconds for r in warm_job), _median(r.cpu for r in warm_job)
    baseline_s, baseline_cpu = _median(r.seconds for r in warm_base), _median(r.cpu for r in warm_base)
    result = {
        "lines": summary["lines"],
        "seconds": round(seconds, 2),
        "lines_per_s": round(summary["lines"] / seconds),
        "baseline_s": round(baseline_s, 2),
        "ratio": round(seconds / baseline_s, 2),
        "baseline_json_s": round(_median(r.seconds for r in json_runs[1:]), 2),
        "cpu_ratio": round(cpu / baseline_cpu, 2),
        "job_runs_s": [round(r.seconds, 2) for r in job_runs],
        "baseline_runs_s": [round(r.seconds, 2) for r in base_runs],
        "job_jit_s": [round(r.jit, 2) for r in job_runs],
        "baseline_jit_s": [round(r.jit, 2) for r in base_runs],
        "baseline_cold_s": round(base_runs[0].seconds, 2),
        "job_cold_s": round(job_runs[0].seconds, 2),
        "cold_ratio": round(job_runs[0].seconds / base_runs[0].seconds, 2),
        "baseline_jvm_cpu_s": round(baseline_cpu, 2),
        "rerun_s": round(rerun_s, 2),
        "session_start_s": round(t1 - t0, 2),
        # CPU the JVM used for the job: unlike `seconds`, not inflated when
        # other processes compete for the cores.
        "jvm_cpu_s": round(cpu, 2),
        "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "malformed": summary["malformed"],
        "log_mb": round(log.stat().st_size / 1e6, 1),
        "checked": (counted == info["events"] and summary["malformed"] == info["malformed"]
                    and all(r.result > 0 for r in base_runs) and rerun["files_read"] == []),
        "master": master,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "commit": _commit(),
        "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if fresh:
        # Each alone in a new JVM, as two spark-submit runs would be.
        base_fresh, job_fresh = _fresh("baseline", lines, master), _fresh("job", lines, master)
        result.update(baseline_fresh_s=base_fresh["seconds"], job_fresh_s=job_fresh["seconds"],
                      fresh_ratio=round(job_fresh["seconds"] / base_fresh["seconds"], 2),
                      baseline_fresh_jit_s=base_fresh["jit_s"], job_fresh_jit_s=job_fresh["jit_s"])
    if "generate_s" in info:
        result["generate_s"] = info["generate_s"]
    when = dt.datetime.strptime(result["when"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    results_path("analytics", when).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _session(master: str):
    from sbus.analytics import job

    spark = job.spark_session(master, app_name="sbus-bench", conf={
        "spark.ui.enabled": "false",
        "spark.driver.memory": "3g",
    })
    spark.sparkContext.setLogLevel("ERROR")
    return spark, _Jvm(spark)


class _Jvm:
    """The session's JVM: the CPU it has used and the time its JIT compilers have spent."""

    def __init__(self, spark):
        jvm = spark.sparkContext._jvm
        self.pid = jvm.java.lang.ProcessHandle.current().pid()
        self._compiler = jvm.java.lang.management.ManagementFactory.getCompilationMXBean()

    def cpu_s(self) -> float:
        return cpu_seconds(self.pid)

    def jit_s(self) -> float:
        # Summed over the compiler threads, which share the cores with the job.
        return self._compiler.getTotalCompilationTime() / 1000


def _baseline(spark, log: Path) -> int:
    """Read the log, parse every line with the declared schema, count the rows."""
    from pyspark.sql import functions as F

    from sbus.analytics.schema import CORRUPT_COLUMN, record_schema

    options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT_COLUMN}
    return (
        spark.read.text(str(log))
        .select(F.from_json("value", record_schema(corrupt_column=True), options).alias("r"))
        .where(F.col("r").isNotNull())  # the whole record: no field can be pruned
        .count())


def _json_baseline(spark, log: Path) -> int:
    """The same through Spark's JSON source, which parses the file's bytes
    without a text column first (but skips blank lines without a trace)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from sbus.analytics.schema import CORRUPT_COLUMN, record_schema

    schema = record_schema(corrupt_column=True)
    df = (spark.read.schema(schema).option("mode", "PERMISSIVE")
          .option("columnNameOfCorruptRecord", CORRUPT_COLUMN).json(str(log)))
    # A condition on every field, so that none is pruned from the parse
    # (Spark refuses to hash maps: their sizes stand in for them).
    maps = [f.name for f in schema.fields if isinstance(f.dataType, T.MapType)]
    every = F.hash(*[c for c in schema.fieldNames() if c not in maps]) + sum(
        (F.size(m) for m in maps), F.lit(0))
    return df.where(every != 7).count()


class Timed(NamedTuple):
    seconds: float  # wall
    cpu: float  # the JVM's CPU seconds
    jit: float  # seconds of JIT compiling in the JVM
    result: object


def _timed(jvm: _Jvm, fn) -> Timed:
    """``fn()``'s result and what it cost."""
    started, cpu, jit = time.perf_counter(), jvm.cpu_s(), jvm.jit_s()
    result = fn()
    return Timed(time.perf_counter() - started, jvm.cpu_s() - cpu, jvm.jit_s() - jit, result)


def _median(values) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _fresh(what: str, lines: int, master: str) -> dict:
    """Seconds (and JIT seconds) of one first run of ``what`` in a new JVM (its start-up not counted)."""
    r = subprocess.run([sys.executable, __file__, "--one", what, "--lines", str(lines),
                        "--master", master], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.splitlines()[-1])


def _one(what: str, lines: int, master: str) -> dict:
    from sbus.analytics import job

    log, _ = cached_log(lines)
    spark, jvm = _session(master)
    with tempfile.TemporaryDirectory(prefix="sbus-analytics-bench-") as out:
        if what == "baseline":
            timed = _timed(jvm, lambda: _baseline(spark, log))
        else:
            timed = _timed(jvm, lambda: job.run(spark, [str(log)], out, show=0,
                                                echo=lambda _: None))
    spark.stop()
    return {"what": what, "seconds": round(timed.seconds, 2), "jit_s": round(timed.jit, 2)}


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
    p.add_argument("--rounds", type=int, default=4, help="rounds of baseline then job (>= 2)")
    p.add_argument("--no-fresh", action="store_true", help="skip the runs in new JVMs")
    p.add_argument("--one", choices=("baseline", "job"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    lines = 100_000 if a.quick else a.lines
    if a.one:
        print(json.dumps(_one(a.one, lines, a.master)))
        return 0
    if a.rounds < 2:
        p.error("--rounds must be at least 2: the first round is the cold one")
    result = run(lines, a.master, rounds=a.rounds, fresh=not a.no_fresh)
    fresh = (f"; in new JVMs: job {result['job_fresh_s']} s, baseline "
             f"{result['baseline_fresh_s']} s, ratio {result['fresh_ratio']} (JIT compiling "
             f"{result['job_fresh_jit_s']} s against {result['baseline_fresh_jit_s']} s)"
             if "fresh_ratio" in result else "")
    print(f"analytics job: {result['lines']} lines in {result['seconds']} s on {a.master} "
          f"({result['lines_per_s']} lines/s, {result['jvm_cpu_s']} s of JVM CPU); "
          f"baseline (read + parse + count) {result['baseline_s']} s: ratio {result['ratio']} "
          f"(target <= 2), CPU ratio {result['cpu_ratio']} (medians of {a.rounds - 1} warm "
          f"rounds; the JSON source parses in {result['baseline_json_s']} s); "
          f"first round: job {result['job_cold_s']} s, baseline "
          f"{result['baseline_cold_s']} s{fresh}; re-run {result['rerun_s']} s; session start "
          f"{result['session_start_s']} s; load {result['load_avg'][0]} -> "
          f"{result['load_avg'][1]} on {result['cpus']} CPUs",
          file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["checked"] else 1


if __name__ == "__main__":
    sys.exit(main())
