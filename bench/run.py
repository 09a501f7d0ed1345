#!/usr/bin/env python3
"""Benchmarks sbusd against bench/relay, the raw-relay ceiling, in the same run.

    bench/run.py [WORKLOAD ...] [--quick] [--repeat N] [--duration S] [--payload 64,4096]

Prints one table on stdout (progress goes to stderr) and writes
bench/results/<UTC time>.json with the machine, the commit and every raw
figure.  bench/README.md explains how to read the table.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
BIN = BENCH / "bin"
RESULTS = BENCH / "results"
VENV_BIN = ROOT / ".venv" / "bin"
SBUSD = VENV_BIN / "sbusd"
SBUSD_CMD = [str(SBUSD)]  # --sbusd replaces it
PYTHON = VENV_BIN / "python" if (VENV_BIN / "python").exists() else Path(sys.executable)
C_PROGRAMS = ("loadgen", "relay")

# Server on one core, load generator on the other, as in the figures.
SERVER_CPUS = {0} if (os.cpu_count() or 1) >= 2 else None
LOADGEN_CPUS = {1} if (os.cpu_count() or 1) >= 2 else None

MEMORY_CLIENTS = 10_000
MEMORY_PATTERNS = 100_000

# (name, loadgen mode, loadgen args for sbusd, loadgen args for the relay, figure, unit)
# `slow` cannot run on the relay (its blocking sends stall behind the reader that
# never reads), so its ceiling is the relay serving the same fast subscribers alone.
FLOOD = {
    "pair": (["-n", "1"], ["-n", "1"], "msgs_per_s", "msg/s"),
    "fanout8": (["-n", "8"], ["-n", "8"], "deliveries_per_s", "dlv/s"),
    "fanout64": (["-n", "64"], ["-n", "64"], "deliveries_per_s", "dlv/s"),
    "manysubs": (["-n", "1", "-i", "1000", "-p", "10"], ["-n", "1", "-i", "1000", "-p", "10"],
                 "msgs_per_s", "msg/s"),
    "manywild": (["-n", "1", "-i", "1000", "-p", "10", "-W"], ["-n", "1", "-i", "1000", "-p", "10", "-W"],
                 "msgs_per_s", "msg/s"),
    "slow": (["-n", "4", "-S", "1"], ["-n", "4"], "deliveries_per_s", "dlv/s"),
}
LATENCY = {"latency": "split", "latency1": "one core"}
ALL = [*FLOOD, "idle", *LATENCY, "wake", "logging", "memory", "micro", "analytics"]
# What the issue asks for; shown in the goal column, never asserted.
GOAL_RATIO, GOAL_CPU_RATIO, GOAL_P99_US = 0.9, 1.2, 80.0
GOAL_BYTES_PER_CLIENT, GOAL_MANYSUBS_VS_PAIR = 2048, 0.9
GOAL_LOG_DEFAULT_DROP, GOAL_LOG_SAMPLED_DROP = 0.05, 0.15
# Other processes taking more than this many cores during a run make its figures suspect.
FOREIGN_WARN = 0.1

LOG_CONFIGS = {
    "log off": ["--log-level", "off", "--stats-interval", "0"],
    "log default": [],
    "log msgs 0.01": ["--log-messages", "0.01"],
}
LOG_OFF_FALLBACK = ["--log-level", "error", "--stats-interval", "0"]


def say(*args):
    print(*args, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ building

def build():
    BIN.mkdir(exist_ok=True)
    for name in C_PROGRAMS:
        src, exe = BENCH / f"{name}.c", BIN / name
        if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
            say(f"building {exe.relative_to(ROOT)}")
            subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(src)], check=True)


NICE = {"value": -10}


def pinned(cpus):
    """preexec_fn: pin to cpus and raise the priority (needs root; ignored without)."""
    def setup():
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if NICE["value"]:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, NICE["value"])
            except OSError:
                pass
    return setup


# ------------------------------------------------------------------- servers

class Server:
    """A relay or an sbusd started on the server core; ready once stdout closes."""

    def __init__(self, kind: str, workdir: Path, extra=(), cpus=SERVER_CPUS):
        self.kind = kind
        self.address = str(workdir / f"{kind}-{time.monotonic_ns()}.sock")
        if kind == "relay":
            argv = [str(BIN / "relay"), "-a", self.address]
        else:
            self.log_file = workdir / f"sbusd-{time.monotonic_ns()}.log"
            argv = [*SBUSD_CMD, "-f", "-a", self.address, "--log-format", "json",
                    "--log-file", str(self.log_file), *extra]
        self.stderr = tempfile.TemporaryFile(dir=workdir)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.stderr, preexec_fn=pinned(cpus))
        self._wait_ready()

    def _wait_ready(self, timeout=20.0):
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready and os.read(fd, 4096) == b"":
                return
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"{self.kind} did not become ready: rc={self.proc.returncode} "
                           f"stderr={self.stderr_tail()!r}")

    @property
    def pid(self):
        return self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def rss_bytes(self):
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stderr_tail(self):
        self.stderr.seek(0)
        return self.stderr.read()[-2000:].decode(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        return self.proc.returncode


def start(kind, workdir, extra=(), cpus=SERVER_CPUS):
    """A Server, or the reason it could not start."""
    if kind == "sbusd" and SBUSD_CMD == [str(SBUSD)] and not SBUSD.exists():
        return f"{SBUSD.relative_to(ROOT)} not found (make build)"
    try:
        return Server(kind, workdir, extra, cpus)
    except (RuntimeError, OSError) as e:
        return str(e)


def busy_seconds():
    """CPU time spent by everything, on every core, since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def task_seconds(pid):
    total = 0.0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0]) * 1e-9
        except (OSError, ValueError, IndexError):
            pass
    return total


