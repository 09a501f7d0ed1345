"""Resources under churn: descriptors, memory, fd exhaustion and SIGPIPE.

The churn soak runs for ``SBUS_SOAK_SECONDS`` in total (default 50, split
between the epoll and select backends; ``make soak`` sets 600). Churn worker
processes run waves of clients that connect, subscribe, publish and leave:
some close cleanly, some close or half-close in the middle of a burst, some
never read and leave with data queued for them, and forked children are
SIGKILLed while they send. A steady publisher/subscriber pair checks that
every one of its messages arrives, once, in order. Afterwards the broker's
open descriptors are back at their starting count, its subscriptions and
queues are empty, and its VmRSS is within RSS_SLACK of where it started.

The module doubles as the churn worker script: ``python test_soak.py churn ...``.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

SOAK_SECONDS = float(os.environ.get("SBUS_SOAK_SECONDS", "50"))
SO_SNDBUFFORCE = 32
WHOAMI = b"CMSG !/cred/whoami"


# =============================================================================
# The churn worker (its own process; forks children it SIGKILLs)
# =============================================================================

def _connect(address, timeout=10.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    s.connect(address)
    return s


PATTERNS = [b"churn/%d", b"churn/", b"", b"steady/", b"churn/*/x", b"!/cred////churn/",
            b"*", b"churn/%d/x"]
SIZES = [16, 200, 2000, 20000]


def _subscribe(rng, s):
    for _ in range(rng.randrange(5)):
        p = rng.choice(PATTERNS)
        s.send(b"SUB " + (p % rng.randrange(20) if b"%d" in p else p))
    if rng.random() < 0.2:
        s.send(rng.choice([b"CMSG blocking/soft/discard", b"CMSG order/stack",
                           b"CMSG order/random", b"CMSG echo/off", b"CMSG blocking/hard/error"]))


def _burst(rng, s, n):
    """Up to n messages without blocking; returns how many went out."""
    s.setblocking(False)
    sent = 0
    for _ in range(n):
        size = rng.choice(SIZES) if rng.random() > 0.002 else 200000
        try:
            s.send(b"MSG churn/%d/x\0" % rng.randrange(20) + b"c" * size)
        except BlockingIOError:
            break
        sent += 1
    return sent


def _in_process_wave(rng, address, stats):
    socks = []
    for _ in range(rng.randrange(50, 150)):
        try:
            s = _connect(address)
            _subscribe(rng, s)
        except OSError:
            stats["connect_errors"] += 1
            continue
        socks.append(s)
        stats["clients"] += 1
    keep = []
    for s in socks:
        try:
            stats["messages"] += _burst(rng, s, rng.randrange(40))
            fate = rng.random()
            if fate < 0.25:
                stats["closed_mid_burst"] += 1
                s.close()
                continue
            if fate < 0.35:
                s.shutdown(socket.SHUT_WR)
                stats["half_closed"] += 1
            elif fate < 0.45:
                s.shutdown(socket.SHUT_RDWR)
                stats["shut_rdwr"] += 1
            elif fate < 0.6:
                try:
                    s.recv(1 << 20)
                except (BlockingIOError, OSError):
                    pass
                stats["read_then_closed"] += 1
                s.close()
                continue
        except OSError:
            stats["send_errors"] += 1
        keep.append(s)
    keep += _hoard(rng, address, stats)
    time.sleep(rng.uniform(0, 0.2))
    for s in keep:          # the rest leave all at once, most with data queued
        s.close()


HOARD_BYTES = 8 << 20       # the default per-client queue limit


def _hoard(rng, address, stats):
    """Two subscribers that never read get a full queue each (distinct keys,
    so nothing is shared): memory abuse the broker must give back."""
    hoarders, pub = [], _connect(address)
    pub.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 4 << 20)
    for i in range(2):
        key = b"hoard/%d/%d" % (os.getpid(), rng.randrange(1 << 30))
        h = _connect(address)
        h.send(b"SUB " + key)
        h.settimeout(30)
        h.send(WHOAMI)
        h.recv(200)         # subscribed before the flood starts
        hoarders.append(h)
        size = rng.choice([4000, 20000, 60000])
        for _ in range(HOARD_BYTES // size):
            pub.send(b"MSG " + key + b"\0" + b"h" * size)
        stats["hoarded_bytes"] += HOARD_BYTES
    pub.close()
    stats["clients"] += 3
    return hoarders


def _child(address, seed):
    rng = random.Random(seed)
    socks = []
    for _ in range(rng.randrange(3, 8)):
        s = _connect(address)
        _subscribe(rng, s)
        socks.append(s)
    until = time.monotonic() + rng.uniform(0.1, 1.0)
    while time.monotonic() < until:     # send until killed, or leave without closing
        s = rng.choice(socks)
        s.settimeout(1)
        for _ in range(rng.randrange(1, 20)):
            try:
                s.send(b"MSG churn/%d/x\0" % rng.randrange(20) + b"k" * rng.choice(SIZES))
            except OSError:
                break
        time.sleep(0.005)


def _forked_wave(rng, address, stats):
    pids = []
    for _ in range(rng.randrange(4, 12)):
        seed = rng.randrange(1 << 30)
        pid = os.fork()
        if pid == 0:
            try:
                _child(address, seed)
            finally:
                os._exit(0)
        pids.append(pid)
    stats["children"] += len(pids)
    time.sleep(rng.uniform(0.05, 0.3))
    for pid in pids:
        if rng.random() < 0.7:
            try:
                os.kill(pid, signal.SIGKILL)
                stats["children_killed"] += 1
            except ProcessLookupError:
                pass
    for pid in pids:
        os.waitpid(pid, 0)


def churn_main(argv):
    address, seconds, seed = argv[0], float(argv[1]), int(argv[2])
    rng = random.Random(seed)
    stats = Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _in_process_wave(rng, address, stats)
        _forked_wave(rng, address, stats)
        stats["waves"] += 1
        time.sleep(0.05)
    sys.stdout.write(json.dumps(stats) + "\n")
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "churn":
    sys.exit(churn_main(sys.argv[2:]))


# =============================================================================
# The tests
# =============================================================================

import resource  # noqa: E402

import pytest  # noqa: E402

from steady import SteadyPair
from conftest import BACKENDS, fd_count, report_line  # noqa: E402

RSS_SLACK_KIB = 20 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_status(pid, field):
    """A kB figure (VmRSS, VmHWM) or a raw value (SigIgn) from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                value = line.split(":", 1)[1].split()[0]
                return value if field.startswith("Sig") else int(value)
    raise KeyError(field)


