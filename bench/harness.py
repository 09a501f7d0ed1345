"""Processes, servers, ports, /proc, pinning, timing and interleaving: what every bench script measures with.

A `Harness` holds the run's settings (broker command, niceness, CPU placement,
the budget for waiting on a quiet machine) so nothing is kept in module
globals.  Failures are exceptions (`BenchError`); a group of alternated runs
records the failure of one server in its `Series` and carries on with the
others.

The process and /proc helpers are the tests' own (tests/support, imported
from here by path): the `Sbusd` and `NatsServer` wrappers, `end_process`,
`free_port`, `cpu_seconds` and `thread_cpu_seconds`, `status_kib` (VmRSS).
The bench scripts import them from this module.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "tests"))

# The bench scripts' process, port and /proc helpers (imported from here, "as" re-exports).
from support import Sbusd as Sbusd  # noqa: E402
from support import cpu_seconds as cpu_seconds  # noqa: E402
from support import free_port as free_port  # noqa: E402
from support import read_to_eof, status_kib  # noqa: E402
from support.nats import NatsServer as NatsServer  # noqa: E402
from support.nats import nats_server_path as nats_server_path  # noqa: E402
from support.procfs import end_process as end_process  # noqa: E402
from support.procfs import machine_busy_seconds, thread_cpu_seconds  # noqa: E402

BIN = BENCH / "bin"
RESULTS = BENCH / "results"
VENV_BIN = ROOT / ".venv" / "bin"
SBUSD = VENV_BIN / "sbusd"
PYTHON = VENV_BIN / "python" if (VENV_BIN / "python").exists() else Path(sys.executable)
C_PROGRAMS = ("relay",)
# The load generator is the package's (sbus/_core/csrc/loadgen/, compiled in
# by `make build`), the same one `sbus bench` runs.
LOADGEN = (str(PYTHON), "-m", "sbus.cli.loadgen")
# Publishers in Python through sbus.Client, as programs send (bench/pypubs.py):
# run as a loadgen mode, it prints loadgen's JSON.
PYPUBS = (str(PYTHON), str(BENCH / "pypubs.py"))

# Server on one core, load generator on the other: the two-core machine the targets assume.
TWO_CORES = (os.cpu_count() or 1) >= 2
SERVER_CPUS = {0} if TWO_CORES else None
LOADGEN_CPUS = {1} if TWO_CORES else None

# Other processes taking more than this many cores during a run make its figures suspect.
FOREIGN_WARN = 0.1
# What loadgen reports as having gone wrong in a run, when non-zero.
PROBLEM_COUNTS = ("lost", "tail_lost", "reordered", "bad", "eof", "unfinished")


def results_path(script: str, when: datetime.datetime | None = None) -> Path:
    """Where SCRIPT writes a run's figures: bench/results/SCRIPT-STAMP.json, STAMP
    the UTC time like 20261121T041401Z (the directory is made).  A file a
    document cites is committed renamed cited-SCRIPT-STAMP.json."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    RESULTS.mkdir(exist_ok=True)
    return RESULTS / f"{script}-{when.astimezone(datetime.timezone.utc):%Y%m%dT%H%M%SZ}.json"


def callgrind_instructions(argv: list, out: Path, timeout: float = 1800) -> int:
    """The instructions ``argv`` ran under callgrind (its dump's summary),
    the dump written to ``out``; the command's output is discarded."""
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout)
    text = out.read_text(errors="replace")
    m = re.search(r"^summary:\s+(\d+)", text, re.M) or re.search(r"^totals:\s+(\d+)", text, re.M)
    return int(m.group(1))


class BenchError(Exception):
    """A measurement that could not be made: a server that did not start or died, a loadgen failure."""


def say(*args):
    print(*args, file=sys.stderr, flush=True)


def build():
    """Compiles bench/*.c into bench/bin/ when the source is newer."""
    BIN.mkdir(exist_ok=True)
    for name in C_PROGRAMS:
        src, exe = BENCH / f"{name}.c", BIN / name
        if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
            say(f"building {exe.relative_to(ROOT)}")
            subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(src)], check=True)


def window(size):
    """loadgen's in-flight window: smaller for large payloads, so a window fits the socket buffers."""
    return "256" if size <= 1024 else "64"


# --------------------------------------------------------------- machine load

def others_busy(seconds=0.5):
    """Cores used by everything on the machine over a short sample (nothing of ours runs)."""
    b0, t0 = machine_busy_seconds(), time.monotonic()
    time.sleep(seconds)
    return (machine_busy_seconds() - b0) / (time.monotonic() - t0)


# ----------------------------------------------------------------- one series

def run_problems(run):
    """What went wrong in one loadgen run, as short words; empty when clean."""
    if "error" in run:
        return [run["error"]]
    out = [f"{key}={run[key]}" for key in PROBLEM_COUNTS if run.get(key)]
    if run.get("stalled"):
        out.append("stalled")
    return out


