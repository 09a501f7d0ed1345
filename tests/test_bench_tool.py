"""`sbus bench` against a real broker: short runs, their output's shape, and that
nothing was lost or reordered (never their speed)."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from support import SBUS

TIMEOUT = 120


def bench(address, *args):
    return subprocess.run([SBUS, "bench", "-a", address, *args], capture_output=True,
                          text=True, timeout=TIMEOUT)


FLOOD_LINE = re.compile(r"(pair|fanout \d+): (\d+) msgs of (\d+) B to (\d+) subscribers? in "
                        r"[\d.]+ s: [\d.]+k?M? msg/s, [\d.]+[kM]? deliveries/s, [\d.]+ MB/s "
                        r"delivered; nothing lost, in order")
LATENCY_LINE = re.compile(r"latency: (\d+) round trips of (\d+) B in [\d.]+ s: p50 [\d.]+ us, "
                          r"p90 [\d.]+ us, p99 [\d.]+ us, max [\d.]+ us; nothing lost, in order")


@pytest.mark.parametrize("workload, subscribers", [(["pair"], 1), (["fanout", "3"], 3)])
def test_flood_summary_line_and_nothing_lost(start_broker, workload, subscribers):
    b = start_broker(log_level="info")
    p = bench(b.address, *workload, "-n", "5000", "-s", "100", "--runs", "2")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 2, p.stdout
    for line in lines:
        m = FLOOD_LINE.fullmatch(line)
        assert m, line
        assert (int(m[2]), int(m[3]), int(m[4])) == (5000, 100, subscribers)
    # The broker saw it too: every message in, and out to every subscriber,
    # beside the one message each subscriber sends itself to sync before a run.
    totals = b.stats()["totals"]
    assert totals["msgs_in"] == 2 * (5000 + subscribers)
    assert totals["msgs_out"] == 2 * (5000 * subscribers + subscribers)
    # Publisher and subscribers were processes of their own: each run's
    # connections (after them, the stats client's) come from distinct pids.
    clients = 1 + subscribers
    pids = [r["pid"] for r in b.events("client_connect")][:2 * clients]
    assert len(set(pids[:clients])) == len(set(pids[clients:])) == clients, pids


def test_latency_summary_line(start_broker):
    b = start_broker()
    p = bench(b.address, "latency", "-n", "500")
    assert p.returncode == 0, p.stderr
    m = LATENCY_LINE.fullmatch(p.stdout.strip())
    assert m, p.stdout
    assert int(m[1]) == 500


def test_json_results(start_broker):
    b = start_broker(address="/dev/unix/abstract")
    address = b.stdout.decode().strip()          # the abstract name sbusd chose
    p = bench(address, "fanout", "2", "-n", "3000", "--json")
    assert p.returncode == 0, p.stderr
    (r,) = [json.loads(line) for line in p.stdout.splitlines()]
    assert r["workload"] == "fanout 2" and r["mode"] == "flood" and r["subscribers"] == 2
    assert r["messages"] == 3000
    assert r["deliveries"] == r["expected_deliveries"] == 6000
    assert (r["lost"], r["reordered"], r["bad"], r["eof"], r["unfinished"], r["stalled"]) == (
        0, 0, 0, 0, 0, False)
    assert r["msgs_per_s"] > 0 and r["seconds"] > 0


def test_failures_are_reported(start_broker, tmp_path):
    p = bench(str(tmp_path / "no-broker"), "pair", "-n", "10")
    assert p.returncode == 1 and p.stdout.startswith("pair: failed: ") and "connect" in p.stdout
    p = bench(str(tmp_path / "x"), "pair", "-s", "4")
    assert p.returncode == 1 and "--size must be 8 or more" in p.stderr
    p = bench(str(tmp_path / "x"), "fanout")
    assert p.returncode == 1 and "how many subscribers" in p.stderr
    # A payload the broker refuses: it reads the one message, hangs up on the
    # publisher and delivers nothing.  The publisher's only send succeeded (the
    # kernel queued the packet before the broker read it) and it sends nothing
    # more to see the hang-up, so the run ends, and the subscriber reports the
    # message lost: a lossy run (2), not a failed one (1).  With more messages
    # the outcome would be a race: a send after the hang-up fails the run.
    b = start_broker("--max-message", "1000")
    p = bench(b.address, "pair", "-n", "1", "-s", "2000")
    assert p.returncode == 2, p
    assert re.fullmatch(r"pair: 1 msgs of 2000 B to 1 subscriber in [\d.]+ s: .*; "
                        r"lost 1, tail_lost 1\n", p.stdout), p.stdout
    assert b.wait_for_event("client_disconnect", predicate=lambda r: r["reason"] == "oversize")
