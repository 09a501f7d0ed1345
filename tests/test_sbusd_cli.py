"""The ``sbusd`` command line and process lifecycle, as real processes over
real sockets: getopt-style option parsing (combined short options as in C),
every address form, readiness (stdout closes once listening), foreground
and daemon modes, the pidfile, signals, -c, socket modes, -r and -u.

Tests that send a stop signal first make a round trip through the broker
(``serving``): see test_stop_signal_right_after_readiness_is_honoured for
why a signal sent the instant stdout closes is not yet reliable.
"""
from __future__ import annotations

import errno
import itertools
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from sbus import __version__

from support import BACKENDS, SBUSD, Conn, Sbusd, alive, read_records, wait_for_record, wait_gone

TIMEOUT = 5.0
NOBODY = 65534
ABSTRACT_RE = re.compile(rb"/dev/unix/abstract/(00[0-9a-f]{214})\n")
_seq = itertools.count()


# -- helpers --------------------------------------------------------------------

def serving(address) -> str:
    """Connect, make a round trip, disconnect: proves the loop is running;
    returns the credentials the broker replied."""
    with Conn.to(address, TIMEOUT) as s:
        return s.sync()


def stale_socket(path: Path) -> os.stat_result:
    """A socket file nobody listens on, as a crashed broker leaves behind
    (mode 0755, so that a 0700 socket at the path is visibly a new one)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o022)
    try:
        s.bind(str(path))
    finally:
        os.umask(old)
        s.close()
    return os.lstat(path)


def same_file(before: os.stat_result, path: Path) -> bool:
    after = os.lstat(path)
    return (before.st_ino, before.st_mode, before.st_mtime_ns, before.st_size) == \
        (after.st_ino, after.st_mode, after.st_mtime_ns, after.st_size)


def run_sbusd(*args, timeout=TIMEOUT, **kwargs) -> subprocess.CompletedProcess:
    """sbusd run to completion (for options that exit or fail at once)."""
    return subprocess.run([SBUSD, *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


@pytest.fixture
def sbusd_process(tmp_path):
    """Factory: ``sbusd_process(*args, ...)`` starts a foreground sbusd (not yet
    waited for); anything still running at teardown is killed."""
    started = []

    def start(*args, log=True, **kwargs) -> Sbusd:
        p = Sbusd(tmp_path, args, log_level="debug" if log else None, **kwargs)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


class Launch:
    """The result of running sbusd in daemon mode (the launcher's side)."""

    def __init__(self, proc: subprocess.CompletedProcess, stderr: str, elapsed: float):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = stderr
        self.elapsed = elapsed


@pytest.fixture
def daemon(tmp_path):
    """Factory: ``daemon(*args)`` runs the launcher to completion and returns
    a Launch; ``daemon.track(pid)`` has a daemon SIGKILLed at teardown."""
    pids = []

    def launch(*args) -> Launch:
        err = tmp_path / f"launcher-{next(_seq)}.stderr"
        started = time.monotonic()
        with open(err, "wb") as e:
            # stderr goes to a file: the daemon keeps it open, a pipe would
            # never reach EOF. stdout is a pipe: the daemon must close it.
            proc = subprocess.run([SBUSD, *args], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=e, timeout=TIMEOUT)
        return Launch(proc, err.read_text(errors="replace"), time.monotonic() - started)

    launch.track = pids.append
    yield launch
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def daemon_args(tmp_path: Path, *extra, name="d"):
    sock, pidfile, log = tmp_path / f"{name}.socket", tmp_path / f"{name}.pid", tmp_path / f"{name}.log"
    args = ["-a", str(sock), "-p", str(pidfile), "--log-format", "json", "--log-file", str(log),
            "--log-level", "debug", *extra]
    return args, sock, pidfile, log


def read_pid(pidfile: Path) -> int:
    text = pidfile.read_text()
    assert re.fullmatch(r"[0-9]+\n", text), repr(text)
    return int(text)


# -- help, version, usage errors -------------------------------------------------

@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_every_option_then_exits_0(flag):
    proc = run_sbusd(flag)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: sbusd [-a address] [-f] [-p pidfile] [-u user] ... [-cgor]")
    for opt in ("-a,", "-f,", "-p,", "-u,", "-c,", "-g,", "-o,", "-r,", "--backend",
                "--log-file", "-h,", "-V,"):
        assert opt in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_version_then_exits_0(flag):
    proc = run_sbusd(flag)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"sbusd {__version__}\n", "")


