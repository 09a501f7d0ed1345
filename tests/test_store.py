"""``sbus store`` end to end: real sbusd and store processes, replay through the library."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

import sbus
from sbus.client.store import StoreError, alast, areplay, last, replay, store_stats
from sbus.store import service, wire
from sbus.store.patterns import compile_pattern, covers
from sbus.store.segments import SUFFIX

from support import SBUS, Conn, StoreProcess, asroot, make_public_dir, wait_until


@pytest.fixture(autouse=True)
def no_store_left():
    yield
    StoreProcess.stop_all()


@pytest.fixture
def start_store(tmp_path, bus):
    def start(*patterns, args=(), directory=None):
        return StoreProcess(tmp_path, bus.address, directory or tmp_path / "log", patterns,
                            "--stats-interval", "0", *args).ready()

    return start


def settle(client):
    """Until the store has written what was published before: a stats answer
    comes after the store handled every message it received before it."""
    return store_stats(client)


def publish(address, items):
    with sbus.Client(address) as c:
        c.publish_many(items)
        c.whoami(timeout=10)


def test_exact_replay_binary_order_once_and_private_never_stored(bus, start_store):
    start_store("a/", "a/*/c", "")
    items = [(f"a/{i}/c", bytes([i % 256, 0, 255, 10]) * (i % 5)) for i in range(300)]
    with sbus.Client(bus.address) as c:
        me = c.whoami(timeout=10)
        c.publish(f"{me}/secret", b"hidden")
        c.publish_many(items)
        c.publish("other/x", b"\0\1")
        c.whoami(timeout=10)
        settle(c)
        got = list(replay(c, "a/"))
        assert [(m.key.decode(), m.payload) for m in got] == items
        everything = replay(c, "")
        seqs, keys = [], []
        for m in everything:
            seqs.append(everything.seq)
            keys.append(m.key)
        assert not any(k.startswith(b"!") for k in keys)
        assert keys.count(b"other/x") == 1 and len(keys) == 301
        assert seqs == list(range(seqs[0], seqs[0] + 301))
    assert not any(b"hidden" in p.read_bytes() for p in (Path(bus.address).parent / "log").iterdir())


def test_last_values_and_since_until(bus, start_store):
    start_store("s/")
    with sbus.Client(bus.address) as c:
        for i in range(3):
            c.publish_many([(f"s/{k}", b"%d" % i) for k in "xyz"])
            c.whoami(timeout=10)
            settle(c)
            if i == 0:
                t1 = time.time()
                time.sleep(0.05)
        t2 = time.time()
        time.sleep(0.05)
        c.publish("s/x", b"late")
        c.whoami(timeout=10)
        settle(c)
        values = {m.key: m.payload for m in last(c, "s/")}
        assert values == {b"s/x": b"late", b"s/y": b"2", b"s/z": b"2"}
        assert [m.payload for m in last(c, "s/y")] == [b"2"]
        window = [m.payload for m in replay(c, "s/", since=t1, until=t2)]
        assert window == [b"1", b"1", b"1", b"2", b"2", b"2"]
        assert [m.payload for m in replay(c, "s/x", since=t2)] == [b"late"]


def test_follow_under_concurrent_publishing_has_no_gap_and_no_repeat(bus, start_store):
    start_store("f/")
    total = 20000
    go = threading.Event()

    def publisher():
        with sbus.Client(bus.address) as p:
            for start in range(0, total, 500):
                p.publish_many((b"f/n", b"%d" % i) for i in range(start, start + 500))
                if start == 5000:
                    go.set()
                time.sleep(0.002)
            p.whoami(timeout=10)

    t = threading.Thread(target=publisher)
    t.start()
    go.wait(10)
    with sbus.Client(bus.address) as c:
        seen = []
        with replay(c, "f/", follow=True) as it:
            for m in it:
                seen.append(int(m.payload))
                if len(seen) == total:
                    break
    t.join()
    assert seen == list(range(total))


def test_kill9_at_random_moments_loses_nothing_written(bus, start_store, tmp_path):
    store = start_store("k/", args=("--fsync", "never", "--segment-bytes", "20000"))
    rng = random.Random(7)
    confirmed = 0
    sent = 0
    with sbus.Client(bus.address) as c:
        for _ in range(5):
            stop = threading.Event()

            def publisher():
                nonlocal sent
                with sbus.Client(bus.address) as p:
                    while not stop.is_set():
                        p.publish_many((b"k/n", b"%d" % (sent + i)) for i in range(50))
                        sent += 50
                        time.sleep(0.001)

            t = threading.Thread(target=publisher)
            t.start()
            time.sleep(rng.uniform(0.05, 0.3))
            confirmed = max(confirmed, store_stats(c)["last_seq"])
            time.sleep(rng.uniform(0, 0.05))
            store.kill9()
            stop.set()
            t.join()
            store = store.restart()
            rec = store.wait_for_event("store_recover")
            assert rec["last_seq"] >= confirmed
        values = [int(m.payload) for m in replay(c, "k/")]
    # In order, none twice, every message up to what the store confirmed kept.
    assert values == sorted(set(values))
    assert len(values) >= confirmed


def test_torn_tail_is_cut_and_reported(bus, start_store):
    store = start_store("t/")
    publish(bus.address, [(b"t/x", b"%d" % i) for i in range(100)])
    with sbus.Client(bus.address) as c:
        settle(c)
    assert store.stop() == 0
    (stopped,) = store.events("store_stop")
    assert (stopped["reason"], stopped["recorded"], stopped["last_seq"]) == ("signal", 100, 100)
    seg = sorted(store.directory.glob("*" + SUFFIX))[-1]
    whole = seg.stat().st_size
    torn = b"\x40\0\0\0garbage: half a record"
    with open(seg, "ab") as f:
        f.write(torn)
    store = store.restart()
    rec = store.wait_for_event("store_recover")
    assert rec["torn"] is True and rec["cut_bytes"] == len(torn) and rec["records"] == 100
    assert rec["level"] == "warning"
    assert seg.stat().st_size == whole
    with sbus.Client(bus.address) as c:
        assert [m.payload for m in replay(c, "t/")] == [b"%d" % i for i in range(100)]


def test_retention_removes_oldest_segments_and_counts_them(bus, start_store):
    store = start_store("r/", args=("--segment-bytes", "4096", "--max-bytes", "16384"))
    for i in range(10):
        publish(bus.address, [(b"r/x", b"%05d" % n + b"." * 100) for n in range(i * 50, i * 50 + 50)])
    with sbus.Client(bus.address) as c:
        stats = wait_until(lambda: (lambda s: s if s["retention_records"] else None)(store_stats(c)),
                           timeout=10, what="retention")
        assert stats["bytes"] <= 16384 + 4096
        event = store.wait_for_event("store_retention")
        assert event["records"] > 0 and event["segments"] > 0
        kept = [int(m.payload[:5]) for m in replay(c, "r/")]
        # The newest survive, oldest first gone, and the replay says what went.
        assert kept == list(range(500 - len(kept), 500))
        assert stats["retention_records"] + stats["records"] == 500


def test_disk_full_keeps_answering_counts_and_resumes(bus, start_store, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        store = start_store("d/", "e/", args=("--segment-bytes", "10000000"),
                            directory=mnt / "log")
        with sbus.Client(bus.address) as c:
            for n in range(40):
                c.publish_many([(b"d/x", b"%06d" % (n * 100 + i) + b"-" * 200) for i in range(100)])
                c.whoami(timeout=10)
            store.wait_for_event("store_disk_full", timeout=10)
            stats = store_stats(c)          # still answering
            assert stats["disk_full"] is True
            assert stats["missed_by_pattern"]["d/"] == stats["missed_disk_full"] > 0
            before = [int(m.payload[:6]) for m in replay(c, "d/")]
            assert before == list(range(len(before)))
            # Space comes back (as when an operator clears some).
            subprocess.run(["mount", "-o", "remount,size=4m", str(mnt)], check=True)
            time.sleep(1.2)
            c.publish("e/after", b"back")
            c.whoami(timeout=10)
            resumed = store.wait_for_event("store_disk_resumed", timeout=10)
            assert resumed["missed"] >= stats["missed_disk_full"]
            assert resumed["missed_by_pattern"]["d/"] == resumed["missed"]
            gaps = []
            it = replay(c, "e/", on_gap=gaps.append)
            assert [m.payload for m in it] == [b"back"]
            assert [(g.reason, g.lost) for g in gaps] == [("disk_full", resumed["missed"])]
    finally:
        store.stop()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_malformed_requests_get_private_errors_and_crash_nothing(bus, start_store):
    store = start_store("m/")
    with sbus.Client(bus.address) as c:
        me = c.whoami(timeout=10)
        reply = f"{me}/answers"
        c.subscribe(reply)
        c.publish(wire.REQUEST_KEY, b"\xff\x00garbage")
        c.publish(wire.REQUEST_KEY, wire.request("replay", id="1", reply=reply, pattern="x/"))
        c.publish(wire.REQUEST_KEY, wire.request("replay", id="2", reply=reply, pattern="m/",
                                                 window=0))
        c.publish(wire.REQUEST_KEY, wire.request("launch", id="3", reply=reply))
        c.publish(wire.REQUEST_KEY, wire.request("replay", id="4", reply="public/key",
                                                 pattern="m/"))
        answers = [wire.parse_answer(c.receive(timeout=10).payload) for _ in range(3)]
        assert [(k, i) for k, i, _, _ in answers] == [(b"error", b"1"), (b"error", b"2"),
                                                     (b"error", b"3")]
        assert b"not recorded" in answers[0][3] and b"window" in answers[1][3]
        with pytest.raises(StoreError, match="not recorded"):
            list(replay(c, "elsewhere/"))
        assert store_stats(c)["requests_refused"] == 6
    assert store.proc.poll() is None
    assert len(store.events("store_request_refused")) == 6


@asroot
def test_second_uid_only_gets_its_own_answers(tmp_path, start_broker, spawn):
    d = make_public_dir()
    b = start_broker("-o", address=d / "bus.socket")
    s = StoreProcess(tmp_path, b.address, tmp_path / "log", ["p/"], "--stats-interval", "0").ready()
    try:
        publish(b.address, [(b"p/x", b"1")])
        with sbus.Client(b.address) as c:
            settle(c)
            root = str(c.whoami(timeout=10))

        def other(ctl):
            with sbus.Client(b.address) as o:
                mine = [m.payload.decode() for m in replay(o, "p/")]
            # Subscribing to root's private answers: the library refuses it
            # before sending, and the broker would close a raw client for it.
            with sbus.Client(b.address) as o:
                try:
                    o.subscribe(f"{root}/store/")
                    library = False
                except sbus.KeyRefusedError:
                    library = True
            with Conn.to(b.address) as raw:
                broker = not raw.sub_ok(f"{root}/store/")
            return {"mine": mine, "refused": [library, broker]}

        with sbus.Client(b.address) as c:
            child = spawn(other)
            result = child.result()
            assert result == {"mine": ["1"], "refused": [True, True]}
            assert [m.payload for m in replay(c, "p/")] == [b"1"]
    finally:
        s.stop()


def test_asyncio_twins(bus, start_store):
    import asyncio

    from sbus.client.aio import Client
    start_store("q/")
    publish(bus.address, [(b"q/a", b"1"), (b"q/b", b"2"), (b"q/a", b"3")])

    async def main():
        async with Client(bus.address) as c:
            await asyncio.sleep(0)
            it = await areplay(c, "q/")
            got = [m.payload async for m in it]
            lv = {m.key: m.payload for m in await alast(c, "q/")}
            return got, lv

    with sbus.Client(bus.address) as c:
        settle(c)
    got, lv = asyncio.run(main())
    assert got == [b"1", b"2", b"3"] and lv == {b"q/a": b"3", b"q/b": b"2"}


def test_the_clients_replay_and_last_methods(bus, start_store):
    """``Client.replay``/``last`` and the asyncio twins are the store functions."""
    import asyncio

    start_store("m/")
    publish(bus.address, [("m/a", b"1"), ("m/b", b"2"), ("m/a", b"3")])
    with sbus.Client(bus.address) as c:
        settle(c)
        assert [(m.key, m.payload) for m in c.replay("m/")] == [
            (b"m/a", b"1"), (b"m/b", b"2"), (b"m/a", b"3")]
        assert {m.key: m.payload for m in c.last("m/")} == {b"m/a": b"3", b"m/b": b"2"}

    async def asyncio_side():
        async with sbus.aio.Client(bus.address) as c:
            it = await c.replay("m/", after=1)
            async with it:
                got = [m.payload async for m in it]
            return got, [m.payload for m in await c.last("m/b")]

    assert asyncio.run(asyncio_side()) == ([b"2", b"3"], [b"2"])


def test_cli_replay_and_last(bus, start_store):
    start_store("c/")
    publish(bus.address, [(b"c/x", b"one"), (b"c/y", b"two"), (b"c/x", b"three")])
    with sbus.Client(bus.address) as c:
        settle(c)
    def run(*a):
        return subprocess.run([SBUS, "-a", bus.address, *a], capture_output=True, timeout=30)

    r = run("replay", "c/", "--json")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line) for line in r.stdout.splitlines()] == [
        {"type": "msg", "key": "c/x", "payload": "one"},
        {"type": "msg", "key": "c/y", "payload": "two"},
        {"type": "msg", "key": "c/x", "payload": "three"}]
    assert run("last", "c/", "-F", "{key}={payload}").stdout == b"c/y=two\nc/x=three\n"
    assert run("replay", "c/x", "--raw").stdout == b"onethree"
    r = run("replay", "nope/")
    assert r.returncode == 1 and b"not recorded" in r.stderr
    r = run("store", "--stats")
    assert r.returncode == 0, r.stderr
    counters = json.loads(r.stdout)
    assert (counters["recorded"], counters["keys"], counters["last_seq"]) == (3, 2, 3)


@pytest.mark.parametrize("outer,inner,expected", [
    (b"", b"a/b", True), (b"a/", b"", False), (b"a/", b"a/b/c", True), (b"a/", b"a", False),
    (b"a/", b"a/", True), (b"a/*", b"a/b", True), (b"a/*", b"a/b/", False),
    (b"a/*/c", b"a/x/c", True), (b"a/x*", b"a/xy", True), (b"a/x*", b"a/*", False),
    (b"a/*", b"a/x*", True), (b"a/b", b"a/b/", False), (b"*", b"", False)])
def test_pattern_cover(outer, inner, expected):
    assert covers(outer, inner) is expected


@pytest.mark.parametrize("pattern,key,expected", [
    (b"", b"x", True), (b"a/*/c/", b"a/b/c/d/e", True), (b"a/*/c/", b"a/b/c", False),
    (b"*b", b"ab", False), (b"a*", b"abc", True), (b"a/", b"a/", True), (b"a/", b"a", False)])
def test_pattern_match(pattern, key, expected):
    from sbus._ref.protocol import matches
    assert compile_pattern(pattern)(key) is expected is matches(pattern, key)


def test_messages_the_broker_drops_for_a_slow_store_are_a_counted_gap(tmp_path, start_broker):
    import signal
    b = start_broker("--queue-max-msgs", "100")
    store = StoreProcess(tmp_path, b.address, tmp_path / "log", ["g/"], "--stats-interval", "0").ready()
    try:
        publish(b.address, [(b"g/n", b"first")])
        with sbus.Client(b.address) as c:
            settle(c)
            os.kill(store.pid, signal.SIGSTOP)
            try:
                c.publish_many((b"g/n", b"%d" % i) for i in range(3000))
                c.whoami(timeout=10)
            finally:
                os.kill(store.pid, signal.SIGCONT)
            event = store.wait_for_event("store_gap", timeout=10)
            gaps = []
            got = [m.payload for m in replay(c, "g/", on_gap=gaps.append)]
        kept = [int(p) for p in got[1:]]
        assert got[0] == b"first" and kept == sorted(kept)
        assert [(g.reason, g.lost) for g in gaps] == [("flood", 3000 - len(kept))]
        assert event["lost"] == 3000 - len(kept) > 0
    finally:
        store.stop()


def test_a_store_holding_the_bus_keeps_reading_while_it_asks_for_the_drops(tmp_path, start_broker):
    """While a --flood block store holds the bus, the broker reads no one, so
    its question for the drop count waits for the store to read. Waiting for
    the answer first stopped the store for 5 s: past --block-timeout the
    broker closed it as a client that stopped reading, and the messages it
    had queued for the store were a gap of unknown size."""
    b = start_broker("--queue-max-msgs", "1000", "--block-timeout", "4")
    store = StoreProcess(tmp_path, b.address, tmp_path / "log", ["f/"], "--flood", "block",
                         "--stats-interval", "0").ready()
    n = 200_000
    try:
        with sbus.Client(b.address) as c:
            settle(c)

            def flood():
                with sbus.Client(b.address) as pub:
                    for start in range(0, n, 1000):
                        pub.publish_many((b"f/%d" % (i % 10), b"x" * 64)
                                         for i in range(start, start + 1000))
                    pub.whoami(timeout=60)
            os.kill(store.pid, signal.SIGSTOP)
            publisher = threading.Thread(target=flood)
            try:
                publisher.start()
                # The bus is held once the store's queue is full; its drop
                # check falls due meanwhile, and runs as soon as it goes on.
                time.sleep(2 * service.DROP_CHECK_S)
            finally:
                os.kill(store.pid, signal.SIGCONT)
            publisher.join(120)
            assert not publisher.is_alive()

            def settled():
                s = store_stats(c)
                return s if s["recorded"] >= n or s["lost_unknown"] else None
            stats = wait_until(settled, 60, "the store to record the flood, or a lost connection")
        assert (stats["recorded"], stats["gaps"], stats["lost_unknown"]) == (n, 0, 0)
        assert store.events("store_broker_lost") == []
        assert [r for r in b.events("client_disconnect") if r["pid"] == store.pid] == []
    finally:
        store.stop()


def test_sigterm_stops_the_store_while_the_broker_is_away(bus, start_store):
    store = start_store("w/")
    publish(bus.address, [(b"w/x", b"1")])
    with sbus.Client(bus.address) as c:
        settle(c)
    bus.stop()
    store.wait_for_event("store_broker_lost")
    assert store.stop() == 0
    (stopped,) = store.events("store_stop")
    assert (stopped["reason"], stopped["recorded"]) == ("signal", 1)


def test_sighup_reopens_the_log_for_rotation(bus, start_store):
    """logrotate's way: the log is renamed, SIGHUP, and what the store logs
    next goes to a new file at the old path; nothing is lost in between."""
    store = start_store("h/")
    rotated = store.log_path.with_suffix(".log.1")
    store.log_path.rename(rotated)
    os.kill(store.pid, signal.SIGHUP)
    # Acted on between turns: a record of the turn the signal came in may
    # still go to the old file; once the new one exists, every record does.
    wait_until(store.log_path.exists, 10, "the log reopened")
    with sbus.Client(bus.address) as c:
        c.publish(wire.REQUEST_KEY, b"\xff\x00garbage")     # a refused request is logged
        settle(c)
    wait_until(lambda: store.events("store_request_refused"), 10, "a record in the new log")
    assert store.proc.poll() is None
    assert not any(r.get("event") == "store_request_refused"
                   for r in map(json.loads, rotated.read_text().splitlines()))


# ---- readiness -------------------------------------------------------------------

def test_the_store_says_it_is_ready_and_sbus_ready_waits_for_it(bus, tmp_path, monkeypatch):
    """Issue 38: no polling. READY=1 (systemd's Type=notify) and one
    service_ready record once its subscriptions are in place; ``sbus ready
    store`` returns then, and gives up with a hint when no store runs."""
    from support.systemd import Notify
    r = subprocess.run([SBUS, "-a", bus.address, "ready", "store", "-W", "1"],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.splitlines() == [
        "sbus ready: store not ready within 1 s: no answer on 'sbus/store/request'",
        "  is sbus store running? start one: sbus store --dir DIR --record PATTERN "
        "(docs/store.md), or wait longer with -W SECONDS"]

    notify = Notify(tmp_path, abstract=False)
    monkeypatch.setenv("NOTIFY_SOCKET", notify.env)
    try:
        waiter = subprocess.Popen([SBUS, "-a", bus.address, "ready", "store", "-W", "60"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        store = StoreProcess(tmp_path, bus.address, tmp_path / "log", ["sensors/"])
        out, err = waiter.communicate(timeout=90)
        assert (waiter.returncode, out, err) == (0, b"", b"")
        assert notify.recv(timeout=30) == ("READY=1", store.pid)
        (said,) = store.events("service_ready")
        assert said["service"] == "store" and said["pid"] == store.pid
        assert said["request_key"] == "sbus/store/request"
        assert notify.pending() is None, "once"
        # Ready means recording: what is published now is kept.
        publish(bus.address, [("sensors/t", b"21.5")])
        settle(sbus.Client(bus.address))
        with sbus.Client(bus.address) as c:
            assert [(m.key, m.payload) for m in last(c, "sensors/")] == [
                (b"sensors/t", b"21.5")]
    finally:
        notify.close()
