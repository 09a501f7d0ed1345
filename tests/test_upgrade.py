"""Live upgrade (docs/upgrade.md): sbusd hands its socket, its clients and
their whole state to a new sbusd, and nobody sees an EOF or loses a message;
a hand-over that fails at any step leaves the old one serving with nothing
lost, and ``sbusd --upgrade`` says so."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sbus.sbusd.upgrade import FAIL_ENV, SCM_MAX_FD, STATUS_SUFFIX, STEPS

from support import BACKENDS, SBUSD, Conn, Sbusd, alive, wait_gone, wait_until
from support.frames import GRANTED, frame, publish_together, read_all
from support.systemd import ACTIVATE, Notify, seqpacket_listener

C_DIR = Path(__file__).resolve().parent / "c"
TIMEOUT = 30.0
NOBODY = 65534
OTHER_UID = 65533


class Bus:
    """An sbusd with a pidfile, upgraded in place; every pid it had is
    stopped at the end."""

    def __init__(self, workdir: Path, *args, backend="epoll", address=None, env=None,
                 pass_fds=()):
        self.workdir = workdir
        self.pidfile = workdir / "sbusd.pid"
        self.address = address or str(workdir / "sbus.socket")
        self.first = Sbusd(workdir, ["-f", "-a", self.address, "--backend", backend,
                                     "-p", str(self.pidfile), "--stats-interval", "0", *args],
                           address=self.address, env=env, pass_fds=pass_fds).ready(TIMEOUT)
        self.pids = [self.first.pid]

    @property
    def pid(self) -> int:
        return self.pids[-1]

    def connect(self) -> Conn:
        return Conn.to(self.address, TIMEOUT)

    def upgrade(self) -> subprocess.CompletedProcess:
        """``sbusd --upgrade -p PIDFILE``; on success the old pid has exited."""
        old = self.pid
        proc = subprocess.run([SBUSD, "--upgrade", "-p", str(self.pidfile)],
                              capture_output=True, text=True, timeout=TIMEOUT * 2)
        if proc.returncode == 0:
            new = int(self.pidfile.read_text())
            assert new != old and alive(new)
            assert wait_gone(old, TIMEOUT), f"old pid {old} still runs"
            self.pids.append(new)
            # The new one logs once it serves, just after the outcome the command read.
            wait_until(lambda: len(self.records("upgrade_done")) == len(self.pids) - 1, TIMEOUT)
        return proc

    def records(self, name: str) -> list:
        return [r for r in self.first.records() if r.get("event") == name]

    def stats(self) -> dict:
        with self.connect() as s:
            return s.stats()

    def stop(self) -> None:
        for pid in self.pids:
            if alive(pid):
                os.kill(pid, signal.SIGTERM)
                if not wait_gone(pid, TIMEOUT):
                    os.kill(pid, signal.SIGKILL)
        self.first.kill()


@pytest.fixture
def buses(tmp_path):
    made = []

    def make(*args, **kwargs) -> Bus:
        workdir = tmp_path / f"bus{len(made)}"
        workdir.mkdir()
        bus = Bus(workdir, *args, **kwargs)
        made.append(bus)
        return bus

    yield make
    for bus in made:
        bus.stop()


def upgraded(bus: Bus) -> None:
    proc = bus.upgrade()
    assert proc.returncode == 0, proc.stderr
    assert f"handed over to pid {bus.pid}" in proc.stdout


def read_in_order(conn: Conn, prefix: bytes, count: int, start=0) -> None:
    """``count`` messages ``prefix<i>`` for i from ``start``, in order, and nothing else."""
    for i in range(start, start + count):
        packet = conn.recv(1 << 16)
        assert packet, f"EOF before {prefix.decode()}{i}"
        key = packet.split(b"\0", 1)[0]
        assert key == b"MSG " + prefix + b"%d" % i, (i, packet[:40])


def barrier(*conns: Conn) -> None:
    """Every packet each sent before is handled (whoami answers after them)."""
    for c in conns:
        c.whoami()


def fill(publisher: Conn, prefix: str, start: int, count: int, size=200) -> None:
    payload = b"p" * size
    for i in range(start, start + count):
        assert publisher.pub(f"{prefix}{i}", payload)


@pytest.fixture(scope="module")
def c_client(tmp_path_factory):
    """tests/c/upgrade_client.c compiled, or None without gcc."""
    if shutil.which("gcc") is None:
        return None
    exe = tmp_path_factory.mktemp("upgrade_client") / "upgrade_client"
    proc = subprocess.run(["gcc", "-std=c99", "-D_DEFAULT_SOURCE", "-O2", "-Wall", "-Wextra",
                           "-Werror", "-o", str(exe), str(C_DIR / "upgrade_client.c")],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    return exe


def test_five_upgrades_under_load(buses, c_client):
    """Five upgrades in a row while a publisher streams to a steady reader:
    it gets every message once, in order; a reader that reads nothing until
    the end gets its whole queue (thousands of messages) in order; idle
    clients keep their subscriptions (300: their descriptors cross in two
    SCM_RIGHTS chunks); a C client sees no EOF; the pid changes every time."""
    bus = buses()
    steady, lazy, pub = bus.connect(), bus.connect(), bus.connect()
    steady.sub("steady/")
    lazy.sub("lazy/")
    idle = []
    for i in range(300):
        c = bus.connect()
        c.sub(f"idle/{i}/")
        c.sub(f"idle/{i}/")     # twice: multiplicity is state too
        idle.append(c)
    c_proc = None
    if c_client is not None:
        c_proc = subprocess.Popen([str(c_client), bus.address], stdout=subprocess.PIPE,
                                  text=True)
        assert c_proc.stdout.readline() == "ready\n"
    barrier(steady, lazy, *idle)

    streamed = []
    stop_streaming = threading.Event()

    def stream():
        with bus.connect() as s:
            i = 0
            while not stop_streaming.is_set():
                s.pub(f"steady/{i}")
                i += 1
                if i % 50 == 0:
                    time.sleep(0.002)
            s.pub("steady/end")
            streamed.append(i)

    received = []

    def read_steady():
        steady.settimeout(TIMEOUT)
        while True:
            packet = steady.recv(1 << 16)
            if not packet or packet.startswith(b"MSG steady/end\0"):
                received.append(packet)
                return
            received.append(int(packet[len(b"MSG steady/"):].split(b"\0")[0]))

    threads = [threading.Thread(target=stream), threading.Thread(target=read_steady)]
    for t in threads:
        t.start()
    lazy_count = 0
    c_count = 0
    try:
        for _ in range(5):
            fill(pub, "lazy/", lazy_count, 1500)
            lazy_count += 1500
            for _ in range(20):
                pub.pub(f"c/{c_count}")
                c_count += 1
            barrier(pub)
            upgraded(bus)
    finally:
        stop_streaming.set()
        for t in threads:
            t.join(TIMEOUT)
    assert len(set(bus.pids)) == 6
    assert bus.first.proc.wait(TIMEOUT) == 0
    assert received[-1].startswith(b"MSG steady/end\0")
    assert received[:-1] == list(range(streamed[0])) and streamed[0] > 0
    read_in_order(lazy, b"lazy/", lazy_count)
    for i in range(len(idle)):
        pub.pub(f"idle/{i}/x", b"%d" % i)
    for i, c in enumerate(idle):
        assert c.recv(1 << 16) == b"MSG idle/%d/x\0%d" % (i, i)
    pub.pub("c/end")
    if c_proc is not None:
        out, _ = c_proc.communicate(timeout=TIMEOUT)
        assert c_proc.returncode == 0 and out == f"upgrade_client: ok {c_count}\n", out
    for c in (steady, lazy, pub, *idle):
        c.close()
    done = bus.records("upgrade_done")
    assert [r["old_pid"] for r in done] == bus.pids[:-1]
    handed = bus.records("upgrade_handed_over")
    assert [r["broker_pid"] for r in handed] == bus.pids[:-1]
    assert all(r["clients"] > SCM_MAX_FD for r in handed)


def test_subscriptions_changing_while_the_new_one_indexes_them(buses):
    """The new process indexes the subscriptions ahead of the safe point; a
    client that subscribes, unsubscribes, connects or leaves meanwhile ends up
    with exactly the subscriptions it holds at the safe point."""
    bus = buses()
    pub = bus.connect()
    kept: dict = {}
    stop = threading.Event()
    errors = []

    def churn():
        i = 0
        try:
            while not stop.is_set():
                time.sleep(0.002)   # not faster than a paused broker's backlog holds
                c = bus.connect()
                c.sub(f"kept/{i}/")
                c.sub(f"gone/{i}/")
                c.sub(f"kept/{i}/")
                c.unsub(f"gone/{i}/")
                if i % 3 == 0:
                    c.close()       # leaves
                else:
                    kept[i] = c
                i += 1
        except BaseException as e:     # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(3):
            upgraded(bus)
        stop.set()
        t.join(TIMEOUT)
        assert not errors and len(kept) > 10
        barrier(*kept.values())
        assert bus.stats()["totals"]["subscriptions"] == 2 * len(kept)
        for i in kept:
            pub.pub(f"gone/{i}/x", b"no")
            pub.pub(f"kept/{i}/x", b"%d" % i)
        for i, c in kept.items():
            assert c.recv(1 << 16) == b"MSG kept/%d/x\0%d" % (i, i)
        barrier(pub, *kept.values())
        assert all(not c.got for c in kept.values())
    finally:
        stop.set()
        t.join(TIMEOUT)
        for c in kept.values():     # a failure here must not leave thousands open
            c.close()


# What each injected failure is logged as by the old process.
FAILED_STEP = {"spawn": "spawn", "start": "hello", "hello": "hello", "version": "version",
               "prebuild": "prebuild",
               "send-state": "send-state", "corrupt": "restore", "blob-version": "restore",
               "truncated": "restore", "send-fds": "send-fds", "restore": "restore",
               "ready": "ready", "before-go": "before-go"}
REASON = {"corrupt": "CRC-32", "blob-version": "format version 99",
          "truncated": "truncated", "version": "format 999", "start": "closed"}


@pytest.mark.parametrize("step", STEPS)
def test_failed_upgrade_leaves_the_old_one_serving(buses, step):
    """A failure at any step: sbusd --upgrade exits 1 with the reason, the log
    says why, the same pid serves on; no client sees an EOF, the queue is
    whole, and messages sent during and after arrive exactly once, in order."""
    bus = buses(env={FAIL_ENV: step})
    lazy, live, pub = bus.connect(), bus.connect(), bus.connect()
    lazy.sub("lazy/")
    live.sub("live/")
    barrier(lazy, live)
    fill(pub, "lazy/", 0, 3000)
    fill(pub, "live/", 0, 10, size=10)
    barrier(pub)
    before = bus.stats()["totals"]

    def during():       # while the new process starts, and fails
        for i in range(10, 210):
            pub.pub(f"live/{i}", b"x" * 10)
            time.sleep(0.001)

    publisher = threading.Thread(target=during)
    publisher.start()
    proc = bus.upgrade()
    publisher.join(TIMEOUT)
    fill(pub, "live/", 210, 10, size=10)
    assert proc.returncode == 1, proc.stdout
    assert f"pid {bus.first.pid} serves on" in proc.stderr
    assert int(bus.pidfile.read_text()) == bus.first.pid and bus.pids == [bus.first.pid]
    (failed,) = bus.records("upgrade_failed")
    if step in FAILED_STEP:
        assert failed["step"] == FAILED_STEP[step]
    else:       # the new one died mid-transfer: the old one notices where it is
        assert failed["step"] in ("send", "send-fds", "ready"), failed
    assert REASON.get(step, "") in failed["reason"]
    assert failed["step"] in proc.stderr
    if failed["new_pid"] is not None:
        assert not alive(failed["new_pid"])
    read_in_order(live, b"live/", 220)
    read_in_order(lazy, b"lazy/", 3000)
    barrier(live, lazy)
    assert not live.got and not lazy.got
    after = bus.stats()["totals"]
    assert after["msgs_in"] == before["msgs_in"] + 210
    # Only the first stats probe left.
    assert after["clients"] == before["clients"]
    assert after["disconnects"] == before["disconnects"] + 1
    # The next upgrade fails the same way, and is tried afresh.
    assert bus.upgrade().returncode == 1
    assert len(bus.records("upgrade_failed")) == 2
    assert os.path.exists(str(bus.pidfile) + STATUS_SUFFIX)


def connect_as(address, uid: int) -> socket.socket:
    """A connection whose credentials (SO_PEERCRED, fixed at connect) are
    uid's: a forked child drops to it and connects a socket we keep."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            s.connect(address)
            os._exit(0)
        except BaseException:      # noqa: BLE001 - the child never returns into pytest
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert status == 0, f"uid {uid} could not connect"
    s.settimeout(TIMEOUT)
    return s