@pytest.mark.parametrize("bad", [
    ["-x"],                      # unknown short option
    ["-fx"],                     # unknown option inside a combined group
    ["--no-such-option"],
    ["-a"],                      # missing argument (last on the line)
    ["-p"],
    ["-u"],
    ["surplus-argument"],
    ["--backend", "kqueue"],
    ["--log-level", "loud"],
    ["--max-message", "lots"],
    ["--stats-interval", "nan"],  # no JSON can carry these into broker_start
    ["--block-timeout", "inf"],
    ["--log-messages", "nan"],
], ids=lambda a: " ".join(a))
def test_bad_usage_exits_nonzero_with_usage_on_stderr(tmp_path, bad):
    sock = tmp_path / "never.socket"
    # -f and a private address first, so a wrongly accepted line harms nothing.
    proc = run_sbusd("-f", "-a", str(sock), *bad)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert proc.stderr.startswith("sbusd: ")
    assert "usage: sbusd" in proc.stderr
    assert not os.path.lexists(sock)


# -- readiness --------------------------------------------------------------------

@pytest.mark.alone   # start-up within a second
@pytest.mark.parametrize("backend", BACKENDS)
def test_stdout_closes_once_listening_and_within_one_second(sbusd_process, tmp_path, backend):
    """A parent can wait for EOF on stdout (the C tests do so under alarm(1));
    at that moment the socket already accepts connections."""
    sock = tmp_path / "bus.socket"
    b = sbusd_process("-f", "-a", str(sock), "--backend", backend).ready()
    assert b.stdout == b""
    assert b.ready_s < 1.0, f"start-up to listening took {b.ready_s:.3f}s"
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    creds = serving(str(sock))          # no retry: it must listen already
    assert creds == f"!/cred/{os.getgid()}/{os.getuid()}/{os.getpid()}"
    start = [r for r in b.records() if r["event"] == "broker_start"]
    assert start and start[0]["config"]["backend"] == backend


# -- address forms ---------------------------------------------------------------

@pytest.mark.alone   # start-up within a second
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_abstract_address_is_printed_then_stdout_closes(sbusd_process, backend):
    """-fa/dev/unix/abstract (combined, as the C tests write it): the whole
    108-byte sun_path in hex, a newline, EOF; that name accepts clients."""
    b = sbusd_process("-fa/dev/unix/abstract", "--backend", backend).ready()
    m = ABSTRACT_RE.fullmatch(b.stdout)
    assert m, b.stdout
    name = bytes.fromhex(m.group(1).decode())
    assert len(name) == 108 and name[0] == 0
    assert b.ready_s < 1.0, f"start-up to listening took {b.ready_s:.3f}s"
    with Conn.to(name) as c1, Conn.to(name) as c2:
        c1.send(b"SUB x/")
        c1.sync()
        c2.send(b"MSG x/y\0hello")
        assert c1.recv(4096) == b"MSG x/y\0hello"
    other = sbusd_process("-fa/dev/unix/abstract", log=False).ready()
    assert ABSTRACT_RE.fullmatch(other.stdout) and other.stdout != b.stdout


def test_explicit_abstract_hex_address(sbusd_process, tmp_path):
    """/dev/unix/abstract/HEX: HEX is sun_path (leading NUL included), padded
    with NULs to 108 bytes as C clients connect with sizeof(sockaddr_un)."""
    name = b"\0sbus-cli-test-" + uuid.uuid4().hex.encode()
    address = "/dev/unix/abstract/" + name.hex()
    b = sbusd_process("-f", "-a", address).ready()
    assert b.stdout == b""              # only a random address is printed
    assert serving(name.ljust(108, b"\0"))
    # The same explicit name cannot be bound twice: a clear error, not a hang.
    proc = run_sbusd("-f", "-a", address)
    assert proc.returncode != 0
    assert "in use" in proc.stderr.lower()
    assert serving(name.ljust(108, b"\0"))