def loadgen(mode, server, args, timeout=120, cpus=LOADGEN_CPUS):
    """One loadgen run; its JSON plus `foreign_cores`: the CPU other processes took meanwhile."""
    argv = [str(BIN / "loadgen"), mode, "-a", server.address, "-P", str(server.pid), *args]
    t0, busy0, srv0 = time.monotonic(), busy_seconds(), task_seconds(server.pid)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, preexec_fn=pinned(cpus))
    wall = time.monotonic() - t0
    busy, srv = busy_seconds() - busy0, task_seconds(server.pid) - srv0 if server.alive() else 0.0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"loadgen rc={p.returncode}: {p.stderr.strip()[-500:]}"}
    out = json.loads(lines[-1])
    out["rc"] = p.returncode
    out["foreign_cores"] = max(0.0, busy - srv - out.get("loadgen_cpu", 0)) / wall
    if p.stderr.strip():
        out["stderr"] = p.stderr.strip()[-500:]
    if not server.alive():
        out["error"] = f"server died: rc={server.proc.returncode} {server.stderr_tail()[-300:]}"
    return out


# ------------------------------------------------------------------ workloads

def problems(run):
    """What went wrong in one loadgen run, as short words; empty when clean."""
    if "error" in run:
        return [run["error"]]
    out = []
    for key in ("lost", "tail_lost", "reordered", "bad", "eof", "unfinished"):
        if run.get(key):
            out.append(f"{key}={run[key]}")
    if run.get("stalled"):
        out.append("stalled")
    return out


def others_busy(seconds=0.5):
    """Cores used by everything on the machine over a short sample (nothing of ours runs)."""
    b0, t0 = busy_seconds(), time.monotonic()
    time.sleep(seconds)
    return (busy_seconds() - b0) / (time.monotonic() - t0)


QUIET = {"budget": 60.0, "waited": 0.0}


def wait_quiet(limit=10.0):
    """Gives other users of the machine up to `limit` seconds (QUIET budget in all) to calm down."""
    t0 = time.monotonic()
    load = others_busy()
    while load > FOREIGN_WARN and QUIET["waited"] + (time.monotonic() - t0) < QUIET["budget"] \
            and time.monotonic() - t0 < limit:
        say(f"  waiting for a quiet machine: others use {load:.2f} cores")
        load = others_busy(2.0)
    QUIET["waited"] += time.monotonic() - t0


def run_group(configs, workdir, reps, mode, make_args, loadgen_cpus=LOADGEN_CPUS):
    """Starts every server of the group, then alternates their loadgen runs.

    configs: {label: (kind, extra sbusd args)}; make_args(kind, label) gives the
    loadgen arguments; returns {label: [runs] or error}."""
    wait_quiet()
    servers = {label: start(kind, workdir, extra) for label, (kind, extra) in configs.items()}
    results = {label: [] if isinstance(s, Server) else s for label, s in servers.items()}
    try:
        for _ in range(reps):
            for label, s in servers.items():
                if not isinstance(s, Server):
                    continue
                if not s.alive():
                    results[label] = f"server exited: {s.stderr_tail()[-300:]}"
                    servers[label] = results[label]
                    continue
                try:
                    results[label].append(loadgen(mode, s, make_args(configs[label][0], label),
                                                  cpus=loadgen_cpus))
                except subprocess.TimeoutExpired:
                    results[label].append({"error": "loadgen timed out"})
    finally:
        for s in servers.values():
            if isinstance(s, Server):
                s.stop()
    return results


