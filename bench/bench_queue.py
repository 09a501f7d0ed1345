#!/usr/bin/env python3
"""Shared-queue throughput: `sbus queue` with 4 consumers against a NATS queue group
of 4 nats-py subscribers, in the same run.

    bench/bench_queue.py [--count N] [--payload BYTES] [--consumers N] [--prefetch K]
                         [--repeat N] [--quick] [--json PATH]

Rows (jobs/s, first job received to last job done, over all consumers):

- ``queue_sbus``: one publisher (``Client.produce``: many jobs to a packet;
  ``--single``: ``publish_many``, a packet per job) -> sbusd -> ``sbus queue``
  -> N consumers (``sbus.client.consume``), each job acknowledged;
- ``queue_nats``: one nats-py publisher -> nats-server -> N nats-py subscribers
  in one queue group.

Both rows deliver the same jobs (count and payload size) to the same number
of consumers, each doing the same work per job (read its sequence number,
add it up). They do not give the same guarantees: a NATS core queue group
has no acknowledgements, no redelivery of the jobs of a consumer that dies,
and no flow control (a subscriber's backlog grows without bound; here its
pending limits are off). The sbus consumers acknowledge every job (acks
held and sent together), the service holds each job until then, gives a
consumer at most its prefetch, and watches leases and ack deadlines.

Each job's payload carries its sequence number; the row checks that the
consumers together got every job exactly once (count and sum of sequence
numbers). The rows alternate, ``--repeat`` times each, so drift on the
machine hits both alike; the table shows medians. Besides the rate, each
run measures the CPU time per job of every process: the servers' (sbusd and
``sbus queue``; nats-server) from /proc, the consumers' and the publisher's
from getrusage, from the start of the publisher to the last consumer's end.
On a shared machine the CPU per job is the steadier figure. Every process is
its own (``--worker``). Prints a table on stdout, progress on stderr, and
writes JSON (default bench/results/queue-<UTC>.json). Nothing here asserts
on speed.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import BENCH, NatsServer, Sbusd, Series, alternate, end_process, results_path, thread_cpu_seconds

from support import QueueService

PATTERN = "bench/"
KEY = "bench/job"
SUBJECT = "bench.job"
GROUP = "workers"
STOP = b"stop"
QUIET = 2.0         # a NATS subscriber stops after this long without a job


def say(*args):
    print(*args, file=sys.stderr, flush=True)


def job(seq: int, payload: int) -> bytes:
    return b"%020d" % seq + b"x" * max(0, payload - 20)


def cpu_now() -> float:
    """User + system CPU seconds of this process, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- workers (each in its own process) ------------------------------------------------

def sbus_consumer(address, prefetch):
    """Jobs until a STOP job; count, sum of sequence numbers, first and last time."""
    from sbus import Client
    from sbus.client.consume import consume
    got = total = 0
    first = last = None
    with Client(address) as bus:
        print("ready", flush=True)
        cpu = cpu_now()
        for j in consume(bus, PATTERN, prefetch):
            if j.payload == STOP:
                j.ack()
                break
            now = time.monotonic_ns()
            first = first or now
            last = now
            got += 1
            total += int(j.payload[:20])
            j.ack()
    return {"received": got, "sum": total, "first_ns": first, "last_ns": last,
            "cpu_s": cpu_now() - cpu}


def sbus_publisher(address, count, payload, consumers, single):
    from sbus import Client
    cpu = cpu_now()
    with Client(address) as bus:
        for start in range(0, count, 1000):
            jobs = [job(i, payload) for i in range(start, min(count, start + 1000))]
            if single:
                bus.publish_many([(KEY, j) for j in jobs])
            else:
                bus.produce(KEY, jobs)
        bus.publish_many([(KEY, STOP)] * consumers)
        bus.whoami(timeout=60)
    return {"sent": count, "cpu_s": cpu_now() - cpu}