def median(runs, key):
    vals = [r[key] for r in runs if r.get(key) is not None and r[key] >= 0]
    return statistics.median(vals) if vals else None


@dataclass
class Summary:
    """The medians of one series: the figure asked for, server CPU µs per delivery, and what went wrong."""
    value: float | None = None
    cpu_us: float | None = None
    problems: list[str] = field(default_factory=list)
    foreign_cores: float | None = None  # median of what other processes used meanwhile


@dataclass
class Series:
    """The loadgen runs (their JSON) of one server configuration; `failed` says why they stopped early."""
    runs: list[dict] = field(default_factory=list)
    failed: str | None = None

    @property
    def good(self):
        return [r for r in self.runs if "error" not in r]

    def summary(self, key) -> Summary:
        if self.failed is not None:
            return Summary(problems=[self.failed])
        good = self.good
        return Summary(median(good, key), median(good, "server_cpu_us_per_delivery"),
                       sorted({p for r in self.runs for p in run_problems(r)}),
                       median(good, "foreign_cores"))

    def worst(self, key):
        """The largest `key` of any run (for maxima, where a median would hide the worst case)."""
        if self.failed is not None:
            return None
        return max((r[key] for r in self.runs if key in r), default=self.summary(key).value)

    def utilisation(self):
        """Median fraction of its core the server used during the measured interval."""
        if self.failed is not None:
            return None
        vals = [r["server_cpu"] / r["seconds"] for r in self.good
                if r.get("server_cpu", -1) >= 0 and r.get("seconds")]
        return statistics.median(vals) if vals else None

    def to_json(self):
        """As results files have always held it: the runs, or the reason there are none."""
        return self.failed if self.failed is not None else self.runs

    def median(self, key):
        """The median of `key` over the good runs (None when none has it)."""
        return median(self.good, key)

    def medians(self, key):
        """For a `key` whose value is a dict of figures: the median of each, by name."""
        good = self.good
        return {name: median([r[key] for r in good], name) for name in good[0][key]} if good else {}


def alternate(labels, reps, run_one, progress=None) -> dict[str, Series]:
    """`reps` rounds of `run_one(label)` for every label in turn, so that drift on
    the machine falls on every label alike; each label's results as a `Series`.

    A BenchError from a run records why in that label's series, which runs no
    more; `progress(round, label, result)` is called after every other run."""
    series = {label: Series() for label in labels}
    for i in range(reps):
        for label, runs in series.items():
            if runs.failed is not None:
                continue
            try:
                result = run_one(label)
            except BenchError as e:
                runs.failed = str(e)
                continue
            runs.runs.append(result)
            if progress:
                progress(i, label, result)
    return series


# -------------------------------------------------------------------- servers

class Server:
    """A relay or an sbusd started on the server core; ready once stdout closes."""

    def __init__(self, argv, kind, address, workdir: Path, preexec, log_file=None):
        self.kind = kind
        self.address = address
        self.log_file = log_file
        self.stderr = tempfile.TemporaryFile(dir=workdir)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.stderr, preexec_fn=preexec)
        try:
            read_to_eof(self.proc.stdout, timeout=20.0)
            ready = self.proc.poll() is None
        except AssertionError:
            ready = False
        if not ready:
            self.stop()
            raise BenchError(f"{self.kind} did not become ready: rc={self.proc.returncode} "
                             f"stderr={self.stderr_tail()!r}")

    @property
    def pid(self):
        return self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def rss_bytes(self):
        return status_kib(self.pid, "VmRSS") * 1024

    def stderr_tail(self):
        self.stderr.seek(0)
        return self.stderr.read()[-2000:].decode(errors="replace")

    def stop(self):
        end_process(self.proc)
        self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# -------------------------------------------------------------------- harness