@pytest.mark.parametrize("listening", [False, True], ids=["bound", "listening"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dev_fd_inherited_socket(sbusd_process, tmp_path, listening, backend):
    """/dev/fd/N: a SOCK_SEQPACKET socket the parent bound (and maybe put in
    listening state) serves clients; with -c it ends once they have left."""
    path = tmp_path / "inherited.socket"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(path))
    if listening:
        s.listen(8)
    fd = s.fileno()
    try:
        b = sbusd_process("-fca", f"/dev/fd/{fd}", "--backend", backend, pass_fds=(fd,)).ready()
    finally:
        s.close()                       # only the broker's copy remains
    assert b.stdout == b""
    with Conn.to(str(path)) as sub, Conn.to(str(path)) as pub:
        sub.send(b"SUB k")
        sub.sync()
        pub.send(b"MSG k\0v")
        assert sub.recv(4096) == b"MSG k\0v"
    assert b.wait() == 0


@pytest.mark.parametrize("kind", ["pipe", "stream-socket", "closed-fd"])
def test_dev_fd_that_is_not_a_seqpacket_socket_is_an_error(tmp_path, kind):
    cleanup = []
    if kind == "pipe":
        fd, w = os.pipe()
        cleanup = [lambda: os.close(fd), lambda: os.close(w)]
    elif kind == "stream-socket":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(tmp_path / "stream.socket"))
        cleanup = [s.close]
        fd = s.fileno()
    else:
        fd = 200                        # not passed down: closed in sbusd
    try:
        proc = run_sbusd("-f", "-a", f"/dev/fd/{fd}",
                         pass_fds=[fd] if kind != "closed-fd" else [])
    finally:
        for close in cleanup:
            close()
    assert proc.returncode != 0
    assert f"/dev/fd/{fd}" in proc.stderr
    assert proc.stdout == ""


# -- socket file: modes, -r ---------------------------------------------------------

@pytest.mark.parametrize("flags, mode", [
    ([], 0o700),
    (["-g"], 0o770),
    (["-o"], 0o707),
    (["-g", "-o"], 0o777),
    (["-go"], 0o777),
    (["--group", "--other"], 0o777),
], ids=lambda v: oct(v) if isinstance(v, int) else " ".join(v) or "none")
def test_socket_file_mode(sbusd_process, tmp_path, flags, mode):
    sock = tmp_path / "bus.socket"
    sbusd_process("-f", "-a", str(sock), *flags).ready()
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == mode, oct(st.st_mode)
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())


@pytest.mark.parametrize("umask, flags, mode", [
    (0o000, [], 0o700),                 # a lax umask does not widen the default
    (0o777, ["-go"], 0o777),            # a strict one does not narrow -g/-o
])
def test_socket_file_mode_does_not_depend_on_umask(sbusd_process, tmp_path, umask, flags, mode):
    sock = tmp_path / "bus.socket"
    sbusd_process("-f", "-a", str(sock), *flags, umask=umask).ready()
    assert stat.S_IMODE(os.lstat(sock).st_mode) == mode


@pytest.mark.parametrize("kind", ["stale-socket", "regular-file"])
def test_existing_path_without_r_is_an_error_and_left_alone(tmp_path, kind):
    sock = tmp_path / "bus.socket"
    if kind == "stale-socket":
        before = stale_socket(sock)
    else:
        sock.write_bytes(b"precious\n")
        before = os.lstat(sock)
    proc = run_sbusd("-f", "-a", str(sock))
    assert proc.returncode != 0
    assert str(sock) in proc.stderr and "exists" in proc.stderr
    assert proc.stdout == ""
    assert same_file(before, sock)
    if kind == "regular-file":
        assert sock.read_bytes() == b"precious\n"


@pytest.mark.parametrize("backend", BACKENDS)
def test_r_replaces_a_stale_socket(sbusd_process, tmp_path, backend):
    sock = tmp_path / "bus.socket"
    stale_socket(sock)
    with pytest.raises(ConnectionRefusedError):
        Conn.to(str(sock))
    sbusd_process("-f", "-r", "-a", str(sock), "--backend", backend).ready()
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o700
    assert serving(str(sock))           # a fresh socket now listens at the path