def median(runs, key):
    vals = [r[key] for r in runs if isinstance(r, dict) and key in r and r[key] is not None and r[key] >= 0]
    return statistics.median(vals) if vals else None


def utilisation(runs):
    """Median fraction of its core the server used during the measured interval."""
    if isinstance(runs, str):
        return None
    vals = [r["server_cpu"] / r["seconds"] for r in runs
            if "error" not in r and r.get("server_cpu", -1) >= 0 and r.get("seconds")]
    return statistics.median(vals) if vals else None


def summarize(runs, key):
    """(median figure, median CPU µs per delivery, problems) of a list of runs or an error string."""
    if isinstance(runs, str):
        return None, None, [runs]
    probs = sorted({p for r in runs for p in problems(r)})
    good = [r for r in runs if "error" not in r]
    foreign = median(good, "foreign_cores")
    if foreign is not None and foreign > FOREIGN_WARN:
        probs.append(f"busy machine: others used {foreign:.2f} cores")
    return median(good, key), median(good, "server_cpu_us_per_delivery"), probs


def flood_rows(name, sizes, reps, duration, workdir):
    sbus_args, relay_args, key, unit = FLOOD[name]
    rows = []
    for size in sizes:
        window = "256" if size <= 1024 else "64"

        def make_args(kind, label):
            return [*(relay_args if kind == "relay" else sbus_args),
                    "-s", str(size), "-d", str(duration), "-w", window]

        res = run_group({"relay": ("relay", ()), "sbus": ("sbusd", ())}, workdir, reps, "flood", make_args)
        r_val, r_cpu, r_prob = summarize(res["relay"], key)
        s_val, s_cpu, s_prob = summarize(res["sbus"], key)
        row = dict(workload=name, payload=size, metric=unit, relay=r_val, sbus=s_val,
                   relay_cpu_us=r_cpu, sbus_cpu_us=s_cpu, problems=r_prob + s_prob, raw=res,
                   relay_busy=utilisation(res["relay"]), sbus_busy=utilisation(res["sbus"]))
        if name in ("pair", "fanout8", "manysubs"):
            row["goals"] = [("ratio", ">=", GOAL_RATIO), ("cpu_ratio", "<=", GOAL_CPU_RATIO)]
        if name == "slow":
            row["note"] = "relay: the 4 fast subscribers without the slow one"
        rows.append(row)
        say(f"{name} {size} B: relay {fmt(r_val)} sbus {fmt(s_val)} {unit} {' '.join(r_prob + s_prob)}")
    return rows


def idle_rows(sizes, reps, duration, workdir):
    """manysubs against pair, each server measured on both, runs interleaved.

    Run-to-run noise on this kind of machine (the kernel's per-packet cost
    drifts by 20% between runs) swamps a comparison of two workloads measured
    minutes apart; alternating them on the same servers cancels the drift."""
    pair_args, many_args = FLOOD["pair"][0], FLOOD["manysubs"][0]
    configs = {"relay pair": ("relay", ()), "relay manysubs": ("relay", ()),
               "sbus pair": ("sbusd", ()), "sbus manysubs": ("sbusd", ())}
    rows = []
    for size in sizes:
        window = "256" if size <= 1024 else "64"

        def make_args(kind, label):
            return [*(many_args if label.endswith("manysubs") else pair_args),
                    "-s", str(size), "-d", str(duration), "-w", window]

        res = run_group(configs, workdir, max(reps, 5), "flood", make_args)
        fig = {label: summarize(runs, "msgs_per_s") for label, runs in res.items()}
        row = dict(workload="manysubs / pair", payload=size, metric="ratio",
                   relay=ratio(fig["relay manysubs"][0], fig["relay pair"][0]),
                   sbus=ratio(fig["sbus manysubs"][0], fig["sbus pair"][0]),
                   relay_cpu_us=ratio(fig["relay manysubs"][1], fig["relay pair"][1]),
                   sbus_cpu_us=ratio(fig["sbus manysubs"][1], fig["sbus pair"][1]),
                   problems=sorted({p for f in fig.values() for p in f[2]}), raw=res, no_ratio=True,
                   figures={label: dict(msgs_per_s=f[0], cpu_us=f[1]) for label, f in fig.items()},
                   goals=[("sbus", ">=", GOAL_MANYSUBS_VS_PAIR)],
                   note="interleaved runs; the CPU columns are manysubs/pair of µs per message")
        rows.append(row)
        say(f"manysubs / pair {size} B: relay {fmt(row['relay'])} sbus {fmt(row['sbus'])} "
            + " ".join(f"{label} {fmt(f[0])}" for label, f in fig.items()))
    return rows


