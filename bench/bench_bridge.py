#!/usr/bin/env python3
"""Host to host through NATS: two sbusd brokers, one nats-server, two `sbus bridge`.

    bench/bench_bridge.py [--count N] [--payload BYTES] [--rate R] [--seconds S] [--json PATH]

Rows, all with --payload-byte messages (default 64) and loss checked:

- ``bridge_rate``: msgs/s from host A's publisher (publish_many) to a
  subscriber on host B, first message to last at B;
- ``bridge_latency``: p50/p99 from A's publish to B's receive at a fixed
  --rate msgs/s (CLOCK_MONOTONIC stamps; every process is on this machine);
- ``nats_rate``: plain nats-py publisher -> nats-py subscriber over the same
  nats-server, in the same run, for scale.

Every publisher and subscriber is its own process (``--worker``). Prints a
table on stdout, progress on stderr, and writes JSON (default
bench/results/bridge-<UTC>.json).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
BIN = Path(sys.executable).parent
KEY = b"bench/key"
PLAIN_SUBJECT = "plain.bench"      # outside the bridges' prefix: plain NATS only


def say(*args):
    print(*args, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- workers (each in its own process) ------------------------------------------

def sbus_sub(address, count, timeout):
    """Receive up to ``count`` messages on KEY; report count, span and latencies."""
    import sbus
    bus = sbus.Client(address)
    bus.subscribe(KEY)
    bus.whoami(timeout=10)
    print("ready", flush=True)
    got, first, last, lat = 0, None, None, []
    deadline = time.monotonic() + timeout
    while got < count:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            batch = bus.receive_many(1024, timeout=min(left, 1.0))
        except TimeoutError:
            if got:     # quiet for a second after traffic: the rest is lost
                break
            continue
        now = time.monotonic_ns()
        for m in batch:
            if m.key != KEY:
                continue
            got += 1
            lat.append(now - int(m.payload[:20]))
        first = first or now
        last = now
    return {"received": got, "seconds": (last - first) / 1e9 if got > 1 else None,
            "latency_ns": lat}


def sbus_pub(address, count, payload, rate):
    import sbus
    bus = sbus.Client(address)
    pad = b"x" * max(0, payload - 20)
    if rate:
        start = time.monotonic()
        for i in range(count):
            ahead = start + i / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
            bus.publish(KEY, b"%020d" % time.monotonic_ns() + pad)
    else:
        batch = 1000
        for i in range(0, count, batch):
            stamp = b"%020d" % time.monotonic_ns() + pad
            bus.publish_many([(KEY, stamp)] * min(batch, count - i))
    bus.whoami(timeout=30)
    return {"sent": count}


async def _nats_sub(url, count, timeout):
    import nats
    nc = await nats.connect(url)
    state = {"got": 0, "first": None, "last": None}
    done = asyncio.Event()

    async def on_msg(msg):
        state["last"] = time.monotonic_ns()
        state["first"] = state["first"] or state["last"]
        state["got"] += 1
        if state["got"] >= count:
            done.set()

    await nc.subscribe(PLAIN_SUBJECT, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
    await nc.flush()
    print("ready", flush=True)
    seen = -1
    while not done.is_set() and seen != state["got"]:     # until done or quiet for a while
        seen = state["got"]
        try:
            await asyncio.wait_for(done.wait(), timeout if not seen else 2.0)
        except asyncio.TimeoutError:
            pass
    await nc.close()
    got, first, last = state["got"], state["first"], state["last"]
    return {"received": got, "seconds": (last - first) / 1e9 if got > 1 else None}


async def _nats_pub(url, count, payload):
    import nats
    nc = await nats.connect(url, pending_size=8 << 20)
    data = b"x" * payload
    for _ in range(count):
        await nc.publish(PLAIN_SUBJECT, data)
    await nc.flush(timeout=60)
    await nc.close()
    return {"sent": count}


def worker(args):
    if args.worker == "sbus_sub":
        out = sbus_sub(args.address, args.count, args.seconds)
    elif args.worker == "sbus_pub":
        out = sbus_pub(args.address, args.count, args.payload, args.rate)
    elif args.worker == "nats_sub":
        out = asyncio.run(_nats_sub(args.address, args.count, args.seconds))
    else:
        out = asyncio.run(_nats_pub(args.address, args.count, args.payload))
    print(json.dumps(out), flush=True)


# -- the run --------------------------------------------------------------------

class Processes:
    def __init__(self):
        self.procs = []

    def start(self, argv, **kw):
        p = subprocess.Popen(argv, **kw)
        self.procs.append(p)
        return p

    def stop_all(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_bridge: timed out waiting for {what}")
        time.sleep(0.05)


def listening(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def logged(path, event):
    try:
        return any(json.loads(line).get("event") == event
                   for line in Path(path).read_text().splitlines() if line.strip())
    except (FileNotFoundError, ValueError):
        return False


def pair(sub_argv, pub_argv, procs, timeout):
    """Start the subscriber, wait for it, run the publisher; the subscriber's report."""
    sub = procs.start(sub_argv, stdout=subprocess.PIPE)
    assert sub.stdout.readline().strip() == b"ready"
    subprocess.run(pub_argv, check=True, stdout=subprocess.DEVNULL, timeout=timeout)
    out, _ = sub.communicate(timeout=timeout)
    return json.loads(out.splitlines()[-1])


