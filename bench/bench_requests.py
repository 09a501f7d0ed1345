#!/usr/bin/env python3
"""Request/reply round trips: ``Client.request``/``Client.serve`` through sbusd against
nats-py's ``request`` through nats-server, in the same run.

    bench/bench_requests.py [--count N] [--payload BYTES] [--askers N] [--repeat N]
                            [--quick] [--json PATH]

Rows (round trips/s over all askers, first request sent to last reply received;
p50/p99 of one request's round trip, in microseconds):

- ``rr_sbus_1``: one blocking asker (``sbus.Client.request``), one request at a
  time, to one blocking server (``sbus.Client.serve``) echoing the body;
- ``rr_sbus_N``: N such askers at once, each its own process, one server;
- ``rr_nats_1`` and ``rr_nats_N``: the same with nats-py (``await nc.request``)
  and a nats-py server answering with ``msg.respond``.

Every reply is checked against its request. Every process is its own
(``--worker``). Prints a table on stdout, progress on stderr, and writes JSON
(default bench/results/requests-<UTC>.json). Nothing here asserts on speed.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import BENCH, NatsServer, Sbusd, alternate, end_process, results_path

KEY = "bench/echo"
SUBJECT = "bench.echo"
TIMEOUT = 30.0


def say(*args):
    print(*args, file=sys.stderr, flush=True)


def body(seq: int, payload: int) -> bytes:
    return b"%020d" % seq + b"x" * max(0, payload - 20)


def summary(times_ns, wrong, first_ns, last_ns):
    return {"requests": len(times_ns), "wrong": wrong, "first_ns": first_ns, "last_ns": last_ns,
            "times_ns": times_ns}


# -- workers (each in its own process) ------------------------------------------------

def sbus_server(address):
    from sbus import Client
    with Client(address) as bus:
        bus.subscribe(KEY)
        bus.whoami(timeout=TIMEOUT)
        print("ready", flush=True)
        bus.serve(KEY, lambda request: request.payload)
    return {}


def sbus_asker(address, count, payload):
    from sbus import Client
    times, wrong = [], 0
    with Client(address) as bus:
        bus.request(KEY, b"warm", TIMEOUT)    # the reply inbox is made before the clock starts
        print("ready", flush=True)
        sys.stdin.readline()
        first = time.monotonic_ns()
        for i in range(count):
            sent = time.perf_counter_ns()
            reply = bus.request(KEY, body(i, payload), TIMEOUT)
            times.append(time.perf_counter_ns() - sent)
            wrong += reply != body(i, payload)
        return summary(times, wrong, first, time.monotonic_ns())


async def _nats_server(url):
    import nats
    nc = await nats.connect(url)

    async def on_msg(msg):
        await msg.respond(msg.data)

    await nc.subscribe(SUBJECT, cb=on_msg)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await nc.close()
    return {}


async def _nats_asker(url, count, payload):
    import nats
    nc = await nats.connect(url)
    await nc.request(SUBJECT, b"warm", timeout=TIMEOUT)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    times, wrong = [], 0
    first = time.monotonic_ns()
    for i in range(count):
        sent = time.perf_counter_ns()
        msg = await nc.request(SUBJECT, body(i, payload), timeout=TIMEOUT)
        times.append(time.perf_counter_ns() - sent)
        wrong += msg.data != body(i, payload)
    last = time.monotonic_ns()
    await nc.close()
    return summary(times, wrong, first, last)


def worker(args):
    if args.worker == "sbus_server":
        out = sbus_server(args.address)
    elif args.worker == "sbus_asker":
        out = sbus_asker(args.address, args.count, args.payload)
    elif args.worker == "nats_server":
        out = asyncio.run(_nats_server(args.address))
    else:
        out = asyncio.run(_nats_asker(args.address, args.count, args.payload))
    print(json.dumps(out), flush=True)


# -- the run ----------------------------------------------------------------------------

def spawn(args, kind, address, procs):
    argv = [sys.executable, __file__, "--worker", kind, "--address", address,
            "--count", str(args.count), "--payload", str(args.payload)]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(p)
    line = p.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"bench_requests: a {kind} did not start: {line!r}")
    return p


def report(p, timeout):
    out, _ = p.communicate(timeout=timeout)
    if p.returncode:
        raise SystemExit(f"bench_requests: a worker failed ({p.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def row(name, results):
    times = sorted(t for r in results for t in r["times_ns"])
    seconds = (max(r["last_ns"] for r in results) - min(r["first_ns"] for r in results)) / 1e9
    return {"row": name, "requests": len(times), "wrong": sum(r["wrong"] for r in results),
            "seconds": seconds, "per_s": len(times) / seconds,
            "p50_us": times[len(times) // 2] / 1e3,
            "p99_us": times[min(len(times) - 1, len(times) * 99 // 100)] / 1e3}


def measure(args, name, address, server_kind, asker_kind, askers):
    procs = []
    try:
        server = spawn(args, server_kind, address, procs)
        started = [spawn(args, asker_kind, address, procs) for _ in range(askers)]
        for p in started:
            p.stdin.write("go\n")
            p.stdin.flush()
        result = row(name, [report(p, 600) for p in started])
        server.stdin.close()
        return result
    finally:
        for p in reversed(procs):
            end_process(p)


def run_sbus(args, work, askers):
    broker = Sbusd(work, ["-f", "-a", str(work / "sbus.socket")],
                   address=str(work / "sbus.socket"), log_level="warning").ready()
    try:
        return measure(args, f"rr_sbus_{askers}", broker.address, "sbus_server", "sbus_asker",
                       askers)
    finally:
        broker.stop()


def run_nats(args, work, askers):
    server = NatsServer(work)
    try:
        return measure(args, f"rr_nats_{askers}", server.url, "nats_server", "nats_asker",
                       askers)
    finally:
        server.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=20_000,
                    help="requests per asker (default 20000)")
    ap.add_argument("--payload", type=int, default=64, help="bytes per request (default 64)")
    ap.add_argument("--askers", type=int, default=8, help="askers at once (default 8)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each row (default 3)")
    ap.add_argument("--quick", action="store_true", help="one short run of each: 500 requests")
    ap.add_argument("--json", metavar="PATH", help="where to write the results")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.count, args.repeat = 500, 1
    rows = {f"rr_{bus}_{n}": (run, n) for n in (1, args.askers)
            for bus, run in (("sbus", run_sbus), ("nats", run_nats))}
    started = dict.fromkeys(rows, 0)

    def run_one(name):
        run, askers = rows[name]
        started[name] += 1
        with tempfile.TemporaryDirectory(prefix="bench-requests-") as work:
            say(f"{name} run {started[name]}/{args.repeat}: {askers} x {args.count} requests")
            return run(args, Path(work), askers)

    series = alternate(rows, args.repeat, run_one)
    runs = {name: s.runs for name, s in series.items()}
    print(f"{'row':<12} {'round trips/s':>14} {'p50 us':>8} {'p99 us':>8} {'wrong':>6}  (medians)")
    medians = {}
    for name, rs in runs.items():
        medians[name] = {k: series[name].median(k) for k in ("per_s", "p50_us", "p99_us")}
        m = medians[name]
        print(f"{name:<12} {m['per_s']:>14,.0f} {m['p50_us']:>8.0f} {m['p99_us']:>8.0f} "
              f"{sum(r['wrong'] for r in rs):>6}")
    for n in (1, args.askers):
        print(f"sbus / NATS, {n} asker(s): "
              f"{medians[f'rr_sbus_{n}']['per_s'] / medians[f'rr_nats_{n}']['per_s']:.2f}x")
    now = dt.datetime.now(dt.timezone.utc)
    path = Path(args.json) if args.json else results_path("requests", now)
    path.parent.mkdir(parents=True, exist_ok=True)
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=BENCH).stdout.strip()
    for rs in runs.values():
        for r in rs:
            r.pop("times_ns", None)
    path.write_text(json.dumps({"time": now.strftime("%Y%m%dT%H%M%SZ"), "commit": rev,
                                "cores": os.cpu_count(),
                                "settings": {k: getattr(args, k) for k in
                                             ("count", "payload", "askers", "repeat")},
                                "runs": runs, "medians": medians}, indent=2))
    say(f"results: {path}")


if __name__ == "__main__":
    sys.exit(main())