def latency_rows(name, sizes, reps, duration, workdir):
    split = LATENCY[name] == "split"
    cpus = LOADGEN_CPUS if split else SERVER_CPUS
    rows = []
    for size in sizes:
        def make_args(kind, label):
            return ["-s", str(size), "-d", str(duration)]

        servers = {"relay": ("relay", ()), "sbus": ("sbusd", ())}
        res = run_group(servers, workdir, reps, "latency", make_args, loadgen_cpus=cpus)
        for pct in ("p50_us", "p90_us", "p99_us", "max_us"):
            r_val, r_cpu, r_prob = summarize(res["relay"], pct)
            s_val, s_cpu, s_prob = summarize(res["sbus"], pct)
            if pct == "max_us":  # the worst of the runs, not a median
                r_val = max((r[pct] for r in res["relay"] if isinstance(r, dict) and pct in r), default=r_val) \
                    if not isinstance(res["relay"], str) else None
                s_val = max((r[pct] for r in res["sbus"] if isinstance(r, dict) and pct in r), default=s_val) \
                    if not isinstance(res["sbus"], str) else None
            row = dict(workload=name, payload=size, metric=pct.replace("_us", " µs"), relay=r_val, sbus=s_val,
                       relay_cpu_us=r_cpu, sbus_cpu_us=s_cpu, problems=r_prob + s_prob,
                       lower_is_better=True, raw=res if pct == "p50_us" else None)
            if pct == "p99_us":
                row["goals"] = [("sbus", "<=", GOAL_P99_US)]
            rows.append(row)
        say(f"{name} {size} B: p99 relay {fmt(rows[-2]['relay'])} sbus {fmt(rows[-2]['sbus'])} µs")
    return rows


def wake_rows(sizes, reps, duration):
    """The machine's floor for the latency rows: no broker, two processes
    bouncing one packet over a socketpair, across the two cores and on one."""
    rows = []
    if SERVER_CPUS is None:
        return rows
    placements = {"across cores": min(SERVER_CPUS), "one core": min(LOADGEN_CPUS)}
    for size in sizes[:1]:
        for where, cpu in placements.items():
            wait_quiet()
            argv = [str(BIN / "loadgen"), "wake", "-s", str(size), "-d", str(duration), "-C", str(cpu)]
            runs = []
            for _ in range(reps):
                p = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                                   preexec_fn=pinned(LOADGEN_CPUS))
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                runs.append(json.loads(lines[-1]) if lines else {"error": p.stderr.strip()[-300:]})
            for pct in ("p50_us", "p99_us"):
                val, _, probs = summarize(runs, pct)
                rows.append(dict(workload=f"wake floor, {where}", payload=size, metric=pct.replace("_us", " µs"),
                                 relay=val, problems=probs, no_ratio=True, lower_is_better=True,
                                 raw=runs if pct == "p50_us" else None))
        rows[0]["note"] = ("no broker: two processes ping-pong (in the relay column); "
                           "an echo through a broker on the other core crosses twice as often")
        say(f"wake floor {size} B: " + ", ".join(f"{r['workload']} {r['metric']} {fmt(r['relay'])}" for r in rows))
    return rows


def starts(args, workdir):
    """None if sbusd starts with these arguments and serves a client; else the error."""
    s = start("sbusd", workdir, args)
    if isinstance(s, str):
        return s
    try:
        hold(s, 1, 0, timeout=10)
    except (RuntimeError, OSError):
        pass
    time.sleep(0.2)
    error = None if s.alive() else f"exited: {s.stderr_tail()}"
    s.stop()
    return error