@dataclass
class Harness:
    """The run's settings and the processes started under them."""
    workdir: Path
    sbusd_cmd: list[str] = field(default_factory=lambda: [str(SBUSD)])
    nice: int = -10
    quiet_budget: float = 60.0  # seconds in all to wait for a quiet machine
    quiet_waited: float = 0.0

    @property
    def default_sbusd(self):
        return self.sbusd_cmd == [str(SBUSD)]

    def pinned(self, cpus):
        """preexec_fn: pin to cpus and raise the priority (needs root; ignored without)."""
        def setup():
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            if self.nice:
                try:
                    os.setpriority(os.PRIO_PROCESS, 0, self.nice)
                except OSError:
                    pass
        return setup

    def start(self, kind, extra=(), cpus=SERVER_CPUS) -> Server:
        """A started "relay" or "sbusd" (with `extra` arguments); BenchError if it cannot start."""
        stamp = time.monotonic_ns()
        address = str(self.workdir / f"{kind}-{stamp}.sock")
        log_file = None
        if kind == "relay":
            argv = [str(BIN / "relay"), "-a", address]
        else:
            if self.default_sbusd and not SBUSD.exists():
                raise BenchError(f"{SBUSD.relative_to(ROOT)} not found (make build)")
            log_file = self.workdir / f"sbusd-{stamp}.log"
            argv = [*self.sbusd_cmd, "-f", "-a", address, "--log-format", "json",
                    "--log-file", str(log_file), *extra]
        try:
            return Server(argv, kind, address, self.workdir, self.pinned(cpus), log_file)
        except OSError as e:
            raise BenchError(str(e)) from e

    def wait_quiet(self, limit=10.0):
        """Gives other users of the machine up to `limit` seconds (the budget in all) to calm down."""
        t0 = time.monotonic()
        load = others_busy()
        while load > FOREIGN_WARN and self.quiet_waited + (time.monotonic() - t0) < self.quiet_budget \
                and time.monotonic() - t0 < limit:
            say(f"  waiting for a quiet machine: others use {load:.2f} cores")
            load = others_busy(2.0)
        self.quiet_waited += time.monotonic() - t0

    def loadgen(self, mode, server, args, timeout=120, cpus=LOADGEN_CPUS, program=LOADGEN):
        """One loadgen run (or `program`'s, which takes loadgen's arguments and prints its
        JSON); its JSON plus `foreign_cores`: the CPU other processes took meanwhile.

        A failed run is returned with an "error" key, so that a series keeps its place."""
        argv = [*program, mode, "-a", server.address, "-P", str(server.pid), *args]
        t0, busy0, srv0 = time.monotonic(), machine_busy_seconds(), thread_cpu_seconds(server.pid)
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                               preexec_fn=self.pinned(cpus))
        except subprocess.TimeoutExpired:
            return {"error": "loadgen timed out"}
        wall = time.monotonic() - t0
        busy, srv = machine_busy_seconds() - busy0, thread_cpu_seconds(server.pid) - srv0 if server.alive() else 0.0
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

    def wake(self, size, duration, cpu, timeout=120):
        """One `loadgen wake` run (no server): two processes ping-pong, the second on `cpu`."""
        argv = [*LOADGEN, "wake", "-s", str(size), "-d", str(duration), "-C", str(cpu)]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                           preexec_fn=self.pinned(LOADGEN_CPUS))
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {"error": p.stderr.strip()[-300:]}

    def interleave(self, configs, reps, mode, loadgen_args, loadgen_cpus=LOADGEN_CPUS,
                   program=LOADGEN) -> dict[str, Series]:
        """Starts every server of the group, then alternates their loadgen runs `reps` times.

        configs: {label: (kind, extra sbusd args)}; loadgen_args(kind, label) gives
        the loadgen arguments.  Alternating lets drift on the machine hit all alike."""
        self.wait_quiet()
        servers, refused = {}, {}
        try:
            for label, (kind, extra) in configs.items():
                try:
                    servers[label] = self.start(kind, extra)
                except BenchError as e:
                    refused[label] = str(e)

            def run_one(label):
                server = servers[label]
                if not server.alive():
                    raise BenchError(f"server exited: {server.stderr_tail()[-300:]}")
                return self.loadgen(mode, server, loadgen_args(configs[label][0], label), cpus=loadgen_cpus,
                                    program=program)

            series = alternate(list(servers), reps, run_one)
        finally:
            for server in servers.values():
                server.stop()
        # A server that exited keeps no runs, as one that never started.
        series = {label: Series(failed=series[label].failed) if series[label].failed else series[label]
                  for label in series}
        series.update({label: Series(failed=why) for label, why in refused.items()})
        return {label: series[label] for label in configs}

    def hold(self, server, clients, patterns, timeout=300):
        """Runs `loadgen hold`; returns (RSS connected, RSS subscribed or None, loadgen output)."""
        argv = [*LOADGEN, "hold", "-a", server.address, "-c", str(clients), "-p", str(patterns)]
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=self.pinned(LOADGEN_CPUS))
        out = {}
        try:
            deadline = time.monotonic() + timeout

            def phase(name):
                while time.monotonic() < deadline:
                    line = p.stdout.readline()
                    if not line:
                        raise BenchError(f"loadgen hold: {p.stderr.read().strip()[-500:]}")
                    if line.startswith("{"):
                        d = json.loads(line)
                        out[name] = d
                        if d.get("phase") == name:
                            return
                raise BenchError("loadgen hold timed out")

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

    def sbusd_serves(self, args):
        """Whether sbusd starts with these arguments and serves a client; BenchError saying why not."""
        server = self.start("sbusd", args)
        try:
            try:
                self.hold(server, 1, 0, timeout=10)
            except (BenchError, OSError):
                pass
            time.sleep(0.2)
            if not server.alive():
                raise BenchError(f"exited: {server.stderr_tail()}")
        finally:
            server.stop()
