"""Typed result rows, the performance targets (`Goal`), the table on stdout and the results file.

Nothing here measures: workloads build `Row`s, this module judges and shows them.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness import FOREIGN_WARN, LOADGEN_CPUS, ROOT, SERVER_CPUS, results_path


@dataclass(frozen=True)
class Goal:
    """A performance target on one figure of a row (against the relay, or absolute): shown as ok or MISS,
    never asserted."""
    field: str  # "ratio", "cpu_ratio", "sbus" or "drop_vs_off"
    op: str     # ">=" or "<="
    limit: float

    def met(self, value):
        return value >= self.limit if self.op == ">=" else value <= self.limit

    def to_json(self):
        return [self.field, self.op, self.limit]


THROUGHPUT_GOALS = (Goal("ratio", ">=", 0.9), Goal("cpu_ratio", "<=", 1.2))
P99_US_GOAL = Goal("sbus", "<=", 80.0)
BYTES_PER_CLIENT_GOAL = Goal("sbus", "<=", 2048)
MANYSUBS_VS_PAIR_GOAL = Goal("sbus", ">=", 0.9)
MANYPUBS_CPU_GOAL = Goal("cpu_ratio", "<=", 0.85)       # many publishers at saturation
MANYPUBS_RATE_CPU_GOAL = Goal("cpu_ratio", "<=", 1.0)   # at the fixed offered rate: no worse than the relay
# Publishers in Python (bench/pypubs.py): CPU per delivery at saturation no
# worse than the relay's, and p99 at 100k msgs/s no worse than the relay's.
PYPUBS_CPU_GOAL = Goal("cpu_ratio", "<=", 1.0)
PYPUBS_P99_GOAL = Goal("ratio", "<=", 1.0)
LOG_DEFAULT_DROP_GOAL = Goal("drop_vs_off", "<=", 0.05)
LOG_SAMPLED_DROP_GOAL = Goal("drop_vs_off", "<=", 0.15)


def ratio(a, b):
    return a / b if a is not None and b else None


@dataclass
class Row:
    """One line of the table: a figure of sbusd beside the same figure of the relay."""
    source: str          # the workload (an entry of workloads.WORKLOADS) that measured it
    workload: str        # what the table shows, e.g. "pair, log off"
    payload: int | None  # bytes, or None where the figure has no payload
    metric: str
    relay: float | None = None
    sbus: float | None = None
    relay_cpu_us: float | None = None
    sbus_cpu_us: float | None = None
    relay_busy: float | None = None
    sbus_busy: float | None = None
    problems: list[str] = field(default_factory=list)
    foreign_cores: float | None = None  # cores other processes used meanwhile (the worst series)
    goals: tuple[Goal, ...] = ()
    note: str | None = None
    drop_vs_off: float | None = None    # logging rows: throughput lost against logging off
    cpu_vs_off: float | None = None     # logging rows: server CPU per message added
    lower_is_better: bool = False
    no_ratio: bool = False  # the figures are ratios already
    hidden: bool = False    # in the results file only
    details: dict = field(default_factory=dict)  # more figures for the results file
    raw: object = None

    @property
    def ratio(self):
        return ratio(self.sbus, self.relay)

    @property
    def cpu_ratio(self):
        return ratio(self.sbus_cpu_us, self.relay_cpu_us)

    def busy_note(self):
        if self.foreign_cores is not None and self.foreign_cores > FOREIGN_WARN:
            return f"busy machine: others used {self.foreign_cores:.2f} cores"
        return None

    def to_json(self):
        doc = dict(workload=self.workload, source=self.source, payload=self.payload, metric=self.metric,
                   relay=self.relay, sbus=self.sbus, relay_cpu_us=self.relay_cpu_us,
                   sbus_cpu_us=self.sbus_cpu_us, relay_busy=self.relay_busy, sbus_busy=self.sbus_busy,
                   problems=self.problems + [n for n in [self.busy_note()] if n],
                   foreign_cores=self.foreign_cores, ratio=self.ratio, cpu_ratio=self.cpu_ratio)
        optional = dict(goals=[g.to_json() for g in self.goals], note=self.note, drop_vs_off=self.drop_vs_off,
                        cpu_vs_off=self.cpu_vs_off, lower_is_better=self.lower_is_better,
                        no_ratio=self.no_ratio, hidden=self.hidden, raw=self.raw, **self.details)
        doc.update((k, v) for k, v in optional.items() if v is not None and v is not False and v != [])
        return doc


def worst_foreign(*values):
    known = [v for v in values if v is not None]
    return max(known) if known else None


# --------------------------------------------------------------------- table

def fmt(v):
    if v is None:
        return "-"
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


def tidy(problems):
    """Problems on one line each, without repeats, long ones cut in the middle."""
    problems = [" | ".join(ln.strip() for ln in p.splitlines() if ln.strip()) for p in problems]
    problems = [p if len(p) <= 160 else p[:100] + " ... " + p[-55:] for p in problems]
    return list(dict.fromkeys(problems))


def judge(row: Row):
    """'ok' / 'MISS' per goal of the row, with the goal itself."""
    out = []
    for goal in row.goals:
        v = getattr(row, goal.field)
        if v is None:
            out.append(f"{goal.field}? ({goal.op}{goal.limit:g})")
            continue
        verdict = "ok" if goal.met(v) else "MISS"
        if goal.field == "drop_vs_off":
            cpu = f" (CPU/msg {row.cpu_vs_off:+.0%})" if row.cpu_vs_off is not None else ""
            out.append(f"{verdict} drop {v:.0%}{goal.op}{goal.limit:.0%}{cpu}")
        elif goal.field == "sbus":
            out.append(f"{verdict} {fmt(v)}{goal.op}{goal.limit:g}")
        else:
            what = {"ratio": "x", "cpu_ratio": "cpu"}[goal.field]
            out.append(f"{verdict} {what}{v:.2f}{goal.op}{goal.limit:g}")
    return out


def busy(row: Row):
    r, s = row.relay_busy, row.sbus_busy
    if r is None and s is None:
        return ""
    return f"{'-' if r is None else f'{r:.0%}'}/{'-' if s is None else f'{s:.0%}'}"


def payload_text(size):
    return "" if size is None else f"{size} B" if size < 1024 else f"{size // 1024} KiB"


def table(rows: list[Row]):
    """The rows as aligned text, a blank line between workloads."""
    head = ["workload", "payload", "metric", "relay", "sbus", "ratio", "µs/dlv relay", "sbus", "ratio",
            "busy r/s", "goal / notes"]
    shown = [r for r in rows if not r.hidden]
    lines = []
    for r in shown:
        notes = judge(r) + tidy(r.problems) + [n for n in [r.busy_note(), r.note] if n]
        lines.append([r.workload, payload_text(r.payload), r.metric, fmt(r.relay), fmt(r.sbus),
                      "" if r.no_ratio else fmt(r.ratio),
                      fmt(r.relay_cpu_us), fmt(r.sbus_cpu_us), fmt(r.cpu_ratio),
                      busy(r), "; ".join(notes)])
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]
    right = {3, 4, 5, 6, 7, 8, 9}

    def render(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [render(head), "  ".join("-" * w for w in widths)]
    for i, (row, cells) in enumerate(zip(shown, lines)):
        if i and row.source != shown[i - 1].source:
            out.append("")
        out.append(render(cells))
    return "\n".join(out)


# --------------------------------------------------------------- results file

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


def write_results(rows: list[Row], started, finished, options: dict, sbusd_cmd) -> Path:
    """bench/results/run-<UTC start>.json: the machine, the commit, the options and every row with its raw runs."""
    path = results_path("run", started)
    doc = {"started": started.isoformat(), "seconds": (finished - started).total_seconds(),
           "commit": git("rev-parse", "HEAD"), "describe": git("describe", "--always", "--dirty"),
           "machine": machine(), "options": options, "sbusd": sbusd_cmd,
           "rows": [r.to_json() for r in rows]}
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path
