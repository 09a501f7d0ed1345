"""The subscription flood: CLIENTS clients of one user, each subscribing to
PATTERNS distinct SIZE-byte patterns (by default 4 x 65,536 x 4,000 bytes);
sbusd's VmRSS before, at the peak and after the clients leave.

    .venv/bin/python bench/sub_flood.py                      # 4 x 65536 x 4000 bytes
    .venv/bin/python bench/sub_flood.py --sbusd OTHER/sbusd  # another build ("before")
    .venv/bin/python bench/sub_flood.py --patterns 4096 -- --user-sub-max-bytes 8388608

Run as root, the clients drop to uid 65534 (the socket is opened with -o):
sbusd's own uid has no per-uid budgets, so a flood from root would meet only
the per-connection and broker-wide ones. Prints one line of figures; nothing
here asserts. A broker without budgets takes what it is given (about 2.1 GiB
for the default flood): mind the machine's memory.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from harness import Sbusd, status_kib

NOBODY = 65534
BATCH = 256             # SUBs between barriers


def whoami(s: socket.socket) -> bool:
    """The barrier: False once the broker has closed the connection."""
    try:
        s.send(b"CMSG !/cred/whoami")
        while True:
            p = s.recv(1 << 16)
            if not p:
                return False
            if p.startswith(b"CMSG !/cred/whoami\0"):
                return True
    except (BrokenPipeError, ConnectionResetError):
        return False


def client(address: str, k: int, patterns: int, size: int, out) -> None:
    """One flooding client, in a forked process; writes how many it holds."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(600)
    s.connect(address)
    held = 0
    try:
        while held < patterns:
            n = min(BATCH, patterns - held)
            for i in range(n):
                s.send(b"SUB " + (b"flood-%d-%d-" % (k, held + i)).ljust(size, b"p"))
            if not whoami(s):
                break
            held += n
    except (BrokenPipeError, ConnectionResetError):
        pass
    os.write(out, b"%d\n" % held)
    # Hold the patterns until told to go (stdin closes).
    os.read(0, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sbusd", default=str(Path(sys.executable).parent / "sbusd"))
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--patterns", type=int, default=65536)
    ap.add_argument("--size", type=int, default=4000)
    ap.add_argument("sbusd_args", nargs="*", help="more sbusd options (after --)")
    args = ap.parse_args()

    d = Path(tempfile.mkdtemp(prefix="sbus-flood-", dir="/tmp"))
    os.chmod(d, 0o755)
    address = str(d / "sbus.socket")
    broker = Sbusd(d, ["-f", "-o", "-a", address, "--log-level", "warning", *args.sbusd_args],
                   address=address, log_level=None, command=[args.sbusd])
    kids = []
    try:
        broker.ready(timeout=30)
        time.sleep(0.2)
        base = status_kib(broker.pid, "VmRSS")
        started = time.monotonic()
        r, w = os.pipe()
        for k in range(args.clients):
            hold_r, hold_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    # stdin closes when the parent says go: no other hold of it
                    for fd in [hold_w, r] + [h for _, h in kids]:
                        os.close(fd)
                    os.dup2(hold_r, 0)
                    client(address, k, args.patterns, args.size, w)
                finally:
                    os._exit(0)
            os.close(hold_r)
            kids.append((pid, hold_w))
        os.close(w)
        held = []
        with os.fdopen(r) as f:
            for _ in range(args.clients):
                held.append(int(f.readline()))
        seconds = time.monotonic() - started
        peak = max(status_kib(broker.pid, "VmRSS"), status_kib(broker.pid, "VmHWM"))
        for pid, hold_w in kids:
            os.close(hold_w)
            os.waitpid(pid, 0)
        kids = []
        time.sleep(2.5)                 # a tick or two: the broker trims its heap
        after = status_kib(broker.pid, "VmRSS")
        figures = {"clients": args.clients, "patterns_each": args.patterns, "size": args.size,
                   "held": held, "rss_base_kib": base, "rss_peak_kib": peak,
                   "rss_after_kib": after, "seconds": round(seconds, 1),
                   "sbusd": args.sbusd, "args": args.sbusd_args}
        print(json.dumps(figures))
        print(f"sub_flood: {args.clients} x {args.patterns} x {args.size} B: held {sum(held)} "
              f"patterns; VmRSS {base >> 10} MiB -> peak {peak >> 10} MiB -> "
              f"{after >> 10} MiB after they left ({seconds:.1f}s)", file=sys.stderr)
        return 0
    finally:
        for pid, _hold_w in kids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        broker.stop(timeout=30)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