def logging_rows(sizes, reps, duration, workdir):
    """pair with sbusd's logging off, at its default, and sampling 1% of messages."""
    configs = {"relay": ("relay", ())}
    configs.update({label: ("sbusd", args) for label, args in LOG_CONFIGS.items()})
    fallback_note = None
    error = starts(LOG_CONFIGS["log off"], workdir)
    if error and starts(LOG_OFF_FALLBACK, workdir) is None:
        # Nothing is logged at level error while all goes well: as good as off.
        configs["log off"] = ("sbusd", LOG_OFF_FALLBACK)
        fallback_note = f"--log-level off failed ({error.splitlines()[-1][:80]}); ran {' '.join(LOG_OFF_FALLBACK)}"
    rows = []
    for size in sizes[:1]:
        window = "256" if size <= 1024 else "64"
        # At least 5 alternated runs each, as for `idle`: a comparison of
        # sbusd with itself drowns in the kernel's run-to-run drift otherwise.
        res = run_group(configs, workdir, max(reps, 5), "flood",
                        lambda kind, label: ["-n", "1", "-s", str(size), "-d", str(duration), "-w", window])
        r_val, r_cpu, r_prob = summarize(res["relay"], "msgs_per_s")
        off, off_cpu, _ = summarize(res["log off"], "msgs_per_s")
        for label in LOG_CONFIGS:
            s_val, s_cpu, s_prob = summarize(res[label], "msgs_per_s")
            row = dict(workload=f"pair, {label}", payload=size, metric="msg/s", relay=r_val, sbus=s_val,
                       relay_cpu_us=r_cpu, sbus_cpu_us=s_cpu, problems=r_prob + s_prob,
                       raw={"relay": res["relay"], label: res[label]})
            if label == "log off" and fallback_note:
                row["note"] = fallback_note
            if label != "log off" and off and s_val:
                row["drop_vs_off"] = 1 - s_val / off
                if s_cpu and off_cpu:
                    row["cpu_vs_off"] = s_cpu / off_cpu - 1
                limit = GOAL_LOG_DEFAULT_DROP if label == "log default" else GOAL_LOG_SAMPLED_DROP
                row["goals"] = [("drop_vs_off", "<=", limit)]
            rows.append(row)
        say(f"logging {size} B: " + " ".join(f"{r['workload']}={fmt(r['sbus'])}" for r in rows))
    return rows


def hold(server, clients, patterns, timeout=300):
    """Runs `loadgen hold`; returns (RSS connected, RSS subscribed or None, loadgen output)."""
    argv = [str(BIN / "loadgen"), "hold", "-a", server.address, "-c", str(clients), "-p", str(patterns)]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=pinned(LOADGEN_CPUS))
    out = {}
    try:
        deadline = time.monotonic() + timeout

        def phase(name):
            while time.monotonic() < deadline:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"loadgen hold: {p.stderr.read().strip()[-500:]}")
                if line.startswith("{"):
                    d = json.loads(line)
                    out[name] = d
                    if d.get("phase") == name:
                        return
            raise RuntimeError("loadgen hold timed out")

        phase("connected")
        time.sleep(0.3)
        rss1 = server.rss_bytes()
        rss2 = None
        if patterns:
            p.stdin.write("\n")
            p.stdin.flush()
            phase("subscribed")
            time.sleep(0.3)
            rss2 = server.rss_bytes()
        return rss1, rss2, out
    finally:
        try:
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def memory_rows(workdir, quick):
    clients = MEMORY_CLIENTS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < clients + 200:
        clients = max(100, hard - 200)
    patterns = MEMORY_PATTERNS // (10 if quick else 1)
    rows = []
    per_client, per_pattern = {}, {}
    for kind in ("relay", "sbusd"):
        label = "relay" if kind == "relay" else "sbus"
        # Idle clients: RSS before and after `clients` connect and are served once.
        s = start(kind, workdir)
        if isinstance(s, str):
            per_client[label] = per_pattern[label] = s
            continue
        try:
            hold(s, 10, 0)  # warm-up: first accept, first buffers
            time.sleep(0.3)
            base = s.rss_bytes()
            rss, _, out = hold(s, clients, 0)
            per_client[label] = (rss - base) / clients
            per_client[label + "_served"] = out["connected"]["clients"]
        except (RuntimeError, OSError, KeyError) as e:
            per_client[label] = str(e)
        finally:
            s.stop()
        # Patterns: RSS of 100 clients before and after they subscribe `patterns`.
        s = start(kind, workdir)
        if isinstance(s, str):
            per_pattern[label] = s
            continue
        try:
            hold(s, 10, 0)
            rss1, rss2, _ = hold(s, 100, patterns)
            per_pattern[label] = (rss2 - rss1) / patterns
        except (RuntimeError, OSError) as e:
            per_pattern[label] = str(e)
        finally:
            s.stop()

    def val(d, k):
        return d.get(k) if isinstance(d.get(k), (int, float)) else None

    def probs(d):
        return [f"{k}: {v}" for k, v in d.items() if isinstance(v, str)]

    served = per_client.get("sbus_served")
    rows.append(dict(workload=f"memory, {clients} idle clients", payload=None, metric="B RSS/client",
                     relay=val(per_client, "relay"), sbus=val(per_client, "sbus"), problems=probs(per_client),
                     lower_is_better=True, goals=[("sbus", "<=", GOAL_BYTES_PER_CLIENT)],
                     note=f"{served} of {clients} clients served" if served is not None else None,
                     served=served, clients=clients))
    rows.append(dict(workload=f"memory, {patterns} patterns", payload=None, metric="B RSS/pattern",
                     relay=val(per_pattern, "relay"), sbus=val(per_pattern, "sbus"), problems=probs(per_pattern),
                     lower_is_better=True, note="relay stores first segments only"))
    say(f"memory: {fmt(rows[0]['sbus'])} B/client, {fmt(rows[1]['sbus'])} B/pattern")
    return rows