def cpu_seconds(pid):
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK     # fields 14 and 15


def sync(sock):
    sock.send(WHOAMI)
    while True:
        packet = sock.recv(1 << 20)
        if packet.startswith(WHOAMI + b"\0"):
            return packet[len(WHOAMI) + 1:]
        if packet == b"":
            raise ConnectionResetError("eof while syncing")


def stats(b):
    with b.connect(timeout=30) as s:
        s.send(b"CMSG stats")
        packet = s.recv(1 << 22)
        assert packet.startswith(b"CMSG stats\0"), packet[:40]
        return json.loads(packet[len(b"CMSG stats\0"):])


def wait_until(predicate, timeout, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


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
SOAK_FIGURES = {}   # backend -> VmRSS figures of the soak, for the RSS test below


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_SECONDS * 4) + 300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_churn_soak_returns_descriptors_and_frees_everything(start_broker, backend, request):
    seconds = SOAK_SECONDS / len(BACKENDS)
    b = start_broker(backend=backend, log_level="info")
    pid = b.pid()
    pair = SteadyPair(b)
    # Warm the broker up (first replies, first queue) before taking the baseline.
    pair.publish(100)
    assert wait_until(lambda: pair.received == pair.sent, 30)
    fds_start, rss_start = fd_count(pid), proc_status(pid, "VmRSS")
    fds_peak, rss_peak = fds_start, rss_start

    workers = [subprocess.Popen(
        [sys.executable, __file__, "churn", b.address, str(seconds), str(i * 7919 + os.getpid())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    reports = []
    try:
        started = last_sample = time.monotonic()
        while any(w.poll() is None for w in workers):
            due = int((time.monotonic() - started) * RATE) + 100 - pair.sent
            if due <= 0 or pair.publish(min(due, 100)) == 0:
                time.sleep(0.005)
            assert not pair.errors, pair.errors
            assert b.proc.poll() is None, f"broker died: {b.stderr_text()[-3000:]}"
            if time.monotonic() - last_sample > 0.5:
                last_sample = time.monotonic()
                fds_peak = max(fds_peak, fd_count(pid))
                rss_peak = max(rss_peak, proc_status(pid, "VmRSS"))
    finally:
        for w in workers:
            try:
                out, err = w.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                w.kill()
                out, err = w.communicate()
            assert w.returncode == 0, err.decode(errors="replace")[-3000:]
            reports.append(json.loads(out))
    churn = Counter()
    for r in reports:
        churn.update(r)

    # Everyone but the pair has gone: descriptors are back, nothing is held.
    fds_settled = wait_until(lambda: fd_count(pid) == fds_start, 60)
    fds_end = fd_count(pid)
    snapshot = stats(b)
    totals = snapshot["totals"]
    assert pair.finish(), f"steady pair: sent {pair.sent}, received {pair.received}, {pair.errors}"
    assert b.proc.poll() is None, f"broker died: {b.stderr_text()[-3000:]}"
    # The broker hands memory back at its next tick (at most a second away).
    wait_until(lambda: proc_status(pid, "VmRSS") - rss_start <= RSS_SLACK_KIB, 5)
    rss_end = proc_status(pid, "VmRSS")
    hwm = proc_status(pid, "VmHWM")
    connects, reasons = _disconnect_reasons(b)
    report_line(request, (
        f"\n[soak {backend}] {seconds:g}s: {totals['connects'] - 3} clients churned "
        f"({churn['clients']} in-process in {churn['waves']} waves, {churn['children']} forked "
        f"children, {churn['children_killed']} SIGKILLed), {totals['msgs_in']} messages in, "
        f"{totals['msgs_out']} out; steady pair {pair.received} in order; "
        f"fds {fds_start} -> peak {fds_peak} -> {fds_end}; "
        f"VmRSS {rss_start} kB -> peak {max(rss_peak, hwm)} kB -> {rss_end} kB "
        f"(+{rss_end - rss_start} kB); disconnect reasons {dict(reasons)}"))

    assert fds_settled, f"broker fds: started with {fds_start}, now {fds_end}"
    assert totals["clients"] == 3, totals           # the pair and this stats client
    assert totals["subscriptions"] == 2, totals     # the pair's two patterns
    assert totals["queued_msgs"] == 0 and totals["queued_bytes"] == 0, totals
    SOAK_FIGURES[backend] = {"rss_start": rss_start, "rss_end": rss_end,
                             "rss_peak": max(rss_peak, hwm)}
    assert churn["children_killed"] > 0 and churn["clients"] > 500, churn
    assert not set(reasons) - _known_reasons(), reasons
    # Every connection is logged as closed (the pair is still connected; the
    # stats client's disconnect may still be on its way).
    assert wait_until(lambda: _disconnect_reasons(b)[1].total() >= connects - 2, 30)
    assert "Traceback" not in b.stderr_text(), b.stderr_text()[-3000:]

    pair.close()
    assert wait_until(lambda: fd_count(pid) == fds_start - 2, 30)


@pytest.mark.parametrize("backend", BACKENDS)
def test_churn_soak_rss_returns_near_start(backend, request):
    """VmRSS after the soak above is within RSS_SLACK_KIB of its start."""
    figures = SOAK_FIGURES.get(backend)
    if figures is None:
        pytest.skip("runs after test_churn_soak_returns_descriptors_and_frees_everything")
    assert figures["rss_end"] - figures["rss_start"] <= RSS_SLACK_KIB, figures


# ---- descriptor exhaustion ------------------------------------------------------

NOFILE = 64
STORM = 300


def _open_storm(address, n):
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        try:
            s.connect(address)
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def _served(s, timeout=5.0):
    """True if the broker answers a whoami on s, False if it dropped s."""
    s.settimeout(timeout)
    try:
        s.send(WHOAMI)
        return s.recv(200).startswith(WHOAMI + b"\0")
    except (BrokenPipeError, ConnectionResetError, socket.timeout):
        return False


@pytest.mark.timeout(300)
def test_fd_exhaustion_neither_crashes_nor_spins_and_recovers(start_broker, backend, request):
    b = start_broker(backend=backend, log_level="info")
    pid = b.pid()
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
    assert resource.prlimit(pid, resource.RLIMIT_NOFILE) == (NOFILE, NOFILE)
    fds_start = fd_count(pid)

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
        time.sleep(0.1)
    cpu_share = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
    assert all(not _served(s, timeout=2) for s in knocked[-5:])   # still full: dropped
    assert b.proc.poll() is None, b.stderr_text()[-3000:]
    exhausted = b.events("fd_exhausted")
    assert len(exhausted) == 1, exhausted        # once per episode, not per attempt
    assert len(b.events("client_connect")) == len(served)

    # Clients leave: the broker takes new ones at once.
    for s in socks + knocked:
        s.close()
    assert wait_until(lambda: fd_count(pid) == fds_start, 30), (fd_count(pid), fds_start)
    fresh = b.connect()
    fresh.send(b"SUB after/storm")
    assert sync(fresh).startswith(b"!/cred/")
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
    pid = b.pid()
    pub, sub = b.connect(timeout=30), b.connect(timeout=30)
    pub.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)
    sub.send(b"SUB big")
    sync(sub)
    # Far more than the subscriber's socket buffer: the broker queues the rest.
    for i in range(60):
        pub.send(b"MSG big\0" + bytes([i]) * 100000)
    sync(pub)
    assert wait_until(lambda: stats(b)["totals"]["queued_msgs"] > 0, 10)
    sub.recv(1 << 20)           # take one, so the broker is writing when we go
    sub.close()                 # with data unread and more queued
    rec = b.wait_for_event("client_disconnect", timeout=10,
                           predicate=lambda r: r["counters"]["subscriptions"] == 1)
    assert rec["reason"] in ("eof", "error"), rec
    assert b.proc.poll() is None, b.stderr_text()[-3000:]

    # Also a subscriber that shuts down reading and keeps the socket open.
    sub2 = b.connect()
    sub2.send(b"SUB big")
    sync(sub2)
    sub2.shutdown(socket.SHUT_RD)
    for i in range(30):
        pub.send(b"MSG big\0" + b"y" * 100000)
    sync(pub)
    assert b.proc.poll() is None, b.stderr_text()[-3000:]
    sub2.close()

    for _ in range(3):
        os.kill(pid, signal.SIGPIPE)
    time.sleep(0.5)
    assert b.proc.poll() is None, f"SIGPIPE killed the broker: rc={b.proc.returncode}"
    assert int(proc_status(pid, "SigIgn"), 16) & SIGPIPE_BIT, "SIGPIPE is not ignored"
    fresh = b.connect()
    fresh.send(b"SUB big")
    sync(fresh)
    pub.send(b"MSG big\0after")
    assert fresh.recv(100) == b"MSG big\0after"
    assert b.stop() == 0
