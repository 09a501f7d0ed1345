"""Leaf brokers (``sbusd --upstream``) with real processes: messages up and
down, one upstream subscription per distinct local pattern, a chain of three
levels, an upstream that goes away under load, a bad upstream, and nested
credentials: the spec's four-step identity proof across servers with
eavesdroppers of another uid on every server (docs/hierarchy.md)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from sbus import Client
from sbus.errors import ProofError

from support import SBUS
from support.conn import Conn
from support.proof import check_proof
from support.sbusd import Sbusd
from support.seconduser import asroot, make_public_dir
from support.waiting import wait_until

_STARTED: list = []     # every broker a test started, stopped after it whatever happened


def stop_started() -> None:
    while _STARTED:
        _STARTED.pop().stop()


@pytest.fixture(autouse=True)
def _stop_brokers():
    yield
    stop_started()


@contextmanager
def public_dir():
    """A world-reachable directory for the sockets of the brokers a test
    starts (a second user connects); they are stopped before it goes."""
    d = make_public_dir()
    try:
        yield d
    finally:
        stop_started()
        shutil.rmtree(d, ignore_errors=True)


def broker(workdir, name, *args, upstream=None, log_level="info"):
    """A foreground sbusd at workdir/name (a leaf of ``upstream`` if given)."""
    extra = ["--upstream", upstream.address] if upstream is not None else []
    b = Sbusd.foreground(workdir, *extra, *args, address=str(workdir / name),
                         log_level=log_level)
    _STARTED.append(b)
    if upstream is not None:
        b.wait_for_event("upstream_connected", timeout=10)
    return b


def link_identity(leaf) -> str:
    """The leaf's credentials upstream (the prefix of its clients' whoami)."""
    with leaf.connect() as c:
        return c.whoami().rsplit("/!/cred/", 1)[0]


def link_patterns(upstream, leaf) -> int:
    """How many subscriptions the leaf's link holds on ``upstream``."""
    pid = int(link_identity(leaf).rsplit("/", 1)[1])
    [entry] = [e for e in upstream.stats()["clients"] if e["pid"] == pid]
    return entry["subscriptions"]


def wait_patterns(upstream, leaf, n):
    wait_until(lambda: link_patterns(upstream, leaf) == n, timeout=10,
               what=f"{n} link subscriptions upstream")


def stop_all(*brokers):
    for b in brokers:
        b.stop()


def payloads(packets, prefix=b"MSG "):
    return [p for p in packets if p.startswith(prefix)]


# ---- messages up and down -------------------------------------------------

def test_messages_go_up_and_come_down_once(tmp_path):
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    try:
        here, there = leaf.connect(), up.connect()
        here.sub("x/")
        here.sync()
        there.sub("x/")
        there.sync()
        wait_patterns(up, leaf, 2)          # !/cred//// and x/
        there.pub("x/down", b"1")
        here.pub("x/up", b"2")
        # once each (no echo back through the link); two publishers: no order between them
        assert sorted(here.drain()) == [b"MSG x/down\x001", b"MSG x/up\x002"]
        assert sorted(there.drain()) == [b"MSG x/down\x001", b"MSG x/up\x002"]
        # what no local client asked for does not come down
        assert link_patterns(up, leaf) == 2
        there.pub("y/1", b"not asked for")
        assert here.drain() == []
    finally:
        stop_all(leaf, up)


def test_upstream_export_narrows_what_goes_up(tmp_path):
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", "--upstream-export", "pub/", upstream=up)
    try:
        there = up.connect()
        there.sub("")
        there.sync()
        here = leaf.connect()
        here.pub("pub/1", b"a")
        here.pub("local/1", b"b")
        here.sync()
        assert payloads(there.drain()) == [b"MSG pub/1\x00a"]
    finally:
        stop_all(leaf, up)


def test_upstream_subscriptions_are_counted_by_reference(tmp_path):
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    clients = []
    try:
        # 1,000 subscribers over 50 connections, 37 distinct patterns.
        for i in range(50):
            c = leaf.connect()
            for j in range(20):
                c.sub(f"p/{(i * 20 + j) % 37}/")
            c.sync()
            clients.append(c)
        wait_patterns(up, leaf, 1 + 37)
        # Half unsubscribe everything, half leave: nothing is left behind.
        for i, c in enumerate(clients[:25]):
            for j in range(20):
                c.unsub(f"p/{(i * 20 + j) % 37}/")
            c.sync()
        wait_patterns(up, leaf, 1 + 37)     # the others still hold every pattern
        for c in clients[25:]:
            c.close()
        wait_patterns(up, leaf, 1)
        assert leaf.stats()["upstream"]["patterns"] == 0
    finally:
        for c in clients:
            c.close()
        stop_all(leaf, up)