def micro_rows(quick, workdir):
    out = workdir / "micro.json"
    argv = [str(PYTHON), "-m", "pytest", str(BENCH / "test_micro.py"), "--benchmark-only", "-q",
            "-p", "no:cacheprovider", f"--benchmark-json={out}", "-o", "addopts=",
            f"--benchmark-max-time={'0.05' if quick else '0.5'}"]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if not out.exists():
        tail = (p.stdout + p.stderr).strip().splitlines()[-5:]
        return [dict(workload="micro", payload=None, metric="", relay=None, sbus=None,
                     problems=[f"pytest rc={p.returncode}: {' | '.join(tail)}"])]
    data = json.loads(out.read_text())
    rows = []
    for b in data["benchmarks"]:
        ops = b.get("extra_info", {}).get("ops", 1)
        ns = b["stats"]["median"] * 1e9 / ops
        rows.append(dict(workload=f"micro {b['name'].removeprefix('test_')}", payload=None,
                         metric="ns/op" if ns < 1e4 else "µs/op", relay=None, sbus=ns if ns < 1e4 else ns / 1e3,
                         problems=[] if p.returncode == 0 else [f"pytest rc={p.returncode}"],
                         lower_is_better=True,  # the summary, not every round's time (megabytes)
                         raw={k: v for k, v in b["stats"].items() if k != "data"}))
    say(f"micro: {len(rows)} benchmarks")
    return rows


def analytics_rows(args):
    """bench/bench_analytics.py belongs to the analytics job: run it, show the JSON it prints."""
    path = BENCH / "bench_analytics.py"
    if not path.exists():
        return []
    argv = [str(PYTHON), str(path), *args]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    except subprocess.TimeoutExpired:
        return [dict(workload="analytics", payload=None, metric="", relay=None, sbus=None,
                     problems=["bench_analytics.py timed out"])]
    if p.returncode != 0 and args and "unrecognized arguments" in p.stderr:
        return analytics_rows([])
    data = None
    for line in reversed(p.stdout.splitlines()):
        if line.strip().startswith("{"):
            try:
                data = json.loads(line)
                break
            except ValueError:
                pass
    if data is None:
        try:
            data = json.loads(p.stdout)
        except ValueError:
            tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
            return [dict(workload="analytics", payload=None, metric="", relay=None, sbus=None,
                         problems=[f"rc={p.returncode}, no JSON: {' | '.join(tail)}"])]
    probs = [] if p.returncode == 0 else [f"rc={p.returncode}"]
    if "lines_per_s" in data:
        if data.get("checked") is False:
            probs.append("event counts differ from the generator's")
        note = (f"{data.get('lines')} lines in {data.get('seconds')} s, {data.get('jvm_cpu_s')} s JVM CPU, "
                f"session start {data.get('session_start_s')} s, counts "
                f"{'checked' if data.get('checked') else 'NOT checked'}")
        return [dict(workload="analytics job", payload=None, metric="lines/s", relay=None,
                     sbus=data["lines_per_s"], problems=probs, note=note, raw=data)]
    rows = [dict(workload=f"analytics {k}", payload=None, metric="", relay=None, sbus=v, problems=probs)
            for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    rows.append(dict(workload="analytics (raw)", payload=None, metric="", relay=None, sbus=None,
                     problems=[], raw=data, hidden=True))
    return rows


# --------------------------------------------------------------------- report

def fmt(v, unit=""):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.2f}M"
    if a >= 1e4:
        return f"{v / 1e3:.0f}k"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def ratio(a, b):
    return a / b if a is not None and b else None