def user_view(stats: dict) -> list:
    return sorted(stats["users"], key=lambda u: u["uid"])


def abstract_address() -> tuple:
    """(sbusd's -a, what connect takes) for a fresh abstract name."""
    sun_path = b"\0sbus-upgrade-" + os.urandom(8).hex().encode()
    return "/dev/unix/abstract/" + sun_path.hex(), sun_path.ljust(108, b"\0")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["path", "abstract", "fd"])
def test_upgrade_on_every_backend_and_address(buses, tmp_path, backend, where):
    """Each backend, on a path, an abstract address and /dev/fd/N: the queue
    and the subscriptions cross, the allow-list (-u) holds in the new process,
    and the per-uid budgets' figures come out equal."""
    pass_fds = ()
    listener = None
    if where == "path":
        address = connect_to = None
    elif where == "abstract":
        address, connect_to = abstract_address()
    else:
        listener = seqpacket_listener(tmp_path / "passed.socket")
        os.set_inheritable(listener.fileno(), True)
        address = f"/dev/fd/{listener.fileno()}"
        connect_to = str(tmp_path / "passed.socket")
        pass_fds = (listener.fileno(),)
    args = ["-u", str(NOBODY)] + (["-o"] if where == "abstract" else [])
    bus = buses(*args, backend=backend, address=address, pass_fds=pass_fds)
    if listener is not None:
        listener.close()
    if connect_to is not None:
        bus.address = connect_to
    lazy, pub = bus.connect(), bus.connect()
    lazy.sub("lazy/")
    lazy.cmsg("order/stack")
    barrier(lazy)
    fill(pub, "lazy/", 0, 2000)
    barrier(pub)
    users = None
    if where == "abstract":
        # Another uid, with subscriptions and a queue of its own: an account.
        other = connect_as(connect_to, NOBODY)
        other.send(b"SUB lazy/")
        other.send(b"SUB nobody/")
        other.send(b"CMSG !/cred/whoami")
        assert other.recv(1024).startswith(b"CMSG !/cred/whoami\0!/cred/")
        fill(pub, "lazy/", 2000, 2000)
        barrier(pub)
        users = user_view(bus.stats())
        assert [u["uid"] for u in users] == [0, NOBODY]
    upgraded(bus)
    if users is not None:
        assert user_view(bus.stats()) == users
        refused = connect_as(connect_to, OTHER_UID)     # -u still keeps it out
        assert refused.recv(16) == b""
    # Stack order: the newest first, and what was already in the socket
    # before it (written in arrival order).
    got = []
    lazy.settimeout(TIMEOUT)
    total = 4000 if users is not None else 2000
    while len(got) < total:
        got.append(int(lazy.recv(1 << 16).split(b"\0")[0][len(b"MSG lazy/"):]))
    assert sorted(got) == list(range(total))
    pub.pub("lazy/after")
    assert lazy.recv(1 << 16).startswith(b"MSG lazy/after\0")
    (done,) = bus.records("upgrade_done")
    assert done["clients"] == (3 if users is not None else 2)