def test_r_with_nothing_at_the_path_just_starts(sbusd_process, tmp_path):
    sock = tmp_path / "bus.socket"
    sbusd_process("-f", "-r", "-a", str(sock)).ready()
    assert serving(str(sock))


@pytest.mark.parametrize("kind", ["regular-file", "directory", "symlink-to-socket",
                                  "dangling-symlink", "fifo"])
def test_r_refuses_to_remove_anything_but_a_socket(tmp_path, kind):
    sock = tmp_path / "bus.socket"
    if kind == "regular-file":
        sock.write_bytes(b"precious\n")
    elif kind == "directory":
        sock.mkdir()
        (sock / "inside").write_text("x")
    elif kind == "symlink-to-socket":
        stale_socket(tmp_path / "real.socket")
        sock.symlink_to(tmp_path / "real.socket")
    elif kind == "dangling-symlink":
        sock.symlink_to(tmp_path / "nowhere")
    else:
        os.mkfifo(sock)
    before = os.lstat(sock)
    proc = run_sbusd("-f", "-r", "-a", str(sock))
    assert proc.returncode != 0
    assert str(sock) in proc.stderr
    assert same_file(before, sock)
    if kind == "regular-file":
        assert sock.read_bytes() == b"precious\n"
    if kind == "directory":
        assert (sock / "inside").read_text() == "x"
    if kind == "symlink-to-socket":
        assert stat.S_ISSOCK(os.lstat(tmp_path / "real.socket").st_mode)


# -- combined short options and long options --------------------------------------

def test_fa_path_cr_replaces_stale_socket_and_auto_closes(sbusd_process, tmp_path):
    """The C test suite's own form: -fa PATH -cr."""
    sock = tmp_path / "bus.socket"
    stale_socket(sock)
    b = sbusd_process("-fa", str(sock), "-cr").ready()
    assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o700
    assert serving(str(sock))
    assert b.wait() == 0
    assert not os.path.lexists(sock)


def test_crgo_sets_all_four_flags(sbusd_process, tmp_path):
    sock = tmp_path / "bus.socket"
    stale_socket(sock)
    b = sbusd_process("-crgo", "-fa", str(sock)).ready()
    assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o777
    config = b.records()[0]["config"]
    assert (config["auto_close"], config["reuse"], config["mode"]) == (True, True, "0o777")
    assert serving(str(sock))
    assert b.wait() == 0


@pytest.mark.parametrize("style", ["equals", "separate"])
def test_long_options(sbusd_process, tmp_path, style):
    sock = tmp_path / "bus.socket"
    stale_socket(sock)
    address = [f"--address={sock}"] if style == "equals" else ["--address", str(sock)]
    b = sbusd_process("--foreground", *address, "--auto-close", "--reuse", "--group", "--other",
              "--backend=select").ready()
    assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o777
    assert b.records()[0]["config"]["backend"] == "select"
    assert serving(str(sock))
    assert b.wait() == 0
    assert not os.path.lexists(sock)


# -- foreground lifecycle ------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=lambda s: s.name)
def test_foreground_signal_exits_0_and_removes_socket(sbusd_process, tmp_path, sig, backend):
    sock = tmp_path / "bus.socket"
    b = sbusd_process("-f", "-a", str(sock), "--backend", backend).ready()
    client = Conn.to(str(sock))
    client.sync()                      # the loop runs: the signal cannot race it
    b.proc.send_signal(sig)
    assert b.wait() == 0
    assert client.recv(4096) == b""     # clients are disconnected, not left hanging
    client.close()
    assert not os.path.lexists(sock)
    stop = [r for r in b.records() if r["event"] == "broker_stop"]
    assert stop and stop[0]["reason"] == sig.name


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_as_soon_as_the_socket_accepts_still_stops_cleanly(sbusd_process, tmp_path, sig):
    """A supervisor that waits for connect() to succeed rather than for EOF on
    stdout, then stops the broker at once, hits the moment between listen()
    and the event loop: the signal is remembered, not fatal."""
    for attempt in range(5):
        sock = tmp_path / f"race-{attempt}.socket"
        b = sbusd_process("-f", "-a", str(sock))
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    s.connect(str(sock))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.monotonic() < deadline, "never listened"
                time.sleep(0.0005)      # polling connect() is the supervisor under test
        b.proc.send_signal(sig)
        assert b.wait() == 0, b.stderr_text()
        assert not os.path.lexists(sock)
        stop = [r for r in b.records() if r["event"] == "broker_stop"]
        assert stop and stop[0]["reason"] == sig.name