def tidy(problems):
    """Problems without repeats; of the busy-machine notes only the worst."""
    problems = [" | ".join(ln.strip() for ln in p.splitlines() if ln.strip()) for p in problems]
    problems = [p if len(p) <= 160 else p[:100] + " ... " + p[-55:] for p in problems]
    busy = [p for p in problems if p.startswith("busy machine")]
    rest = list(dict.fromkeys(p for p in problems if not p.startswith("busy machine")))
    if busy:
        rest.append(max(busy, key=lambda p: float(p.split("used ")[1].split()[0])))
    return rest


def judge(row):
    """'ok' / 'MISS' per goal of the row, with the goal itself."""
    out = []
    for field, op, limit in row.get("goals", []):
        v = row.get(field)
        if v is None:
            out.append(f"{field}? ({op}{limit:g})")
            continue
        ok = v >= limit if op == ">=" else v <= limit
        what = {"ratio": "x", "cpu_ratio": "cpu", "sbus": "", "drop_vs_off": "drop"}.get(field, field)
        shown = f"{v:.0%}" if field == "drop_vs_off" else f"{v:.2f}" if field != "sbus" else fmt(v)
        if field != "drop_vs_off":
            out.append(f"{'ok' if ok else 'MISS'} {what}{shown}{op}{limit:g}")
        else:
            cpu = f" (CPU/msg {row['cpu_vs_off']:+.0%})" if row.get("cpu_vs_off") is not None else ""
            out.append(f"{'ok' if ok else 'MISS'} drop {shown}{op}{limit:.0%}{cpu}")
    return out


def derived(rows):
    """Whole-run figures: manysubs against pair for sbusd itself, unless the
    interleaved `idle` workload measured it better."""
    out = []
    measured = {r["payload"] for r in rows if r["workload"] == "manysubs / pair"}
    for size in sorted({r["payload"] for r in rows if r["workload"] == "pair"} - measured):
        pair = next((r for r in rows if r["workload"] == "pair" and r["payload"] == size), None)
        many = next((r for r in rows if r["workload"] == "manysubs" and r["payload"] == size), None)
        if pair and many:
            out.append(dict(workload="manysubs / pair", payload=size, metric="ratio",
                            relay=ratio(many["relay"], pair["relay"]), sbus=ratio(many["sbus"], pair["sbus"]),
                            problems=[], goals=[("sbus", ">=", GOAL_MANYSUBS_VS_PAIR)], no_ratio=True))
    return out


def busy(row):
    r, s = row.get("relay_busy"), row.get("sbus_busy")
    if r is None and s is None:
        return ""
    return f"{'-' if r is None else f'{r:.0%}'}/{'-' if s is None else f'{s:.0%}'}"