def test_every_connections_modes_and_counters_cross(buses):
    """Each client's stats entry (counters, queue, subscriptions, modes) and
    the totals are the same before and after; a client whose peer stopped
    reading (write-dead: deliveries dropped) stays so, and still publishes."""
    bus = buses()
    modes = [("blocking/soft/discard", "blocking/hard/error"), ("order/random", "echo/off"),
             ("order/stack", "blocking/hard/block"), ()]
    clients = []
    for i, cmsgs in enumerate(modes):
        c = bus.connect()
        for key in cmsgs:
            c.cmsg(key)
        c.sub(f"m/{i}/")
        c.sub("m/all/")
        clients.append(c)
    dead = bus.connect()
    dead.sub("m/all/")
    barrier(dead, *clients)
    dead.shutdown(socket.SHUT_RD)
    pub = bus.connect()
    fill(pub, "m/all/", 0, 2000)
    for i in range(len(modes)):
        fill(pub, f"m/{i}/", 0, 10)
    barrier(pub)

    def snapshot():
        stats = bus.stats()
        mine = max(c["client"] for c in stats["clients"])      # the probe itself
        # Not what the probes change: the counts of connections and replies,
        # and the peak of queued bytes (a stats reply is queued for a moment).
        totals = {k: v for k, v in stats["totals"].items()
                  if k not in ("connects", "disconnects", "replies_out", "clients",
                               "queued_bytes_peak")}
        return [c for c in stats["clients"] if c["client"] != mine], totals

    before = snapshot()
    (dead_entry,) = [c for c in before[0] if c["pid"] == os.getpid() and c["subscriptions"] == 1
                     and c["drops_disconnect"]]
    upgraded(bus)
    assert snapshot() == before
    pub.pub("m/all/late")
    barrier(pub)
    assert dead.pub("m/0/from-the-dead")

    def dead_now():
        return [c for c in snapshot()[0] if c["client"] == dead_entry["client"]][0]

    wait_until(lambda: dead_now()["msgs_in"] == 1, TIMEOUT)
    assert dead_now()["drops_disconnect"] == dead_entry["drops_disconnect"] + 1


