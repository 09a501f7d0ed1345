"""Every workload: one entry in WORKLOADS and the function that measures it.

A workload function takes the run's `Plan` and returns `report.Row`s.  To add
one, write the function and add its entry; run.py's CLI, the default run and
the table pick it up from here.
"""
from __future__ import annotations

import json
import resource
import shlex
import subprocess
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from harness import (
    BENCH,
    LOADGEN_CPUS,
    PYPUBS,
    PYTHON,
    ROOT,
    SERVER_CPUS,
    BenchError,
    Harness,
    Series,
    Summary,
    say,
    window,
)
from report import (
    BYTES_PER_CLIENT_GOAL,
    LOG_DEFAULT_DROP_GOAL,
    LOG_SAMPLED_DROP_GOAL,
    MANYPUBS_CPU_GOAL,
    MANYPUBS_RATE_CPU_GOAL,
    MANYSUBS_VS_PAIR_GOAL,
    P99_US_GOAL,
    PYPUBS_CPU_GOAL,
    PYPUBS_P99_GOAL,
    THROUGHPUT_GOALS,
    Goal,
    Row,
    fmt,
    ratio,
    worst_foreign,
)


@dataclass
class Plan:
    """What this run measures with: the harness and the sizes, repeats and durations asked for."""
    harness: Harness
    sizes: list[int]
    reps: int
    duration: float
    quick: bool
    analytics_args: str | None

    @property
    def workdir(self) -> Path:
        return self.harness.workdir


RELAY_AND_SBUS = {"relay": ("relay", ()), "sbus": ("sbusd", ())}


# ---------------------------------------------------------------------- flood

@dataclass(frozen=True)
class Flood:
    """A `loadgen flood` workload: its arguments per server, the figure shown, its goals."""
    sbus_args: tuple[str, ...]
    figure: str  # loadgen's key: "msgs_per_s" or "deliveries_per_s"
    unit: str
    relay_args: tuple[str, ...] | None = None  # default: the same as sbusd's
    goals: tuple[Goal, ...] = ()
    note: str | None = None


PAIR = ("-n", "1")
MANYSUBS = ("-n", "1", "-i", "1000", "-p", "10")


def flood_rows(spec: Flood, name, plan: Plan):
    relay_args = spec.sbus_args if spec.relay_args is None else spec.relay_args
    rows = []
    for size in plan.sizes:
        def loadgen_args(kind, label):
            return [*(relay_args if kind == "relay" else spec.sbus_args),
                    "-s", str(size), "-d", str(plan.duration), "-w", window(size)]

        res = plan.harness.interleave(RELAY_AND_SBUS, plan.reps, "flood", loadgen_args)
        r, s = res["relay"].summary(spec.figure), res["sbus"].summary(spec.figure)
        rows.append(Row(name, name, size, spec.unit, relay=r.value, sbus=s.value,
                        relay_cpu_us=r.cpu_us, sbus_cpu_us=s.cpu_us,
                        relay_busy=res["relay"].utilisation(), sbus_busy=res["sbus"].utilisation(),
                        problems=r.problems + s.problems,
                        foreign_cores=worst_foreign(r.foreign_cores, s.foreign_cores),
                        goals=spec.goals, note=spec.note, raw=raw(res)))
        say(f"{name} {size} B: relay {fmt(r.value)} sbus {fmt(s.value)} {spec.unit} "
            f"{' '.join(r.problems + s.problems)}")
    return rows


def raw(series: dict[str, Series]):
    return {label: s.to_json() for label, s in series.items()}


# ------------------------------------------------------------------- manypubs

MANYPUBS_PUBLISHERS = 256
MANYPUBS_PROCS = 2
MANYPUBS_RATE = 100_000  # messages/s offered over all publishers in the fixed-rate mode