def test_a_closed_stdout_is_no_error(tmp_path):
    """`sbusd -f ... >&-`: nobody to tell it is ready, and nothing breaks."""
    sock = tmp_path / "bus.socket"
    proc = subprocess.Popen(["sh", "-c", 'exec "$0" -f -a "$1" >&-', SBUSD, str(sock)],
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                assert serving(str(sock))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.monotonic() < deadline
                time.sleep(0.01)        # stdout is closed: no readiness signal to wait for
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_abstract_hex_name_without_its_leading_nul_is_a_clear_error():
    proc = run_sbusd("-f", "-a", "/dev/unix/abstract/6162")
    assert proc.returncode == 1
    assert proc.stderr.startswith("sbusd: bad unix socket address") and "begins with 00" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_close_exits_0_once_the_last_client_has_left(sbusd_process, tmp_path, backend):
    sock = tmp_path / "bus.socket"
    b = sbusd_process("-fc", "-a", str(sock), "--backend", backend).ready()
    with pytest.raises(subprocess.TimeoutExpired):
        b.wait(timeout=0.3)             # no client has come yet: keep running
    first, second = Conn.to(str(sock)), Conn.to(str(sock))
    first.sync()
    second.sync()
    first.close()
    assert second.sync()               # one client left: still serving
    assert b.proc.poll() is None
    second.close()
    assert b.wait() == 0
    assert not os.path.lexists(sock)
    stop = [r for r in b.records() if r["event"] == "broker_stop"]
    assert stop and stop[0]["reason"] == "auto_close"


def test_without_c_the_broker_outlives_its_clients(sbusd_process, tmp_path):
    sock = tmp_path / "bus.socket"
    b = sbusd_process("-f", "-a", str(sock)).ready()
    serving(str(sock))
    serving(str(sock))                  # the first one left; still here
    assert b.proc.poll() is None


# -- daemon lifecycle -----------------------------------------------------------------

@pytest.mark.alone   # start-up within a second
@pytest.mark.parametrize("sig, backend", [(signal.SIGTERM, "epoll"), (signal.SIGINT, "select")],
                         ids=["SIGTERM-epoll", "SIGINT-select"])
def test_daemon_launcher_exits_0_once_listening_and_signal_cleans_up(daemon, tmp_path, sig, backend):
    args, sock, pidfile, log = daemon_args(tmp_path, "--backend", backend)
    launch = daemon(*args)
    assert launch.returncode == 0, launch.stderr
    assert launch.stdout == b""
    assert launch.elapsed < 1.0, f"daemon start-up took {launch.elapsed:.3f}s"
    # The launcher has exited: the daemon listens and its pidfile exists.
    pid = read_pid(pidfile)
    daemon.track(pid)
    assert alive(pid)
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    assert serving(str(sock))
    start = wait_for_record(log, "broker_start")
    assert start["pid"] == pid and start["config"]["foreground"] is False
    assert start["config"]["backend"] == backend

    os.kill(pid, sig)
    assert wait_gone(pid), "daemon did not stop"
    assert not os.path.lexists(sock)
    assert not os.path.lexists(pidfile)
    assert wait_for_record(log, "broker_stop")["reason"] == sig.name


def test_daemon_sighup_reopens_its_log_file(daemon, tmp_path):
    args, sock, pidfile, log = daemon_args(tmp_path)
    launch = daemon(*args)
    assert launch.returncode == 0, launch.stderr
    pid = read_pid(pidfile)
    daemon.track(pid)
    wait_for_record(log, "broker_start")
    rotated = tmp_path / "d.log.1"
    log.rename(rotated)                 # what logrotate does
    os.kill(pid, signal.SIGHUP)
    reopened = wait_for_record(log, "log_reopened")
    assert reopened["broker_pid"] == pid
    assert alive(pid)                   # SIGHUP does not end a daemon
    serving(str(sock))                  # later records go to the new file
    wait_for_record(log, "client_connect")
    wait_for_record(log, "client_disconnect")
    old = [r["event"] for r in read_records(rotated)]
    assert "broker_start" in old and "log_reopened" not in old and "client_connect" not in old
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid)
    assert wait_for_record(log, "broker_stop")["reason"] == "SIGTERM"
    assert not os.path.lexists(sock) and not os.path.lexists(pidfile)