def table(rows):
    head = ["workload", "payload", "metric", "relay", "sbus", "ratio", "µs/dlv relay", "sbus", "ratio",
            "busy r/s", "goal / notes"]
    lines = []
    for r in rows:
        if r.get("hidden"):
            continue
        size = r["payload"]
        payload = "" if size is None else f"{size} B" if size < 1024 else f"{size // 1024} KiB"
        notes = judge(r) + tidy(r.get("problems", [])) + ([r["note"]] if r.get("note") else [])
        lines.append([r["workload"], payload, r["metric"], fmt(r.get("relay")), fmt(r.get("sbus")),
                      "" if r.get("no_ratio") else fmt(r.get("ratio")),
                      fmt(r.get("relay_cpu_us")), fmt(r.get("sbus_cpu_us")), fmt(r.get("cpu_ratio")),
                      busy(r), "; ".join(notes)])
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]
    right = {3, 4, 5, 6, 7, 8, 9}

    def render(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [render(head), "  ".join("-" * w for w in widths)]
    last = None
    for cells in lines:
        group = cells[0].split(",")[0].split()[0]
        if last is not None and group != last:
            out.append("")
        last = group
        out.append(render(cells))
    return "\n".join(out)


def machine():
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return {"nproc": os.cpu_count(), "cpu_model": model, "kernel": platform.release(),
            "machine": platform.machine(), "memory_bytes": mem, "python": platform.python_version(),
            "gcc": gcc[0] if gcc else None, "server_cpus": sorted(SERVER_CPUS or []),
            "loadgen_cpus": sorted(LOADGEN_CPUS or []),
            "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}


def git(*args):
    p = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
    return p.stdout.strip() if p.returncode == 0 else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                    help=f"any of {', '.join(ALL)}; 'fanout' means both fanouts; default: all")
    ap.add_argument("--quick", action="store_true", help="one short run each, smaller memory test")
    ap.add_argument("--repeat", type=int, help="runs per server, alternated; the median is shown (default 3)")
    ap.add_argument("--duration", type=float, help="seconds per run (default 1.5)")
    ap.add_argument("--payload", default="64,4096", help="payload sizes in bytes (default 64,4096)")
    ap.add_argument("--no-json", action="store_true", help="do not write bench/results/*.json")
    ap.add_argument("--nice", type=int, default=-10,
                    help="niceness of servers and load generator, so other work on the machine "
                         "disturbs them less (default -10; needs root, else ignored)")
    ap.add_argument("--analytics-args", default=None, metavar="ARGS",
                    help="arguments for bench/bench_analytics.py (default: the issue's "
                         "1,000,000-line log on local[2]; with --quick, 100,000 lines)")
    ap.add_argument("--quiet-wait", type=float, default=60.0, metavar="S",
                    help="seconds in all to wait for other processes to leave the CPUs alone (default 60)")
    ap.add_argument("--sbusd", metavar="CMD", help="the broker command to measure (default .venv/bin/sbusd); "
                    "it gets sbusd's arguments: -f -a PATH --log-format json --log-file FILE ...")
    opts = ap.parse_args(argv)
    if opts.sbusd:
        SBUSD_CMD[:] = shlex.split(opts.sbusd)

    chosen = []
    for w in opts.workloads or ALL:
        names = ["fanout8", "fanout64"] if w == "fanout" else [w]
        for n in names:
            if n not in ALL:
                ap.error(f"unknown workload {w!r}; choose from {', '.join(ALL)}")
            if n not in chosen:
                chosen.append(n)
    QUIET["budget"] = opts.quiet_wait
    NICE["value"] = opts.nice
    reps = opts.repeat or (1 if opts.quick else 3)
    duration = opts.duration or (0.5 if opts.quick else 1.5)
    sizes = [int(x) for x in opts.payload.split(",") if x]

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the servers inherit it
    build()
    if not opts.sbusd and not SBUSD.exists():
        say(f"warning: {SBUSD} not found; run `make build`. Only the relay is measured.")

    started = dt.datetime.now(dt.timezone.utc)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sbus-bench-") as tmp:
        workdir = Path(tmp)
        for name in chosen:
            if name in FLOOD:
                rows += flood_rows(name, sizes, reps, duration, workdir)
            elif name == "idle":
                rows += idle_rows(sizes, reps, duration, workdir)
            elif name in LATENCY:
                rows += latency_rows(name, sizes, reps, max(duration, 1.0), workdir)
            elif name == "wake":
                rows += wake_rows(sizes, reps, max(duration, 1.0))
            elif name == "logging":
                rows += logging_rows(sizes, reps, duration, workdir)
            elif name == "memory":
                rows += memory_rows(workdir, opts.quick)
            elif name == "micro":
                rows += micro_rows(opts.quick, workdir)
            elif name == "analytics":
                args = opts.analytics_args
                if args is None:
                    args = "--quick" if opts.quick else ""
                rows += analytics_rows(shlex.split(args))
    rows += derived(rows)
    for r in rows:
        if "ratio" not in r:
            r["ratio"] = ratio(r.get("sbus"), r.get("relay"))
        r["cpu_ratio"] = ratio(r.get("sbus_cpu_us"), r.get("relay_cpu_us"))

    print(table(rows))
    if not opts.no_json:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
        doc = {"started": started.isoformat(), "seconds": (dt.datetime.now(dt.timezone.utc) - started).total_seconds(),
               "commit": git("rev-parse", "HEAD"), "describe": git("describe", "--always", "--dirty"),
               "machine": machine(), "options": {"workloads": chosen, "repeat": reps, "duration": duration,
                                                 "payloads": sizes, "quick": opts.quick,
                                                 "waited_for_quiet_s": QUIET["waited"], "nice": opts.nice},
               "sbusd": SBUSD_CMD, "rows": rows}
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"\nresults: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