def test_more_connections_than_a_fresh_broker_holds(buses):
    """A fresh broker sizes its per-connection lists (a message's recipients,
    the turn's touched and closing connections, the paused) for 64
    connections; the new process must grow them for every connection it
    restores. They once stayed at 64: fanning out to the restored clients
    wrote past them, and the new sbusd crashed (in index_remove, or malloc
    aborting on the corrupted heap) as clients came, subscribed and left."""
    bus = buses()
    many = 200
    clients = [bus.connect() for _ in range(many)]
    for c in clients:
        c.sub("all/")
    barrier(*clients)
    pub = bus.connect()
    upgraded(bus)
    new_pid = bus.pid
    for round_ in range(3):
        pub.pub(f"all/{round_}", b"x")
        for c in clients:
            assert c.recv(1 << 16) == b"MSG all/%d\0x" % round_
        # Newcomers grow the lists from where the restore left them.
        clients += [bus.connect() for _ in range(many)]
        for c in clients[-many:]:
            c.sub("all/")
        barrier(pub, *clients)
    for c in clients:
        c.close()
    wait_until(lambda: bus.stats()["totals"]["clients"] == 2, TIMEOUT)  # pub, the probe
    assert alive(new_pid) and bus.pids[-1] == new_pid


def test_a_new_sbusd_with_many_connections_stops_cleanly(buses):
    """Stopping closes every connection in one turn, each through the
    closing list and out of the index: the list must hold all the restored
    ones. Before, it wrote past its end, and the new sbusd crashed in
    index_remove before it logged broker_stop."""
    bus = buses()
    clients = [bus.connect() for _ in range(200)]
    for i, c in enumerate(clients):
        c.sub(f"own/{i}/")
    barrier(*clients)
    upgraded(bus)
    os.kill(bus.pid, signal.SIGTERM)
    assert wait_gone(bus.pid, TIMEOUT)
    (stop,) = bus.records("broker_stop")
    assert stop["reason"] == "SIGTERM"
    shutdown = [r for r in bus.records("client_disconnect") if r.get("reason") == "shutdown"]
    assert len(shutdown) == len(clients)
    for c in clients:
        c.close()


