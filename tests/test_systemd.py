"""sbusd under systemd: socket activation and readiness notification.

The tests play systemd's part exactly: the "manager" (this process) creates,
binds and listens on the SOCK_SEQPACKET socket, forks, and in the child puts
the socket at fd 3, sets ``LISTEN_FDS=1``, ``LISTEN_FDNAMES`` and
``LISTEN_PID`` to the child's own pid, then execs sbusd. It listens for
``sd_notify`` datagrams on a ``NOTIFY_SOCKET`` with ``SO_PASSCRED``, as systemd
does, and accepts only those sent by the main pid (as ``NotifyAccess=main``
would; the units say ``all`` for a live upgrade's new process, tests/test_upgrade.py).

A second test uses Debian's ``systemd-socket-activate`` (package ``systemd``),
and a third runs sbusd inside the seccomp sandbox that
``tools/systemd/sbusd.service`` asks for (``SystemCallFilter=``,
``MemoryDenyWriteExecute=``, ``RestrictAddressFamilies=``, ``PrivateNetwork=``),
built the way systemd builds it, with libseccomp.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sbus import Client

from support import ROOT, SBUS, SBUSD, Conn, wait_until
from support.systemd import ACTIVATE, TIMEOUT, UNITS, Notify, read_unit, seqpacket_listener, values


def queued_client(path: Path) -> Conn:
    """A client that connects while nothing serves the socket yet: the kernel
    queues it on the listening socket, as with a socket unit."""
    return Conn.to(path, TIMEOUT)


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture
def spawn(procs, tmp_path):
    """spawn(listener, sbusd args..., listen_pid="self", env={}, wrap=[]) -> Popen."""

    def start(listener, *args, listen_pid="self", env=None, wrap=()):
        stderr = open(tmp_path / f"sbusd-{len(procs)}.stderr", "wb")
        argv = [sys.executable, "-c", ACTIVATE, str(listener.fileno()), listen_pid,
                *wrap, SBUSD, "-f", "--log-format", "json", "--log-level", "debug",
                "--stats-interval", "0", *args]
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=stderr, pass_fds=(listener.fileno(),),
                             env={**os.environ, **(env or {})}, cwd=tmp_path)
        stderr.close()
        p.stderr_path = stderr.name
        procs.append(p)
        return p

    return start


def stderr_of(p) -> str:
    return Path(p.stderr_path).read_text(errors="replace")


def log_records(p) -> list:
    return [json.loads(line) for line in stderr_of(p).splitlines() if line.startswith("{")]


def stop(p, timeout=TIMEOUT) -> int:
    p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise AssertionError(f"sbusd ignored SIGTERM; stderr: {stderr_of(p)}") from None


def expect_notify(notify: Notify, state: str, pid: int, proc) -> None:
    got = notify.recv()
    assert got is not None, f"no {state} on NOTIFY_SOCKET; sbusd stderr: {stderr_of(proc)}"
    assert got == (state, pid), f"expected {state} from the main pid {pid}, got {got}"


def pubsub_round_trip(path: Path) -> None:
    with Client(str(path)) as sub, Client(str(path)) as pub:
        sub.subscribe("test/")
        sub.whoami(timeout=TIMEOUT)          # the SUB is registered once this returns
        pub.publish("test/activated", b"hello")
        m = sub.receive(timeout=TIMEOUT)
        assert (m.key, m.payload) == (b"test/activated", b"hello")


# ---------------------------------------------------------------- emulation

@pytest.mark.parametrize("notify_form", ["path", "abstract"])
def test_socket_activation_ready_before_first_client(tmp_path, spawn, notify_form):
    bus = tmp_path / "bus.socket"
    unused = tmp_path / "unused.socket"
    listener = seqpacket_listener(bus)
    notify = Notify(tmp_path, abstract=notify_form == "abstract")
    early = queued_client(bus)            # waiting before sbusd even exists

    p = spawn(listener, "-a", str(unused), env={"NOTIFY_SOCKET": notify.env})
    reply = early.sync()
    assert reply.startswith("!/cred/"), reply
    # By the time the first client has its answer, READY=1 must be queued,
    # sent by the main pid (systemd drops it otherwise with NotifyAccess=main).
    assert notify.pending() == ("READY=1", p.pid), (
        f"READY=1 did not precede serving the first client; stderr: {stderr_of(p)}")
    pubsub_round_trip(bus)
    assert not unused.exists(), "sbusd bound its -a address although it was socket-activated"
    start = [r for r in log_records(p) if r.get("event") == "broker_start"]
    assert start and start[0]["pid"] == p.pid
    early.close()

    assert stop(p) == 0, stderr_of(p)
    expect_notify(notify, "STOPPING=1", p.pid, p)
    assert notify.pending() is None, "unexpected extra notification"
    # The socket belongs to the manager: sbusd must leave the file alone, and
    # the next connection is queued for the next activation.
    assert bus.exists(), "sbusd removed the socket file systemd owns"
    late = queued_client(bus)
    p2 = spawn(listener, "-a", str(unused), env={"NOTIFY_SOCKET": notify.env})
    assert late.sync().startswith("!/cred/")
    expect_notify(notify, "READY=1", p2.pid, p2)
    late.close()
    assert stop(p2) == 0
    expect_notify(notify, "STOPPING=1", p2.pid, p2)
    notify.close()
    listener.close()


def test_listen_pid_of_another_process_is_ignored(tmp_path, spawn):
    bus = tmp_path / "bus.socket"
    own = tmp_path / "own.socket"
    listener = seqpacket_listener(bus)
    notify = Notify(tmp_path, abstract=False)
    stray = queued_client(bus)

    # LISTEN_PID names our pid, not sbusd's: the fds were meant for a parent.
    p = spawn(listener, "-a", str(own), listen_pid=str(os.getpid()),
              env={"NOTIFY_SOCKET": notify.env})
    expect_notify(notify, "READY=1", p.pid, p)
    assert own.exists(), f"sbusd did not bind its -a address; stderr: {stderr_of(p)}"
    with Conn.to(own, TIMEOUT) as s:
        assert s.sync().startswith("!/cred/")
    with pytest.raises(socket.timeout):
        stray.sync(timeout=0.3)           # nobody serves the passed socket
    assert stop(p) == 0
    expect_notify(notify, "STOPPING=1", p.pid, p)
    assert not own.exists(), "sbusd left its own socket file behind"
    stray.close()
    notify.close()
    listener.close()


def test_listen_fds_other_than_one_refused(tmp_path, spawn):
    listener = seqpacket_listener(tmp_path / "bus.socket")
    p = spawn(listener, "-a", str(tmp_path / "own.socket"), env={"TEST_LISTEN_FDS": "2"})
    assert p.wait(TIMEOUT) == 1
    assert "systemd passed 2 sockets" in stderr_of(p)
    assert not (tmp_path / "own.socket").exists()


def test_passed_stream_socket_refused(tmp_path, spawn):
    listener = seqpacket_listener(tmp_path / "bus.socket", kind=socket.SOCK_STREAM)
    p = spawn(listener, "-a", str(tmp_path / "own.socket"))
    assert p.wait(TIMEOUT) == 1
    assert "/dev/fd/3 is not a Unix-domain SOCK_SEQPACKET socket" in stderr_of(p)


# --------------------------------------------------- systemd-socket-activate

def test_systemd_socket_activate(tmp_path, procs):
    tool = shutil.which("systemd-socket-activate")
    if tool is None:
        pytest.skip("systemd-socket-activate not found: it comes with Debian's 'systemd' "
                    "package (apt-get install systemd)")
    bus = tmp_path / "bus.socket"
    unused = tmp_path / "unused.socket"
    notify = Notify(tmp_path, abstract=True)
    stderr_path = tmp_path / "activate.stderr"
    with open(stderr_path, "wb") as err:
        p = subprocess.Popen(
            [tool, "--seqpacket", "--listen", str(bus), f"--setenv=NOTIFY_SOCKET={notify.env}",
             SBUSD, "-f", "-a", str(unused), "--log-format", "json", "--stats-interval", "0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    procs.append(p)
    p.stderr_path = str(stderr_path)
    wait_until(lambda: bus.exists() or p.poll() is not None, TIMEOUT, interval=0.01, fail=False)
    assert bus.exists() and p.poll() is None, stderr_of(p)
    # systemd-socket-activate starts sbusd (exec: same pid) on the first connection.
    first = queued_client(bus)
    assert first.sync().startswith("!/cred/"), stderr_of(p)
    expect_notify(notify, "READY=1", p.pid, p)
    pubsub_round_trip(bus)
    assert not unused.exists()
    first.close()
    assert stop(p) == 0, stderr_of(p)
    expect_notify(notify, "STOPPING=1", p.pid, p)
    notify.close()


# ---------------------------------------------------------------- the units

def one(section: list, key: str) -> str:
    found = values(section, key)
    assert len(found) == 1, f"{key}= {found}"
    return found[0]


def assert_sandboxed(svc: list, *also_yes: str) -> None:
    """The sandbox every unit asks for, with also_yes set to yes as well."""
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices",
                "MemoryDenyWriteExecute", *also_yes):
        assert one(svc, key) == "yes", key
    assert one(svc, "ProtectSystem") == "strict"
    assert one(svc, "RestrictAddressFamilies") == "AF_UNIX"
    assert values(svc, "SystemCallFilter")[0] == "@system-service"


def verify(*names: str) -> None:
    """systemd-analyze verify finds nothing wrong with these units, where it is installed."""
    analyze = shutil.which("systemd-analyze")
    if analyze:
        r = subprocess.run([analyze, "verify", *(str(UNITS / n) for n in names)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_unit_files():
    sock = read_unit("sbusd.socket")["Socket"]
    svc = read_unit("sbusd.service")["Service"]
    path = one(sock, "ListenSequentialPacket")
    assert path == "/run/sbus.socket"
    assert re.fullmatch(r"0[0-7]{3}", one(sock, "SocketMode"))
    assert one(svc, "Type") == "notify"
    # all: a live upgrade's new process (a child of the main pid) sends MAINPID=.
    assert one(svc, "NotifyAccess") == "all"
    exec_start = one(svc, "ExecStart").split()
    pidfile = exec_start[exec_start.index("-p") + 1]
    assert pidfile.startswith(f"/run/{one(svc, 'RuntimeDirectory')}/")
    assert one(svc, "ExecReload").split() == ["/usr/bin/env", "sbusd", "--upgrade", "-p", pidfile]
    assert exec_start[:3] == ["/usr/bin/env", "sbusd", "-f"]
    assert exec_start[exec_start.index("--log-format") + 1] == "json"
    assert exec_start[exec_start.index("-a") + 1] == path, "-a should name the socket unit's path"
    assert one(svc, "User") == "sbus"        # not root
    assert_sandboxed(svc)
    assert "PrivateUsers" not in dict(svc), "PrivateUsers= hides the clients' real uids"
    verify("sbusd.socket", "sbus-fds.socket", "sbusd.service")


def test_queue_unit_is_sandboxed_like_the_broker():
    unit = read_unit("sbus-queue@.service")
    svc, broker = unit["Service"], read_unit("sbusd.service")["Service"]
    assert "sbusd.socket" in one(unit["Unit"], "Requires")
    exec_start = one(svc, "ExecStart").split()
    assert exec_start[:5] == ["/usr/bin/env", "sbus", "-a", "/run/sbus.socket", "queue"]
    assert exec_start[exec_start.index("--log-format") + 1] == "json"
    assert "%i" in one(svc, "EnvironmentFile")
    assert one(svc, "Type") == "notify"     # READY=1 once its subscriptions are in place
    assert one(svc, "User") not in ("", "root")
    # Everything the broker's sandbox has, except what only a notify service needs.
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices",
                "PrivateNetwork", "MemoryDenyWriteExecute", "ProtectSystem",
                "RestrictAddressFamilies", "CapabilityBoundingSet", "RestrictNamespaces",
                "ProtectKernelTunables", "ProtectKernelModules", "ProtectControlGroups",
                "RestrictSUIDSGID", "LockPersonality", "SystemCallArchitectures"):
        assert values(svc, key) == values(broker, key), key
    assert values(svc, "SystemCallFilter") == values(broker, "SystemCallFilter")
    assert "PrivateUsers" not in dict(svc), "PrivateUsers= would change its !/cred/ key"
    verify("sbusd.socket", "sbus-fds.socket", "sbusd.service", "sbus-queue@.service")




def test_store_unit():
    svc = read_unit("sbus-store.service")["Service"]
    unit = read_unit("sbus-store.service")["Unit"]
    assert "sbusd.socket" in one(unit, "Requires")
    exec_start = one(svc, "ExecStart").split()
    assert exec_start[:5] == ["/usr/bin/env", "sbus", "-a", "/run/sbus.socket", "store"]
    assert one(svc, "Type") == "notify"     # READY=1 once its subscriptions are in place
    assert exec_start[exec_start.index("--log-format") + 1] == "json"
    state = one(svc, "StateDirectory")
    assert exec_start[exec_start.index("--dir") + 1] == f"/var/lib/{state}", \
        "--dir should be the StateDirectory, the one place it may write"
    assert one(svc, "User") not in ("", "root")
    assert_sandboxed(svc, "PrivateNetwork")
    verify("sbusd.socket", "sbus-fds.socket", "sbus-store.service")


def test_fds_units():
    """sbus-fds.socket makes the socket clients look for beside the bus socket,
    world-usable; sbus-fds.service serves it, sandboxed as the store."""
    sock = read_unit("sbus-fds.socket")["Socket"]
    bus = one(read_unit("sbusd.socket")["Socket"], "ListenSequentialPacket")
    assert one(sock, "ListenSequentialPacket") == bus + ".fds"
    assert one(sock, "SocketMode") == "0666"
    svc = read_unit("sbus-fds.service")["Service"]
    unit = read_unit("sbus-fds.service")["Unit"]
    assert "sbusd.socket" in one(unit, "Requires") and "sbus-fds.socket" in one(unit, "Requires")
    exec_start = one(svc, "ExecStart").split()
    assert exec_start[:5] == ["/usr/bin/env", "sbus", "-a", bus, "fds"]
    assert "--socket" not in exec_start, "the socket comes from systemd (fd 3)"
    assert exec_start[exec_start.index("--log-format") + 1] == "json"
    assert one(svc, "User") not in ("", "root")
    assert_sandboxed(svc, "PrivateNetwork")
    verify("sbusd.socket", "sbus-fds.socket", "sbus-fds.service")


def test_leaf_unit_runs_a_leaf_sandboxed_like_the_broker(tmp_path):
    unit = read_unit("sbusd-leaf.service")
    svc, broker = unit["Service"], read_unit("sbusd.service")["Service"]
    assert one(svc, "Type") == "notify" and one(svc, "NotifyAccess") == "all"
    exec_start = one(svc, "ExecStart").split()
    pidfile = exec_start[exec_start.index("-p") + 1]
    assert pidfile.startswith(f"/run/{one(svc, 'RuntimeDirectory')}/")
    assert one(svc, "ExecReload").split() == ["/usr/bin/env", "sbusd", "--upgrade", "-p", pidfile]
    assert exec_start[:4] == ["/usr/bin/env", "sbusd", "-f", "-g"]
    own = exec_start[exec_start.index("-a") + 1]
    upstream = exec_start[exec_start.index("--upstream") + 1]
    assert own == f"/run/{one(svc, 'RuntimeDirectory')}/sbus.socket"
    assert upstream == one(read_unit("sbusd.socket")["Socket"], "ListenSequentialPacket")
    # Without the host's bus it has nothing to be a leaf of, as every other unit.
    assert "sbusd.socket" in one(unit["Unit"], "Requires").split()
    assert one(svc, "User") not in ("", "root")
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices",
                "PrivateNetwork", "MemoryDenyWriteExecute", "ProtectSystem",
                "RestrictAddressFamilies", "CapabilityBoundingSet", "RestrictNamespaces",
                "ProtectKernelTunables", "ProtectKernelModules", "ProtectControlGroups",
                "RestrictSUIDSGID", "LockPersonality", "SystemCallArchitectures", "UMask"):
        assert values(svc, key) == values(broker, key), key
    assert values(svc, "SystemCallFilter") == values(broker, "SystemCallFilter")
    assert "PrivateUsers" not in dict(svc)
    # Its command line, with the two paths moved under tmp_path, makes a leaf.
    from support.sbusd import Sbusd
    host = Sbusd.foreground(tmp_path, address=str(tmp_path / "host"), log_level="info")
    argv = exec_start[2:]
    argv[argv.index("-a") + 1] = str(tmp_path / "leaf")
    argv[argv.index("--upstream") + 1] = host.address
    argv[argv.index("-p") + 1] = str(tmp_path / "leaf.pid")
    leaf = Sbusd(tmp_path, argv, address=str(tmp_path / "leaf")).ready(10)
    try:
        leaf.wait_for_event("upstream_connected", timeout=10)
        with leaf.connect() as c:
            assert c.whoami().endswith("/" + c.me)
    finally:
        leaf.stop()
        host.stop()
    verify("sbusd.socket", "sbus-fds.socket", "sbusd.service", "sbusd-leaf.service")


# ---------------------------------------------------------------- sandbox

def test_sandbox_is_effective(sandbox):
    """The emulation is not vacuous: W+X memory, other socket families and a
    syscall outside the allow list are all refused."""
    probe = ("import mmap, socket, sys\n"
             "try:\n"
             "    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
             "    sys.exit('W+X mapping allowed')\n"
             "except PermissionError:\n"
             "    pass\n"
             "try:\n"
             "    socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
             "    sys.exit('AF_INET allowed')\n"
             "except OSError:\n"
             "    pass\n"
             "print('ok', flush=True)\n"
             "import os; os.sync()\n"          # @sync is in @system-service
             "import ctypes; ctypes.CDLL(None).syscall(169, 0, 0, 0, 0)\n")  # reboot
    r = subprocess.run([*sandbox, sys.executable, "-c", probe], capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.stdout == "ok\n", r.stdout + r.stderr
    assert r.returncode == -signal.SIGSYS, (r.returncode, r.stderr)


def test_sbusd_in_the_units_sandbox(tmp_path, spawn, sandbox):
    bus = tmp_path / "bus.socket"
    listener = seqpacket_listener(bus)
    notify = Notify(tmp_path, abstract=False)
    early = queued_client(bus)
    p = spawn(listener, "-a", str(tmp_path / "unused.socket"),
              env={"NOTIFY_SOCKET": notify.env}, wrap=sandbox)
    assert early.sync().startswith("!/cred/"), stderr_of(p)
    expect_notify(notify, "READY=1", p.pid, p)
    pubsub_round_trip(bus)
    with Client(str(bus)) as c:
        assert "clients" in c.stats(timeout=TIMEOUT)
    early.close()
    assert stop(p) == 0, f"rc={p.returncode} (-31 is SIGSYS); stderr: {stderr_of(p)}"
    expect_notify(notify, "STOPPING=1", p.pid, p)
    notify.close()
    listener.close()


# ---------------------------------------------------------------- metrics and documentation

def test_metrics_units_write_the_textfile_node_exporter_reads(tmp_path, start_broker):
    from prometheus_client.parser import text_string_to_metric_families
    timer = read_unit("sbus-metrics.timer")
    assert one(timer["Timer"], "OnUnitActiveSec") == "15s"
    assert one(timer["Install"], "WantedBy") == "timers.target"
    unit = read_unit("sbus-metrics.service")
    svc = unit["Service"]
    assert one(svc, "Type") == "oneshot"
    assert "sbusd.socket" in one(unit["Unit"], "Requires").split()
    assert one(svc, "User") == "sbus"
    argv = one(svc, "ExecStart").split()
    assert argv[:4] == ["/usr/bin/env", "sbus", "-a", "/run/sbus.socket"]
    output = Path(argv[argv.index("--output") + 1])
    assert output.suffix == ".prom"
    assert one(svc, "ReadWritePaths") == str(output.parent), "the only place it may write"
    assert one(svc, "RestrictAddressFamilies") == "AF_UNIX"
    assert one(svc, "ProtectSystem") == "strict" and one(svc, "PrivateNetwork") == "yes"
    # The unit's command, on a test broker and a test directory: a file
    # Prometheus's parser reads, written whole, nothing else left beside it.
    b = start_broker()
    textdir = tmp_path / "textfile-collector"
    textdir.mkdir()
    textfile = textdir / output.name
    command = [SBUS, "-a", b.address,
               *argv[argv.index("-a") + 2:argv.index("--output") + 1], str(textfile)]
    r = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    families = {f.name: f for f in text_string_to_metric_families(textfile.read_text())}
    assert families["sbus_messages_received"].type == "counter"
    assert [p.name for p in textdir.iterdir()] == [textfile.name]
    assert textfile.stat().st_mode & 0o777 == 0o644
    verify("sbusd.socket", "sbusd.service", "sbus-metrics.service", "sbus-metrics.timer")


# What tools/systemd/README.md installs under /usr/share/doc/sbus/, from the
# sources (the sdist carries docs/ and tools/systemd/).
INSTALLED_DOCS = {"systemd.md": UNITS / "README.md",
                  **{p.name: p for p in (ROOT / "docs").glob("*.md")}}


def test_every_units_documentation_is_installed_by_the_readme():
    readme = (UNITS / "README.md").read_text()
    assert "install -D -m 0644 tools/systemd/README.md /usr/share/doc/sbus/systemd.md" in readme
    assert "install -m 0644 docs/*.md /usr/share/doc/sbus/" in readme
    units = sorted(p.name for p in UNITS.iterdir() if p.suffix in (".service", ".socket", ".timer"))
    assert "sbus-bridge.service" in units and "sbus-metrics.timer" in units
    for name in units:
        for section in read_unit(name).values():
            for link in " ".join(values(section, "Documentation")).split():
                prefix = "file:///usr/share/doc/sbus/"
                assert link.startswith(prefix), (name, link)
                assert INSTALLED_DOCS[link[len(prefix):]].is_file(), (name, link)


def test_the_readme_installs_the_wheel_make_wheel_makes():
    """The name auditwheel gives a repaired wheel (its tags in that order,
    tools/build_wheels.py), not one that pip cannot find (issue 38)."""
    import fnmatch

    from sbus._version import __version__ as version
    readme = (UNITS / "README.md").read_text()
    (glob,) = re.findall(r"pip install \./(\S+\.whl)", readme)
    made = f"pysbus-{version}-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
    assert fnmatch.fnmatch(made, glob), (glob, made)
    assert f"`{made}`" in readme, "the example names the file make wheel makes"
    assert not fnmatch.fnmatch(f"pysbus-{version}.tar.gz", glob)


def test_the_readme_has_a_section_for_every_service_unit():
    readme = (UNITS / "README.md").read_text()
    for unit in UNITS.glob("*.service"):
        name = unit.name.replace("@", "")
        assert f"cp tools/systemd/{unit.name}" in readme or f"'tools/systemd/{unit.name}'" \
            in readme or f"tools/systemd/{unit.name} " in readme, name


def test_service_units_are_type_notify_and_verify_clean():
    """sbus store, sbus queue, sbus bridge and sbus fds send READY=1 themselves once
    their subscriptions are in place (sbus.runner.ready; the store's and the
    queue's tests receive it): their units wait for it."""
    names = ("sbus-store.service", "sbus-queue@.service", "sbus-bridge.service", "sbus-fds.service")
    for name in names:
        svc = read_unit(name)["Service"]
        assert one(svc, "Type") == "notify", name
        assert "NotifyAccess" not in dict(svc), "the main process itself says it"
    verify("sbusd.socket", "sbus-fds.socket", "sbusd.service", *names)