def test_a_burst_comes_down_whole_and_in_order(tmp_path):
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    try:
        here = leaf.connect()
        here.sub("burst/")
        here.sync()
        wait_patterns(up, leaf, 2)
        there = up.connect()
        n = 20000
        body = b"x" * 100
        for i in range(n):
            there.pub(f"burst/{i}", body)
        got = []
        wait_until(lambda: got.extend(here.drain(0.2)) or len(got) >= n, timeout=60,
                   what=f"{n} messages")
        assert [int(p[len(b"MSG burst/"):p.index(b"\0")]) for p in got] == list(range(n))
    finally:
        stop_all(leaf, up)


FULL_RATE_SUBSCRIBER = """
import json, sys, time
from sbus import Client
count = int(sys.argv[2])
c = Client(sys.argv[1])
c.send_cmsg("blocking/hard/block")
c.subscribe("full/")
c.whoami()
print("ready", flush=True)
got, order, timeout = 0, True, 60.0
while got < count:
    try:
        batch = c.receive_many(64, timeout=timeout)
    except TimeoutError:
        break
    timeout = 5.0   # the publisher is done when nothing comes this long
    for m in batch:
        order = order and int(m.payload[:10]) == got
        got += 1
print(json.dumps({"received": got, "in_order": order}), flush=True)
"""


