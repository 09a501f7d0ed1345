"""The analytics job on a real Spark standalone cluster, the two ways a user starts it.

A master and one worker are started from the installed PySpark's own classes,
bound to 127.0.0.1; the job runs on them as ``python -m sbus.analytics
--master spark://...`` and as ``spark-submit .../sbus/analytics/cli.py``, over
logs of two days, and every table (and the malformed lines and per-file
counts) must equal a local-mode run's.  The cluster is stopped whatever happens.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from support import ROOT, free_port
from support.analytics_log import LINES, MALFORMED, sim_log, snapshot

pytestmark = [
    pytest.mark.spark,
    pytest.mark.slow,
    # A master, a worker and two spark-submit runs: over 300 s while other tests load the machine.
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas"),
]

DAY2 = sim_log(seed=2, broker_pid=300, start=86400.0, seconds=90)  # 2026-11-22
# The JVM's quick compiler only, and one GC thread: each JVM here does little
# work, and C2 and parallel GC threads cost more CPU than they save.
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
# Settings for tiny inputs: few shuffle partitions, no adaptive re-planning or
# code generation, the JVM's quick compiler; none of them changes a result.
QUICK = {
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.codegen.wholeStage": "false",
    "spark.ui.enabled": "false",
    "spark.executor.memory": "512m",
    "spark.cores.max": "2",
    "spark.executor.extraJavaOptions": QUICK_JVM,
    "spark.driver.extraJavaOptions": QUICK_JVM,
}


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def cluster_env(tmp: Path) -> dict:
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_HOME": str(spark_home()),
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOG_DIR": str(tmp / "logs"), "SPARK_WORKER_DIR": str(tmp / "work"),
           "SPARK_DAEMON_JAVA_OPTS": QUICK_JVM}
    env.pop("PYTHONPATH", None)  # the installed sbus must be found on its own
    return env


class Cluster:
    """A standalone master and one worker, each in its own process group."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs = tmp, []
        self.env = cluster_env(tmp)
        self.port, self.ui = free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                   "--port", str(self.port), "--webui-port", str(self.ui))
        self.wait(lambda s: s.get("status") == "ALIVE", "the master")
        self.start("worker", "org.apache.spark.deploy.worker.Worker", self.url,
                   "--host", "127.0.0.1", "--port", str(free_port()),
                   "--webui-port", str(free_port()), "--cores", "2", "--memory", "1g",
                   "--work-dir", str(tmp / "work"))
        self.wait(lambda s: any(w["state"] == "ALIVE" for w in s.get("workers", [])),
                  "a worker")

    def start(self, name: str, cls: str, *args: str) -> None:
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), cls, *args], stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True))
        log.close()

    def state(self) -> dict:
        """The master's state, or {} while it is not there to say: not
        listening yet, or, for a moment as its web UI starts, answering
        /json/ with its HTML page (seen once in a CI run)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui}/json/", timeout=2) as r:
                return json.load(r)
        except (OSError, ValueError):
            return {}

    def wait(self, ready, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            if ready(self.state()):
                return
            time.sleep(0.3)
        raise RuntimeError(f"{what} did not start: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:]
                         for p in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        for p in reversed(self.procs):
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                if p.poll() is not None:
                    break
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(wait)
                except subprocess.TimeoutExpired:
                    continue


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spark-cluster")
    c = None
    try:
        c = Cluster(tmp)
        yield c
    finally:
        if c is not None:
            c.stop()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("two-days")
    (d / "sbusd.log.1").write_text("\n".join(LINES) + "\n")
    (d / "sbusd.log").write_text("\n".join(DAY2) + "\n")
    return d


def run_job(argv, env, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


def conf_args() -> list:
    return [x for k, v in QUICK.items() for x in ("--conf", f"{k}={v}")]


def test_the_job_runs_on_a_standalone_cluster_both_ways(spark, cluster, logs, tmp_path):
    from sbus.analytics import run

    local = tmp_path / "local"
    run(spark, [str(logs)], str(local), show=0, echo=lambda _: None)
    want = snapshot(spark, local)
    assert len({d for f in want["files"] for d in f[2]}) == 2
    assert all(want[t] for t in want), [t for t in want if not want[t]]

    via_python = tmp_path / "python-m"
    run_job([sys.executable, "-m", "sbus.analytics", str(logs), "--out", str(via_python),
             "--master", cluster.url, "--show", "0", *conf_args()], cluster.env, tmp_path)

    via_submit = tmp_path / "spark-submit"
    submit = spark_home() / "bin" / "spark-submit"
    proc = run_job([str(submit), "--master", cluster.url, *conf_args(),
                    str(ROOT / "sbus" / "analytics" / "cli.py"), str(logs),
                    "--out", str(via_submit), "--show", "0", "--csv"], cluster.env, tmp_path)
    assert f"{len(MALFORMED)} malformed" in proc.stdout

    # Both ran on the cluster, not in a local driver.
    apps = cluster.state().get("completedapps", [])
    assert [a["name"] for a in apps].count("sbus-analytics") == 2, apps

    for out in (via_python, via_submit):
        got = snapshot(spark, out)
        for name in want:
            assert got[name] == want[name], (out.name, name)

    # The CSVs spark-submit was asked for hold every record of each day.
    import csv

    records = [json.loads(ln) for ln in LINES + DAY2 if ln.strip() and ln not in MALFORMED]
    per_day = Counter((r["timestamp"][:10], r["event"]) for r in records)
    from_csv = Counter()
    for part in (via_submit / "csv" / "events").glob("date=*/part-*.csv"):
        day = part.parent.name.removeprefix("date=")
        with open(part, newline="") as f:
            for r in csv.DictReader(f):
                from_csv[(day, r["event"])] += int(r["records"])
    assert from_csv == per_day
