"""Flood control against real sbusd processes, with real slow subscribers.

A "slow" or "stuck" subscriber is a socket the test simply does not read: the
broker's send to it fails with EAGAIN once its kernel buffer is full, and the
client's soft mode, hard mode and order decide what happens next. Publishers
run in separate processes (a small C program, tests/c/flood_pub.c) so the
test process is free to read the fast subscribers.

Brokers run with ``--max-message 4096`` where a test wants to reach the queue
quickly: the per-client kernel send buffer is then about 144 KiB instead of
about 860 KiB. Everything waits for conditions (generous deadlines, nothing
asserts speed): the machine these run on is small and shared.
"""
from __future__ import annotations

import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from support import recv_or_none, status_kib, stop_process, wait_until

HERE = Path(__file__).resolve().parent
SMALL = ("--max-message", "4096")
MIB = 1 << 20


# ---- helpers ----------------------------------------------------------------

def per_client(snap, cid):
    for c in snap["clients"]:
        if c["client"] == cid:
            return c
    raise AssertionError(f"client {cid} not in {[c['client'] for c in snap['clients']]}")


def subscriber(broker, *patterns, cmsgs=()):
    """A connected client with the given control messages and subscriptions;
    returns (socket, client id). Clients are connected one at a time, so the
    newest id in the stats snapshot is ours."""
    s = broker.connect(timeout=60)
    for c in cmsgs:
        s.send(b"CMSG " + c)
    for p in patterns:
        s.send(b"SUB " + p)
    s.sync()
    cid = max(c["client"] for c in s.stats()["clients"])
    return s, cid


def seq(packet):
    body = packet[packet.index(b"\0") + 1:]
    return int(body[:10])


def read_seqs(sock, n, timeout=60.0):
    """The sequence numbers of the next n packets."""
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"got {len(out)} of {n} packets within {timeout}s")
        sock.settimeout(left)
        try:
            out.append(seq(sock.recv(1 << 16)))
        except socket.timeout:
            pass
    return out


def drain_now(sock, limit=None):
    """Sequence numbers of the packets readable right now (at most limit)."""
    out = []
    old = sock.gettimeout()
    sock.settimeout(0.0)
    try:
        while limit is None or len(out) < limit:
            try:
                packet = sock.recv(1 << 16)
            except (BlockingIOError, socket.timeout):
                break
            if not packet:
                break
            out.append(seq(packet))
    finally:
        sock.settimeout(old)
    return out


def flood_records(broker, cid):
    return [r for r in broker.events("flood") if r["client"] == cid]


def wait_flood_total(broker, cid, field, total):
    """The client's flood records, once their field adds up to total."""
    def ready():
        recs = flood_records(broker, cid)
        return recs if sum(r[field] for r in recs) == total else None
    return wait_until(ready, what=f"flood records whose {field} add up to {total}")


def last_stats_record(broker):
    recs = broker.events("stats")
    return recs[-1] if recs else None


def publisher_socket(broker):
    s = broker.connect(timeout=60)
    s.set_sndbuf(4 * MIB)
    return s


def fill_until_queued(pub, key, cid, size=4000):
    """Publish size-byte packets on key until client cid has one queued:
    its kernel buffer is then full, and every later delivery to it is queued."""
    packet = b"MSG " + key + b"\0" + b"0" * 10
    packet += b"f" * (size - len(packet))
    for sent in range(1, 2000):
        pub.send(packet)
        if per_client(pub.stats_after(), cid)["queued_msgs"] > 0:
            return sent
    raise AssertionError("the subscriber's kernel buffer never filled")


@pytest.fixture(scope="session")
def flood_pub_exe(tmp_path_factory):
    out = tmp_path_factory.mktemp("flood_c") / "flood_pub"
    subprocess.run(["gcc", "-O2", "-Wall", "-o", str(out), str(HERE / "c" / "flood_pub.c")],
                   check=True)
    return str(out)