def manypubs_rows(plan: Plan):
    """256 publisher connections (over 2 processes), one message each in
    turn, to one subscriber in blocking/hard/block mode: at saturation, and
    at a fixed offered rate.  CPU per delivery for both, p99 publish-to-
    delivery latency at the fixed rate (at saturation it is the window's
    queueing, shown in the results file only)."""
    base = ("-N", str(MANYPUBS_PUBLISHERS), "-G", str(MANYPUBS_PROCS), "-n", "1")
    modes = [("manypubs", (), "msgs_per_s", "msg/s", (MANYPUBS_CPU_GOAL,), False),
             (f"manypubs {MANYPUBS_RATE // 1000}k/s", ("-r", str(MANYPUBS_RATE)), "p99_us", "p99 µs",
              (MANYPUBS_RATE_CPU_GOAL,), True)]
    rows = []
    for size in plan.sizes:
        for label, extra, figure, unit, goals, lower in modes:
            def loadgen_args(kind, _label, extra=extra, size=size):
                return [*base, *extra, "-s", str(size), "-d", str(plan.duration), "-w", window(size)]

            res = plan.harness.interleave(RELAY_AND_SBUS, plan.reps, "manypubs", loadgen_args)
            r, s = res["relay"].summary(figure), res["sbus"].summary(figure)
            rows.append(Row("manypubs", label, size, unit, relay=r.value, sbus=s.value,
                            relay_cpu_us=r.cpu_us, sbus_cpu_us=s.cpu_us,
                            relay_busy=res["relay"].utilisation(), sbus_busy=res["sbus"].utilisation(),
                            problems=r.problems + s.problems,
                            foreign_cores=worst_foreign(r.foreign_cores, s.foreign_cores),
                            goals=goals, lower_is_better=lower, raw=raw(res)))
            say(f"{label} {size} B: relay {fmt(r.value)} sbus {fmt(s.value)} {unit}, "
                f"µs/dlv relay {fmt(r.cpu_us)} sbus {fmt(s.cpu_us)} {' '.join(r.problems + s.problems)}")
    return rows


# ---------------------------------------------------------- Python publishers

PY_RATES = (0, 10_000, 50_000, 100_000, 200_000)   # messages/s offered in all; 0: saturation
# Publisher connections and the Python processes that drive them.
PY_SHAPES = {"pypubs": (MANYPUBS_PUBLISHERS, 1), "pypair": (1, 1)}
PY_SHORT = 0.95     # a fixed-rate run that sent less than this share of its rate says so


def pyrates_rows(name, plan: Plan):
    """Publishers in Python (bench/pypubs.py, sbus.Client.publish) to one
    subscriber in blocking/hard/block mode, at saturation and at each offered
    rate of PY_RATES: messages/s, server CPU per delivery and p50/p99
    publish-to-delivery latency, beside the relay.  Every rate of both servers
    runs in one alternation, so the machine's drift falls on all alike."""
    pubs, procs = PY_SHAPES[name]
    configs = {f"{label} {rate}": (kind, ()) for rate in PY_RATES for label, (kind, _) in RELAY_AND_SBUS.items()}
    rows = []
    for size in plan.sizes[:1]:
        def loadgen_args(kind, label, size=size):
            rate = int(label.split()[1])
            return ["-N", str(pubs), "-G", str(procs), "-s", str(size), "-d", str(plan.duration),
                    "-w", window(size), *(["-r", str(rate)] if rate else [])]

        res = plan.harness.interleave(configs, plan.reps, "pubs", loadgen_args, program=PYPUBS)
        for rate in PY_RATES:
            pair = {"relay": res[f"relay {rate}"], "sbus": res[f"sbus {rate}"]}
            label = name if not rate else f"{name} {rate // 1000}k/s"
            sent = {k: v.summary("msgs_per_s").value for k, v in pair.items()}
            note = None
            if rate and any(v is not None and v < PY_SHORT * rate for v in sent.values()):
                note = (f"offered {fmt(rate)}/s; the Python publishers sent relay {fmt(sent['relay'])}, "
                        f"sbus {fmt(sent['sbus'])}/s")
            elif not rate:
                note = "latency at saturation is the window's queueing"
            figures = ([("msgs_per_s", "msg/s")] if not rate else []) + [("p50_us", "p50 µs"), ("p99_us", "p99 µs")]
            for i, (figure, unit) in enumerate(figures):
                r, s = pair["relay"].summary(figure), pair["sbus"].summary(figure)
                goals = ()
                if name == "pypubs" and figure == "msgs_per_s":
                    goals = (PYPUBS_CPU_GOAL,)
                elif name == "pypubs" and rate == MANYPUBS_RATE and figure == "p99_us":
                    goals = (PYPUBS_P99_GOAL,)
                rows.append(Row(name, label, size, unit, relay=r.value, sbus=s.value,
                                relay_cpu_us=r.cpu_us, sbus_cpu_us=s.cpu_us,
                                relay_busy=pair["relay"].utilisation(), sbus_busy=pair["sbus"].utilisation(),
                                problems=r.problems + s.problems,
                                foreign_cores=worst_foreign(r.foreign_cores, s.foreign_cores),
                                goals=goals, lower_is_better=figure != "msgs_per_s",
                                note=note if i == 0 else None, raw=raw(pair) if i == 0 else None,
                                details={"offered_rate": rate, "publishers": pubs, "publisher_procs": procs}))
            say(f"{label} {size} B: sent relay {fmt(sent['relay'])} sbus {fmt(sent['sbus'])} msg/s, "
                f"p99 relay {fmt(pair['relay'].summary('p99_us').value)} "
                f"sbus {fmt(pair['sbus'].summary('p99_us').value)} µs")
    return rows