def run(args):
    me = [sys.executable, str(Path(__file__).resolve())]
    work = Path(tempfile.mkdtemp(prefix="sbus-bench-bridge-"))
    procs = Processes()
    results = {}
    try:
        port = free_port()
        procs.start([str(BIN / "nats-server"), "-a", "127.0.0.1", "-p", str(port)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: listening(port), 15, "nats-server")
        url = f"nats://127.0.0.1:{port}"
        hosts = {}
        for name in ("a", "b"):
            address = str(work / f"{name}.socket")
            sbusd = procs.start([str(BIN / "sbusd"), "-f", "-a", address, "--log-level", "off"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            sbusd.stdout.read()         # closed once it listens
            hosts[name] = address
        logs = {}
        # a's broker blocks the publisher rather than discard when bridge a falls
        # behind (--local-flood block): the rate row is lossless by design.
        for name, side in (("a", ["--export", "bench/", "--local-flood", "block"]),
                           ("b", ["--import", "sbus.bench.>"])):
            logs[name] = work / f"bridge-{name}.log"
            procs.start([str(BIN / "sbus"), "-a", hosts[name], "bridge", "--nats", url, *side,
                         "--max-pending", str(256 << 20), "--stats-interval", "60",
                         "--log-format", "json", "--log-file", str(logs[name])],
                        stdout=subprocess.DEVNULL)
        for name in logs:
            wait_for(lambda: logged(logs[name], "bridge_connected"), 30, f"bridge {name}")
        common = ["--payload", str(args.payload)]
        for rep in range(args.repeat):
            say(f"repeat {rep + 1}/{args.repeat}: bridge_rate")
            r = pair(me + ["--worker", "sbus_sub", "--address", hosts["b"], "--count",
                           str(args.count), "--seconds", "120"],
                     me + ["--worker", "sbus_pub", "--address", hosts["a"], "--count",
                           str(args.count), "--rate", "0", *common], procs, 300)
            results.setdefault("bridge_rate", []).append(
                {"received": r["received"], "sent": args.count,
                 "rate": r["received"] / r["seconds"] if r["seconds"] else 0})
            say(f"repeat {rep + 1}/{args.repeat}: nats_rate")
            r = pair(me + ["--worker", "nats_sub", "--address", url, "--count", str(args.count),
                           "--seconds", "120"],
                     me + ["--worker", "nats_pub", "--address", url, "--count", str(args.count),
                           *common], procs, 300)
            results.setdefault("nats_rate", []).append(
                {"received": r["received"], "sent": args.count,
                 "rate": r["received"] / r["seconds"] if r["seconds"] else 0})
        say("bridge_latency")
        n = int(args.rate * args.latency_seconds)
        r = pair(me + ["--worker", "sbus_sub", "--address", hosts["b"], "--count", str(n),
                       "--seconds", str(args.latency_seconds + 30)],
                 me + ["--worker", "sbus_pub", "--address", hosts["a"], "--count", str(n),
                       "--rate", str(args.rate), *common], procs, 300)
        lat = sorted(r["latency_ns"])
        results["bridge_latency"] = [{
            "received": r["received"], "sent": n, "rate": args.rate,
            "p50_us": lat[len(lat) // 2] / 1000 if lat else None,
            "p99_us": lat[int(len(lat) * 0.99)] / 1000 if lat else None}]
    finally:
        procs.stop_all()
    return results


def table(results, payload, load):
    med = lambda rows, f: statistics.median(r[f] for r in rows)     # noqa: E731
    br, nr = results["bridge_rate"], results["nats_rate"]
    lost_b = sum(r["sent"] - r["received"] for r in br)
    lost_n = sum(r["sent"] - r["received"] for r in nr)
    lat = results["bridge_latency"][0]
    ratio = med(br, "rate") / med(nr, "rate") if med(nr, "rate") else 0
    return "\n".join([
        f"{payload}-byte messages; load average {load}",
        f"bridge A->B      {med(br, 'rate'):>10,.0f} msg/s   lost {lost_b}",
        f"plain nats-py    {med(nr, 'rate'):>10,.0f} msg/s   lost {lost_n}",
        f"ratio            {ratio:>10.2f}",
        f"latency @{lat['rate']:,}/s  p50 {lat['p50_us']:.0f} us  p99 {lat['p99_us']:.0f} us"
        f"   lost {lat['sent'] - lat['received']}",
    ])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=200_000)
    ap.add_argument("--payload", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--latency-seconds", type=float, default=5.0)
    ap.add_argument("--json", help="where to write the figures")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=60, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    results = run(args)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(table(results, args.payload, load))
    for rows in results.values():
        for r in rows:
            r.pop("latency_ns", None)
    path = Path(args.json) if args.json else RESULTS / (
        "bridge-" + dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"payload": args.payload, "load": load, "rows": results},
                               indent=2))
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
