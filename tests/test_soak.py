"""Resources under churn: descriptors, memory, fd exhaustion and SIGPIPE.

The churn soak runs for ``SBUS_SOAK_SECONDS`` in total (default 30, split
between the event-loop backends; ``make soak`` sets 600). Churn worker
processes run waves of clients that connect, subscribe, publish and leave:
some close cleanly, some close or half-close in the middle of a burst, some
never read and leave with data queued for them, and forked children are
SIGKILLed while they send. A steady publisher/subscriber pair checks that
every one of its messages arrives, once, in order. Afterwards the broker's
open descriptors are back at their starting count, its subscriptions and
queues are empty, and its VmRSS is within RSS_SLACK of where it started.

The churn worker is tests/workers/churn.py.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from support import (
    BACKENDS,
    Conn,
    Sbusd,
    SteadyPair,
    cpu_seconds,
    fd_count,
    report_line,
    start_worker,
    status_field,
    status_kib,
    wait_until,
    worker_report,
)
from support.budget import SOAK_SECONDS

RSS_SLACK_KIB = 20 * 1024


def _known_reasons():
    from sbus import logschema
    return set(logschema.DISCONNECT_REASONS)


def _disconnect_reasons(b):
    """Counter of client_disconnect reasons, scanning the log cheaply."""
    reasons = Counter()
    connects = 0
    with open(b.log_path, "rb") as f:
        for line in f:
            if b'"client_disconnect"' in line:
                reasons[json.loads(line)["reason"]] += 1
            elif b'"client_connect"' in line:
                connects += 1
    return connects, reasons


RATE = 500      # steady messages per second during the soak


@dataclass
class Soak:
    """One backend's churn soak, measured; the tests below judge it."""
    broker: Sbusd
    pair: SteadyPair
    churn: Counter          # the workers' reports, summed
    totals: dict            # the broker's totals once the churn has left
    pair_intact: bool       # every steady message arrived, once, in order
    fds_start: int
    fds_settled: bool       # back at fds_start within a minute
    fds_end: int
    rss_start: int          # VmRSS, kB
    rss_end: int
    rss_peak: int
    connects: int
    reasons: Counter        # client_disconnect reasons


