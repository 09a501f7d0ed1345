"""``sbus bench``: the running broker's throughput and latency on this host.

    sbus bench pair                 one publisher, one subscriber
    sbus bench fanout N             one publisher, N subscribers
    sbus bench latency              round trips: ping -> broker -> echo -> broker

Each run is the compiled load generator (``python -m sbus.cli.loadgen``, the
one ``make bench`` uses) in a process of its own, which forks a process per
subscriber (or the echo). Every payload carries a sequence number; the
subscribers count what was lost, reordered or malformed, and a run with any
of those exits 2. One summary line per run, or its JSON with ``--json``.
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Dict, List, Optional

# What the load generator reports as gone wrong, when non-zero or true.
PROBLEMS = ("lost", "tail_lost", "reordered", "bad", "eof", "unfinished", "stalled")
DEFAULT_SECONDS = 2.0
SEQ_BYTES = 8       # the sequence number at the start of each payload


def loadgen_argv(workload: str, address: str, subscribers: int, size: int,
                 count: Optional[int], seconds: Optional[float], window: int) -> List[str]:
    mode = "latency" if workload == "latency" else "flood"
    argv = [sys.executable, "-m", "sbus.cli.loadgen", mode, "-a", address, "-s", str(size)]
    if mode == "flood":
        argv += ["-n", str(subscribers), "-w", str(window)]
    if count is not None:
        argv += ["-m", str(count)]
    if seconds is not None or count is None:
        argv += ["-d", str(DEFAULT_SECONDS if seconds is None else seconds)]
    return argv


def run_once(argv: List[str], timeout: float) -> Dict[str, Any]:
    """One generator run; its JSON, with ``error`` if it printed none."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:g} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip()
                else f"the load generator exited with {p.returncode}"}
    return json.loads(lines[-1])


def problems(result: Dict[str, Any]) -> List[str]:
    return [f"{k} {result[k]}" if result[k] is not True else k
            for k in PROBLEMS if result.get(k)]


def _rate(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def summary(workload: str, r: Dict[str, Any]) -> str:
    """One line: what ran, how fast, and whether anything went missing."""
    if "error" in r:
        return f"{workload}: failed: {r['error']}"
    size = r.get("payload", 0)
    if r.get("mode") == "latency":
        line = (f"{workload}: {r['round_trips']} round trips of {size} B in "
                f"{r['seconds']:.2f} s: p50 {r['p50_us']:.1f} us, p90 {r['p90_us']:.1f} us, "
                f"p99 {r['p99_us']:.1f} us, max {r['max_us']:.1f} us")
    else:
        subs = r["subscribers"]
        line = (f"{workload}: {r['messages']} msgs of {size} B to {subs} subscriber"
                f"{'s' if subs != 1 else ''} in {r['seconds']:.2f} s: "
                f"{_rate(r['msgs_per_s'])} msg/s, "
                f"{_rate(r['deliveries_per_s'])} deliveries/s, "
                f"{r['deliveries_per_s'] * size / 1e6:.1f} MB/s delivered")
    bad = problems(r)
    return line + ("; " + ", ".join(bad) if bad else "; nothing lost, in order")


def main(args, address: str, out) -> int:
    """Run ``args.runs`` times; exit 0 if every run was clean, 2 if any lost
    or reordered, 1 if any failed."""
    subscribers = args.subscribers if args.workload == "fanout" else 1
    argv = loadgen_argv(args.workload, address, subscribers, args.size, args.count,
                        args.seconds, args.window)
    name = f"fanout {subscribers}" if args.workload == "fanout" else args.workload
    status = 0
    for _ in range(args.runs):
        result = run_once(argv, args.timeout)
        result["workload"] = name
        if args.json:
            out.write(json.dumps(result) + "\n")
        else:
            out.write(summary(name, result) + "\n")
        out.flush()
        if "error" in result:
            status = max(status, 1)
        elif problems(result):
            status = 2
    return status