# ----------------------------------------------------------------------- idle

def idle_rows(plan: Plan):
    """manysubs against pair, each server measured on both, runs interleaved.

    Run-to-run noise on this kind of machine (the kernel's per-packet cost
    drifts by 20% between runs) swamps a comparison of two workloads measured
    minutes apart; alternating them on the same servers cancels the drift."""
    configs = {"relay pair": ("relay", ()), "relay manysubs": ("relay", ()),
               "sbus pair": ("sbusd", ()), "sbus manysubs": ("sbusd", ())}
    rows = []
    for size in plan.sizes:
        def loadgen_args(kind, label):
            return [*(MANYSUBS if label.endswith("manysubs") else PAIR),
                    "-s", str(size), "-d", str(plan.duration), "-w", window(size)]

        res = plan.harness.interleave(configs, max(plan.reps, 5), "flood", loadgen_args)
        fig: dict[str, Summary] = {label: runs.summary("msgs_per_s") for label, runs in res.items()}
        rows.append(Row(
            "idle", "manysubs / pair", size, "ratio",
            relay=ratio(fig["relay manysubs"].value, fig["relay pair"].value),
            sbus=ratio(fig["sbus manysubs"].value, fig["sbus pair"].value),
            relay_cpu_us=ratio(fig["relay manysubs"].cpu_us, fig["relay pair"].cpu_us),
            sbus_cpu_us=ratio(fig["sbus manysubs"].cpu_us, fig["sbus pair"].cpu_us),
            problems=sorted({p for f in fig.values() for p in f.problems}),
            foreign_cores=worst_foreign(*(f.foreign_cores for f in fig.values())),
            no_ratio=True, goals=(MANYSUBS_VS_PAIR_GOAL,), raw=raw(res),
            details={"figures": {label: dict(msgs_per_s=f.value, cpu_us=f.cpu_us) for label, f in fig.items()}},
            note="interleaved runs; the CPU columns are manysubs/pair of µs per message"))
        say(f"manysubs / pair {size} B: relay {fmt(rows[-1].relay)} sbus {fmt(rows[-1].sbus)} "
            + " ".join(f"{label} {fmt(f.value)}" for label, f in fig.items()))
    return rows


def derived_rows(rows: list[Row]):
    """Whole-run figures: manysubs against pair for sbusd itself, unless the
    interleaved `idle` workload measured it better."""
    def find(source, size):
        return next((r for r in rows if r.source == source and r.payload == size), None)

    out = []
    measured = {r.payload for r in rows if r.source == "idle"}
    for size in sorted({r.payload for r in rows if r.source == "pair"} - measured):
        pair, many = find("pair", size), find("manysubs", size)
        if pair and many:
            out.append(Row("idle", "manysubs / pair", size, "ratio",
                           relay=ratio(many.relay, pair.relay), sbus=ratio(many.sbus, pair.sbus),
                           goals=(MANYSUBS_VS_PAIR_GOAL,), no_ratio=True))
    return out


# -------------------------------------------------------------------- latency

PERCENTILES = ("p50_us", "p90_us", "p99_us", "max_us")


def latency_rows(one_core, name, plan: Plan):
    """Echo round trips, one in flight; ping and echo on the other core, or on the server's."""
    cpus = SERVER_CPUS if one_core else LOADGEN_CPUS
    duration = max(plan.duration, 1.0)
    rows = []
    for size in plan.sizes:
        res = plan.harness.interleave(RELAY_AND_SBUS, plan.reps, "latency",
                                      lambda kind, label: ["-s", str(size), "-d", str(duration)],
                                      loadgen_cpus=cpus)
        for pct in PERCENTILES:
            r, s = res["relay"].summary(pct), res["sbus"].summary(pct)
            if pct == "max_us":  # the worst of the runs, not a median
                r.value, s.value = res["relay"].worst(pct), res["sbus"].worst(pct)
            rows.append(Row(name, name, size, pct.replace("_us", " µs"), relay=r.value, sbus=s.value,
                            relay_cpu_us=r.cpu_us, sbus_cpu_us=s.cpu_us, problems=r.problems + s.problems,
                            foreign_cores=worst_foreign(r.foreign_cores, s.foreign_cores),
                            lower_is_better=True, goals=(P99_US_GOAL,) if pct == "p99_us" else (),
                            raw=raw(res) if pct == "p50_us" else None))
        p99 = rows[-2]
        say(f"{name} {size} B: p99 relay {fmt(p99.relay)} sbus {fmt(p99.sbus)} µs")
    return rows