async def _nats_consumer(url):
    import nats
    nc = await nats.connect(url)
    state = {"got": 0, "sum": 0, "first": None, "last": None}

    async def on_msg(msg):
        now = time.monotonic_ns()
        state["first"] = state["first"] or now
        state["last"] = now
        state["got"] += 1
        state["sum"] += int(msg.data[:20])

    await nc.subscribe(SUBJECT, queue=GROUP, cb=on_msg, pending_msgs_limit=-1,
                       pending_bytes_limit=-1)
    await nc.flush()
    print("ready", flush=True)
    cpu = cpu_now()
    seen = -1
    while seen != state["got"] or not seen:     # until quiet after traffic
        seen = state["got"]
        await asyncio.sleep(QUIET)
    await nc.close()
    return {"received": state["got"], "sum": state["sum"], "first_ns": state["first"],
            "last_ns": state["last"], "cpu_s": cpu_now() - cpu}


async def _nats_publisher(url, count, payload):
    import nats
    cpu = cpu_now()
    nc = await nats.connect(url, pending_size=8 << 20)
    for i in range(count):
        await nc.publish(SUBJECT, job(i, payload))
    await nc.flush(timeout=60)
    await nc.close()
    return {"sent": count, "cpu_s": cpu_now() - cpu}


def worker(args):
    if args.worker == "sbus_consumer":
        out = sbus_consumer(args.address, args.prefetch)
    elif args.worker == "sbus_publisher":
        out = sbus_publisher(args.address, args.count, args.payload, args.consumers, args.single)
    elif args.worker == "nats_consumer":
        out = asyncio.run(_nats_consumer(args.address))
    else:
        out = asyncio.run(_nats_publisher(args.address, args.count, args.payload))
    print(json.dumps(out), flush=True)


# -- the run ----------------------------------------------------------------------------

def spawn(args, kind, address, procs, **more):
    argv = [sys.executable, __file__, "--worker", kind, "--address", address,
            "--count", str(args.count), "--payload", str(args.payload),
            "--consumers", str(args.consumers), "--prefetch", str(args.prefetch)]
    if args.single:
        argv.append("--single")
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **more)
    procs.append(p)
    return p


def wait_ready(p):
    line = p.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"bench_queue: a worker did not start: {line!r}")