class Publisher:
    """flood_pub in its own process: count packets on key, sizes cycled,
    numbered from first. With linger it keeps its socket open after the last
    send until finish(), so the broker never sees it hang up early."""

    def __init__(self, exe, address, count, key, sizes, first, linger):
        self.count = count
        self.proc = subprocess.Popen(
            [exe, address, str(count), key, ",".join(map(str, sizes)), str(first),
             "1" if linger else "0"],
            stdin=subprocess.PIPE if linger else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.sent = None

    def done(self):
        """True once every send has returned (non-blocking check)."""
        if self.sent is None:
            r, _, _ = select.select([self.proc.stdout], [], [], 0)
            if r:
                self.sent = int(self.proc.stdout.readline() or -1)
        return self.sent is not None

    def finish(self, timeout=90.0):
        """Wait for the last send, let it close; returns how many it sent."""
        wait_until(self.done, timeout, "the publisher to finish sending", interval=0.05)
        if self.proc.stdin:
            self.proc.stdin.close()
        rc = self.proc.wait(timeout)
        assert rc == 0, self.proc.stderr.read()
        return self.sent

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def publisher(flood_pub_exe):
    started = []

    def start(broker, count, key="f/x", sizes=(1000,), first=0, linger=True):
        p = Publisher(flood_pub_exe, broker.address, count, key, sizes, first, linger)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


@pytest.fixture
def start_flood_broker(start_broker, tmp_path):
    """start_broker with a socket path of its own per broker (several may run
    in one test) and a check that it really is running."""
    count = itertools.count()

    def start(*args, backend="epoll"):
        b = start_broker(*args, backend=backend,
                         address=str(tmp_path / f"flood-{next(count)}.socket"))
        assert b.proc.poll() is None, b.stderr_text()
        return b
    return start


# ---- defaults and flags -------------------------------------------------------

def test_defaults_and_command_line_flood_settings(start_flood_broker, backend):
    b = start_flood_broker(backend=backend)
    s, cid = subscriber(b)
    c = per_client(s.stats(), cid)
    assert (c["soft"], c["hard"], c["order"]) == ("queue", "discard", "queue")
    config = b.wait_for_event("broker_start")["config"]
    assert config["queue_max_bytes"] == 8 * MIB
    assert config["queue_max_msgs"] == 65536
    assert config["total_max_bytes"] == 256 * MIB
    assert config["block_timeout"] == 10.0

    b2 = start_flood_broker("--soft", "block", "--hard", "error", "--order", "random",
               "--queue-max-bytes", "1000", "--queue-max-msgs", "7",
               "--total-max-bytes", "5000", "--block-timeout", "2.5", backend=backend)
    s2, cid2 = subscriber(b2)
    c2 = per_client(s2.stats(), cid2)
    assert (c2["soft"], c2["hard"], c2["order"]) == ("block", "error", "random")
    config = b2.wait_for_event("broker_start")["config"]
    assert (config["queue_max_bytes"], config["queue_max_msgs"], config["total_max_bytes"],
            config["block_timeout"]) == (1000, 7, 5000, 2.5)
    # A client's control messages override the defaults; the most recent wins.
    for cmsg in (b"blocking/soft/queue", b"blocking/hard/block", b"order/stack",
                 b"blocking/soft/discard", b"order/queue"):
        s2.send(b"CMSG " + cmsg)
    c2 = per_client(s2.stats(), cid2)
    assert (c2["soft"], c2["hard"], c2["order"]) == ("discard", "block", "queue")
    s2.send(b"CMSG blocking/hard/queue")      # queue is not a hard mode: ignored
    assert per_client(s2.stats(), cid2)["hard"] == "block"

    bad = subprocess.run([b.proc.args[0], "-f", "-a", str(b.workdir / "x.socket"),
                          "--hard", "queue"], capture_output=True, timeout=60)
    assert bad.returncode == 1 and b"--hard" in bad.stderr


# ---- soft modes -----------------------------------------------------------------

def test_queue_mode_fast_subscriber_keeps_receiving_while_slow_ones_are_stuck(
        start_flood_broker, backend, publisher):
    b = start_flood_broker(*SMALL, backend=backend)
    slow1, id1 = subscriber(b, b"f/")
    slow2, id2 = subscriber(b, b"f/")
    fast, _ = subscriber(b, b"f/")
    before = b.stats()
    n, size = 3000, 1000
    pub = publisher(b, n, sizes=[size])
    assert read_seqs(fast, n) == list(range(n))       # all of it, in order, while the others sleep
    assert pub.finish() == n
    snap = b.stats()
    assert snap["totals"]["msgs_in"] == n
    outs = {}
    for cid in (id1, id2):
        c = per_client(snap, cid)
        outs[cid] = c["msgs_out"] - per_client(before, cid)["msgs_out"]
        assert c["drops_soft"] == c["drops_hard"] == c["drops_disconnect"] == 0
        assert 0 < outs[cid] < n and outs[cid] + c["queued_msgs"] == n
        assert c["queued_bytes"] == c["queued_msgs"] * size
    # Each message is stored once however many queues hold it: the broker-wide
    # figure is the size of the union of both queues, not the sum.
    union = n - min(outs.values())
    assert snap["totals"]["queued_bytes"] == union * size
    assert snap["totals"]["queued_msgs"] == 2 * n - sum(outs.values())
    # The stuck ones wake up and get everything, in order.
    assert read_seqs(slow1, n) == list(range(n))
    assert read_seqs(slow2, n) == list(range(n))
    snap = b.stats()
    assert snap["totals"]["queued_bytes"] == 0 and snap["totals"]["queued_msgs"] == 0
    assert snap["totals"]["drops_soft"] == snap["totals"]["drops_hard"] == 0


def test_discard_mode_drops_only_for_the_slow_one_and_counts_every_drop(
        start_flood_broker, backend, publisher):
    b = start_flood_broker(*SMALL, backend=backend)
    slow, sid = subscriber(b, b"f/", cmsgs=[b"blocking/soft/discard"])
    fast, _ = subscriber(b, b"f/")
    base = per_client(b.stats(), sid)["msgs_out"]
    n = 3000
    pub = publisher(b, n)
    assert read_seqs(fast, n) == list(range(n))
    assert pub.finish() == n
    snap = b.stats()
    c = per_client(snap, sid)
    got = c["msgs_out"] - base
    assert c["queued_msgs"] == 0 and c["queued_bytes"] == 0
    assert c["drops_hard"] == 0 and c["drops_disconnect"] == 0
    assert 0 < got < n and got + c["drops_soft"] == n
    assert snap["totals"]["drops_soft"] == c["drops_soft"]
    # It holds exactly what fitted into its socket, the oldest ones; nothing else comes.
    assert read_seqs(slow, got) == list(range(got))
    assert recv_or_none(slow, 0.3) is None
    # Once it reads again, it receives again.
    pub2 = publisher(b, 10, first=n)
    assert read_seqs(slow, 10) == list(range(n, n + 10))
    pub2.finish()
    # Every drop is in the log, summarised (a record per client per interval).
    recs = wait_flood_total(b, sid, "drops_soft", c["drops_soft"])
    assert all(r["soft"] == "discard" and r["drops_hard"] == 0 for r in recs)
    assert len(recs) < 20


@pytest.mark.parametrize("soft", ["discard", "error"])
def test_control_replies_are_queued_whatever_the_soft_mode(start_flood_broker, backend, soft):
    # Thousands of requests with no reading in between: the replies overflow
    # the socket into the queue. The soft modes are about deliveries; a reply
    # is what a client waits for (whoami as a barrier), so none is dropped and
    # blocking/soft/error does not disconnect the client for it.
    b = start_flood_broker(*SMALL, backend=backend)
    asker, aid = subscriber(b, cmsgs=[b"blocking/soft/" + soft.encode()])
    n = 5000
    for _ in range(n):
        asker.send(b"CMSG !/cred/whoami")
    wait_until(lambda: per_client(b.stats(), aid)["queued_msgs"] > 0,
               what="the replies to overflow the socket")
    asker.settimeout(10)
    replies = [asker.recv(200) for _ in range(n)]
    assert all(r.startswith(b"CMSG !/cred/whoami\0") for r in replies)
    c = per_client(b.stats(), aid)
    assert c["replies_out"] == n + 2        # and subscriber()'s whoami and stats
    assert c["drops_soft"] == c["drops_disconnect"] == 0


@pytest.mark.parametrize("which", ["soft", "hard"])
def test_error_mode_disconnects_the_slow_client_and_the_rest_carry_on(
        start_flood_broker, backend, publisher, which):
    b = start_flood_broker(*SMALL, "--queue-max-msgs", "100", backend=backend)
    slow, sid = subscriber(b, b"f/", cmsgs=[b"blocking/%s/error" % which.encode()])
    # The fast one must not lose anything either: at its own limit it blocks the bus.
    fast, _ = subscriber(b, b"f/", cmsgs=[b"blocking/hard/block"])
    other_pub, _ = subscriber(b)
    base = per_client(b.stats(), sid)["msgs_out"]
    n = 2000
    pub = publisher(b, n)
    assert read_seqs(fast, n) == list(range(n))
    assert pub.finish() == n
    rec = b.wait_for_event("client_disconnect", timeout=60, predicate=lambda r: r["client"] == sid)
    assert rec["reason"] == "flood_error"
    assert f"blocking/{which}/error" in rec["detail"]
    counters = rec["counters"]
    delivered = counters["msgs_out"] - base
    # It keeps what reached its socket, the oldest first, then EOF.
    assert [seq(p) for p in slow.until_closed(60)] == list(range(delivered))
    lost = counters["drops_disconnect"]
    # At least these; more when the publisher was ahead of the broker's reads.
    if which == "soft":
        assert lost >= 1                      # the first that would have blocked
    else:
        assert lost >= 101                    # the full queue plus the one over the limit
    assert delivered + lost <= n and counters["queued_msgs"] == 0
    # The bus carries on.
    other_pub.send(b"MSG f/after\0%010d" % 123456)
    assert read_seqs(fast, 1) == [123456]
    assert b.stats()["totals"]["drops_disconnect"] == lost


def pump(slow, fast, n, slow_batch=40, timeout=120.0):
    """Read fast eagerly and slow in small bites until both have n packets."""
    got_slow, got_fast = [], []
    deadline = time.monotonic() + timeout
    while len(got_slow) < n or len(got_fast) < n:
        assert time.monotonic() < deadline, (len(got_slow), len(got_fast))
        got_fast += drain_now(fast)
        got_slow += drain_now(slow, slow_batch)
        time.sleep(0.003)       # the pace of the slow reader: the load under test
    return got_slow, got_fast


@pytest.mark.parametrize("mode", [b"blocking/soft/block", b"blocking/hard/block"])
def test_block_mode_loses_nothing_end_to_end(start_flood_broker, backend, publisher, mode):
    limit, size, n = 200, 300, 10000
    b = start_flood_broker(*SMALL, "--queue-max-msgs", str(limit), "--block-timeout", "120",
              backend=backend)
    slow, sid = subscriber(b, b"f/", cmsgs=[mode])
    fast, _ = subscriber(b, b"f/", cmsgs=[b"blocking/hard/block"])
    pub = publisher(b, n, sizes=[size])
    got_slow, got_fast = pump(slow, fast, n)
    assert got_slow == list(range(n))
    assert got_fast == list(range(n))
    assert pub.finish() == n
    totals = b.stats()["totals"]
    assert totals["msgs_in"] == n
    assert totals["drops_soft"] == totals["drops_hard"] == totals["drops_disconnect"] == 0
    assert totals["queued_msgs"] == 0
    # The slow reader really did hold the bus, and memory stayed bounded:
    # no queue ever grew past its limit plus one receive batch (32).
    b.wait_for_event("flood", timeout=30, predicate=lambda r: r["client"] == sid and r["blocks"] > 0)
    # Packets count once however many queues hold them: the fast reader's
    # few are the slow one's newest.
    assert totals["queued_bytes_peak"] <= (limit + 32) * size, totals["queued_bytes_peak"] / size


def test_block_mode_with_many_publishers_keeps_each_ones_order_and_the_bound(
        start_flood_broker, backend, publisher):
    # Deliveries from every publisher read in a loop turn go out together;
    # the bus must still stop before another publisher is read once a
    # blocking reader could pass its limit, so the bound stays one batch.
    limit, size, n, pubs = 200, 300, 1500, 8
    b = start_flood_broker(*SMALL, "--queue-max-msgs", str(limit), "--block-timeout", "120",
              backend=backend)
    slow, sid = subscriber(b, b"f/", cmsgs=[b"blocking/hard/block"])
    fast, _ = subscriber(b, b"f/", cmsgs=[b"blocking/hard/block"])
    started = [publisher(b, n, key=f"f/p{k}", sizes=[size], first=k * 100000) for k in range(pubs)]
    got_slow, got_fast = pump(slow, fast, n * pubs)
    for got in (got_slow, got_fast):
        by_pub = {}
        for s in got:
            by_pub.setdefault(s // 100000, []).append(s % 100000)
        assert by_pub == {k: list(range(n)) for k in range(pubs)}
    assert [p.finish() for p in started] == [n] * pubs
    totals = b.stats()["totals"]
    assert totals["msgs_in"] == n * pubs
    assert totals["drops_soft"] == totals["drops_hard"] == totals["drops_disconnect"] == 0
    b.wait_for_event("flood", timeout=30, predicate=lambda r: r["client"] == sid and r["blocks"] > 0)
    # Packets count once however many queues hold them: the fast reader's
    # few are the slow one's newest.
    assert totals["queued_bytes_peak"] <= (limit + 32) * size, totals["queued_bytes_peak"] / size


def test_hard_block_holds_the_bus_until_the_slow_client_reads(start_flood_broker, backend, publisher):
    limit, n = 100, 3000
    b = start_flood_broker(*SMALL, "--queue-max-msgs", str(limit), "--block-timeout", "120",
              "--stats-interval", "0.2", backend=backend)
    slow, sid = subscriber(b, b"f/", cmsgs=[b"blocking/hard/block"])
    fast, _ = subscriber(b, b"f/", cmsgs=[b"blocking/hard/block"])
    pub = publisher(b, n)
    got_fast = []

    def held():
        got_fast.extend(drain_now(fast))
        rec = last_stats_record(b)
        return rec if rec and any(c["client"] == sid and c["queued_msgs"] > limit
                                  for c in rec["clients"]) else None

    first = wait_until(held, what="the slow client's queue to pass its limit")

    def two_later():
        later = [r for r in b.events("stats") if r["timestamp"] > first["timestamp"]]
        return later[1] if len(later) >= 2 else None

    # Held: later stats records show the broker has read nothing more.
    later = wait_until(two_later, what="two more stats records")
    assert later["totals"]["msgs_in"] == first["totals"]["msgs_in"] < n
    got_fast += drain_now(fast)
    assert len(got_fast) < n and not pub.done()
    # The slow client reads: everything flows, nothing is lost.
    got_slow = []

    def all_read():
        got_slow.extend(drain_now(slow))
        got_fast.extend(drain_now(fast))
        return len(got_slow) >= n and len(got_fast) >= n
    wait_until(all_read, 120, "both subscribers to read everything", interval=0.002)
    assert got_slow == list(range(n)) and got_fast == list(range(n))
    assert pub.finish() == n
    totals = b.stats()["totals"]
    assert totals["drops_soft"] == totals["drops_hard"] == totals["drops_disconnect"] == 0
    b.wait_for_event("flood", timeout=30, predicate=lambda r: r["client"] == sid and r["blocks"] > 0)


# ---- hard modes -----------------------------------------------------------------

@pytest.mark.parametrize("limit_flag,limit_value,size,expect_queued", [
    ("--queue-max-msgs", "100", 1000, 100),
    ("--queue-max-bytes", "50000", 1000, 50),
])
def test_hard_discard_caps_the_queue_and_counts_the_rest(
        start_flood_broker, backend, publisher, limit_flag, limit_value, size, expect_queued):
    b = start_flood_broker(*SMALL, limit_flag, limit_value, backend=backend)
    slow, sid = subscriber(b, b"f/")
    fast, _ = subscriber(b, b"f/", cmsgs=[b"blocking/hard/block"])
    base = per_client(b.stats(), sid)["msgs_out"]
    n = 2000
    pub = publisher(b, n, sizes=[size])
    assert read_seqs(fast, n) == list(range(n))
    assert pub.finish() == n
    snap = b.stats()
    c = per_client(snap, sid)
    sent = c["msgs_out"] - base
    assert c["queued_msgs"] == expect_queued and c["queued_bytes"] == expect_queued * size
    assert c["drops_hard"] == n - sent - expect_queued > 0
    assert c["drops_soft"] == c["drops_disconnect"] == 0
    # The oldest ones are kept (in the socket, then in the queue); newer ones dropped.
    assert read_seqs(slow, sent + expect_queued) == list(range(sent + expect_queued))
    assert recv_or_none(slow, 0.3) is None
    recs = wait_flood_total(b, sid, "drops_hard", c["drops_hard"])
    assert all(r["hard"] == "discard" for r in recs)


def test_total_max_bytes_caps_queued_bytes_broker_wide(start_flood_broker, backend):
    cap, size = 200_000, 1000
    b = start_flood_broker(*SMALL, "--total-max-bytes", str(cap), backend=backend)
    s1, id1 = subscriber(b, b"a/")
    s2, id2 = subscriber(b, b"b/")
    pub = publisher_socket(b)
    pad = b"p" * (size - len(b"MSG a/x\0") - 10)
    for i in range(400):
        pub.send(b"MSG a/x\0%010d" % i + pad)
    snap = pub.stats_after()
    c1 = per_client(snap, id1)
    assert c1["queued_bytes"] == cap // size * size and c1["drops_hard"] > 0
    # The broker-wide cap is reached: b's subscriber can queue nothing now.
    for i in range(400):
        pub.send(b"MSG b/x\0%010d" % i + pad)
    snap = pub.stats_after()
    c2 = per_client(snap, id2)
    assert c2["queued_msgs"] == 0 and c2["drops_hard"] > 0
    assert snap["totals"]["queued_bytes"] <= cap
    assert snap["totals"]["queued_bytes_peak"] <= cap + 4096   # + a stats reply at most
    # a's subscriber drains; the room is b's now.
    read_seqs(s1, 400 - c1["drops_hard"])
    pub.send(b"MSG b/x\0%010d" % 999 + pad)
    snap = pub.stats_after()
    assert per_client(snap, id2)["queued_msgs"] == 1


def test_disconnect_with_a_queue_counts_the_queue_as_dropped(start_flood_broker, backend):
    b = start_flood_broker(*SMALL, backend=backend)
    slow, sid = subscriber(b, b"f/")
    pub = publisher_socket(b)
    for i in range(300):
        pub.send(b"MSG f/x\0%010d" % i + b"q" * 990)
    queued = per_client(pub.stats_after(), sid)["queued_msgs"]
    assert queued > 0
    slow.close()
    rec = b.wait_for_event("client_disconnect", timeout=60, predicate=lambda r: r["client"] == sid)
    # eof if the broker reads the hang-up first, error if it is writing the
    # queue to the socket when the hang-up comes: the scheduler decides.
    assert rec["reason"] in ("eof", "error")
    assert rec["counters"]["drops_disconnect"] == queued
    totals = pub.stats_after()["totals"]
    assert totals["drops_disconnect"] == queued and totals["queued_bytes"] == 0


# ---- block: timeouts, disconnects, publishers that are slow readers -------------

@pytest.mark.parametrize("mode", [b"blocking/soft/block", b"blocking/hard/block"])
def test_block_timeout_disconnects_a_client_that_keeps_the_bus_blocked(
        start_flood_broker, backend, publisher, mode):
    b = start_flood_broker(*SMALL, "--queue-max-msgs", "100", "--block-timeout", "1", backend=backend)
    stuck, sid = subscriber(b, b"f/", cmsgs=[mode])
    # At the same limit the fast one blocks too, briefly, rather than drop.
    fast, _ = subscriber(b, b"f/", cmsgs=[b"blocking/hard/block"])
    n = 3000
    pub = publisher(b, n)
    assert read_seqs(fast, n, timeout=120) == list(range(n))
    assert pub.finish() == n
    rec = b.wait_for_event("client_disconnect", timeout=30, predicate=lambda r: r["client"] == sid)
    assert rec["reason"] == "flood_error" and "kept the bus blocked for 1s" in rec["detail"]
    assert rec["counters"]["drops_disconnect"] > 0
    totals = b.stats()["totals"]
    assert totals["drops_soft"] == totals["drops_hard"] == 0


def test_blocked_client_that_disconnects_releases_the_bus_at_once(start_flood_broker, backend, publisher):
    b = start_flood_broker(*SMALL, "--block-timeout", "600", backend=backend)
    stuck, sid = subscriber(b, b"f/", cmsgs=[b"blocking/soft/block"])
    fast, _ = subscriber(b, b"f/")
    n = 3000
    pub = publisher(b, n)
    b.wait_for_event("flood", timeout=60, predicate=lambda r: r["client"] == sid and r["blocks"] > 0)
    got = drain_now(fast)
    assert len(got) < n and not pub.done()       # held
    stuck.close()
    # Released long before the 600 s block timeout could have done it.
    got += read_seqs(fast, n - len(got), timeout=120)
    assert got == list(range(n))
    assert pub.finish() == n
    rec = b.wait_for_event("client_disconnect", timeout=30, predicate=lambda r: r["client"] == sid)
    assert rec["reason"] in ("eof", "error")        # as above: read or write first, a race


SELF_LOOP = r"""
import socket, sys, threading, time
addr, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(120)
s.connect(addr)
s.send(b"CMSG blocking/soft/block")
s.send(b"SUB loop/")
s.send(b"CMSG !/cred/whoami")
assert s.recv(1000).startswith(b"CMSG !/cred/whoami\0")
got = []
def reader():
    while len(got) < n:
        p = s.recv(1 << 16)
        got.append(int(p[p.index(b"\0") + 1:][:10]))
        if len(got) % 50 == 0:
            time.sleep(0.003)         # a slow reader
t = threading.Thread(target=reader)
t.start()
pad = b"x" * (size - 21)
for i in range(n):
    s.send(b"MSG loop/x\0%010d" % i + pad)
t.join(120)
print("ok" if got == list(range(n)) else "bad %d %r" % (len(got), got[:10]))
"""


def test_client_that_publishes_and_reads_slowly_in_block_mode_gets_everything(
        start_flood_broker, backend):
    b = start_flood_broker(*SMALL, "--block-timeout", "120", backend=backend)
    fast, _ = subscriber(b, b"loop/")
    n = 3000
    proc = subprocess.Popen([sys.executable, "-c", SELF_LOOP, b.address, str(n), "1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert read_seqs(fast, n, timeout=120) == list(range(n))
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.strip() == b"ok", (out, err)
    totals = b.stats()["totals"]
    assert totals["msgs_in"] == n
    assert totals["drops_soft"] == totals["drops_hard"] == totals["drops_disconnect"] == 0


def test_client_that_publishes_and_never_reads_in_block_mode_is_cut_off(start_flood_broker, backend):
    """It blocks the bus, the broker stops reading it, its own sends stall:
    the block timeout ends the stand-off and everyone else carries on."""
    b = start_flood_broker(*SMALL, "--block-timeout", "2", backend=backend)
    fast, _ = subscriber(b, b"loop/")
    me, mid = subscriber(b, b"loop/", cmsgs=[b"blocking/soft/block"])
    me.settimeout(120)
    with pytest.raises(OSError):
        for i in range(100000):
            me.send(b"MSG loop/x\0%010d" % i + b"m" * 979)
    rec = b.wait_for_event("client_disconnect", timeout=30, predicate=lambda r: r["client"] == mid)
    assert rec["reason"] == "flood_error" and "kept the bus blocked" in rec["detail"]
    accepted = rec["counters"]["msgs_in"]
    assert 0 < accepted <= i
    assert read_seqs(fast, accepted) == list(range(accepted))
    late = publisher_socket(b)
    late.send(b"MSG loop/after\0%010d" % 424242)
    assert read_seqs(fast, 1) == [424242]


# ---- orders -----------------------------------------------------------------------

@pytest.mark.parametrize("order,how", [
    ("queue", "default"), ("stack", "cmsg"), ("stack", "flag"), ("random", "cmsg"),
])
def test_queue_order_decides_what_a_slow_client_gets_next(start_flood_broker, backend, order, how):
    b = start_flood_broker(*SMALL, *(("--order", order) if how == "flag" else ()), backend=backend)
    # The most recent control message wins: another order first, then ours.
    cmsgs = [b"order/random", b"order/" + order.encode()] if how == "cmsg" else []
    slow, sid = subscriber(b, b"f/", cmsgs=cmsgs)
    pub = publisher_socket(b)
    base = per_client(pub.stats(), sid)["msgs_out"]
    n = 300
    for i in range(n):
        pub.send(b"MSG f/x\0%010d" % i + b"o" * 990)
    c = per_client(pub.stats_after(), sid)
    assert c["order"] == order
    k = c["msgs_out"] - base                 # already in its socket, in arrival order
    assert c["queued_msgs"] == n - k >= 100
    got = read_seqs(slow, n)
    assert got[:k] == list(range(k))
    expected = {
        "queue": list(range(k, n)),
        "stack": list(range(n - 1, k - 1, -1)),    # newest first
        "random": list(range(k, n)),               # equal sizes, sole holder: oldest first
    }[order]
    assert got[k:] == expected


def test_random_order_sends_what_frees_memory_first(start_flood_broker, backend):
    """Sole holder first, then larger, then older."""
    b = start_flood_broker(*SMALL, backend=backend)
    a, aid = subscriber(b, b"own/", b"shared/", cmsgs=[b"order/random"])
    other, oid = subscriber(b, b"shared/", b"fill")
    pub = publisher_socket(b)
    fill_until_queued(pub, b"fill", oid)    # from now on `other` queues every shared message
    base = per_client(pub.stats(), aid)["msgs_out"]
    sizes = (100, 3000, 1000, 2000, 500)
    batch = []
    for i in range(240):
        shared = i % 3 == 0
        packet = b"MSG " + (b"shared/x" if shared else b"own/x") + b"\0%010d" % i
        packet += b"r" * (sizes[(i * 7) % 5] - len(packet))
        pub.send(packet)
        batch.append((shared, len(packet), i))
    c = per_client(pub.stats_after(), aid)
    k = c["msgs_out"] - base
    assert c["queued_msgs"] == len(batch) - k >= 100
    got = read_seqs(a, len(batch))
    assert got[:k] == list(range(k))
    expected = [i for shared, size, i in sorted(batch[k:], key=lambda m: (m[0], -m[1], m[2]))]
    assert got[k:] == expected


def mixed_workload_peak(start_flood_broker, backend, order, rounds=2500):
    """One slowly reading subscriber (order under test) and one stuck one that
    shares the small messages; alternating 64 B and 4 KiB packets, three
    published for every two read, in lock step. Returns the broker's peak of
    queued bytes."""
    b = start_flood_broker(*SMALL, "--order", order, backend=backend)
    reader, rid = subscriber(b, b"mix/")
    stuck, _ = subscriber(b, b"mix/small")
    pub = publisher_socket(b)
    small = b"MSG mix/small\0" + b"s" * 50
    big = b"MSG mix/big\0" + b"b" * (4096 - 12)
    assert len(small) == 64 and len(big) == 4096
    reader.settimeout(60)
    k = 0
    for _ in range(rounds):
        for _ in range(3):
            pub.send(small if k % 2 == 0 else big)
            k += 1
        reader.recv(1 << 16)
        reader.recv(1 << 16)
    snap = pub.stats_after()
    assert snap["totals"]["msgs_in"] == 3 * rounds
    assert snap["totals"]["drops_hard"] == snap["totals"]["drops_soft"] == 0
    assert per_client(snap, rid)["order"] == order
    return snap["totals"]["queued_bytes_peak"]


def test_random_order_reaches_a_lower_peak_than_queue_order_on_mixed_sizes(start_flood_broker, backend):
    peak_queue = mixed_workload_peak(start_flood_broker, backend, "queue")
    peak_random = mixed_workload_peak(start_flood_broker, backend, "random")
    print(f"\n[{backend}] mixed workload queued_bytes_peak: queue={peak_queue} random={peak_random}")
    assert peak_random * 2 < peak_queue


# ---- memory --------------------------------------------------------------------------

def test_a_million_messages_to_a_never_reading_subscriber_keep_memory_bounded(
        start_flood_broker, publisher):
    n, size = 1_000_000, 100
    b = start_flood_broker(backend="epoll")             # defaults: 8 MiB / 65536 msgs per client
    stuck, sid = subscriber(b, b"m/")
    ctl = b.connect(timeout=60)
    before = per_client(ctl.stats(), sid)
    pid = b.pid
    rss_start = status_kib(pid, "VmRSS") * 1024
    pub = publisher(b, n, key="m/x", sizes=[size])
    rss_max = queued_max = 0
    t0 = time.monotonic()
    while not pub.done():
        assert time.monotonic() - t0 < 300, "publishing a million messages took over 300 s"
        snap = ctl.stats()
        c = per_client(snap, sid)
        assert c["queued_msgs"] <= 65536 and c["queued_bytes"] <= 8 * MIB
        queued_max = max(queued_max, snap["totals"]["queued_bytes"])
        rss_max = max(rss_max, status_kib(pid, "VmRSS") * 1024)
        time.sleep(0.1)         # the sampling period while the publisher runs
    elapsed = time.monotonic() - t0
    assert pub.finish() == n
    snap = wait_until(lambda: [s for s in [ctl.stats()] if s["totals"]["msgs_in"] == n],
                      what="the broker to read every message")[0]
    c = per_client(snap, sid)
    delivered = c["msgs_out"] - before["msgs_out"]
    dropped = c["drops_soft"] + c["drops_hard"] + c["drops_disconnect"]
    # Every message is accounted for: in its socket, in its queue, or counted dropped.
    assert delivered + c["queued_msgs"] + dropped == n
    assert c["queued_msgs"] == 65536 and c["drops_hard"] > 900_000
    assert snap["totals"]["queued_bytes_peak"] <= 8 * MIB + 64 * 1024
    rss_max = max(rss_max, status_kib(pid, "VmRSS") * 1024)
    hwm = status_kib(pid, "VmHWM") * 1024
    print(f"\n1M x {size} B in {elapsed:.1f}s: delivered={delivered} queued={c['queued_msgs']} "
          f"dropped={dropped} queued_bytes max seen={queued_max} "
          f"peak={snap['totals']['queued_bytes_peak']} "
          f"RSS start={rss_start / MIB:.1f} MiB max={rss_max / MIB:.1f} MiB "
          f"HWM={hwm / MIB:.1f} MiB")
    assert hwm < 200 * MIB
    assert hwm - rss_start < 64 * MIB             # 65536 queued packets are ~10 MiB
    recs = wait_flood_total(b, sid, "drops_hard", c["drops_hard"])
    assert len(recs) <= elapsed + 5


# ---- the flood log ---------------------------------------------------------------------

@pytest.mark.parametrize("interval", [
    "10",
    "0.2",
])
def test_flood_summaries_are_one_per_client_per_second(start_flood_broker, publisher, interval):
    b = start_flood_broker(*SMALL, "--stats-interval", interval, backend="epoll")
    subs = [subscriber(b, b"f/", cmsgs=[b"blocking/soft/discard"]) for _ in range(2)]
    ids = [cid for _, cid in subs]
    t0 = time.monotonic()
    first = 0
    while time.monotonic() - t0 < 3.5:
        publisher(b, 100_000, sizes=[200], first=first).finish()
        first += 100_000
    snap = b.stats()
    for cid in ids:
        drops = per_client(snap, cid)["drops_soft"]
        assert drops > 0
        recs = wait_flood_total(b, cid, "drops_soft", drops)
        stamps = sorted(datetime.fromisoformat(r["timestamp"].replace("Z", "+00:00"))
                        for r in recs)
        gaps = [(y - x).total_seconds() for x, y in zip(stamps, stamps[1:])]
        assert len(recs) >= 2
        assert min(gaps) >= 0.9, gaps


# ---- known losses in block mode --------------------------------------------------------

def blocked_burst(b, burst, packet_size, hang_up):
    """A soft-block subscriber whose socket is full, and a burst from one
    publisher that is all waiting when the broker next reads: the broker is
    stopped (SIGSTOP) while the publisher sends it (and, with hang_up, closes),
    then resumed. The subscriber reads only once the broker has stopped
    reading. Returns the burst's sequence numbers as the subscriber got them
    and its counters."""
    sub, sid = subscriber(b, b"k")
    pub = publisher_socket(b)
    fill_until_queued(pub, b"k", sid)
    sub.send(b"CMSG blocking/soft/block")
    wait_until(lambda: per_client(pub.stats(), sid)["soft"] == "block", what="block mode")
    in_before = pub.stats()["totals"]["msgs_in"]
    stop_process(b.pid)
    try:
        for i in range(burst):
            packet = b"MSG k\0%010d" % (i + 1)
            pub.send(packet + b"y" * (packet_size - len(packet)))
        if hang_up:
            pub.close()
    finally:
        os.kill(b.pid, signal.SIGCONT)

    # The subscriber reads nothing until the broker has stopped reading: two
    # stats records in a row (written even while the bus is blocked) show the
    # same msgs_in, past what it was, and the subscriber still queued.
    def held():
        recs = b.events("stats")[-2:]
        return (len(recs) == 2 and
                recs[0]["totals"]["msgs_in"] == recs[1]["totals"]["msgs_in"] > in_before and
                all(c["queued_msgs"] > 0 for r in recs for c in r["clients"]
                    if c["client"] == sid))
    wait_until(held, what="the broker to take what it takes of the burst")
    got = []

    def settled():
        got.extend(s for s in drain_now(sub) if s > 0)
        rec = last_stats_record(b)
        return rec if (rec and rec["totals"]["msgs_in"] == in_before + burst and
                       any(c["client"] == sid and c["queued_msgs"] == 0
                           for c in rec["clients"])) else None

    rec = wait_until(settled, what="the subscriber to drain its queue")
    got += [s for s in drain_now(sub) if s > 0]
    return got, per_client(rec, sid)


@pytest.mark.parametrize("backend", [
    "epoll",
    "select",
])
def test_block_mode_loses_nothing_when_a_publisher_hangs_up_while_blocked(start_flood_broker, backend):
    b = start_flood_broker(*SMALL, "--queue-max-msgs", "100", "--block-timeout", "120",
              "--stats-interval", "0.2", backend=backend)
    got, c = blocked_burst(b, burst=150, packet_size=116, hang_up=True)
    assert c["drops_hard"] == 0
    assert got == list(range(1, 151))


@pytest.mark.parametrize("backend", ["epoll", "select"])
def test_block_mode_loses_nothing_when_one_batch_exceeds_the_queue_limit(start_flood_broker, backend):
    b = start_flood_broker(*SMALL, "--queue-max-bytes", "65536", "--block-timeout", "120",
              "--stats-interval", "0.2", backend=backend)
    got, c = blocked_burst(b, burst=32, packet_size=4000, hang_up=False)
    assert c["drops_hard"] == 0
    assert got == list(range(1, 33))


def test_stats_read_with_messages_in_one_batch_counts_their_deliveries(start_flood_broker, backend):
    b = start_flood_broker(*SMALL, backend=backend)
    sub, sid = subscriber(b, b"a/")
    pub = publisher_socket(b)
    fill_until_queued(pub, b"a/", sid)
    before = pub.stats_after()
    stop_process(b.pid)        # so the broker reads all of it in one batch
    try:
        for i in range(10):
            pub.send(b"MSG a/x\0%010d" % i + b"z" * 100)
        pub.send(b"CMSG stats")
    finally:
        os.kill(b.pid, signal.SIGCONT)
    packet = pub.recv(1 << 22)
    snap = json.loads(packet[len(b"CMSG stats\0"):])
    assert snap["totals"]["msgs_in"] == before["totals"]["msgs_in"] + 10
    assert (per_client(snap, sid)["queued_msgs"] ==
            per_client(before, sid)["queued_msgs"] + 10)


def test_a_subscriber_the_flush_closes_while_it_is_closing_is_torn_down_once(start_flood_broker, backend):
    # Its end of input is read in the turn after publishers' packets pended
    # deliveries for it; sending those before it goes overflows its queue,
    # which in blocking/hard/error mode closes it as well: it must be torn
    # down (and freed) once, for the reason found first.
    b = start_flood_broker(*SMALL, "--queue-max-msgs", "4", backend=backend)
    sub, sid = subscriber(b, b"k", cmsgs=[b"blocking/hard/error"])
    pubs = [publisher_socket(b) for _ in range(8)]
    fill_until_queued(pubs[0], b"k", sid)
    for p in pubs:
        p.sync()
    stop_process(b.pid)
    try:
        for p in pubs:
            for i in range(2):
                p.send(b"MSG k\0%010d" % i + b"f" * 3000)
        sub.shutdown(socket.SHUT_WR)
    finally:
        os.kill(b.pid, signal.SIGCONT)
    rec = b.wait_for_event("client_disconnect", predicate=lambda r: r["client"] == sid)
    for p in pubs:
        p.sync()
    assert b.proc.poll() is None
    assert rec["reason"] in ("eof", "flood_error"), rec
    records = [r for r in b.records() if r.get("event") == "client_disconnect"]
    assert [r["client"] for r in records] == [sid], records
