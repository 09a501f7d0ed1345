#!/usr/bin/env python3
"""Benchmarks sbusd against bench/relay, the raw-relay ceiling, in the same run.

    bench/run.py [WORKLOAD ...] [--quick] [--repeat N] [--duration S] [--payload 64,4096]

Prints one table on stdout (progress goes to stderr) and writes
bench/results/run-<UTC time>.json with the machine, the commit and every raw
figure.  bench/README.md explains how to read the table.
"""
from __future__ import annotations

import argparse
import datetime as dt
import resource
import shlex
import sys
import tempfile
from pathlib import Path

from harness import ROOT, SBUSD, Harness, build, say
from report import table, write_results
from workloads import ALIASES, WORKLOADS, Plan, choose, derived_rows


def parser():
    names = ", ".join(WORKLOADS)
    aliases = "; ".join(f"'{a}' means {' and '.join(ws)}" for a, ws in ALIASES.items())
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                    help=f"any of {names}; {aliases}; default: all")
    ap.add_argument("--quick", action="store_true", help="one short run each, smaller memory test")
    ap.add_argument("--repeat", type=int, help="runs per server, alternated; the median is shown (default 3)")
    ap.add_argument("--duration", type=float, help="seconds per run (default 1.5)")
    ap.add_argument("--payload", default="64,4096", help="payload sizes in bytes (default 64,4096)")
    ap.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    ap.add_argument("--nice", type=int, default=-10,
                    help="niceness of servers and load generator, so other work on the machine "
                         "disturbs them less (default -10; needs root, else ignored)")
    ap.add_argument("--analytics-args", default=None, metavar="ARGS",
                    help="arguments for bench/bench_analytics.py (default: a "
                         "1,000,000-line log on local[2]; with --quick, 100,000 lines)")
    ap.add_argument("--quiet-wait", type=float, default=60.0, metavar="S",
                    help="seconds in all to wait for other processes to leave the CPUs alone (default 60)")
    ap.add_argument("--sbusd", metavar="CMD", help="the broker command to measure (default .venv/bin/sbusd); "
                    "it gets sbusd's arguments: -f -a PATH --log-format json --log-file FILE ...")
    return ap


def main(argv=None):
    ap = parser()
    opts = ap.parse_args(argv)
    try:
        chosen = choose(opts.workloads)
    except KeyError as e:
        ap.error(f"unknown workload {e.args[0]!r}; choose from {', '.join(WORKLOADS)}")
    reps = opts.repeat or (1 if opts.quick else 3)
    duration = opts.duration or (0.5 if opts.quick else 1.5)
    sizes = [int(x) for x in opts.payload.split(",") if x]

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the servers inherit it
    build()
    if not opts.sbusd and not SBUSD.exists():
        say(f"warning: {SBUSD} not found; run `make build`. Only the relay is measured.")

    started = dt.datetime.now(dt.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="sbus-bench-") as tmp:
        harness = Harness(Path(tmp), nice=opts.nice, quiet_budget=opts.quiet_wait)
        if opts.sbusd:
            harness.sbusd_cmd = shlex.split(opts.sbusd)
        plan = Plan(harness, sizes, reps, duration, opts.quick, opts.analytics_args)
        rows = [row for w in chosen for row in w.run(plan)]
    rows += derived_rows(rows)

    print(table(rows))
    if not opts.no_json:
        options = {"workloads": [w.name for w in chosen], "repeat": reps, "duration": duration,
                   "payloads": sizes, "quick": opts.quick, "waited_for_quiet_s": harness.quiet_waited,
                   "nice": opts.nice}
        path = write_results(rows, started, dt.datetime.now(dt.timezone.utc), options, harness.sbusd_cmd)
        print(f"\nresults: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
