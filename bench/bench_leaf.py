#!/usr/bin/env python3
"""A leaf broker against a direct pair, in the same run.

    bench/bench_leaf.py [--count N] [--payload BYTES] [--repeat N] [--quick] [--json PATH]
                        [--sbusd CMD] [--leaf-args ARGS]

Rows (messages/s, first message received to last, and broker CPU per message):

- ``direct``: publisher -> sbusd -> subscriber, both on the one broker;
- ``leaf``: publisher on the upstream -> sbusd -> the leaf's link ->
  leaf sbusd -> subscriber on the leaf (``sbusd --upstream``). Its CPU counts
  the upstream, the leaf and the link process.
- ``leaf up``: the other way, publisher on the leaf, subscriber on the upstream.

The two rows alternate, ``--repeat`` times each; each takes the median. As
programs do it, the publisher sends with ``Client.publish_many`` and the
subscriber reads with ``Client.receive_many`` in ``blocking/hard/block``
mode; it checks it got every message once, in order, and counts what a hop
dropped. Publisher and subscriber are processes of their own (``--worker``).
``--sbusd`` runs another broker build (both brokers; its link is that
build's), ``--leaf-args`` gives the leaf more options (``--upstream-flood
discard``). Prints a table on
stdout and writes JSON (default bench/results/leaf-<UTC>.json). Nothing here
asserts on speed.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import SBUSD, Sbusd, alternate, cpu_seconds, results_path

from sbus import Client

KEY = b"bench/leaf"
IDLE = 2.0      # seconds without a message after which the rest counts as lost
PATTERN = b"bench/"


def subscriber(address: str, count: int) -> None:
    """Subscribe (its broker blocks the publisher rather than drop for it),
    say "ready", then read with ``Client.receive_many`` until the last
    message (or IDLE seconds without one, when the last was lost); print
    rate and losses (a gap in the sequence: a hop upstream dropped under its
    flood control). A message out of order or twice ends it with an error."""
    c = Client(address)
    c.send_cmsg("blocking/hard/block")
    c.subscribe(PATTERN)
    c.whoami()
    print("ready", flush=True)
    expect = received = 0
    first = last = 0.0
    timeout = 30.0
    while expect < count:
        try:
            batch = c.receive_many(64, timeout=timeout)
        except TimeoutError:
            if received:
                break
            raise
        timeout = IDLE
        if received == 0:
            first = time.perf_counter()
        for m in batch:
            seq = int(m.payload[:10])
            if seq < expect:
                raise SystemExit(f"got {seq} after {expect - 1}: out of order or twice")
            expect = seq + 1
            received += 1
        last = time.perf_counter()
    print(json.dumps({"seconds": last - first, "received": received}), flush=True)


def publisher(address: str, count: int, payload: int) -> None:
    """As programs publish in bulk: ``Client.publish_many`` (sendmmsg batches)."""
    pad = b"x" * max(0, payload - 10)
    with Client(address) as c:
        c.publish_many((KEY, b"%010d" % i + pad) for i in range(count))
        c.whoami()


def worker(args) -> int:
    if args.worker == "sub":
        subscriber(args.address, args.count)
    else:
        publisher(args.address, args.count, args.payload)
    return 0


def link_pid(leaf_pid: int) -> int:
    children = Path(f"/proc/{leaf_pid}/task/{leaf_pid}/children").read_text().split()
    return int(children[0])


def one(row: str, up: Sbusd, leaf: Sbusd, count: int, payload: int) -> dict:
    me = [sys.executable, __file__, "--count", str(count), "--payload", str(payload)]
    sub_at = leaf.address if row == "leaf" else up.address
    pub_at = leaf.address if row == "leaf up" else up.address
    pids = [up.pid] + ([leaf.pid, link_pid(leaf.pid)] if row != "direct" else [])
    sub = subprocess.Popen(me + ["--worker", "sub", "--address", sub_at],
                           stdout=subprocess.PIPE, text=True)
    assert sub.stdout.readline().strip() == "ready"
    if row == "leaf":       # the subscription has to reach the upstream first
        deadline = time.monotonic() + 10
        while not any(c.get("subscriptions", 0) >= 2 and not c["echo"]
                      for c in up.stats()["clients"]):
            if time.monotonic() > deadline:
                raise SystemExit("the leaf's subscription never reached the upstream")
            time.sleep(0.02)
    cpu0 = [cpu_seconds(p) for p in pids]
    subprocess.run(me + ["--worker", "pub", "--address", pub_at], check=True)
    out = json.loads(sub.stdout.readline())
    sub.wait(30)
    cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
    got = out["received"]
    return {"row": row, "msgs_per_s": got / out["seconds"], "lost": count - got,
            # per message delivered: what a lost one cost is spread over the rest
            "cpu_us_per_msg": sum(cpu) / got * 1e6,
            "cpu_us_per_msg_by_process": dict(zip(("upstream", "leaf", "link"),
                                                  (c / got * 1e6 for c in cpu))),
            "received": out["received"]}


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-leaf-") as d:
        work = Path(d)
        command = shlex.split(args.sbusd) if args.sbusd else [str(SBUSD)]

        def start(name, *more):
            return Sbusd(work, ["-f", "-a", str(work / name), *more], address=str(work / name),
                         log_level="warning", command=command).ready(timeout=10.0)

        up = start("up")
        leaf = start("leaf", "--upstream", up.address, *shlex.split(args.leaf_args))
        def progress(_, row, r):
            by = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_us_per_msg_by_process"].items())
            print(f"{row}: {r['msgs_per_s']:.0f} msg/s, {r['lost']} lost, "
                  f"{r['cpu_us_per_msg']:.2f} us CPU/msg ({by})", file=sys.stderr)

        try:
            series = alternate(("direct", "leaf", "leaf up"), args.repeat,
                               lambda row: one(row, up, leaf, args.count, args.payload), progress)
        finally:
            leaf.stop()
            up.stop()
    runs = {row: s.runs for row, s in series.items()}
    rows = {row: {"msgs_per_s": s.median("msgs_per_s"),
                  "cpu_us_per_msg": s.median("cpu_us_per_msg"),
                  "lost": sum(r["lost"] for r in s.runs),
                  "cpu_us_per_msg_by_process": s.medians("cpu_us_per_msg_by_process")}
            for row, s in series.items()}
    # A short run (--quick) may take less CPU than a clock tick shows: no ratio then.
    direct_cpu = rows["direct"]["cpu_us_per_msg"]
    for row in ("leaf", "leaf up"):
        rows[row]["vs_direct"] = rows[row]["msgs_per_s"] / rows["direct"]["msgs_per_s"]
        rows[row]["cpu_vs_direct"] = rows[row]["cpu_us_per_msg"] / direct_cpu if direct_cpu else None
    return {"count": args.count, "payload": args.payload, "repeat": args.repeat,
            "rows": rows, "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=200_000)
    ap.add_argument("--payload", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2,000 messages, once")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sbusd", metavar="CMD", help="the broker command (default .venv/bin/sbusd)")
    ap.add_argument("--leaf-args", default="", metavar="ARGS", help="more options for the leaf")
    ap.add_argument("--worker", choices=("sub", "pub"), help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.count, args.repeat = 2000, 1
    result = run(args)
    print(f"{'row':8} {'msgs/s':>10} {'vs direct':>10} {'CPU us/msg':>11} {'CPU vs direct':>14}"
          f" {'lost':>6}  CPU us/msg by process")
    for row, r in result["rows"].items():
        by = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_us_per_msg_by_process"].items())
        cpu_vs = r.get("cpu_vs_direct", 1.0)
        print(f"{row:8} {r['msgs_per_s']:10.0f} {r.get('vs_direct', 1.0):10.2f} "
              f"{r['cpu_us_per_msg']:11.2f} {'-' if cpu_vs is None else f'{cpu_vs:.2f}':>14} {r['lost']:6d}  {by}")
    path = args.json or results_path("leaf")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