def test_upgrade_while_a_client_holds_the_bus(buses):
    """A client in blocking/soft/block mode with a full socket holds the bus
    and the publisher is paused: both states cross, and once it reads,
    everything arrives, in order, nothing dropped."""
    bus = buses()
    slow, pub = bus.connect(), bus.connect()
    slow.sub("b/")
    slow.cmsg("blocking/soft/block")
    barrier(slow)
    pub.setblocking(False)
    sent = 0
    deadline = time.monotonic() + TIMEOUT
    # Publish until the broker stops reading us (the bus is held).
    while time.monotonic() < deadline:
        try:
            pub.send(b"MSG b/%d\0%s" % (sent, b"x" * 1000))
            sent += 1
        except BlockingIOError:
            if blocked(bus):
                break
    assert blocked(bus)
    upgraded(bus)
    assert blocked(bus)
    slow.settimeout(TIMEOUT)
    read_in_order(slow, b"b/", sent)
    totals = bus.stats()["totals"]
    assert totals["drops_soft"] == totals["drops_hard"] == 0


def blocked(bus: Bus) -> bool:
    """Whether the bus is held: then a new connection is not read, and its
    whoami goes unanswered."""
    with bus.connect() as probe:
        probe.settimeout(1.0)     # an unblocked bus answers in microseconds
        probe.send(b"CMSG !/cred/whoami")
        try:
            probe.recv(1024)
        except socket.timeout:
            return True
    return False


