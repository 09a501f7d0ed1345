"""Hostile input against a live broker, and the limits against memory abuse.

The live fuzz runs over real sockets on every backend: hostile client
processes (tests/workers/hostile.py) send random verbs, missing NULs, huge
patterns, SUB/UNSUB bursts, '!' in every position, invalid and foreign
!/cred/ forms, oversized packets, empty packets and half-closed sockets while
a well-behaved publisher and subscriber pair checks that every message of
theirs (public and !/cred/ private) arrives once and in order.
``SBUS_FUZZ_SECONDS`` sets how long the hostile clients run per backend
(default 4, or 30 when SBUS_FUZZ_EXAMPLES is raised above the default, as
``make fuzz`` does). The compiled core's properties are in test_properties.py.

Then the limits against memory abuse: --max-subscriptions, --max-pattern and
their defaults.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from collections import Counter

import pytest

from sbus._ref import protocol as rproto

from support import BACKENDS, SBUSD, SteadyPair, fd_count, report_line, start_worker, wait_until, worker_report
from support.budget import FUZZ_TIMEOUT, LIVE_SECONDS

pytestmark = pytest.mark.timeout(FUZZ_TIMEOUT)


# ---- live fuzz against a real broker -------------------------------------------

def _known_reasons():
    """The schema's disconnect reasons (sbus.logschema is the source of truth;
    plain Python, so a rebuild of the compiled core mid-run cannot break it)."""
    from sbus import logschema
    return set(logschema.DISCONNECT_REASONS)


RATE = 1000     # steady messages per second during the live fuzz
WARN_REASONS_WITH_DETAIL = {"protocol_error", "bang_misuse", "cred_refused", "limit",
                            "oversize", "flood_error", "error"}


@pytest.mark.timeout(max(300, int(LIVE_SECONDS * 10)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_live_fuzz_broker_survives_and_steady_pair_loses_nothing(start_broker, backend, request):
    nproc, per_proc = 3, 10
    # --max-pattern: the huge patterns hit the pattern limit (no longer a default).
    b = start_broker("--block-timeout", "1", "--queue-max-bytes", str(2 << 20),
                     "--max-pattern", "4096",
                     "--total-max-bytes", str(96 << 20), "--stats-interval", "0",
                     backend=backend, log_level="info")
    known = _known_reasons()
    pair = SteadyPair(b)
    fds_before = fd_count(b.pid)
    workers = [start_worker("hostile", b.address, 1000 * i + os.getpid() % 1000, LIVE_SECONDS,
                            per_proc, pair.cred_prefix.decode()) for i in range(nproc)]
    try:
        # The steady pair talks throughout the hostile run, about RATE a second.
        started = time.monotonic()
        while any(w.poll() is None for w in workers):
            due = int((time.monotonic() - started) * RATE) - pair.sent
            if due <= 0 or pair.publish(min(due, 50)) == 0:
                time.sleep(0.002)       # the steady rate is part of the load under test
            assert not pair.errors, pair.errors
            assert b.proc.poll() is None, f"broker died: {b.stderr_text()[-3000:]}"
        while pair.sent < 3000:         # at least a few thousand messages
            if pair.publish(200) == 0:
                time.sleep(0.002)       # the window is full: let the subscriber read
    finally:
        reports = [worker_report(w, 60) for w in workers]
    assert pair.finish(), f"steady pair: sent {pair.sent}, received {pair.received}, {pair.errors}"
    assert b.proc.poll() is None, f"broker died: {b.stderr_text()[-3000:]}"

    # Nobody saw someone else's private messages.
    assert sum(r["nleaks"] for r in reports) == 0, [r["leaks"] for r in reports]

    # Every hostile connection is logged as closed, with a known reason.
    hostile_pids = {r["pid"] for r in reports}
    connects = sum(r["stats"].get("connects", 0) for r in reports)
    wait_until(lambda: len([r for r in b.events("client_disconnect")
                            if r["pid"] in hostile_pids]) >= connects, 30, interval=0.2, fail=False)
    recs = b.records()
    mine = [r for r in recs if r.get("event") == "client_disconnect" and r["pid"] in hostile_pids]
    opened = [r for r in recs if r.get("event") == "client_connect" and r["pid"] in hostile_pids]
    assert len(opened) == connects, (len(opened), connects)
    assert len(mine) == connects, f"{connects} hostile connections, {len(mine)} disconnects logged"
    assert {r["client"] for r in mine} == {r["client"] for r in opened}
    all_disconnects = [r for r in recs if r.get("event") == "client_disconnect"]
    bad = [r for r in all_disconnects if r["reason"] not in known]
    assert not bad, bad[:5]
    missing_detail = [r for r in mine if r["reason"] in WARN_REASONS_WITH_DETAIL and not r["detail"]]
    assert not missing_detail, missing_detail[:5]
    reasons = Counter(r["reason"] for r in mine)
    # The garbage reached every rule it aims at.
    for reason in ("eof", "protocol_error", "bang_misuse", "cred_refused", "limit", "oversize"):
        assert reasons[reason] > 0, (reason, reasons)

    # The broker is healthy: no traceback, no descriptor kept, still serving.
    assert "Traceback" not in b.stderr_text(), b.stderr_text()[-3000:]
    assert fd_count(b.pid) == fds_before
    fresh = b.connect()
    fresh.send(b"SUB after/fuzz")
    assert fresh.sync().startswith("!/cred/")
    pair.pub.send(b"MSG after/fuzz\0ok")
    assert fresh.recv(100) == b"MSG after/fuzz\0ok"
    pair.close()
    stats = Counter()
    for r in reports:
        stats.update(r["stats"])
    report_line(request, f"\n[live fuzz {backend}] {LIVE_SECONDS:g}s, {nproc}x{per_proc} hostile "
                       f"clients: {connects} connections, {stats['packets']} packets sent, "
                       f"{stats['disconnects']} disconnects seen; steady pair {pair.received} "
                       f"messages in order; broker reasons {dict(reasons)}")


BANG_BASES = [b"a/b/c", b"x/", b"", b"!/cred////k/", b"!/cred/1/2/3/k", b"*/*"]


def _bang_cases():
    for base in BANG_BASES:
        for i in range(len(base) + 1):
            yield base[:i] + b"!" + base[i:]


def test_bang_in_every_position_follows_the_oracle(broker):
    """'!' inserted at every position of a few keys, as SUB, UNSUB and MSG:
    the broker keeps the client exactly when the plain-Python oracle says the
    key is fine, and otherwise disconnects it with the matching reason."""
    kept, dropped = [], 0
    for key in _bang_cases():
        for verb in (b"SUB ", b"UNSUB ", b"MSG "):
            verdict = rproto.check_key(key, verb != b"MSG ")
            if verb == b"MSG ":
                want = None if verdict == "ok" else "bang_misuse"
            elif verb == b"SUB ":
                want = {"ok": None, "bang_misuse": "bang_misuse",
                        "cred_malformed": "cred_refused"}[verdict]
                form = rproto.cred_form(key)
                if form is not None and form[:3] != (None, None, None) and verdict == "ok":
                    want = "cred_refused"       # someone else's credentials
            else:   # UNSUB: a reserved '!' is fatal as in SUB, unless the pattern's
                # !/cred/ form already rules it out (malformed, or someone else's
                # credentials): such a pattern was never stored, so it is not found
                form = rproto.cred_form(key)
                ruled_out = key.startswith(b"!/cred/") and (form is None or form[:3] != (None, None, None))
                want = "bang_misuse" if verdict == "bang_misuse" and not ruled_out else None
            s = broker.connect()
            s.send(verb + key + (b"\0x" if verb == b"MSG " else b""))
            if want is None:
                s.sync()         # still connected; closed at the end
                kept.append(s)
                continue
            s.assert_closed()
            s.close()
            dropped += 1
            # Kept clients stay open, so disconnects arrive one by one, in order.
            wait_until(lambda: len(broker.events("client_disconnect")) >= dropped, 10,
                       interval=0.01, fail=False)
            got = broker.events("client_disconnect")[dropped - 1]["reason"]
            assert got == want, (verb, key, got, want)
    assert len(broker.events("client_disconnect")) == dropped
    assert len(kept) > 20 and dropped > 20, (len(kept), dropped)
    for s in kept:
        s.close()


# ---- limits against memory abuse ------------------------------------------------

def _limit_disconnect(b, predicate=lambda r: True):
    return b.wait_for_event("client_disconnect", timeout=10,
                            predicate=lambda r: r["reason"] == "limit" and predicate(r))


def test_max_subscriptions_flag(start_broker, backend):
    b = start_broker("--max-subscriptions", "10", backend=backend)
    s, other = b.connect(), b.connect()
    for i in range(10):
        s.send(b"SUB k/%d" % i)
    for i in range(5):                  # unsubscribing frees room
        s.send(b"UNSUB k/%d" % i)
        s.send(b"SUB k/%d" % i)
    s.sync()
    for i in range(10):
        other.send(b"SUB k/%d" % i)     # the limit is per client
    other.sync()
    s.send(b"SUB k/10")
    s.assert_closed()
    rec = _limit_disconnect(b)
    assert "10" in rec["detail"]
    assert rec["counters"]["subscriptions"] == 10
    refused = b.wait_for_event("subscribe", predicate=lambda r: r["accepted"] is False)
    assert refused["reason"] == "too_many_subscriptions"
    other.sync()                         # the other client is untouched
    assert [r["client"] for r in b.events("client_disconnect")] == [rec["client"]]


def test_max_pattern_flag(start_broker, backend):
    b = start_broker("--max-pattern", "100", backend=backend)
    s = b.connect()
    s.send(b"SUB " + b"p" * 100)
    s.send(b"SUB !/cred////" + b"q" * 90)       # 100 bytes as sent
    s.sync()
    s.send(b"SUB " + b"p" * 101)
    s.assert_closed()
    rec = _limit_disconnect(b)
    assert "100" in rec["detail"]
    assert rec["counters"]["subscriptions"] == 2


def test_default_limits_are_in_help():
    out = subprocess.run([SBUSD, "--help"], capture_output=True, text=True, timeout=30).stdout
    assert re.search(r"--max-subscriptions N.*\(default 65536\)", out), out
    assert re.search(r"--max-pattern BYTES.*\(default 0: as long as a packet allows\)", out), out


def test_default_pattern_limit_is_the_packet(broker):
    """No limit below the packet size, as in the spec and the original sbusd."""
    s = broker.connect()
    s.set_sndbuf(1 << 20)                        # room for the largest packet
    pub = broker.connect()
    s.send(b"SUB " + b"p" * 4097)
    s.send(b"SUB " + b"q" * (409600 - 4))        # the largest packet the broker takes
    s.sync()
    pub.send(b"MSG " + b"p" * 4097 + b"\0long")
    assert s.recv(10000) == b"MSG " + b"p" * 4097 + b"\0long"
    s.send(b"SUB " + b"q" * (409600 - 3))        # a packet too large is oversize, as ever
    s.assert_closed()
    rec = broker.wait_for_event("client_disconnect")
    assert rec["reason"] == "oversize" and rec["counters"]["subscriptions"] == 2


def test_default_subscription_limit_is_65536(start_broker):
    b = start_broker(log_level="warning")
    s = b.connect(timeout=60)
    s.set_sndbuf(8 << 20)
    for i in range(65536):
        s.send(b"SUB s/%d" % i)
    s.sync()
    s.send(b"SUB s/one-too-many")
    s.assert_closed(30)
    rec = _limit_disconnect(b)
    assert "65536" in rec["detail"] and rec["counters"]["subscriptions"] == 65536