@pytest.fixture(scope="module", params=BACKENDS)
def soak(request, tmp_path_factory):
    """Churns a fresh broker of one backend for its share of SOAK_SECONDS (once
    per module, for every test that asks) and measures it afterwards."""
    backend = request.param
    seconds = SOAK_SECONDS / len(BACKENDS)
    b = Sbusd.foreground(tmp_path_factory.mktemp(f"soak-{backend}"), backend=backend,
                         log_level="info")
    pid = b.pid
    pair = SteadyPair(b)
    try:
        # Warm the broker up (first replies, first queue) before taking the baseline.
        pair.publish(100)
        wait_until(lambda: pair.received == pair.sent, 30, "the warm-up messages")
        fds_start, rss_start = fd_count(pid), status_kib(pid, "VmRSS")
        fds_peak, rss_peak = fds_start, rss_start

        workers = [start_worker("churn", b.address, seconds, i * 7919 + os.getpid())
                   for i in range(2)]
        try:
            started = last_sample = time.monotonic()
            while any(w.poll() is None for w in workers):
                due = int((time.monotonic() - started) * RATE) + 100 - pair.sent
                if due <= 0 or pair.publish(min(due, 100)) == 0:
                    time.sleep(0.005)       # the steady rate is part of the load under test
                assert not pair.errors, pair.errors
                assert b.proc.poll() is None, f"broker died: {b.stderr_text()[-3000:]}"
                if time.monotonic() - last_sample > 0.5:
                    last_sample = time.monotonic()
                    fds_peak = max(fds_peak, fd_count(pid))
                    rss_peak = max(rss_peak, status_kib(pid, "VmRSS"))
        finally:
            reports = [worker_report(w, 120) for w in workers]
        churn = Counter()
        for r in reports:
            churn.update(r)

        # Everyone but the pair has gone: descriptors are back, nothing is held.
        fds_settled = wait_until(lambda: fd_count(pid) == fds_start, 60, fail=False)
        fds_end = fd_count(pid)
        totals = b.stats()["totals"]
        pair_intact = pair.finish()
        assert b.proc.poll() is None, f"broker died: {b.stderr_text()[-3000:]}"
        # The broker hands memory back at its next tick (at most a second away).
        wait_until(lambda: status_kib(pid, "VmRSS") - rss_start <= RSS_SLACK_KIB, 5, fail=False)
        rss_end = status_kib(pid, "VmRSS")
        rss_peak = max(rss_peak, status_kib(pid, "VmHWM"))
        connects, reasons = _disconnect_reasons(b)
        report_line(request, (
            f"\n[soak {backend}] {seconds:g}s: {totals['connects'] - 3} clients churned "
            f"({churn['clients']} in-process in {churn['waves']} waves, {churn['children']} forked "
            f"children, {churn['children_killed']} SIGKILLed), {totals['msgs_in']} messages in, "
            f"{totals['msgs_out']} out; steady pair {pair.received} in order; "
            f"fds {fds_start} -> peak {fds_peak} -> {fds_end}; "
            f"VmRSS {rss_start} kB -> peak {rss_peak} kB -> {rss_end} kB "
            f"(+{rss_end - rss_start} kB); disconnect reasons {dict(reasons)}"))
        yield Soak(b, pair, churn, totals, pair_intact, fds_start, fds_settled, fds_end,
                   rss_start, rss_end, rss_peak, connects, reasons)
    finally:
        pair.close()
        b.stop()


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_SECONDS * 4) + 300)
def test_churn_soak_returns_descriptors_and_frees_everything(soak):
    b, pair, totals = soak.broker, soak.pair, soak.totals
    assert soak.pair_intact, f"steady pair: sent {pair.sent}, received {pair.received}, {pair.errors}"
    assert soak.fds_settled, f"broker fds: started with {soak.fds_start}, now {soak.fds_end}"
    assert totals["clients"] == 3, totals           # the pair and the stats client
    assert totals["subscriptions"] == 2, totals     # the pair's two patterns
    assert totals["queued_msgs"] == 0 and totals["queued_bytes"] == 0, totals
    # How many clients a worker runs and how many children it kills depend on
    # the machine's speed; that it did both is what makes the soak a soak.
    assert soak.churn["children_killed"] > 0 and soak.churn["clients"] > 500, soak.churn
    assert not set(soak.reasons) - _known_reasons(), soak.reasons
    # Every connection is logged as closed (the pair is still connected; the
    # stats client's disconnect may still be on its way).
    wait_until(lambda: _disconnect_reasons(b)[1].total() >= soak.connects - 2, 30,
               "every churned connection's disconnect record")
    assert "Traceback" not in b.stderr_text(), b.stderr_text()[-3000:]

    pair.close()
    wait_until(lambda: fd_count(b.pid) == soak.fds_start - 2, 30, "the pair's descriptors to close")


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_SECONDS * 4) + 300)
def test_churn_soak_rss_returns_near_start(soak):
    """VmRSS after the churn is within RSS_SLACK_KIB of its start."""
    assert soak.rss_end - soak.rss_start <= RSS_SLACK_KIB, (soak.rss_start, soak.rss_peak,
                                                            soak.rss_end)


# ---- descriptor exhaustion ------------------------------------------------------

NOFILE = 64
STORM = 300


def _open_storm(address, n):
    socks = []
    for _ in range(n):
        try:
            socks.append(Conn.to(address, 10))
        except OSError:
            continue
    return socks


def _served(s, timeout=5.0):
    """True if the broker answers a whoami on s, False if it dropped s."""
    s.settimeout(timeout)
    try:
        return s.whoami() is not None
    except socket.timeout:
        return False


