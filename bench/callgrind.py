#!/usr/bin/env python3
"""Instructions per delivery of sbusd under callgrind: user-space work per
message, the same on a loaded machine as on an idle one (the kernel's part,
the system calls, is not counted).

    bench/callgrind.py [--backend io_uring] [--sbusd-path DIR] -- manypubs -N 256 -G 2 -n 1 -w 256 -r 1000

One sbusd runs under valgrind --tool=callgrind (--stats-interval 0: the
stats record is a timer's work, not a turn's). A first loadgen run warms it
up (first-use imports); then the workload runs for --short and for --long
seconds, each between a zero and a dump of the counters, once every
connection's disconnect has been logged. (Ir_long - Ir_short) /
(deliveries_long - deliveries_short) leaves connecting and teardown out.
Under valgrind sbusd is some 50 times slower: a fixed rate (-r) of 1000
gives turns of one or two messages, as 100k/s does natively; without -r the
window keeps it saturated. --top N prints the functions that account for
the difference. --sbusd-path puts DIR first on PYTHONPATH (a copy of another
build's sbus/ package), for before/after pairs.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"


def self_costs(path):
    """Each function's own instructions (not its callees') in a callgrind dump."""
    names, costs, fn, after_call = {}, collections.Counter(), None, False

    def name(spec):
        m = re.match(r"\((\d+)\)(?: (.*))?", spec)
        if not m:
            return spec
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), spec)

    for line in open(path):
        if line.startswith("fn="):
            fn, after_call = name(line[3:].rstrip("\n")), False
        elif line.startswith("cfn="):
            name(line[4:].rstrip("\n"))
        elif line.startswith("calls="):
            after_call = True
        elif line[:1].isdigit() or line[:1] in "+-*":
            parts = line.split()
            if len(parts) >= 2:
                if after_call:
                    after_call = False      # the call's inclusive cost: the callee's
                else:
                    costs[fn] += int(parts[1])
    return costs


class Server:
    def __init__(self, backend, sbusd_path):
        self.tmp = tempfile.mkdtemp(prefix="sbus-callgrind-")
        self.sock, self.out, self.log = f"{self.tmp}/s.sock", f"{self.tmp}/cg.out", f"{self.tmp}/log"
        self.env = dict(os.environ)
        if sbusd_path:
            self.env["PYTHONPATH"] = sbusd_path
        self.proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}",
             str(VENV / "bin/python"), str(VENV / "bin/sbusd"), "-f", "-a", self.sock,
             "--backend", backend, "--log-file", self.log, "--stats-interval", "0"],
            stdout=subprocess.DEVNULL, stderr=open(f"{self.tmp}/stderr", "w"), env=self.env)
        for _ in range(600):
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    s.connect(self.sock)
                break
            except OSError:
                time.sleep(0.2)
        else:
            sys.exit(f"sbusd did not start: {open(f'{self.tmp}/stderr').read()[-500:]}")

    def run(self, seconds, loadgen):
        """Zero, run loadgen, wait for the disconnects, dump: (Ir, loadgen JSON, dump), or None."""
        subprocess.run(["callgrind_control", "-z", str(self.proc.pid)], check=True, capture_output=True)
        before = set(glob.glob(self.out + ".*"))
        lg = subprocess.run([str(VENV / "bin/python"), "-m", "sbus.cli.loadgen", loadgen[0], "-a", self.sock,
                             "-d", str(seconds), *loadgen[1:]], capture_output=True, text=True, env=self.env)
        for _ in range(120):
            time.sleep(1)
            text = open(self.log).read()
            if text.count('"client_connect"') == text.count('"client_disconnect"'):
                break
        time.sleep(1)       # the tick flushes the log
        subprocess.run(["callgrind_control", "-d", str(self.proc.pid)], check=True, capture_output=True)
        time.sleep(0.5)
        dump = sorted(set(glob.glob(self.out + ".*")) - before)[-1]
        lines = [ln for ln in lg.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            print(f"loadgen failed: {lg.stderr[-300:]}", file=sys.stderr)
            return None
        ir = int(re.search(r"^summary: (\d+)", open(dump).read(), re.M).group(1))
        return ir, json.loads(lines[-1]), dump

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="epoll")
    ap.add_argument("--sbusd-path", help="a directory holding another build's sbus/ package")
    ap.add_argument("--short", type=float, default=2.0)
    ap.add_argument("--long", type=float, default=6.0)
    ap.add_argument("--top", type=int, default=0, help="print the N functions that cost most per delivery")
    ap.add_argument("loadgen", nargs="+", help="loadgen mode and arguments, without -a and -d")
    opts = ap.parse_args()
    server = Server(opts.backend, opts.sbusd_path)
    try:
        server.run(1, opts.loadgen)     # warm-up
        short = server.run(opts.short, opts.loadgen) or server.run(opts.short, opts.loadgen)
        long = server.run(opts.long, opts.loadgen) or server.run(opts.long, opts.loadgen)
    finally:
        server.stop()
    if not short or not long:
        sys.exit("loadgen failed twice")
    deliveries = long[1]["deliveries"] - short[1]["deliveries"]
    print(json.dumps({"backend": opts.backend, "loadgen": opts.loadgen,
                      "ir_per_delivery": round((long[0] - short[0]) / deliveries, 1),
                      "deliveries": [short[1]["deliveries"], long[1]["deliveries"]],
                      "dumps": [short[2], long[2]]}))
    if opts.top:
        a, b = self_costs(short[2]), self_costs(long[2])
        diff = collections.Counter({fn: b[fn] - a.get(fn, 0) for fn in b})
        for fn, ir in diff.most_common(opts.top):
            print(f"{ir / deliveries:9.1f}  {fn[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
