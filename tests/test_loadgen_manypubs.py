"""`loadgen manypubs` against a real sbusd on every backend: many publisher
connections over several processes, every delivery accounted for per
publisher (never its speed)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import TESTS

TIMEOUT = 120
CLEAN = {"lost": 0, "tail_lost": 0, "reordered": 0, "bad": 0, "eof": 0, "unfinished": 0,
         "stalled": False}


def manypubs(address, *args):
    p = subprocess.run([sys.executable, "-m", "sbus.cli.loadgen", "manypubs", "-a", address, *args],
                       capture_output=True, text=True, timeout=TIMEOUT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, p.stderr
    return p.returncode, json.loads(lines[-1]), p.stderr


@pytest.mark.parametrize("rate", [None, "20000"], ids=["saturation", "fixed-rate"])
def test_every_publisher_delivers_everything_in_order(broker, rate):
    extra = ("-r", rate) if rate else ()
    rc, r, err = manypubs(broker.address, "-N", "48", "-G", "3", "-n", "2", "-m", "6000", "-s", "64",
                          *extra)
    assert rc == 0, (r, err)
    assert {k: r[k] for k in CLEAN} == CLEAN
    assert (r["publishers"], r["publisher_procs"], r["subscribers"]) == (48, 3, 2)
    assert r["messages"] == 6000
    assert r["deliveries"] == r["expected_deliveries"] == 12000
    assert 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"]
    assert broker.stats()["totals"]["msgs_in"] >= 6000


def test_loss_and_reordering_are_counted_per_publisher(tmp_path):
    path = str(tmp_path / "lossy.socket")
    relay = subprocess.Popen([sys.executable, "-m", "workers.lossyrelay", path], cwd=TESTS,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout.readline() == "ready\n"
        rc, r, err = manypubs(path, "-N", "4", "-G", "2", "-n", "2", "-m", "400", "-s", "32")
    finally:
        relay.kill()
        relay.wait()
    assert rc == 2, (r, err)
    # per subscriber: publisher 0's message 5 lost; publisher 1's 3 comes after its 4,
    # so it counts as lost when 4 arrives and as reordered when it comes
    assert (r["messages"], r["lost"], r["reordered"], r["bad"]) == (400, 4, 2, 0)
    assert r["deliveries"] == 2 * 399
