#!/usr/bin/env python3
"""N MiB from one process to another: a sealed memfd handed over by ``sbus fds``
against the same bytes published through sbusd as 400 KiB messages.

    bench/bench_fds.py [--mib N ...] [--repeat N] [--latency K] [--quick]

Rows, for each size (medians of --repeat runs, the two rows interleaved):

- ``memfd_N``: the giver copies the bytes into a memfd, seals it and gives it
  (``sbus.fdpass.give``); the receiver, its own process, takes it
  (``Receiver.take``) and maps it: from the first byte written to the map;
- ``filled_N``: the same with the memfd filled and sealed before the clock
  starts, as a producer that renders into the memfd (mmap) would have it:
  the hand-over alone, whatever N is;
- ``chunks_N``: the giver publishes the bytes as ``--max-message`` payloads
  (400 KiB less the key) with ``publish_many``; the receiver, subscribed with
  ``blocking/hard/block`` (nothing discarded), joins them: from the first
  publish to the last byte joined;
- ``handover``: one fd, ``Giver.give`` to ``Receiver.take`` returning in the
  other process (notification on the bus, then a claim), one at a time,
  --latency times: p50 and p99 in microseconds;
- ``handover_wait``: the same with ``Claimer.wait`` (WAIT: the service pushes
  the fds to the waiting receiver, no bus).

Times cross processes through CLOCK_MONOTONIC (one clock for the machine).
Prints a table on stdout and progress on stderr; nothing asserts on speed.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Sbusd, end_process

KEY = "bench/fds/chunk"
CHUNK = 400 * 1024 - 64
TIMEOUT = 120.0


def say(*args):
    print(*args, file=sys.stderr, flush=True)


# -- the receiving worker (its own process) -----------------------------------------

def worker(mode: str, address: str, count: int) -> int:
    from sbus import Client
    from sbus.fdpass.client import Receiver, is_sealed
    bus = Client(address)
    out = sys.stdout
    if mode == "chunks":
        bus.send_cmsg("blocking/soft/queue")
        bus.send_cmsg("blocking/hard/block")
        bus.subscribe(KEY)
        bus.whoami(timeout=TIMEOUT)
        out.write("ready\n")
        out.flush()
        buf = bytearray()
        while len(buf) < count:
            buf += bus.receive(timeout=TIMEOUT).payload
        done = time.monotonic_ns()
        out.write(json.dumps({"done_ns": done, "size": len(buf)}) + "\n")
        return 0
    receiver = Receiver(bus)
    out.write(receiver.address + "\n")
    out.flush()
    if mode == "wait":
        for _ in range(count):
            with receiver.claimer.wait(timeout=TIMEOUT) as h:
                done = time.monotonic_ns()
            out.write(json.dumps({"us": (done - int(h.note)) / 1000}) + "\n")
            out.flush()
        return 0
    if mode == "memfd":
        with receiver.take(timeout=TIMEOUT) as h:
            fd = h.fds[0]
            assert is_sealed(fd)
            with mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ) as m:
                done = time.monotonic_ns()
                size = len(m)
        out.write(json.dumps({"done_ns": done, "size": size}) + "\n")
        return 0
    for _ in range(count):       # handover: one at a time, the note holds the start
        with receiver.take(timeout=TIMEOUT) as h:
            done = time.monotonic_ns()
        out.write(json.dumps({"us": (done - int(h.note)) / 1000}) + "\n")
        out.flush()
    return 0


def spawn(mode, address, count) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--worker", mode, "--address", address,
                             "--count", str(count)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, text=True)


# -- the giving side (this process) --------------------------------------------------

def run_memfd(address, data, filled=False) -> float:
    from sbus.fdpass.client import give, memfd_payload
    p = spawn("memfd", address, 0)
    try:
        receiver = p.stdout.readline().strip()
        fd = memfd_payload(data) if filled else -1
        start = time.monotonic_ns()
        if fd < 0:
            fd = memfd_payload(data)
        give(receiver, [fd], b"bench", address=address)
        os.close(fd)
        got = json.loads(p.stdout.readline())
        assert got["size"] == len(data), got
        return (got["done_ns"] - start) / 1e9
    finally:
        end_process(p)


def run_chunks(address, data) -> float:
    from sbus import Client
    p = spawn("chunks", address, len(data))
    try:
        assert p.stdout.readline() == "ready\n"
        view = memoryview(data)
        with Client(address) as bus:
            start = time.monotonic_ns()
            bus.publish_many((KEY, view[i:i + CHUNK]) for i in range(0, len(data), CHUNK))
            got = json.loads(p.stdout.readline())
        assert got["size"] == len(data), got
        return (got["done_ns"] - start) / 1e9
    finally:
        end_process(p)


def run_handover(address, count, mode="handover") -> list:
    from sbus.fdpass.client import Giver
    p = spawn(mode, address, count)
    times = []
    r, w = os.pipe()
    try:
        receiver = p.stdout.readline().strip()
        with Giver(address=address) as giver:
            for _ in range(count):
                giver.give(receiver, [r], b"%d" % time.monotonic_ns())
                times.append(json.loads(p.stdout.readline())["us"])
        return times
    finally:
        os.close(r)
        os.close(w)
        end_process(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, action="append",
                    help="payload size in MiB, repeatable (default 64 and 1024)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each row (default 3)")
    ap.add_argument("--latency", type=int, default=2000,
                    help="hand-overs for the latency row (default 2000)")
    ap.add_argument("--quick", action="store_true", help="16 MiB, one run, 200 hand-overs")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.address, args.count)
    sizes = args.mib or ([16] if args.quick else [64, 1024])
    if args.quick:
        args.repeat, args.latency = 1, 200
    with tempfile.TemporaryDirectory(prefix="bench-fds-") as work:
        work = Path(work)
        broker = Sbusd(work, ["-f", "-a", str(work / "sbus.socket")],
                       address=str(work / "sbus.socket"), log_level="warning").ready()
        sbus = Path(sys.executable).with_name("sbus")
        service = subprocess.Popen([str(sbus), "-a", broker.address, "fds", "--log-level",
                                    "warning"], stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(broker.address + ".fds"):
                if time.monotonic() > deadline or service.poll() is not None:
                    raise SystemExit("sbus fds did not start")
                time.sleep(0.05)
            print(f"{'row':<14} {'MiB':>6} {'seconds':>9} {'MiB/s':>9}  (median of {args.repeat})")
            for mib in sizes:
                data = os.urandom(1 << 20) * mib
                runs = {"memfd": [], "filled": [], "chunks": []}
                for i in range(args.repeat):
                    for name, run in (("memfd", run_memfd),
                                      ("filled", lambda a, d: run_memfd(a, d, filled=True)),
                                      ("chunks", run_chunks)):
                        say(f"{name}_{mib} run {i + 1}/{args.repeat}")
                        runs[name].append(run(broker.address, data))
                for name, times in runs.items():
                    t = statistics.median(times)
                    print(f"{name + '_' + str(mib):<14} {mib:>6} {t:>9.4f} {mib / t:>9.0f}",
                          flush=True)
                del data
            for mode in ("handover", "wait"):
                say(f"{mode}: {args.latency} one at a time")
                us = sorted(run_handover(broker.address, args.latency, mode))
                name = "handover" if mode == "handover" else "handover_wait"
                print(f"{name:<14} p50 {us[len(us) // 2]:.0f} us, "
                      f"p99 {us[int(len(us) * 0.99)]:.0f} us ({len(us)} hand-overs)",
                      flush=True)
        finally:
            end_process(service)
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