def wake_rows(plan: Plan):
    """The machine's floor for the latency rows: no broker, two processes
    bouncing one packet over a socketpair, across the two cores and on one."""
    rows = []
    if SERVER_CPUS is None:
        return rows
    placements = {"across cores": min(SERVER_CPUS), "one core": min(LOADGEN_CPUS)}
    duration = max(plan.duration, 1.0)
    for size in plan.sizes[:1]:
        for where, cpu in placements.items():
            plan.harness.wait_quiet()
            runs = Series([plan.harness.wake(size, duration, cpu) for _ in range(plan.reps)])
            for pct in ("p50_us", "p99_us"):
                f = runs.summary(pct)
                rows.append(Row("wake", f"wake floor, {where}", size, pct.replace("_us", " µs"),
                                relay=f.value, problems=f.problems, foreign_cores=f.foreign_cores,
                                no_ratio=True, lower_is_better=True,
                                raw=runs.to_json() if pct == "p50_us" else None))
        rows[0].note = ("no broker: two processes ping-pong (in the relay column); "
                        "an echo through a broker on the other core crosses twice as often")
        say(f"wake floor {size} B: " + ", ".join(f"{r.workload} {r.metric} {fmt(r.relay)}" for r in rows))
    return rows


# -------------------------------------------------------------------- logging

LOG_CONFIGS = {
    "log off": (["--log-level", "off", "--stats-interval", "0"], None),
    "log default": ([], LOG_DEFAULT_DROP_GOAL),
    "log msgs 0.01": (["--log-messages", "0.01"], LOG_SAMPLED_DROP_GOAL),
}
# Nothing is logged at level error while all goes well: as good as off, for a broker without "off".
LOG_OFF_FALLBACK = ["--log-level", "error", "--stats-interval", "0"]


def logging_rows(plan: Plan):
    """pair with sbusd's logging off, at its default, and sampling 1% of messages."""
    configs = {"relay": ("relay", ())}
    configs.update({label: ("sbusd", args) for label, (args, _) in LOG_CONFIGS.items()})
    fallback_note = None
    try:
        plan.harness.sbusd_serves(LOG_CONFIGS["log off"][0])
    except BenchError as off_failed:
        try:
            plan.harness.sbusd_serves(LOG_OFF_FALLBACK)
            configs["log off"] = ("sbusd", LOG_OFF_FALLBACK)
            fallback_note = (f"--log-level off failed ({str(off_failed).splitlines()[-1][:80]}); "
                             f"ran {' '.join(LOG_OFF_FALLBACK)}")
        except BenchError:
            pass  # sbusd does not start at all: the rows say why
    rows = []
    for size in plan.sizes[:1]:
        # At least 5 alternated runs each, as for `idle`: a comparison of
        # sbusd with itself drowns in the kernel's run-to-run drift otherwise.
        res = plan.harness.interleave(
            configs, max(plan.reps, 5), "flood",
            lambda kind, label: [*PAIR, "-s", str(size), "-d", str(plan.duration), "-w", window(size)])
        r = res["relay"].summary("msgs_per_s")
        off = res["log off"].summary("msgs_per_s")
        for label, (_, goal) in LOG_CONFIGS.items():
            s = res[label].summary("msgs_per_s")
            row = Row("logging", f"pair, {label}", size, "msg/s", relay=r.value, sbus=s.value,
                      relay_cpu_us=r.cpu_us, sbus_cpu_us=s.cpu_us, problems=r.problems + s.problems,
                      foreign_cores=worst_foreign(r.foreign_cores, s.foreign_cores),
                      raw=raw({"relay": res["relay"], label: res[label]}))
            if goal is None:
                row.note = fallback_note
            elif off.value and s.value:
                row.drop_vs_off = 1 - s.value / off.value
                if s.cpu_us and off.cpu_us:
                    row.cpu_vs_off = s.cpu_us / off.cpu_us - 1
                row.goals = (goal,)
            rows.append(row)
        say(f"logging {size} B: " + " ".join(f"{r.workload}={fmt(r.sbus)}" for r in rows))
    return rows


