#!/usr/bin/env python3
"""What the batched client calls cost in the client beyond the syscalls:
instructions per message of ``publish_many`` and of ``receive_many``,
counted by callgrind, for a tree before and after (docs/clients.md).

    bench/clients_cost.py [--python OTHER/.venv/bin/python] [--count N] [--payload BYTES]
                          [--calls N] [--sizes 1,2,8,64]

For each interpreter (this one, and each ``--python``, whose venv imports its
own tree), it starts one sbusd and runs, under ``valgrind --tool=callgrind``,
a client that publishes ``count`` messages with ``publish_many`` (256 a
call) and, in a second run, also receives them with ``receive_many(64)``
after each call; each again with ``count`` 0. The differences over ``count``
are the client's instructions per message (start-up excluded): the first
run's is ``publish_many``'s, the second's less the first's ``receive_many``'s.
Rows: the blocking client, the same once its reply inbox is open (after a
``sync()``: replies and other messages then share the socket), and the
asyncio one. Instruction counts do not move with the machine's load (the
kernel's share, the syscalls themselves, is not counted), so before/after is
exact to a few tens of instructions (the batches the broker's timing makes
vary a little).

A second table gives what one ``receive_many`` call costs when it finds 1,
2, 8 or 64 messages waiting (``--sizes``): the call's fixed cost beside its
cost per message. The subscriber (under callgrind) and a publisher (a
process of its own, not counted) take turns over two pipes, so each call
finds exactly that many; the same run with the subscriber on another key is
subtracted, and the difference divided by ``--calls``. Rows: blocking with a
timeout (as the bench's receive row calls it), blocking without, asyncio.
Prints the tables; nothing asserts.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from harness import Sbusd, callgrind_instructions

SYNC = r"""
import sys
from sbus import Client
address, count, size, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
items = [("cost/k", b"x" * size)] * 256
with Client(address) as bus:
    if mode != "publish":
        bus.subscribe("cost/k")
    bus.sync() if REPLIES else bus.whoami()
    done = 0
    while done < count:
        bus.publish_many(items)
        done += 256
        n = 256 if mode != "publish" else 0
        while n:
            n -= len(bus.receive_many(64))
    bus.whoami()
"""

AIO = r"""
import asyncio, sys
import sbus.aio
address, count, size, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
items = [("cost/k", b"x" * size)] * 256
async def main():
    async with sbus.aio.Client(address) as bus:
        if mode != "publish":
            await bus.subscribe("cost/k")
        await bus.whoami()
        done = 0
        while done < count:
            await bus.publish_many(items)
            done += 256
            n = 256 if mode != "publish" else 0
            while n:
                n -= len(await bus.receive_many(64))
        await bus.whoami()
asyncio.run(main())
"""

# One receive_many call per turn: the publisher (a native process) publishes
# `size` messages and makes a round trip, so they are in the subscriber's
# socket before it calls; "none" subscribes to another key (the same set-up).
CALLS = r"""
import asyncio, os, subprocess, sys
address, calls, size, mode, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
timeout = None if timeout == "none" else float(timeout)
FEED = (
    "import os, sys\n"
    "from sbus import Client\n"
    "address, calls, size, go, done = sys.argv[1], *map(int, sys.argv[2:])\n"
    "with Client(address) as pub:\n"
    "    for _ in range(calls):\n"
    "        os.read(go, 1)\n"
    "        pub.publish_many([('cost/k', b'x' * 64)] * size)\n"
    "        pub.whoami()\n"
    "        os.write(done, b'x')\n")
go_r, go_w = os.pipe()
done_r, done_w = os.pipe()
key = "cost/other" if mode.endswith("none") else "cost/k"
feed = [sys.executable, "-c", FEED, address, str(calls), str(size), str(go_r), str(done_w)]
def start():
    pub = subprocess.Popen(feed, pass_fds=(go_r, done_w))
    os.close(go_r)
    os.close(done_w)    # so that a publisher that died reads as EOF
    return pub
def turn():
    os.write(go_w, b"x")
    if not os.read(done_r, 1):
        sys.exit("the publisher died")