def test_a_daemon_without_log_file_lets_go_of_captured_output(daemon, tmp_path):
    """subprocess.run(capture_output=True), or $(sbusd ... 2>&1): the caller
    reads both pipes to EOF, so the daemon must keep neither."""
    sock, pidfile = tmp_path / "cap.socket", tmp_path / "cap.pid"
    started = time.monotonic()
    proc = subprocess.run([SBUSD, "-a", str(sock), "-p", str(pidfile)], stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < TIMEOUT
    pid = read_pid(pidfile)
    daemon.track(pid)
    assert serving(str(sock))
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid)
    # A file on stderr is kept for the logs.
    err = tmp_path / "cap.stderr"
    with open(err, "wb") as e:
        proc = subprocess.run([SBUSD, "-a", str(sock), "-p", str(pidfile), "--log-format", "json"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=e,
                              timeout=TIMEOUT)
    assert proc.returncode == 0
    pid = read_pid(pidfile)
    daemon.track(pid)
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid)
    assert [r["event"] for r in read_records(err)][-1] == "broker_stop"


def test_daemon_pidfile_dev_null_means_none(daemon, tmp_path):
    args, sock, pidfile, log = daemon_args(tmp_path)
    args[args.index(str(pidfile))] = "/dev/null"
    launch = daemon(*args)
    assert launch.returncode == 0, launch.stderr
    pid = wait_for_record(log, "broker_start")["pid"]
    daemon.track(pid)
    assert serving(str(sock))
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert not os.path.lexists(pidfile)
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert not os.path.lexists(sock)


def test_daemon_random_abstract_address_is_printed_by_the_launcher(daemon, tmp_path):
    args, _, pidfile, log = daemon_args(tmp_path)
    args[args.index("-a") + 1] = "/dev/unix/abstract"
    launch = daemon(*args)
    assert launch.returncode == 0, launch.stderr
    m = ABSTRACT_RE.fullmatch(launch.stdout)
    assert m, launch.stdout
    pid = read_pid(pidfile)
    daemon.track(pid)
    assert serving(bytes.fromhex(m.group(1).decode()))
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid)
    assert not os.path.lexists(pidfile)


def test_daemon_existing_pidfile_fails_the_launcher(daemon, tmp_path):
    args, sock, pidfile, log = daemon_args(tmp_path)
    pidfile.write_text("12345\n")
    before = os.lstat(pidfile)
    launch = daemon(*args)
    assert launch.returncode != 0
    assert str(pidfile) in launch.stderr
    assert same_file(before, pidfile) and pidfile.read_text() == "12345\n"
    assert not os.path.lexists(sock)    # the failed daemon cleaned up
    for r in read_records(log):
        if r.get("event") == "broker_start":
            daemon.track(r["pid"])
            raise AssertionError("a daemon started despite the existing pidfile")


@pytest.mark.parametrize("target_exists", [False, True], ids=["dangling", "to-a-file"])
def test_daemon_pidfile_is_never_followed_through_a_symlink(daemon, tmp_path, target_exists):
    args, sock, pidfile, log = daemon_args(tmp_path)
    target = tmp_path / "victim"
    if target_exists:
        target.write_text("do not touch\n")
    pidfile.symlink_to(target)
    launch = daemon(*args)
    assert launch.returncode != 0
    assert str(pidfile) in launch.stderr
    assert pidfile.is_symlink()
    if target_exists:
        assert target.read_text() == "do not touch\n"
    else:
        assert not os.path.lexists(target)
    assert not os.path.lexists(sock)


