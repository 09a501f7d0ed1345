#!/usr/bin/env python3
"""What chunking costs a message that fits one packet: client instructions per
message, counted by callgrind, for a tree before and after (docs/chunks.md).

    bench/chunks_cost.py --python OTHER/.venv/bin/python [--count N] [--payload BYTES]

For each interpreter (this one, and each ``--python``, whose venv imports its
own tree), it starts one sbusd and runs, under ``valgrind --tool=callgrind``,
a client that subscribes, then publishes ``count`` messages and receives them
(64 at a time: ``publish`` each, ``receive_many``; the sync client, then the
asyncio one), and the same
with ``count`` 0; the difference over ``count`` is the client's instructions
per message (publish + receive), start-up excluded. Instruction counts do
not move with the machine's load, so before/after is exact to a few
instructions. Prints a table; nothing asserts.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from harness import Sbusd, callgrind_instructions

CLIENT = r"""
import sys
from sbus import Client
address, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
body = b"x" * size
with Client(address) as bus:
    bus.subscribe("cost/k")
    bus.sync()
    got = 0
    while got < count:
        n = min(64, count - got)
        for _ in range(n):
            bus.publish("cost/k", body)
        while n:
            batch = bus.receive_many(n)
            n -= len(batch)
            got += len(batch)
"""

AIO_CLIENT = r"""
import asyncio, sys
import sbus.aio
address, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
body = b"x" * size
async def main():
    async with sbus.aio.Client(address) as bus:
        await bus.subscribe("cost/k")
        await bus.sync()
        got = 0
        while got < count:
            n = min(64, count - got)
            for _ in range(n):
                await bus.publish("cost/k", body)
            while n:
                batch = await bus.receive_many(n)
                n -= len(batch)
                got += len(batch)
asyncio.run(main())
"""


def instructions(python: str, address: str, count: int, size: int, work: Path,
                 client: str = CLIENT) -> int:
    return callgrind_instructions([python, "-c", client, address, str(count), str(size)],
                                  work / f"cg.{abs(hash((python, count, client)))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", default=[],
                    help="another tree's venv python (the 'before'); repeatable")
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--payload", type=int, default=100)
    args = ap.parse_args()
    pythons = [sys.executable] + args.python
    with tempfile.TemporaryDirectory(prefix="bench-chunks-cost-") as work:
        work = Path(work)
        broker = Sbusd(work, ["-f", "-a", str(work / "sbus.socket")],
                       address=str(work / "sbus.socket"), log_level="warning").ready()
        try:
            print(f"{'client':<6} {'python':<50} {'instr/msg':>10}  (publish + receive, "
                  f"{args.payload} B, {args.count} messages)")
            for name, client in (("sync", CLIENT), ("aio", AIO_CLIENT)):
                for python in pythons:
                    full = instructions(python, broker.address, args.count, args.payload, work,
                                        client)
                    empty = instructions(python, broker.address, 0, args.payload, work, client)
                    print(f"{name:<6} {python:<50} {(full - empty) / args.count:>10.1f}",
                          flush=True)
        finally:
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