def sync():
    from sbus import Client
    with Client(address) as bus:
        bus.subscribe(key)
        bus.whoami()
        pub = start()
        for _ in range(calls):
            turn()
            if key == "cost/k":
                got = len(bus.receive_many(64, timeout=timeout))
                while got < size:
                    got += len(bus.receive_many(64, timeout=timeout))
        pub.wait()
async def aio():
    import sbus.aio
    async with sbus.aio.Client(address) as bus:
        await bus.subscribe(key)
        await bus.whoami()
        pub = start()
        for _ in range(calls):
            turn()
            if key == "cost/k":
                got = len(await bus.receive_many(64))
                while got < size:
                    got += len(await bus.receive_many(64))
        pub.wait()
sync() if mode.startswith("sync") else asyncio.run(aio())
"""
CALL_ROWS = (("sync, timeout", "sync", "10"), ("sync", "sync", "none"), ("aio", "aio", "none"))

CLIENTS = (("sync", SYNC.replace("REPLIES", "False")),
           ("sync, replies open", SYNC.replace("REPLIES", "True")),
           ("aio", AIO))


def instructions(python: str, address: str, client: str, count: int, size: int, mode: str,
                 work: Path) -> int:
    return callgrind_instructions([python, "-c", client, address, str(count), str(size), mode],
                                  work / "cg.out")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", default=[],
                    help="another tree's venv python (the 'before'); repeatable")
    ap.add_argument("--count", type=int, default=25600, help="messages (default 25600; 0: skip this table)")
    ap.add_argument("--payload", type=int, default=64, help="payload bytes (default 64)")
    ap.add_argument("--calls", type=int, default=400, help="receive_many calls per size (default 400)")
    ap.add_argument("--sizes", default="1,2,8,64", help="messages a call finds (default 1,2,8,64)")
    args = ap.parse_args()
    pythons = [sys.executable] + args.python
    # One hash seed for every run: randomised, dicts' layouts (and so the
    # instructions of every lookup) differ between a run and the one subtracted.
    os.environ["PYTHONHASHSEED"] = "0"
    with tempfile.TemporaryDirectory(prefix="bench-clients-cost-") as work:
        work = Path(work)
        # Out of any tree: `python -c` puts the working directory first on
        # sys.path, and a tree there would be imported in place of the venv's.
        os.chdir(work)
        broker = Sbusd(work, ["-f", "-a", str(work / "sbus.socket")],
                       address=str(work / "sbus.socket"), log_level="warning").ready()
        try:
            if args.count:     # 0: the per-call table only
                print(f"{'client':<20} {'python':<45} {'publish_many':>12} {'receive_many':>12}"
                      f"  (instructions per message, {args.payload} B, {args.count} messages)")
                for name, client in CLIENTS:
                    for python in pythons:
                        per = {}
                        for mode in ("publish", "both"):
                            full = instructions(python, broker.address, client, args.count,
                                                args.payload, mode, work)
                            empty = instructions(python, broker.address, client, 0,
                                                 args.payload, mode, work)
                            per[mode] = (full - empty) / args.count
                        print(f"{name:<20} {python:<45} {per['publish']:>12.0f} "
                              f"{per['both'] - per['publish']:>12.0f}", flush=True)
            sizes = [int(n) for n in args.sizes.split(",")]
            print(f"\n{'receive_many':<20} {'python':<45} "
                  + " ".join(f"{f'{n}: call':>9} {'/msg':>6}" for n in sizes)
                  + f"  (instructions, 64 B, {args.calls} calls)")
            for name, mode, timeout in CALL_ROWS:
                for python in pythons:
                    cells = []
                    for n in sizes:
                        runs = [callgrind_instructions(
                            [python, "-c", CALLS, broker.address, str(args.calls), str(n), m, timeout],
                            work / "cg.out") for m in (mode, mode + "none")]
                        per_call = (runs[0] - runs[1]) / args.calls
                        cells.append(f"{per_call:>9.0f} {per_call / n:>6.0f}")
                    print(f"{name:<20} {python:<45} " + " ".join(cells), flush=True)
        finally:
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