# -- relative paths in daemon mode (the daemon changes directory to /) ----------------

@pytest.fixture
def relative_daemon(daemon, tmp_path):
    """A daemon started from tmp_path with relative socket, pidfile and log
    paths. Yields (pid, names); removes anything it wrongly put in /."""
    stem = f"sbt-{uuid.uuid4().hex[:12]}"     # unique, also in /; short for sun_path
    names = {k: f"{stem}.{k}" for k in ("socket", "pid", "log")}
    launch = subprocess.run(
        [SBUSD, "-a", names["socket"], "-p", names["pid"], "--log-format", "json",
         "--log-file", names["log"], "--log-level", "debug"],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, timeout=TIMEOUT)
    pid = None
    for where in (tmp_path, Path("/")):
        try:
            pid = int((where / names["pid"]).read_text())
            break
        except (FileNotFoundError, ValueError):
            pass
    if pid is not None:
        daemon.track(pid)
    try:
        assert launch.returncode == 0
        assert pid is not None
        serving(str(tmp_path / names["socket"]))
        yield pid, names
    finally:
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGTERM)
            if not wait_gone(pid, timeout=2.0):
                os.kill(pid, signal.SIGKILL)
                wait_gone(pid)
        for k in ("pid", "log", "socket"):
            stray = Path("/") / names[k]
            if os.path.lexists(stray):
                stray.unlink()


def test_daemon_relative_pidfile_is_created_where_sbusd_was_started(relative_daemon, tmp_path):
    pid, names = relative_daemon
    assert (tmp_path / names["pid"]).read_text() == f"{pid}\n"
    assert not os.path.lexists(Path("/") / names["pid"])


def test_daemon_relative_log_file_is_created_where_sbusd_was_started(relative_daemon, tmp_path):
    pid, names = relative_daemon
    wait_for_record(tmp_path / names["log"], "broker_start", timeout=1.0)
    assert not os.path.lexists(Path("/") / names["log"])


def test_daemon_relative_socket_is_removed_when_it_stops(relative_daemon, tmp_path):
    pid, names = relative_daemon
    os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid)
    assert not os.path.lexists(tmp_path / names["socket"])


# -- the readiness/signal race ---------------------------------------------------------

@pytest.mark.parametrize("mode", ["foreground", "daemon"])
def test_stop_signal_right_after_readiness_is_honoured(sbusd_process, daemon, tmp_path, mode):
    """Readiness means 'ready for anything', including being told to stop."""
    for attempt in range(20):
        sock = tmp_path / f"race-{attempt}.socket"
        if mode == "foreground":
            b = sbusd_process("-f", "-a", str(sock), log=False).ready()
            pid = b.pid
        else:
            pidfile = tmp_path / f"race-{attempt}.pid"
            launch = daemon("-a", str(sock), "-p", str(pidfile), "--log-level", "off")
            assert launch.returncode == 0, launch.stderr
            pid = read_pid(pidfile)
            daemon.track(pid)
        os.kill(pid, signal.SIGTERM)    # at once, as a supervisor might
        if mode == "foreground":
            try:
                b.wait(timeout=3)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"attempt {attempt}: SIGTERM right after readiness "
                                     "was ignored; sbusd still runs") from None
            assert b.proc.returncode == 0
        else:
            assert wait_gone(pid, timeout=3), (
                f"attempt {attempt}: SIGTERM right after the launcher exited was ignored")
        assert not os.path.lexists(sock)


# -- startup errors that are not usage errors --------------------------------------------

def test_unopenable_log_file_is_a_clear_error(tmp_path):
    sock = tmp_path / "bus.socket"
    proc = run_sbusd("-f", "-a", str(sock), "--log-file", str(tmp_path / "no-dir" / "x.log"))
    assert proc.returncode != 0
    assert not os.path.lexists(sock)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("sbusd: ") and str(tmp_path / "no-dir") in proc.stderr


def test_unknown_user_is_an_error(tmp_path):
    sock = tmp_path / "bus.socket"
    proc = run_sbusd("-f", "-a", str(sock), "-u", "no-such-user-sbus-test")
    assert proc.returncode != 0
    assert "no-such-user-sbus-test" in proc.stderr
    assert not os.path.lexists(sock)


