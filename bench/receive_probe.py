#!/usr/bin/env python3
"""Where the receive row's time goes: bench_clients.py's sbus-sync-receive-many,
with each process's counters.

    bench/receive_probe.py [--count N] [--repeat R] [--pin b0,s1,p1] [--batch bsp] [--perf]

As the row: sbusd (this tree's), a subscriber in ``blocking/hard/block``
reading ``Client.receive_many(64)``, a publisher process sending
``publish_many(N)``. Prints per run: the subscriber's rate, CPU per message
of the three processes (getrusage for the clients, /proc for sbusd), the
subscriber's calls per message and its share of calls finding one message
and 64, and voluntary / involuntary context switches per message of each.
``--pin`` puts the broker (b), subscriber (s) or publisher (p) on a CPU;
``--batch`` makes them SCHED_BATCH; ``--perf`` adds ``perf stat`` of the
broker's syscalls (recvmmsg, sendmmsg, epoll_wait, epoll_ctl) per message.
docs/clients.md, "Where the receive row's time goes", quotes it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
KEY = "bench/key"

SUBSCRIBER = r'''
import collections, json, resource, sys, time
from sbus import Client
address, n = sys.argv[1], int(sys.argv[2])
sizes = collections.Counter()
with Client(address) as c:
    c.send_cmsg("blocking/hard/block")
    c.subscribe("bench/key")
    c.whoami()
    print("ready", flush=True)
    got = len(c.receive_many(1, timeout=30))
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    try:
        while got < n:
            batch = c.receive_many(64, timeout=5)
            sizes[len(batch)] += 1
            got += len(batch)
    except TimeoutError:
        pass
    t = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"got": got, "rate": (got - 1) / t,
                  "cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
                  "vcsw": r1.ru_nvcsw - r0.ru_nvcsw, "ivcsw": r1.ru_nivcsw - r0.ru_nivcsw,
                  "sizes": sorted(sizes.items())}), flush=True)
'''

PUBLISHER = r'''
import json, resource, sys
from sbus import Client
address, n = sys.argv[1], int(sys.argv[2])
with Client(address) as c:
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    c.publish_many([("bench/key", b"p" * 64)] * n)
    c.whoami()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
                  "vcsw": r1.ru_nvcsw - r0.ru_nvcsw, "ivcsw": r1.ru_nivcsw - r0.ru_nivcsw}), flush=True)
'''

SYSCALLS = ("recvmmsg", "sendmmsg", "epoll_wait", "epoll_ctl")


def proc_counts(pid):
    """(CPU seconds, voluntary, involuntary context switches) of pid."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return cpu, int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"])


def one(args, workdir: Path) -> dict:
    sock = str(workdir / "sbus.socket")
    sbusd = subprocess.Popen([str(BIN / "sbusd"), "-f", "-a", sock, "--log-level", "off",
                              "--stats-interval", "0"])
    deadline = time.monotonic() + 10
    while not os.path.exists(sock):
        if time.monotonic() > deadline:
            raise SystemExit("sbusd did not start")
        time.sleep(0.01)
    pins = {x[0]: {int(x[1:])} for x in args.pin.split(",") if x}
    sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, sock, str(args.count)],
                           stdout=subprocess.PIPE, text=True)
    pids = {"b": sbusd.pid, "s": sub.pid}
    try:
        if sub.stdout.readline().strip() != "ready":
            raise SystemExit("the subscriber did not start")
        for who in pids:
            if who in pins:
                os.sched_setaffinity(pids[who], pins[who])
            if who in args.batch:
                os.sched_setscheduler(pids[who], os.SCHED_BATCH, os.sched_param(0))
        before = proc_counts(sbusd.pid)
        perf = None
        if args.perf:
            perf_out = workdir / "perf.txt"
            perf = subprocess.Popen(["perf", "stat", "-x,", "-o", str(perf_out), "-p", str(sbusd.pid),
                                     "-e", ",".join(f"syscalls:sys_enter_{s}" for s in SYSCALLS)])
        pub = subprocess.Popen([sys.executable, "-c", PUBLISHER, sock, str(args.count)],
                               stdout=subprocess.PIPE, text=True)
        if "p" in pins:
            os.sched_setaffinity(pub.pid, pins["p"])
        if "p" in args.batch:
            os.sched_setscheduler(pub.pid, os.SCHED_BATCH, os.sched_param(0))
        s = json.loads(sub.stdout.readline())
        p = json.loads(pub.stdout.readline())
        pub.wait()
        after = proc_counts(sbusd.pid)
        calls = {}
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait()
            for line in perf_out.read_text().splitlines():
                parts = line.split(",")
                if len(parts) > 2 and parts[2].startswith("syscalls:sys_enter_"):
                    calls[parts[2][len("syscalls:sys_enter_"):]] = int(parts[0])
    finally:
        sub.kill()
        sub.wait()
        sbusd.send_signal(signal.SIGTERM)
        sbusd.wait()
    n = args.count
    sizes = dict(s["sizes"])
    ncalls = sum(sizes.values()) or 1
    return {"rate": round(s["rate"]), "received": s["got"],
            "cpu_us": {"broker": round((after[0] - before[0]) / n * 1e6, 2),
                       "subscriber": round(s["cpu"] / n * 1e6, 2), "publisher": round(p["cpu"] / n * 1e6, 2)},
            "sub_calls_per_msg": round(ncalls / n, 3), "sub_calls_of_1": round(sizes.get(1, 0) / ncalls, 3),
            "sub_calls_of_64": round(sizes.get(64, 0) / ncalls, 3),
            "ctx_per_msg": {"broker": [round((after[1] - before[1]) / n, 3), round((after[2] - before[2]) / n, 3)],
                            "subscriber": [round(s["vcsw"] / n, 3), round(s["ivcsw"] / n, 3)],
                            "publisher": [round(p["vcsw"] / n, 3), round(p["ivcsw"] / n, 3)]},
            **({"broker_syscalls_per_msg": {k: round(v / n, 4) for k, v in calls.items()}} if calls else {}),
            "load": os.getloadavg()[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--pin", default="", help="CPUs: b0 (broker), s1 (subscriber), p1 (publisher)")
    ap.add_argument("--batch", default="", help="SCHED_BATCH for b, s and/or p")
    ap.add_argument("--perf", action="store_true", help="count sbusd's syscalls with perf stat")
    args = ap.parse_args(argv)
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="sbus-receive-probe-") as d:
            print(json.dumps(one(args, Path(d))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