# --------------------------------------------------------------------- memory

MEMORY_CLIENTS = 10_000
MEMORY_PATTERNS = 100_000


def rss_per_client(harness: Harness, kind, clients):
    """(RSS growth per idle client, clients served): RSS before and after they connect and are served once."""
    with harness.start(kind) as server:
        harness.hold(server, 10, 0)  # warm-up: first accept, first buffers
        time.sleep(0.3)
        base = server.rss_bytes()
        rss, _, out = harness.hold(server, clients, 0)
        try:
            served = out["connected"]["clients"]
        except KeyError as e:
            raise BenchError(f"loadgen hold said nothing of {e}") from e
        return (rss - base) / clients, served


def rss_per_pattern(harness: Harness, kind, patterns):
    """RSS growth per pattern: 100 clients before and after they subscribe `patterns` in all."""
    with harness.start(kind) as server:
        harness.hold(server, 10, 0)
        rss1, rss2, _ = harness.hold(server, 100, patterns)
        return (rss2 - rss1) / patterns


def memory_rows(plan: Plan):
    clients = MEMORY_CLIENTS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < clients + 200:
        clients = max(100, hard - 200)
    patterns = MEMORY_PATTERNS // (10 if plan.quick else 1)
    per_client, per_pattern, served = {}, {}, None
    client_problems, pattern_problems = [], []
    for kind, label in (("relay", "relay"), ("sbusd", "sbus")):
        try:
            per_client[label], n = rss_per_client(plan.harness, kind, clients)
            if label == "sbus":
                served = n
        except (BenchError, OSError) as e:
            client_problems.append(f"{label}: {e}")
        try:
            per_pattern[label] = rss_per_pattern(plan.harness, kind, patterns)
        except (BenchError, OSError) as e:
            pattern_problems.append(f"{label}: {e}")
    rows = [
        Row("memory", f"memory, {clients} idle clients", None, "B RSS/client",
            relay=per_client.get("relay"), sbus=per_client.get("sbus"), problems=client_problems,
            lower_is_better=True, goals=(BYTES_PER_CLIENT_GOAL,),
            note=f"{served} of {clients} clients served" if served is not None else None,
            details={"served": served, "clients": clients}),
        Row("memory", f"memory, {patterns} patterns", None, "B RSS/pattern",
            relay=per_pattern.get("relay"), sbus=per_pattern.get("sbus"), problems=pattern_problems,
            lower_is_better=True, note="relay stores first segments only"),
    ]
    say(f"memory: {fmt(rows[0].sbus)} B/client, {fmt(rows[1].sbus)} B/pattern")
    return rows


# ---------------------------------------------------------- micro, analytics

def micro_rows(plan: Plan):
    """pytest-benchmark over bench/test_micro.py: the pattern index and the send queue alone."""
    out = plan.workdir / "micro.json"
    argv = [str(PYTHON), "-m", "pytest", str(BENCH / "test_micro.py"), "--benchmark-only", "-q",
            "-p", "no:cacheprovider", f"--benchmark-json={out}", "-o", "addopts=",
            f"--benchmark-max-time={'0.05' if plan.quick else '0.5'}"]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if not out.exists():
        tail = (p.stdout + p.stderr).strip().splitlines()[-5:]
        return [Row("micro", "micro", None, "", problems=[f"pytest rc={p.returncode}: {' | '.join(tail)}"])]
    rows = []
    for b in json.loads(out.read_text())["benchmarks"]:
        ns = b["stats"]["median"] * 1e9 / b.get("extra_info", {}).get("ops", 1)
        rows.append(Row("micro", f"micro {b['name'].removeprefix('test_')}", None,
                        "ns/op" if ns < 1e4 else "µs/op", sbus=ns if ns < 1e4 else ns / 1e3,
                        problems=[] if p.returncode == 0 else [f"pytest rc={p.returncode}"],
                        lower_is_better=True,
                        # the summary, not every round's time (megabytes)
                        raw={k: v for k, v in b["stats"].items() if k != "data"}))
    say(f"micro: {len(rows)} benchmarks")
    return rows


def analytics_rows(plan: Plan):
    """bench/bench_analytics.py belongs to the analytics job: run it, show the JSON it prints."""
    args = plan.analytics_args
    if args is None:
        args = "--quick" if plan.quick else ""
    return run_analytics(shlex.split(args))