# -- -u: who may connect -----------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become uid 65534")


@pytest.fixture
def public_dir():
    """A directory uid 65534 can traverse, so that only the socket's mode and
    -u decide who connects (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="sbus-cli-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _nobody_round_trip(address) -> str:
    """Runs in the forked child, as uid 65534."""
    try:
        s = Conn.to(address, timeout=3.0)
    except OSError as e:
        return f"connect-failed {errno.errorcode.get(e.errno, e.errno)}"
    with s:
        try:
            s.send(b"CMSG !/cred/whoami")
            reply = s.recv(4096)
        except socket.timeout:
            return "timeout"
        except OSError:
            return "closed"
        if not reply:
            return "closed"
        return "ok " + reply.split(b"\0", 1)[-1].decode()


def as_nobody(address) -> str:
    """Fork a child that drops to uid/gid 65534 and tries a round trip; its
    verdict: 'ok <credentials>', 'closed', 'timeout' or 'connect-failed E...'."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            verdict = _nobody_round_trip(address)
        except BaseException as e:
            verdict = f"child-error {type(e).__name__}: {e}"
        try:
            os.write(w, verdict.encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 10.0)
        verdict = os.read(r, 4096).decode() if ready else "no verdict"
    finally:
        os.close(r)
        if verdict == "no verdict":
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return verdict


@needs_root
@pytest.mark.parametrize("argv", [
    ["-u", "65534"],
    ["-u", "nobody"],
    ["--user", "nobody"],
    ["-u", "12345", "-u", "nobody"],    # repeatable
    ["-u65534"],                        # attached argument, as getopt allows
], ids=" ".join)
def test_listed_user_may_connect(sbusd_process, public_dir, argv):
    sock = public_dir / "bus.socket"
    sbusd_process("-fgo", "-a", str(sock), *argv).ready()
    verdict = as_nobody(str(sock))
    assert verdict.startswith(f"ok !/cred/{NOBODY}/{NOBODY}/"), verdict
    assert serving(str(sock))           # our own uid (root) is always allowed


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_unlisted_user_is_closed_on_accept_and_logged(sbusd_process, public_dir, backend):
    sock = public_dir / "bus.socket"
    b = sbusd_process("-fgou", "12345", "-a", str(sock), "--backend", backend).ready()
    assert as_nobody(str(sock)) == "closed"
    assert serving(str(sock))           # the broker's own uid is always allowed
    refused = wait_for_record(b.log_path, "client_disconnect",
                              lambda r: r.get("reason") == "user_refused")
    assert refused["uid"] == NOBODY
    assert not [r for r in b.records()
                if r["event"] == "client_connect" and r.get("uid") == NOBODY]
    assert b.proc.poll() is None


@needs_root
@pytest.mark.parametrize("flags, expected", [
    (["-g", "-o"], f"ok !/cred/{NOBODY}/{NOBODY}/"),   # no -u: everyone the mode lets in
    ([], "connect-failed EACCES"),                     # 0700: others cannot even connect
], ids=["mode-0777", "mode-0700"])
def test_without_u_the_socket_mode_decides(sbusd_process, public_dir, flags, expected):
    sock = public_dir / "bus.socket"
    sbusd_process("-f", "-a", str(sock), *flags).ready()
    assert as_nobody(str(sock)).startswith(expected)


def test_reuse_never_replaces_a_socket_a_broker_is_listening_on(tmp_path):
    path = str(tmp_path / "live.socket")
    first = subprocess.Popen([SBUSD, "-f", "-a", path], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    first.stdout.read()
    try:
        second = subprocess.run([SBUSD, "-f", "-r", "-a", path], capture_output=True, timeout=10)
        assert second.returncode != 0
        assert b"in use" in second.stderr
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(5)
            s.connect(path)                 # still the first broker's socket
            s.send(b"CMSG !/cred/whoami")
            assert s.recv(200).startswith(b"CMSG !/cred/whoami\0")
    finally:
        first.terminate()
        assert first.wait(10) == 0