@pytest.mark.timeout(300)
def test_fd_exhaustion_neither_crashes_nor_spins_and_recovers(start_broker, backend, request):
    b = start_broker(backend=backend, log_level="info")
    pid = b.pid
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
    assert resource.prlimit(pid, resource.RLIMIT_NOFILE) == (NOFILE, NOFILE)
    # sbusd signals readiness a moment before start-up closes its last
    # temporary descriptor; once its loop has served a client and logged it
    # gone, the count is a baseline.
    with b.connect() as probe:
        probe.sync()
    b.wait_for_event("client_disconnect")
    fds_start = fd_count(pid)
    since = len(b.records())

    # A storm far beyond the limit: the broker serves what fits and drops the rest.
    socks = _open_storm(b.address, STORM)
    served = [s for s in socks if _served(s)]
    assert b.proc.poll() is None, b.stderr_text()[-3000:]
    assert 0 < len(served) < NOFILE
    assert len(served) >= NOFILE - fds_start - 2, (len(served), fds_start)
    assert fd_count(pid) <= NOFILE

    # Saturated: keep knocking a few times a second; the broker must idle.
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    knocked = []
    while time.monotonic() - t0 < 4.0:
        knocked += _open_storm(b.address, 5)
        time.sleep(0.1)         # the pace of the knocking: the idle load under test
    cpu_share = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
    assert all(not _served(s, timeout=2) for s in knocked[-5:])   # still full: dropped
    assert b.proc.poll() is None, b.stderr_text()[-3000:]
    exhausted = b.events("fd_exhausted")
    assert len(exhausted) == 1, exhausted        # once per episode, not per attempt
    assert len([r for r in b.records()[since:] if r["event"] == "client_connect"]) == len(served)

    # Clients leave: the broker takes new ones at once.
    for s in socks + knocked:
        s.close()
    assert wait_until(lambda: fd_count(pid) == fds_start, 30, fail=False), \
        (fd_count(pid), fds_start)
    fresh = b.connect()
    fresh.send(b"SUB after/storm")
    assert fresh.sync().startswith("!/cred/")
    with b.connect() as pub:
        pub.send(b"MSG after/storm\0ok")
        assert fresh.recv(100) == b"MSG after/storm\0ok"
    more = [b.connect() for _ in range(NOFILE // 2)]
    assert all(_served(s) for s in more)
    for s in more:
        s.close()
    fresh.close()
    assert b.proc.poll() is None
    assert "Traceback" not in b.stderr_text(), b.stderr_text()[-3000:]
    report_line(request, f"\n[fd exhaustion {backend}] RLIMIT_NOFILE={NOFILE}: {len(socks)} storm "
                       f"connections, {len(served)} served, {len(socks) - len(served)} dropped, "
                       f"{len(knocked)} more while full; broker CPU {cpu_share:.1%} of wall time "
                       f"while saturated; fd_exhausted records: {len(exhausted)}")
    assert cpu_share < 0.5, f"broker used {cpu_share:.0%} CPU while out of descriptors"


# ---- SIGPIPE --------------------------------------------------------------------

SIGPIPE_BIT = 1 << (signal.SIGPIPE - 1)


def test_subscriber_closing_mid_send_and_kill_pipe_do_not_kill_the_broker(start_broker, backend):
    b = start_broker(backend=backend, log_level="info")
    pid = b.pid
    pub, sub = b.connect(timeout=30), b.connect(timeout=30)
    pub.set_sndbuf(8 << 20)
    sub.send(b"SUB big")
    sub.sync()
    # Far more than the subscriber's socket buffer: the broker queues the rest.
    for i in range(60):
        pub.send(b"MSG big\0" + bytes([i]) * 100000)
    pub.sync()
    wait_until(lambda: b.stats()["totals"]["queued_msgs"] > 0, 10, "a queue")
    sub.recv(1 << 20)           # take one, so the broker is writing when we go
    sub.close()                 # with data unread and more queued
    rec = b.wait_for_event("client_disconnect", timeout=10,
                           predicate=lambda r: r["counters"]["subscriptions"] == 1)
    # eof if the broker reads the hang-up first, error if it is mid-write: the race is the point.
    assert rec["reason"] in ("eof", "error"), rec
    assert b.proc.poll() is None, b.stderr_text()[-3000:]

    # Also a subscriber that shuts down reading and keeps the socket open.
    sub2 = b.connect()
    sub2.send(b"SUB big")
    sub2.sync()
    sub2.shutdown(socket.SHUT_RD)
    for _ in range(30):
        pub.send(b"MSG big\0" + b"y" * 100000)
    pub.sync()
    assert b.proc.poll() is None, b.stderr_text()[-3000:]
    sub2.close()

    for _ in range(3):
        os.kill(pid, signal.SIGPIPE)
    # A round trip is the barrier: a pending signal takes effect before the
    # broker next runs, so a reply means the signals did not kill it.
    assert pub.whoami() is not None and b.proc.poll() is None, \
        f"SIGPIPE killed the broker: rc={b.proc.poll()}"
    assert int(status_field(pid, "SigIgn"), 16) & SIGPIPE_BIT, "SIGPIPE is not ignored"
    fresh = b.connect()
    fresh.send(b"SUB big")
    fresh.sync()
    pub.send(b"MSG big\0after")
    assert fresh.recv(100) == b"MSG big\0after"
    assert b.stop() == 0