def test_upgrade_of_a_leaf_keeps_its_upstream_link(buses):
    """A leaf's upstream link process is adopted, not restarted: the upstream
    never sees it leave, and traffic goes both ways across the upgrades; the
    last broker still waits for it at stop."""
    top = buses()
    leaf = buses("--upstream", top.address)
    local = leaf.connect()
    local.sub("down/")
    barrier(local)
    remote = top.connect()
    remote.sub("up/")
    barrier(remote)
    wait_until(lambda: any(r.get("event") == "upstream_connected" for r in leaf.first.records()),
               TIMEOUT)
    wait_until(lambda: top.stats()["totals"]["subscriptions"] >= 3, TIMEOUT)
    (link_conn,) = [c for c in top.stats()["clients"] if c["pid"] != os.getpid()]
    for i in range(100):
        local.pub(f"up/{i}")
        remote.pub(f"down/{i}")
    upgraded(leaf)
    upgraded(leaf)      # the adopted link is handed on again
    for i in range(100, 200):
        local.pub(f"up/{i}")
        remote.pub(f"down/{i}")
    local.settimeout(TIMEOUT)
    remote.settimeout(TIMEOUT)
    read_in_order(remote, b"up/", 200)
    read_in_order(local, b"down/", 200)
    # The same link process, never reconnected: one connection upstream all along.
    assert alive(link_conn["pid"])
    assert link_conn["client"] in [c["client"] for c in top.stats()["clients"]]
    assert not [r for r in top.records("client_disconnect") if r["client"] == link_conn["client"]]
    assert len([r for r in leaf.first.records() if r.get("event") == "upstream_connected"]) == 1
    leaf.stop()
    assert wait_gone(link_conn["pid"], TIMEOUT)


@pytest.mark.parametrize("granted", GRANTED.values(), ids=GRANTED.keys())
def test_upgrade_keeps_the_frames_of_a_granted_connection(buses, granted):
    """A connection granted frames (the link place, docs/hierarchy.md, or a
    bridge's of the broker's own uid, docs/bridge.md) is handed on with them:
    its frames are taken, and its deliveries come in frames."""
    bus = buses()
    link = granted(bus)
    link.sub("f/")
    sub = bus.connect()
    sub.sub("g/")
    barrier(link, sub)
    upgraded(bus)
    assert link.packet(frame(b"MSG g/1\0", b"MSG g/2\0"))
    read_in_order(sub, b"g/", 2, start=1)
    publish_together(bus, [(b"f/%d" % i, b"") for i in range(300)])
    got, frames, _ = read_all(link, 300)
    assert got == [b"MSG f/%d\0" % i for i in range(300)]
    assert frames > 0


