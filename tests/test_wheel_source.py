"""``pysbus[analytics]`` installed from the release's wheel, with the PySpark
wheel pip already built into its cache, whose ``python -m sbus.analytics``
aggregates the log the installed broker wrote. (The sdist's install is
test_wheel_sdist.py: apart, so the two run on parallel workers.)
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

from support.release import (
    INTERPRETERS,
    NAME,
    SPARK_TIMEOUT,
    SUPPORTED,
    check_installed,
    compiler_shims,
    host_env,
    host_python,
    install_wheel,
    make_venv,
    pyproject,
    run,
    runtime_requirements,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


# ---------------------------------------------------------------- analytics

def cached_wheel(name: str, version_: str) -> Path:
    """``name`` as the wheel pip built into its cache when the project's
    environment was set up (PySpark is released as an sdist only), or None."""
    r = run([sys.executable, "-m", "pip", "cache", "list", f"{name}-{version_}",
             "--format=abspath"], check=False)
    found = [Path(p) for p in r.stdout.split() if p.endswith(".whl")]
    return found[0] if found else None


@pytest.mark.spark
def test_analytics_extra_from_the_wheel(dist, dependency_wheels, tmp_path):
    from importlib.metadata import version as installed_version
    pyspark_version = installed_version("pyspark")
    # The newest supported Python present: PySpark 4 needs 3.11 or newer.
    ver = next((v for v in reversed(SUPPORTED) if INTERPRETERS[v] is not None), None)
    if ver is None:
        pytest.skip("no supported CPython is installed")
    java = shutil.which("java")
    assert java, "the PySpark tests need Java 17 or newer (make test checks for it)"
    pyspark = cached_wheel("pyspark", pyspark_version)
    spark_links = [pyspark.parent] if pyspark else []
    # py4j is small and a wheel on the index; PySpark only without pip's cache.
    others = [r for r in pyproject()["optional-dependencies"]["analytics"]
              if not r.startswith("pyspark")]
    deps = dependency_wheels(ver, *runtime_requirements(), *others,
                             f"py4j=={installed_version('py4j')}")
    venv = make_venv(host_python(ver), tmp_path / "host")
    home = tmp_path / "home"
    home.mkdir()
    # Spark's launcher scripts need the system's tools; the shims still come first.
    env = host_env(venv, home, compiler_shims(tmp_path / "shims"), extra_path=("/usr/bin", "/bin"))
    env["JAVA_HOME"] = str(Path(os.path.realpath(java)).parent.parent)
    if pyspark is None:
        deps = dependency_wheels(ver, f"pyspark=={pyspark_version}")  # a long download
    # --no-compile: byte-compiling PySpark's thousands of modules is most of the time.
    install_wheel(dist, deps, venv, env, f"{NAME}[analytics]", *spark_links, extra=["--no-compile"])
    check_installed(venv, home, env)
    py = venv / "bin" / "python"
    usage = run([py, "-m", "sbus.analytics", "--help"], env=env, cwd=home).stdout
    assert usage.startswith("usage: python -m sbus.analytics"), usage

    log = home / "sbusd.log"  # written by the installed broker in check_installed
    records = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    out = tmp_path / "out"
    r = run([py, "-m", "sbus.analytics", log, "--out", out, "--master", "local[1]",
             "--show", "0", "--csv",
             "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.shuffle.partitions=1",
             "--conf", "spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1"],
            env=env, cwd=home, timeout=SPARK_TIMEOUT)
    assert f"{len(records)} records, 0 malformed" in r.stdout, r.stdout
    got = Counter()
    for part in (out / "csv" / "events").glob("date=*/part-*.csv"):    # one folder per day
        with open(part, newline="") as f:
            got.update({row["event"]: int(row["records"]) for row in csv.DictReader(f)})
    assert got == Counter(records)