@pytest.mark.parametrize("way", ["down", "up"])
def test_a_leaf_whose_subscriber_keeps_up_loses_nothing_at_full_rate(tmp_path, way):
    """publish_many as fast as a broker takes it, far faster than the link
    forwards; a subscriber that keeps up on the other broker (its own process,
    receive_many). Down, the upstream holds its publisher for the link rather
    than discard for it (--upstream-flood block, the default); up, the link
    stops reading the leaf while the upstream is behind, so the leaf holds its
    publisher rather than the link drop past its buffer. Every message
    arrives, once, in order."""
    up = broker(tmp_path, "up", log_level="warning")
    leaf = broker(tmp_path, "leaf", upstream=up)
    source, sink = (up, leaf) if way == "down" else (leaf, up)
    n = 200_000
    sub = subprocess.Popen([sys.executable, "-c", FULL_RATE_SUBSCRIBER, sink.address, str(n)],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert sub.stdout.readline().strip() == "ready"
        if way == "down":
            wait_patterns(up, leaf, 2)
        pad = b"x" * 54
        with Client(source.address) as pub:
            assert pub.publish_many((b"full/k", b"%010d" % i + pad) for i in range(n)) == n
        out = json.loads(sub.stdout.readline())
        assert out == {"received": n, "in_order": True}
        [link] = [c for c in up.stats()["clients"] if not c["echo"]]
        assert (link["hard"], link["drops_hard"]) == ("block", 0)
        assert leaf.stats()["upstream"]["overflow_dropped"] == 0
    finally:
        sub.kill()
        sub.wait()
        stop_all(leaf, up)


def test_upstream_flood_discard_is_the_links_hard_mode_upstream(tmp_path):
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", "--upstream-flood", "discard", upstream=up)
    try:
        [link] = [c for c in up.stats()["clients"] if not c["echo"]]
        assert (link["soft"], link["hard"]) == ("queue", "discard")
    finally:
        stop_all(leaf, up)


def test_stats_and_top_show_the_upstream(tmp_path):
    from sbus.cli.top import View
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    with leaf.connect() as c:
        c.sub("a/")
        c.pub("b/1")
        c.sync()
    wait_until(lambda: leaf.stats()["upstream"]["up_msgs"] == 1, timeout=10, what="the report")
    stats = leaf.stats()
    assert stats["upstream"]["state"] == "up"
    assert stats["upstream"]["address"] == up.address
    assert stats["upstream"]["identity"] == link_identity(leaf)
    view = View(leaf.address)
    view.update(stats, time.monotonic())
    [line] = [text for text, _ in view.lines(200, 40) if text.startswith("upstream ")]
    assert line.startswith(f"upstream up {up.address}  patterns ")
    assert "  up 1  " in line
    assert "upstream" not in up.stats()        # a broker without --upstream has none


# ---- requests and replies across the hierarchy -------------------------------

@pytest.mark.parametrize("asker_on, server_on", [("leaf", "up"), ("up", "leaf"),
                                                 ("low", "up"), ("up", "low")])
def test_request_and_reply_across_brokers(tmp_path, asker_on, server_on):
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    low = broker(tmp_path, "low", upstream=leaf)
    where = {"up": up, "leaf": leaf, "low": low}
    try:
        # The server is a process of its own: a local-form key naming a process
        # connected to a leaf stays on that leaf (docs/hierarchy.md).
        srv = subprocess.Popen([sys.executable, "-c", SERVE_TWICE, where[server_on].address])
        try:
            wait_until(lambda: sum(c["subscriptions"] for c in where[server_on].stats()["clients"]
                                   if c["pid"] == srv.pid) == 2, 10, "the server subscribed")
            if server_on != "up":
                wait_patterns(up, leaf, 3)      # its pattern and chunk twin are held upstream too
            with Client(where[asker_on].address) as asker:
                assert asker.request("rpc/echo", b"abc", timeout=10) == b"cba"
                assert asker.request("rpc/echo", b"xyz", timeout=10) == b"zyx"
            assert srv.wait(10) == 0
        finally:
            srv.kill()
            srv.wait()
    finally:
        stop_all(low, leaf, up)


SERVE_TWICE = """
import sys
from sbus import Client
with Client(sys.argv[1]) as srv:
    srv.serve("rpc/echo", lambda r: r.payload[::-1], count=2)
"""


# ---- a chain of three levels ------------------------------------------------

def test_three_levels_deliver_exactly_once_in_order(tmp_path):
    top = broker(tmp_path, "top")
    mid = broker(tmp_path, "mid", upstream=top)
    low = broker(tmp_path, "low", upstream=mid)
    levels = {"top": top, "mid": mid, "low": low}
    try:
        subs = {name: b.connect() for name, b in levels.items()}
        for c in subs.values():
            c.sub("k/")
            c.sync()
        wait_patterns(mid, low, 2)
        wait_patterns(top, mid, 2)
        pubs = {name: b.connect() for name, b in levels.items()}
        n = 300
        for i in range(n):
            for name, c in pubs.items():
                c.pub(f"k/{name}", str(i))
        want = sorted(f"MSG k/{name}\0{i}".encode() for name in levels for i in range(n))
        for name, c in subs.items():
            got = []
            wait_until(lambda: got.extend(c.drain(0.2)) or len(got) >= 3 * n, timeout=20,
                       what=f"{3 * n} messages on {name}")
            got.extend(c.drain(0.5))
            assert sorted(got) == want, name         # each exactly once: no loops
            for src in levels:                       # and in order per publisher
                seq = [int(p.split(b"\0")[1]) for p in got if p.startswith(f"MSG k/{src}\0".encode())]
                assert seq == list(range(n)), (name, src)
    finally:
        stop_all(low, mid, top)


# ---- failure ------------------------------------------------------------------

def test_upstream_away_local_goes_on_loss_is_bounded_and_counted(tmp_path):
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", "--upstream-buffer", "100", upstream=up)
    try:
        local = leaf.connect()
        local.sub("load/")
        local.sync()
        publisher = leaf.connect()
        up.stop()
        leaf.wait_for_event("upstream_disconnected", timeout=10)
        for i in range(500):
            publisher.pub(f"load/{i}", b"")
        publisher.sync()
        # local traffic went on
        got = local.drain()
        assert got == [f"MSG load/{i}\0".encode() for i in range(500)]
        wait_until(lambda: leaf.stats()["upstream"]["overflow_dropped"] == 400, timeout=10,
                   what="400 counted drops")
        assert leaf.stats()["upstream"]["held"] == 100
        assert leaf.events("upstream_overflow")
        up2 = Sbusd.foreground(tmp_path, "-r", address=up.address, log_level="info")
        _STARTED.append(up2)
        try:
            there = up2.connect()
            there.sub("load/")
            there.sync()
            wait_until(lambda: len(leaf.events("upstream_connected")) == 2, timeout=15,
                       what="the link back")
            wait_patterns(up2, leaf, 2)
            for i in range(500, 600):
                publisher.pub(f"load/{i}", b"")
            publisher.sync()
            seen = []
            wait_until(lambda: seen.extend(there.drain(0.2)) or
                       "MSG load/599\0".encode() in seen, timeout=10, what="the last message")
            numbers = [int(p[len(b"MSG load/"):-1]) for p in seen]
            held = [k for k in numbers if k < 500]
            # the held messages are the first 100, in order; everything after the return arrives
            assert held == list(range(100))[-len(held):] if held else True
            assert numbers[len(held):] == list(range(500, 600))
            stats = leaf.stats()["upstream"]
            assert stats["state"] == "up" and stats["held"] == 0
            assert stats["overflow_dropped"] == 400
        finally:
            up2.stop()
    finally:
        leaf.stop()


def test_upstream_restarted_while_publishing(tmp_path):
    """A publisher on the leaf never stops; the upstream goes and comes back.
    Locally nothing is lost; upstream, a subscriber sees the messages in order
    and every one published after the link is back."""
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", "--upstream-buffer", "1000", upstream=up)
    stop = threading.Event()
    published = []

    def publish():
        c = leaf.connect()
        i = 0
        while not stop.is_set():
            c.pub(f"run/{i}", b"")
            published.append(i)
            i += 1
            if i % 100 == 0:
                time.sleep(0.005)
        c.sync()
        c.close()

    try:
        local = leaf.connect(timeout=30)
        local.sub("run/")
        local.sync()
        local_got = []
        worker = threading.Thread(target=publish)
        worker.start()
        time.sleep(0.3)
        up.stop()
        leaf.wait_for_event("upstream_disconnected", timeout=10)
        time.sleep(0.5)
        up2 = Sbusd.foreground(tmp_path, "-r", address=up.address, log_level="info")
        _STARTED.append(up2)
        try:
            there = up2.connect(timeout=30)
            there.sub("run/")
            there.sync()
            wait_until(lambda: len(leaf.events("upstream_connected")) == 2, timeout=15,
                       what="the link back")
            wait_patterns(up2, leaf, 2)
            mark = len(published)
            time.sleep(0.3)
            stop.set()
            worker.join(30)
            last = published[-1]
            seen = []
            wait_until(lambda: seen.extend(there.drain(0.2)) or
                       f"MSG run/{last}\0".encode() in seen, timeout=20, what="the last message")
            numbers = [int(p[len(b"MSG run/"):-1]) for p in seen]
            assert numbers == sorted(set(numbers))              # in order, none twice
            assert set(range(mark, last + 1)) <= set(numbers)   # all after the return
            wait_until(lambda: local_got.extend(local.drain(0.2)) or
                       f"MSG run/{last}\0".encode() in local_got, timeout=20,
                       what="everything locally")
            assert [int(p[len(b"MSG run/"):-1]) for p in local_got] == list(range(last + 1))
            stats = leaf.stats()["upstream"]
            # what was lost upstream is what overflowed while it was away, and counted
            missing = (last + 1) - len(numbers)
            assert stats["overflow_dropped"] <= missing
            assert stats["state"] == "up"
        finally:
            up2.stop()
    finally:
        stop.set()
        leaf.stop()


def test_the_leaf_reconnects_and_logs_why(tmp_path):
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    try:
        up.stop()
        lost = leaf.wait_for_event("upstream_disconnected", timeout=10)
        assert lost["reason"] == "the upstream closed the connection"
        retry = leaf.wait_for_event("upstream_retry", timeout=10,
                                    predicate=lambda r: "No such file" in r["reason"]
                                    or "refused" in r["reason"])
        assert retry["address"] == up.address
        assert leaf.stats()["upstream"]["state"] == "away"
        up2 = Sbusd.foreground(tmp_path, "-r", address=up.address, log_level="info")
        _STARTED.append(up2)
        try:
            wait_until(lambda: len(leaf.events("upstream_connected")) == 2, timeout=15,
                       what="the link back")
            assert leaf.stats()["upstream"]["state"] == "up"
        finally:
            up2.stop()
    finally:
        leaf.stop()


def fake_server(path, behaviour):
    """A SOCK_SEQPACKET listener that is not an sbusd: it closes each
    connection at once ("close") or answers garbage ("garbage")."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(str(path))
    srv.listen(8)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            if behaviour == "garbage":
                try:
                    c.recv(4096)
                    c.send(b"HELLO I am not a bus")
                except OSError:
                    pass
                time.sleep(0.2)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_a_passed_descriptor_is_no_upstream(tmp_path):
    b = Sbusd(tmp_path, ["-f", "-a", str(tmp_path / "leaf"), "--upstream", "/dev/fd/0"],
              log_level=None)
    assert b.wait(10) == 1
    assert "cannot be connected again" in b.stderr_text()


@pytest.mark.parametrize("kind, words", [
    ("missing", "No such file"),
    ("close", "closed the connection"),
    ("garbage", "not an sbusd"),
])
def test_a_bad_upstream_is_a_clear_error_at_start(tmp_path, kind, words):
    target = tmp_path / "bad"
    srv = fake_server(target, kind) if kind != "missing" else None
    try:
        b = Sbusd(tmp_path, ["-f", "-a", str(tmp_path / "leaf"), "--upstream", str(target)],
                  log_level=None)
        assert b.wait(10) == 1
        err = b.stderr_text()
        assert "--upstream" in err and words in err, err
        assert not (tmp_path / "leaf").exists()
    finally:
        if srv is not None:
            srv.close()


def link_pid(leaf) -> int:
    """The leaf's link process: the pid of its credentials upstream."""
    return int(link_identity(leaf).rsplit("/", 1)[1])


def test_the_link_starts_from_the_package_not_from_the_working_directory(tmp_path):
    """sbusd started in a directory holding an ``sbus/`` folder (a source
    checkout, for one): the link must not import that folder, or it dies
    and the leaf quietly serves as a plain broker (issue 38)."""
    up = broker(tmp_path, "up")
    here = tmp_path / "checkout"
    (here / "sbus").mkdir(parents=True)
    (here / "sbus" / "__init__.py").write_text("raise ImportError('the decoy sbus/ was imported')\n")
    address = str(tmp_path / "leaf")
    leaf = Sbusd(tmp_path, ["-f", "-a", address, "--upstream", up.address], address=address,
                 log_level="info", cwd=here).ready(timeout=10.0)
    _STARTED.append(leaf)
    leaf.wait_for_event("upstream_connected", timeout=10)
    with up.connect() as a, leaf.connect() as b:
        assert b.whoami() == f"{link_identity(leaf)}/{a.me}"
        assert link_identity(leaf).startswith("!/cred/")


def test_sigterm_stops_the_link_cleanly(tmp_path):
    """The link runs as every service does (sbus.runner): SIGTERM is noted
    and the loop stops between turns, with status 0, not killed by it."""
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    pid = link_pid(leaf)
    os.kill(pid, signal.SIGHUP)     # nothing to reopen: it goes on
    with leaf.connect() as c, up.connect() as u:
        u.sub("h/")
        u.sync()
        c.pub("h/x", b"after SIGHUP")
        assert u.next_packet(timeout=10) == b"MSG h/x\0after SIGHUP"
    os.kill(pid, signal.SIGTERM)
    # Ended by someone else's signal, it is started again all the same.
    ended = leaf.wait_for_event("upstream_link_failed", timeout=10)
    assert ended["returncode"] == 0, ended
    assert ended["reason"] == "the link ended (exit status 0)"
    leaf.wait_for_event("upstream_link_restarted", timeout=10)
    wait_until(lambda: len(leaf.events("upstream_connected")) == 2, timeout=10,
               what="the new link up")
    assert leaf.stop() == 0
    (ended,) = leaf.events("upstream_link_exit")
    assert ended["returncode"] == 0



def test_a_link_stopped_by_a_signal_says_what_it_held_for_the_upstream(tmp_path):
    """SIGTERM while the upstream is away: what the link held for it is lost,
    and the link says so on sbusd's stderr before it exits 0, as when its
    broker goes, rather than in silence."""
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    pid = link_pid(leaf)
    up.stop()
    leaf.wait_for_event("upstream_disconnected", timeout=10)
    with leaf.connect() as c:
        for i in range(5):
            c.pub(f"t/{i}", b"for an upstream that is away")
        c.sync()
    wait_until(lambda: leaf.stats()["upstream"]["held"] == 5, timeout=10, what="5 held")
    os.kill(pid, signal.SIGTERM)
    ended = leaf.wait_for_event("upstream_link_failed", timeout=10)
    assert ended["returncode"] == 0, leaf.stderr_text()
    wait_until(lambda: "sbusd-link: the link was stopped; lost 5 messages held for the upstream"
               in leaf.stderr_text(), timeout=10, what="the loss said on stderr")
    assert "Traceback" not in leaf.stderr_text()
    assert leaf.stop() == 0


@pytest.mark.parametrize("path", ["c", "reference"])
def test_a_link_whose_broker_goes_as_it_logs_the_upstreams_loss_leaves_cleanly(
        tmp_path, monkeypatch, path):
    """The upstream goes, then the leaf, before the link has seen either
    (it is stopped meanwhile): whichever it sees first, its first act is a
    write to a broker that is gone, the record of the upstream's loss or the
    held messages. It leaves with status 0 and no traceback, and says on the
    leaf's stderr what it could deliver to no one. Both paths: the C one
    writes to its broker in frames, the reference one in packets."""
    monkeypatch.setenv("SBUS_LINK_REFERENCE", "1" if path == "reference" else "0")
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    link = link_pid(leaf)
    os.kill(link, signal.SIGSTOP)
    try:
        up.kill()
        with leaf.connect() as c:
            for i in range(5):
                c.pub(f"t/{i}", b"for an upstream that is gone")
            c.sync()    # with the leaf, in its queue for the link
        os.kill(leaf.pid, signal.SIGTERM)
        # The leaf closed the link's end of the socketpair (it has the broker's pid).
        leaf.wait_for_event("client_disconnect", timeout=10,
                            predicate=lambda r: r["pid"] == leaf.pid and r["reason"] == "shutdown")
    finally:
        os.kill(link, signal.SIGCONT)
    assert leaf.wait(15) == 0
    (ended,) = leaf.events("upstream_link_exit")
    err = leaf.stderr_text()
    assert ended["returncode"] == 0, err
    assert "Traceback" not in err, err
    assert "the leaf broker went away; lost 5 messages held for the upstream" in err, err


# ---- the link's life: it starts, or sbusd says why; it dies, and is started again

BROKEN_LINK = """\
import os, sys
# Only in the link process (python -c ... --upstream): its one import that
# sbusd itself has not made fails, as a half-installed package's would.
if sys.argv[:1] == ["-c"] and "--upstream" in sys.argv and \\
        not os.path.exists(os.environ["LINK_WORKS_WHILE"]):
    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name == "sbus._core.batch":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Broken())
"""


def breakable_link(tmp_path) -> tuple:
    """An environment in which the leaf's link cannot import while ``flag`` is missing."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BROKEN_LINK)
    flag = tmp_path / "link-works"
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "LINK_WORKS_WHILE": str(flag)}, flag


def test_a_link_that_cannot_start_stops_the_leaf_with_the_reason(tmp_path):
    """Not a plain broker that was meant to be a leaf (issue 38): exit 1, and why."""
    up = broker(tmp_path, "up")
    env, _ = breakable_link(tmp_path)
    address = str(tmp_path / "leaf")
    leaf = Sbusd(tmp_path, ["-f", "-a", address, "--upstream", up.address], address=address,
                 log_level="info", env=env)
    assert leaf.wait(30) == 1
    err = leaf.stderr_text()
    assert f"sbusd: --upstream {up.address}: the link could not start (exit status 1): " \
           f"ModuleNotFoundError: No module named 'sbus._core.batch'" in err, err
    (failed,) = leaf.events("upstream_link_failed")
    assert failed["in_s"] is None and failed["returncode"] == 1
    assert not os.path.exists(address)


def test_a_link_that_dies_is_restarted_with_back_off_and_shown_away(tmp_path):
    up = broker(tmp_path, "up")
    env, works = breakable_link(tmp_path)
    works.touch()
    address = str(tmp_path / "leaf")
    leaf = Sbusd(tmp_path, ["-f", "-a", address, "--upstream", up.address], address=address,
                 log_level="info", env=env).ready(timeout=10.0)
    _STARTED.append(leaf)
    leaf.wait_for_event("upstream_connected", timeout=10)
    first = link_pid(leaf)

    works.unlink()      # from now on a new link cannot start
    os.kill(first, signal.SIGKILL)
    killed = leaf.wait_for_event("upstream_link_failed", timeout=10)
    assert killed["reason"] == "the link ended (killed by signal 9)", killed
    again = leaf.wait_for_event(
        "upstream_link_failed", timeout=20,
        predicate=lambda r: r["restarts"] >= 2 and "could not start" in r["reason"])
    assert "No module named 'sbus._core.batch'" in again["reason"]
    delays = [r["in_s"] for r in leaf.events("upstream_link_failed")]
    assert delays == sorted(delays) and delays[-1] > delays[0], delays     # back-off
    # Away between two attempts (a new link says "starting" until it dies).
    wait_until(lambda: leaf.stats()["upstream"]["state"] == "away", timeout=10, what="away")
    assert "No module named 'sbus._core.batch'" in leaf.stats()["upstream"]["reason"]
    with leaf.connect() as c:
        assert c.whoami().startswith("!/cred/")     # a plain broker's answer while away

    works.touch()
    leaf.wait_for_event("upstream_connected", timeout=20,
                        predicate=lambda r: r["identity"] != f"!/cred/{os.getgid()}/"
                        f"{os.getuid()}/{first}")
    wait_until(lambda: leaf.stats()["upstream"]["state"] == "up", timeout=10, what="up")
    assert link_pid(leaf) != first
    with up.connect() as u, leaf.connect() as c:
        u.sub("back/")
        u.sync()
        c.pub("back/x", b"through the new link")
        assert u.next_packet(timeout=10) == b"MSG back/x\0through the new link"


# ---- nested credentials -------------------------------------------------------

def test_whoami_on_a_leaf_is_nested_under_the_leafs_identity(tmp_path):
    up = broker(tmp_path, "up")
    mid = broker(tmp_path, "mid", upstream=up)
    low = broker(tmp_path, "low", upstream=mid)
    try:
        with up.connect() as a, mid.connect() as b, low.connect() as c:
            me = a.me
            assert a.whoami() == me
            mid_id = link_identity(mid)
            assert b.whoami() == f"{mid_id}/{me}"
            assert mid.stats()["upstream"]["identity"] == mid_id
            # the low leaf's identity is itself nested, as its link sees it on mid
            low_id = low.stats()["upstream"]["identity"]
            assert low_id.startswith(mid_id + "/!/cred/")
            assert c.whoami() == f"{low_id}/{me}"
    finally:
        stop_all(low, mid, up)


def test_nested_patterns_only_under_the_leafs_own_identity(tmp_path):
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    try:
        c = leaf.connect()
        who = c.whoami()
        assert c.sub_ok(who + "/mine")                     # own, nested
        assert c.sub_ok("!/cred////also")                  # own, local form
        other = leaf.connect()
        assert not other.sub_ok("!/cred/0/0/1/!/cred/0/0/1/x")  # another leaf's identity
        assert leaf.wait_for_event("subscribe", predicate=lambda r: not r["accepted"])[
            "reason"] == "cred_mismatch"
    finally:
        stop_all(leaf, up)


@asroot
def test_identity_proof_between_an_upstream_and_a_leaf(tmp_path, spawn):
    with public_dir() as d:
        up = broker(d, "up", "-g", "-o")
        leaf = broker(d, "leaf", "-g", "-o", upstream=up)
        # A on the upstream, B on the leaf (its pub/hello has a chunk twin,
        # docs/chunks.md); then the other way round
        check_proof(spawn, (up, leaf), up, leaf,
                    lambda: wait_patterns(up, leaf, 1 + 6))
        check_proof(spawn, (up, leaf), leaf, up,
                    lambda: wait_patterns(up, leaf, 1 + 5))


@asroot
def test_identity_proof_between_two_leaves(tmp_path, spawn):
    with public_dir() as d:
        up = broker(d, "up", "-g", "-o")
        one = broker(d, "one", "-g", "-o", upstream=up)
        two = broker(d, "two", "-g", "-o", upstream=up)
        assert link_identity(one) != link_identity(two)
        check_proof(spawn, (up, one, two), one, two,
                    lambda: (wait_patterns(up, one, 1 + 5), wait_patterns(up, two, 1 + 6)))


@asroot
def test_a_foreign_uid_cannot_subscribe_to_a_nested_key_on_a_leaf(tmp_path, spawn):
    with public_dir() as d:
        up = broker(d, "up", "-g", "-o")
        leaf = broker(d, "leaf", "-g", "-o", upstream=up)
        root_cred = leaf.connect().whoami()      # root's nested identity here

        def attempt():
            c = Conn.to(leaf.address)
            c.sub(root_cred + "/x")
            return c.whoami() is None            # closed: cred_mismatch
        assert spawn(lambda ctl: attempt()).result()


def test_after_a_live_upgrade_a_link_that_dies_is_restarted_and_handed_on(tmp_path):
    """The new sbusd watches the link it adopted (no child of its own, no
    exit status: a pidfd), restarts it, and hands the new one on at the next
    upgrade."""
    from support import SBUSD, alive, wait_gone
    up = broker(tmp_path, "up")
    address, pidfile = str(tmp_path / "leaf"), tmp_path / "leaf.pid"
    leaf = Sbusd(tmp_path, ["-f", "-a", address, "-p", str(pidfile), "--upstream", up.address],
                 address=address, log_level="info").ready(timeout=10.0)
    pids = [leaf.pid]
    try:
        leaf.wait_for_event("upstream_connected", timeout=10)
        first = link_pid(leaf)

        def upgrade():
            r = subprocess.run([SBUSD, "--upgrade", "-p", str(pidfile)], capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            pids.append(int(pidfile.read_text()))
            leaf.wait_for_event("upgrade_done", timeout=20,
                                predicate=lambda rec: rec["broker_pid"] == pids[-1])

        upgrade()
        os.kill(first, signal.SIGKILL)
        failed = leaf.wait_for_event("upstream_link_failed", timeout=10)
        assert failed["broker_pid"] == pids[-1]
        assert failed["reason"] == "the link ended (it exited)", failed
        restarted = leaf.wait_for_event("upstream_link_restarted", timeout=10)
        wait_until(lambda: link_pid(leaf) == restarted["pid"], timeout=15, what="the new link")
        upgrade()
        assert link_pid(leaf) == restarted["pid"] and alive(restarted["pid"])
        assert len(leaf.events("upstream_link_restarted")) == 1
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGTERM)
                wait_gone(pid, 10)
    assert wait_gone(restarted["pid"], 10)


# ---- readiness: the leaf is ready once its link's subscriptions are in place upstream

def test_a_leaf_is_ready_once_its_link_is_and_sbus_ready_upstream_waits(tmp_path):
    from support import SBUS
    from support.systemd import Notify
    up = broker(tmp_path, "up")
    notify = Notify(tmp_path, abstract=False)
    address = str(tmp_path / "leaf")
    try:
        leaf = Sbusd(tmp_path, ["-f", "-a", address, "--upstream", up.address],
                     address=address, log_level="info",
                     env={"NOTIFY_SOCKET": notify.env}).ready(timeout=10.0)
        _STARTED.append(leaf)
        r = subprocess.run([SBUS, "-a", address, "ready", "upstream", "-W", "30"],
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
        # READY=1 once, from the link, after the upstream had its subscriptions.
        state, sender = notify.recv(timeout=10)
        assert state == "READY=1" and sender == link_pid(leaf)
        assert notify.pending() is None
        (said,) = leaf.events("service_ready")
        assert (said["service"], said["pid"], said["address"]) == ("link", sender, up.address)
        assert link_patterns(up, leaf) == 1        # its own private keys, in place
        assert leaf.stats()["upstream"]["subscribed"] is True

        # A plain broker is no leaf; a leaf whose upstream is gone is not ready.
        r = subprocess.run([SBUS, "-a", up.address, "ready", "upstream", "-W", "1"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "this broker has no upstream" in r.stderr
        up.stop()
        leaf.wait_for_event("upstream_disconnected", timeout=10)
        r = subprocess.run([SBUS, "-a", address, "ready", "upstream", "-W", "1"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1
        assert r.stderr.startswith(f"sbus ready: upstream not ready within 1 s: its link to "
                                   f"{up.address} is away ("), r.stderr
        assert "is the upstream sbusd running?" in r.stderr
    finally:
        notify.close()


def test_the_barrier_and_the_proof_calls_on_a_leaf_client(tmp_path):
    """Client.sync() on a leaf goes up and back on the nested private key;
    Client.prove from a leaf client to ``sbus whoami --serve-proofs`` upstream
    (another process: a local-form key naming a pid connected to the leaf
    stays on the leaf, docs/hierarchy.md)."""
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    server = subprocess.Popen([SBUS, "-a", up.address, "whoami", "--serve-proofs", "who/leaf",
                               "--count", "1"], stdout=subprocess.PIPE)
    try:
        with Client(leaf.address) as a:
            assert "/!/cred/" in str(a.whoami())
            a.subscribe("k/")
            a.publish_many((f"k/{i}", str(i)) for i in range(100))
            a.sync(10)
            assert a.pending == 100
            deadline = time.monotonic() + 10
            while True:
                try:
                    peer = a.prove("who/leaf", 1.0)
                    break
                except ProofError as exc:   # until the server's pattern is upstream
                    assert exc.step == 2 and time.monotonic() < deadline
            assert (peer.uid, peer.pid) == (os.geteuid(), server.pid)
            assert server.communicate(timeout=10)[0].decode().split() == [str(a.whoami())]
            assert [m.key for m in a.receive_many(1000, timeout=0)] == [
                f"k/{i}".encode() for i in range(100)]
    finally:
        server.kill()
        server.wait()
