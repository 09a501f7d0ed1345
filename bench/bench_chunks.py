#!/usr/bin/env python3
"""Messages of any size (docs/chunks.md): a large payload chunked through sbusd
against the same bytes over a raw socketpair, and next to a sealed memfd.

    bench/bench_chunks.py [--mib N ...] [--repeat N] [--memfd] [--quick] [--json PATH]

Rows, for each size (median seconds of --repeat runs, the rows alternating):

- ``chunked_N``: one ``Client.publish`` of N MiB (the library sends it as
  ``--max-message`` chunks) to a subscriber in its own process whose
  ``receive()`` returns the whole message: from the publish to the message
  returned, through sbusd (the subscriber asks ``blocking/hard/block``, so
  nothing is discarded);
- ``socketpair_N``: the same bytes from one process to another over a
  ``SOCK_SEQPACKET`` socketpair, written as packets of the same size (the
  chunk's data and its 52-byte header), the reader joining them: the floor
  with no broker and no chunk bookkeeping;
- ``memfd_N`` (with ``--memfd``): ``bench/bench_fds.py``'s row, the bytes in a
  sealed memfd handed over by ``sbus fds`` (that service is started here).

The ratio chunked/socketpair is the rate the issue asks for (goal >= 0.5).
Times cross processes through CLOCK_MONOTONIC. Prints a table on stdout,
writes JSON (default bench/results/chunks-<UTC>.json); nothing asserts on speed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Sbusd, alternate, end_process, results_path

KEY = "bench/chunks/one"
TIMEOUT = 300.0


def say(*args):
    print(*args, file=sys.stderr, flush=True)


def chunk_data_size(max_message: int) -> int:
    from sbus.client.chunks import Chunker
    return Chunker(max_message).data_size(KEY.encode())


# -- workers: processes of their own ------------------------------------------------

def subscriber(address: str, size: int) -> int:
    from sbus import Client
    bus = Client(address)
    bus.chunks.max_message_bytes = bus.chunks.max_total_bytes = size + (1 << 20)
    bus.send_cmsg("blocking/soft/queue")
    bus.send_cmsg("blocking/hard/block")
    bus.subscribe(KEY)
    bus.sync()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    m = bus.receive(timeout=TIMEOUT)
    done = time.monotonic_ns()
    sys.stdout.write(json.dumps({"done_ns": done, "size": len(m.payload),
                                 "lost": bus.chunks.lost}) + "\n")
    return 0


def pair_reader(fd: int, size: int, packet: int) -> int:
    sock = socket.socket(fileno=fd)
    parts = []
    got = 0
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while got < size:
        p = sock.recv(packet + 64)
        parts.append(memoryview(p)[52:])
        got += len(p) - 52
    whole = b"".join(parts)
    done = time.monotonic_ns()
    sys.stdout.write(json.dumps({"done_ns": done, "size": len(whole)}) + "\n")
    return 0


def spawn(*args, pass_fds=()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--worker", *map(str, args)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                            pass_fds=pass_fds)


# -- the runs (this process publishes or writes) -----------------------------------

def run_chunked(address: str, data: bytes) -> dict:
    from sbus import Client
    p = spawn("sub", address, len(data))
    try:
        assert p.stdout.readline() == "ready\n"
        with Client(address) as bus:
            start = time.monotonic_ns()
            bus.publish(KEY, data)
            got = json.loads(p.stdout.readline())
        assert got["size"] == len(data) and got["lost"] == 0, got
        return {"seconds": (got["done_ns"] - start) / 1e9}
    finally:
        end_process(p)


def run_socketpair(data: bytes, step: int) -> dict:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, 32, (step + 128) * 4)   # SO_SNDBUFFORCE, as the clients
        s.setsockopt(socket.SOL_SOCKET, 33, (step + 128) * 4)
    p = spawn("pair", b.fileno(), len(data), step + 52, pass_fds=(b.fileno(),))
    b.close()
    try:
        assert p.stdout.readline() == "ready\n"
        view = memoryview(data)
        header = bytes(52)
        start = time.monotonic_ns()
        for i in range(0, len(data), step):
            a.send(b"".join((header, view[i:i + step])))     # a packet built, as a chunk is
        got = json.loads(p.stdout.readline())
        assert got["size"] == len(data), got
        return {"seconds": (got["done_ns"] - start) / 1e9}
    finally:
        a.close()
        end_process(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, action="append", help="MiB per message (default 64)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each row (default 5)")
    ap.add_argument("--memfd", action="store_true", help="add bench_fds.py's memfd row")
    ap.add_argument("--quick", action="store_true", help="16 MiB, 2 runs")
    ap.add_argument("--json", help="where to write the results")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "sub":
            return subscriber(rest[0], int(rest[1]))
        return pair_reader(int(rest[0]), int(rest[1]), int(rest[2]))
    from sbus.client.protocol import MAX_MESSAGE
    sizes = args.mib or ([16] if args.quick else [64])
    if args.quick:
        args.repeat = 2
    step = chunk_data_size(MAX_MESSAGE)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-chunks-") as work:
        work = Path(work)
        broker = Sbusd(work, ["-f", "-a", str(work / "sbus.socket")],
                       address=str(work / "sbus.socket"), log_level="warning").ready()
        service = None
        try:
            if args.memfd:
                sbus = Path(sys.executable).with_name("sbus")
                service = subprocess.Popen([str(sbus), "-a", broker.address, "fds",
                                            "--log-level", "warning"], stdin=subprocess.DEVNULL)
                deadline = time.monotonic() + 20
                while not os.path.exists(broker.address + ".fds"):
                    if time.monotonic() > deadline or service.poll() is not None:
                        raise SystemExit("sbus fds did not start")
                    time.sleep(0.05)
            print(f"{'row':<16} {'MiB':>6} {'seconds':>9} {'MiB/s':>9}  (median of {args.repeat}, "
                  f"rows alternating)")
            for mib in sizes:
                data = os.urandom(1 << 20) * mib
                labels = ["chunked", "socketpair"] + (["memfd"] if args.memfd else [])

                def run_one(label, data=data):
                    say(f"{label}_{mib}")
                    if label == "chunked":
                        return run_chunked(broker.address, data)
                    if label == "socketpair":
                        return run_socketpair(data, step)
                    from bench_fds import run_memfd
                    return {"seconds": run_memfd(broker.address, data)}
                series = alternate(labels, args.repeat, run_one)
                row = {}
                for label, s in series.items():
                    t = s.median("seconds")
                    row[label] = {"seconds": t, "runs": s.to_json()}
                    print(f"{label + '_' + str(mib):<16} {mib:>6} {t:>9.4f} {mib / t:>9.0f}",
                          flush=True)
                ratio = row["socketpair"]["seconds"] / row["chunked"]["seconds"]
                print(f"{'chunked/socketpair rate':<23} {ratio:.2f}x (goal >= 0.5x)", flush=True)
                results[mib] = row
                del data
        finally:
            if service is not None:
                end_process(service)
            broker.stop()
    path = Path(args.json) if args.json else results_path("chunks")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"sizes": results, "repeat": args.repeat,
                                "chunk_data": step}, indent=1))
    say(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