def run_analytics(args):
    path = BENCH / "bench_analytics.py"
    if not path.exists():
        return []
    argv = [str(PYTHON), str(path), *args]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    except subprocess.TimeoutExpired:
        return [Row("analytics", "analytics", None, "", problems=["bench_analytics.py timed out"])]
    if p.returncode != 0 and args and "unrecognized arguments" in p.stderr:
        return run_analytics([])
    data = last_json(p.stdout)
    if data is None:
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        return [Row("analytics", "analytics", None, "",
                    problems=[f"rc={p.returncode}, no JSON: {' | '.join(tail)}"])]
    probs = [] if p.returncode == 0 else [f"rc={p.returncode}"]
    if "lines_per_s" in data:
        if data.get("checked") is False:
            probs.append("event counts differ from the generator's")
        note = (f"{data.get('lines')} lines in {data.get('seconds')} s, {data.get('jvm_cpu_s')} s JVM CPU, "
                f"baseline {data.get('baseline_s')} s, ratio {data.get('ratio')} (target <= 2), "
                f"CPU ratio {data.get('cpu_ratio')}, in new JVMs {data.get('fresh_ratio')} (JIT "
                f"{data.get('job_fresh_jit_s')} s vs {data.get('baseline_fresh_jit_s')} s), "
                f"session start {data.get('session_start_s')} s, counts "
                f"{'checked' if data.get('checked') else 'NOT checked'}")
        return [Row("analytics", "analytics job", None, "lines/s", sbus=data["lines_per_s"], problems=probs,
                    note=note, raw=data)]
    rows = [Row("analytics", f"analytics {k}", None, "", sbus=v, problems=probs)
            for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    rows.append(Row("analytics", "analytics (raw)", None, "", raw=data, hidden=True))
    return rows


def last_json(text):
    """The last line of `text` that is a JSON object, else all of `text` as JSON, else None."""
    for line in reversed(text.splitlines()):
        if line.strip().startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    try:
        return json.loads(text)
    except ValueError:
        return None


# ---------------------------------------------------------------------- table

@dataclass(frozen=True)
class Workload:
    name: str
    run: Callable[[Plan], list[Row]]


def flood(name, **spec):
    return Workload(name, partial(flood_rows, Flood(**spec), name))


def latency(name, one_core):
    return Workload(name, partial(latency_rows, one_core, name))


# In the order a full run measures them; bench/README.md says what each is.
WORKLOADS = {w.name: w for w in [
    flood("pair", sbus_args=PAIR, figure="msgs_per_s", unit="msg/s", goals=THROUGHPUT_GOALS),
    flood("fanout8", sbus_args=("-n", "8"), figure="deliveries_per_s", unit="dlv/s", goals=THROUGHPUT_GOALS),
    flood("fanout64", sbus_args=("-n", "64"), figure="deliveries_per_s", unit="dlv/s"),
    flood("manysubs", sbus_args=MANYSUBS, figure="msgs_per_s", unit="msg/s", goals=THROUGHPUT_GOALS),
    flood("manywild", sbus_args=(*MANYSUBS, "-W"), figure="msgs_per_s", unit="msg/s"),
    # The relay cannot run `slow` (its blocking sends stall behind the reader
    # that never reads), so its ceiling is the relay serving the fast ones alone.
    flood("slow", sbus_args=("-n", "4", "-S", "1"), relay_args=("-n", "4"), figure="deliveries_per_s",
          unit="dlv/s", note="relay: the 4 fast subscribers without the slow one"),
    Workload("manypubs", manypubs_rows),
    Workload("pypubs", partial(pyrates_rows, "pypubs")),
    Workload("pypair", partial(pyrates_rows, "pypair")),
    Workload("idle", idle_rows),
    latency("latency", one_core=False),
    latency("latency1", one_core=True),
    Workload("wake", wake_rows),
    Workload("logging", logging_rows),
    Workload("memory", memory_rows),
    Workload("micro", micro_rows),
    Workload("analytics", analytics_rows),
]}
# Names on the command line that stand for several workloads.
ALIASES = {"fanout": ("fanout8", "fanout64"), "rates": ("pypubs", "pypair")}


def choose(names):
    """The workloads named (all when none), in the order named, each once; KeyError for an unknown name."""
    chosen = []
    for name in names or WORKLOADS:
        for n in ALIASES.get(name, (name,)):
            if n not in WORKLOADS:
                raise KeyError(name)
            if n not in chosen:
                chosen.append(n)
    return [WORKLOADS[n] for n in chosen]