@pytest.mark.parametrize("sandboxed", [False, True], ids=["plain", "sandboxed"])
def test_upgrade_under_socket_activation(tmp_path, request, sandboxed):
    """As systemd runs it: the socket passed as fd 3 (LISTEN_FDS), readiness
    on $NOTIFY_SOCKET, and (sandboxed) inside the unit's seccomp filter and
    network namespace, which the new process inherits. The new process
    announces itself as the main pid, then ready; the old one never says it
    is stopping."""
    wrap = request.getfixturevalue("sandbox") if sandboxed else []
    path = tmp_path / "sbus.socket"
    pidfile = tmp_path / "sbusd.pid"
    listener = seqpacket_listener(path)
    # An abstract name is per network namespace: the sandbox's is its own.
    notify = Notify(tmp_path, abstract=not sandboxed)
    log = tmp_path / "sbusd.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", ACTIVATE, str(listener.fileno()), "self", *wrap, SBUSD, "-f",
         "-a", str(path), "-p", str(pidfile), "--log-format", "json", "--log-file", str(log)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(listener.fileno(),),
        env={**os.environ, "NOTIFY_SOCKET": notify.env}, cwd=tmp_path)
    listener.close()
    pids = [proc.pid]
    try:
        assert notify.recv() == ("READY=1", proc.pid)
        client, pub = Conn.to(path, TIMEOUT), Conn.to(path, TIMEOUT)
        client.sub("a/")
        barrier(client)
        fill(pub, "a/", 0, 3000)
        barrier(pub)
        result = subprocess.run([SBUSD, "--upgrade", "-p", str(pidfile)], capture_output=True,
                                text=True, timeout=TIMEOUT)
        assert result.returncode == 0, result.stderr
        new = int(pidfile.read_text())
        pids.append(new)
        assert notify.recv() == (f"MAINPID={new}", new)
        assert notify.recv() == ("READY=1", new)
        assert proc.wait(TIMEOUT) == 0
        assert notify.pending() is None         # no STOPPING=1 from the old one
        fill(pub, "a/", 3000, 10)
        read_in_order(client, b"a/", 3010)
        os.kill(new, signal.SIGTERM)
        assert notify.recv() == ("STOPPING=1", new)
        assert wait_gone(new, TIMEOUT)
        # The pidfile went with the last process; the socket is systemd's.
        assert path.exists() and not pidfile.exists()
        assert not Path(str(pidfile) + STATUS_SUFFIX).exists()
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        notify.close()


def test_upgrade_command_without_a_running_sbusd(tmp_path):
    pidfile = tmp_path / "none.pid"
    proc = subprocess.run([SBUSD, "--upgrade", "-p", str(pidfile)], capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 1 and f"no pid in {pidfile}" in proc.stderr


def test_a_state_blob_that_cannot_be_trusted_is_refused(tmp_path):
    """restore_state refuses another format version, a truncated blob, a
    flipped byte and something that is no state at all, naming which."""
    from sbus._core.broker import Broker
    from sbus._core.handover import HandoverError, export_state, restore_state
    from sbus.sbusd.config import parse_args

    cfg = parse_args(["-f"])
    listeners = []

    def fresh() -> Broker:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(str(tmp_path / f"l{len(listeners)}"))
        s.listen()
        listeners.append(s)
        return Broker(s.fileno(), cfg)

    blob, fds = export_state(fresh())
    assert len(fds) == 1
    restore_state(fresh(), blob, [listeners[-1].fileno()])      # the blob as written
    bad = {
        "format version 99": blob[:8] + (99).to_bytes(4, "little") + blob[12:],
        "truncated": blob[:-3],
        "CRC-32": blob[:-1] + bytes([blob[-1] ^ 1]),
        "bad magic": b"no state at all, but long enough to have a header",
    }
    for reason, data in bad.items():
        with pytest.raises(HandoverError, match=reason):
            restore_state(fresh(), data, [listeners[-1].fileno()])
    for s in listeners:
        s.close()


def test_uptime_goes_on_across_an_upgrade_in_broker_stop_too(buses):
    bus = buses()
    time.sleep(2.0)
    upgraded(bus)
    before = bus.stats()["uptime_s"]
    assert before >= 2.0
    os.kill(bus.pid, signal.SIGTERM)
    assert wait_gone(bus.pid, TIMEOUT)
    stop = wait_until(lambda: bus.records("broker_stop"), TIMEOUT)[0]
    assert stop["uptime_s"] >= before