def report(p, timeout):
    out, _ = p.communicate(timeout=timeout)
    if p.returncode:
        raise SystemExit(f"bench_queue: a worker failed ({p.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def row(name, args, results, publisher, servers_cpu):
    got = sum(r["received"] for r in results)
    total = sum(r["sum"] for r in results)
    first = min(r["first_ns"] for r in results if r["first_ns"])
    last = max(r["last_ns"] for r in results if r["last_ns"])
    seconds = (last - first) / 1e9
    exact = got == args.count and total == args.count * (args.count - 1) // 2
    per_job = 1e6 / args.count
    servers = sum(servers_cpu.values())
    consumers = sum(r["cpu_s"] for r in results)
    return {"row": name, "jobs": got, "exactly_once": exact,
            "per_consumer": [r["received"] for r in results],
            "seconds": seconds, "jobs_per_s": got / seconds if seconds > 0 else None,
            "cpu_us_per_job": {**{k: v * per_job for k, v in servers_cpu.items()},
                               "servers": servers * per_job,
                               "consumers": consumers * per_job,
                               "publisher": publisher["cpu_s"] * per_job,
                               "total": (servers + consumers + publisher["cpu_s"]) * per_job}}


def run_sbus(args, work):
    procs = []
    broker = Sbusd(work, ["-f", "-a", str(work / "sbus.socket")], address=str(work / "sbus.socket"),
                   log_level="warning").ready()
    service = None
    try:
        service = QueueService.start(work, broker.address, PATTERN, "--prefetch", str(args.prefetch),
                                     "--max-held", str(args.count + args.consumers))
        consumers = [spawn(args, "sbus_consumer", broker.address, procs)
                     for _ in range(args.consumers)]
        for c in consumers:
            wait_ready(c)
        time.sleep(0.5)     # their hellos are in
        servers = {"sbusd": broker.pid, "queue": service.pid}
        cpu = {k: thread_cpu_seconds(pid) for k, pid in servers.items()}
        publisher = spawn(args, "sbus_publisher", broker.address, procs)
        sent = report(publisher, 600)
        results = [report(c, 600) for c in consumers]
        cpu = {k: thread_cpu_seconds(pid) - cpu[k] for k, pid in servers.items()}
        return row("queue_sbus", args, results, sent, cpu)
    finally:
        for p in reversed(procs):
            end_process(p)
        if service is not None:
            service.stop()
        broker.stop()


def run_nats(args, work):
    procs = []
    server = NatsServer(work)
    try:
        consumers = [spawn(args, "nats_consumer", server.url, procs) for _ in range(args.consumers)]
        for c in consumers:
            wait_ready(c)
        cpu = thread_cpu_seconds(server.proc.pid)
        publisher = spawn(args, "nats_publisher", server.url, procs)
        sent = report(publisher, 600)
        results = [report(c, 600) for c in consumers]
        cpu = {"nats-server": thread_cpu_seconds(server.proc.pid) - cpu}
        return row("queue_nats", args, results, sent, cpu)
    finally:
        for p in reversed(procs):
            end_process(p)
        server.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200_000, help="jobs per run (default 200000)")
    ap.add_argument("--payload", type=int, default=64, help="bytes per job (default 64)")
    ap.add_argument("--consumers", type=int, default=4, help="consumers (default 4)")
    ap.add_argument("--prefetch", type=int, default=256,
                    help="sbus queue --prefetch and the consumers' (default 256)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each row (default 3)")
    ap.add_argument("--single", action="store_true",
                    help="the sbus publisher sends a packet per job (publish_many), not "
                         "producer's batches (Client.produce)")
    ap.add_argument("--quick", action="store_true", help="one short run of each: 5000 jobs")
    ap.add_argument("--json", metavar="PATH", help="where to write the results")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.count, args.repeat = 5000, 1
    rows = {"queue_sbus": run_sbus, "queue_nats": run_nats}
    started = dict.fromkeys(rows, 0)

    def run_one(name):
        started[name] += 1
        with tempfile.TemporaryDirectory(prefix="bench-queue-") as work:
            say(f"{name} run {started[name]}/{args.repeat}: {args.count} jobs, "
                f"{args.consumers} consumers")
            return rows[name](args, Path(work))

    series = alternate(rows, args.repeat, run_one)
    runs = {name: s.runs for name, s in series.items()}
    print(f"{'row':<12} {'jobs/s (median)':>16} {'exactly once':>13}  per consumer (last run)")
    medians, cpu = {}, {}
    for name, s in series.items():
        rs = s.runs
        # a run that moved no job has no rate
        medians[name] = Series([r for r in rs if r["jobs_per_s"]]).median("jobs_per_s")
        shown = f"{medians[name]:,.0f}" if medians[name] else "-"
        print(f"{name:<12} {shown:>16} {str(all(r['exactly_once'] for r in rs)):>13}  "
              f"{rs[-1]['per_consumer']}")
        cpu[name] = s.medians("cpu_us_per_job")
        print("    CPU µs/job (median): " + ", ".join(f"{k} {v:.2f}" for k, v in cpu[name].items()))
    if medians["queue_sbus"] and medians["queue_nats"]:
        print(f"sbus / NATS: {medians['queue_sbus'] / medians['queue_nats']:.2f}x the jobs/s, "
              f"{cpu['queue_sbus']['total'] / cpu['queue_nats']['total']:.2f}x the CPU per job")
    print("note: the NATS queue group acknowledges nothing and redelivers nothing; every sbus "
          "job is acknowledged, held until then, and given out within each consumer's prefetch")
    now = dt.datetime.now(dt.timezone.utc)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    path = Path(args.json) if args.json else results_path("queue", now)
    path.parent.mkdir(parents=True, exist_ok=True)
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=BENCH).stdout.strip()
    path.write_text(json.dumps({"time": stamp, "commit": rev, "cores": os.cpu_count(),
                                "settings": {k: getattr(args, k) for k in
                                             ("count", "payload", "consumers", "prefetch",
                                              "repeat", "single")},
                                "runs": runs, "medians": medians, "cpu_us_per_job": cpu},
                               indent=2))
    say(f"results: {path}")


if __name__ == "__main__":
    sys.exit(main())
