#!/usr/bin/env python3
"""The pause a client sees during a live upgrade (docs/upgrade.md).

    bench/bench_upgrade.py [--clients 1000,10000] [--subs 100000] [--repeat N] [--quick] [--json PATH]

For each number of clients: an sbusd with that many connected clients (raw
sockets of this process, idle) holding ``--subs`` subscriptions in all, and
a probe client that round-trips messages to itself without pause. Then
``sbusd --upgrade``. The pause is the largest gap between two round trips the
probe completed; the row also gives the old process's own figure (from its
safe point to the new one's DONE, ``upgrade_handed_over.pause_ms``), the new
one's time from the state's arrival to serving (``upgrade_done.restore_ms``;
its index was built ahead, ``prebuild_ms``, while the old one served) and the
state's size.
Goals: at most 50 ms at 1,000 clients, 500 ms at 10,000. Each row is the
median of ``--repeat`` upgrades of the same broker. Prints a table on stdout
and writes JSON (default bench/results/upgrade-<UTC>.json). Nothing here
asserts on speed.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import SBUSD, Sbusd, Series, results_path

GOALS_MS = {1000: 50.0, 10000: 500.0}


class Probe(threading.Thread):
    """Round-trips ``probe/N`` to itself until stopped; keeps when each came back."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(address)
        self.sock.send(b"SUB probe/")
        self.sock.send(b"CMSG !/cred/whoami")
        self.sock.recv(4096)
        self.sock.settimeout(30)
        self.done = threading.Event()
        self.back: list = []
        self.error = None

    def run(self) -> None:
        i = 0
        try:
            while not self.done.is_set():
                self.sock.send(b"MSG probe/%d\0" % i)
                packet = self.sock.recv(4096)
                if not packet.startswith(b"MSG probe/%d\0" % i):
                    raise AssertionError(f"probe {i}: got {packet[:40]!r}")
                self.back.append(time.perf_counter())
                i += 1
        except BaseException as e:     # noqa: BLE001 - reported by the main thread
            self.error = e

    def largest_gap(self, since: float) -> float:
        times = [t for t in self.back if t >= since]
        return max(b - a for a, b in zip(times, times[1:]))


def connect_clients(address: str, clients: int, subs: int) -> list:
    """``clients`` idle connections holding ``subs`` distinct patterns in all."""
    socks = []
    for _ in range(clients):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(address)
        socks.append(s)
    for n in range(subs):
        socks[n % clients].send(b"SUB c/%d/%d/" % (n % clients, n))
    for s in socks:
        s.send(b"CMSG !/cred/whoami")
    for s in socks:
        s.settimeout(60)
        if not s.recv(4096).startswith(b"CMSG !/cred/whoami"):
            raise SystemExit("a client got no whoami reply")
    return socks


def upgrade_once(pidfile: Path, probe: Probe) -> float:
    start = time.perf_counter()
    time.sleep(0.2)
    r = subprocess.run([SBUSD, "--upgrade", "-p", str(pidfile)], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"sbusd --upgrade failed: {r.stderr}")
    time.sleep(0.2)
    if probe.error is not None:
        raise SystemExit(f"the probe failed: {probe.error}")
    return probe.largest_gap(start)


def one(clients: int, subs: int, repeat: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-upgrade-") as d:
        work = Path(d)
        pidfile = work / "sbusd.pid"
        bus = Sbusd.foreground(work, "-p", str(pidfile), "--stats-interval", "0",
                               log_level="info")
        socks = []
        try:
            socks = connect_clients(bus.address, clients, subs)
            probe = Probe(bus.address)
            probe.start()
            gaps = [upgrade_once(pidfile, probe) for _ in range(repeat)]
            probe.done.set()
            probe.join(30)
            handed = [r for r in bus.records() if r.get("event") == "upgrade_handed_over"]
            done = [r for r in bus.records() if r.get("event") == "upgrade_done"]
        finally:
            for s in socks:
                s.close()
            try:
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
            bus.kill()
    # The probe's pauses and the brokers' records of each upgrade, as the harness's series.
    pauses = Series([{"pause_ms": g * 1000} for g in gaps])
    handed, done = Series(handed), Series(done)
    return {"clients": clients, "subs": subs,
            "pause_ms": pauses.median("pause_ms"),
            "pauses_ms": [r["pause_ms"] for r in pauses.runs],
            "handover_ms": handed.median("pause_ms"),
            "export_ms": handed.median("export_ms"),
            "restore_ms": done.median("restore_ms"),
            "prebuild_ms": done.median("prebuild_ms"),
            "transfer_ms": done.median("transfer_ms"),
            "rebuild_ms": done.median("rebuild_ms"),
            "state_bytes": handed.runs[-1]["state_bytes"],
            "goal_ms": GOALS_MS.get(clients)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1000,10000", help="comma-separated (default 1000,10000)")
    ap.add_argument("--subs", type=int, default=100_000, help="subscriptions in all (default 100000)")
    ap.add_argument("--repeat", type=int, default=3, help="upgrades per row (default 3)")
    ap.add_argument("--quick", action="store_true", help="1,000 clients, 10,000 subscriptions, once")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.clients.split(",") if x]
    if args.quick:
        counts, args.subs, args.repeat = [1000], 10_000, 1
    # One descriptor per client here and in sbusd (which inherits the limit).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max(counts) + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    rows = []
    for clients in counts:
        row = one(clients, args.subs, args.repeat)
        rows.append(row)
        print(f"{clients} clients: pause {row['pause_ms']:.1f} ms", file=sys.stderr)
    print(f"{'clients':>8} {'subs':>8} {'pause ms':>9} {'goal':>6} {'handover ms':>12} "
          f"{'restore ms':>11} {'state KiB':>10}")
    for r in rows:
        goal = f"{r['goal_ms']:.0f}" if r["goal_ms"] else "-"
        print(f"{r['clients']:8} {r['subs']:8} {r['pause_ms']:9.1f} {goal:>6} "
              f"{r['handover_ms']:12.1f} {r['restore_ms']:11.1f} {r['state_bytes'] / 1024:10.0f}")
    path = args.json or results_path("upgrade")
    path.write_text(json.dumps({"repeat": args.repeat, "rows": rows}, indent=1) + "\n")
    print(f"results: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
