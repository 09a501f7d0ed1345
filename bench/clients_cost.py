#!/usr/bin/env python3
"""What the batched client calls cost in the client beyond the syscalls:
instructions per message of ``publish_many`` and of ``receive_many``,
counted by callgrind, for a tree before and after (docs/clients.md).

    bench/clients_cost.py [--python OTHER/.venv/bin/python] [--count N] [--payload BYTES]

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
vary a little). Prints a table; nothing asserts.
"""
from __future__ import annotations

import argparse
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
    ap.add_argument("--count", type=int, default=25600, help="messages (default 25600)")
    ap.add_argument("--payload", type=int, default=64, help="payload bytes (default 64)")
    args = ap.parse_args()
    pythons = [sys.executable] + args.python
    with tempfile.TemporaryDirectory(prefix="bench-clients-cost-") as work:
        work = Path(work)
        broker = Sbusd(work, ["-f", "-a", str(work / "sbus.socket")],
                       address=str(work / "sbus.socket"), log_level="warning").ready()
        try:
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
        finally:
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
