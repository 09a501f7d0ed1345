"""Fixtures that start real ``sbusd`` processes and talk to them over real sockets."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SBUSD = str(BIN / "sbusd")
SBUS = str(BIN / "sbus")
BACKENDS = ("epoll", "select")


class BrokerProcess:
    """A running ``sbusd -f``; ``stop()`` (also called at teardown) ends it."""

    def __init__(self, workdir: Path, args=(), *, backend="epoll", address=None,
                 log_level="debug", env=None, wait=True, extra_fds=()):
        self.workdir = workdir
        self.address = address or str(workdir / "sbus.socket")
        self.log_path = workdir / f"sbusd-{time.monotonic_ns()}.log"
        self.stderr_path = self.log_path.with_suffix(".stderr")
        argv = [SBUSD, "-f", "-a", self.address, "--backend", backend,
                "--log-format", "json", "--log-file", str(self.log_path),
                "--log-level", log_level, *args]
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr,
            env={**os.environ, **(env or {})}, pass_fds=extra_fds)
        self.stdout = b""
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout=10.0):
        """Read stdout to EOF: sbusd closes it once it listens."""
        deadline = time.monotonic() + timeout
        os.set_blocking(self.proc.stdout.fileno(), False)
        while time.monotonic() < deadline:
            try:
                chunk = self.proc.stdout.read()
            except BlockingIOError:
                chunk = None
            if chunk == b"":
                return self
            if chunk:
                self.stdout += chunk
            if self.proc.poll() is not None and chunk is None:
                break
            time.sleep(0.005)
        raise RuntimeError(f"sbusd did not become ready: rc={self.proc.poll()} "
                           f"stderr={self.stderr_text()!r}")

    def connect(self, timeout=5.0) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(timeout)
        s.connect(self.address)
        return s

    def stop(self, sig=signal.SIGTERM, timeout=10.0):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()
        return self.proc.returncode

    def stderr_text(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def records(self) -> list:
        """Every JSON log record written so far."""
        if not self.log_path.exists():
            return []
        out = []
        text = self.log_path.read_text()
        if not text.endswith("\n"):
            text = text[:text.rfind("\n") + 1]   # the broker is mid-line: skip it
        for line in text.splitlines():
            if line.strip():
                out.append(json.loads(line))
        return out

    def events(self, name: str) -> list:
        return [r for r in self.records() if r.get("event") == name]

    def wait_for_event(self, name: str, timeout=5.0, predicate=lambda r: True) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r in self.events(name):
                if predicate(r):
                    return r
            time.sleep(0.02)
        raise AssertionError(f"no {name!r} event matching within {timeout}s; "
                             f"saw {[r.get('event') for r in self.records()]}")

    def pid(self) -> int:
        return self.proc.pid


@pytest.fixture
def start_broker(tmp_path):
    """Factory: ``start_broker(*args, backend=...)`` starts an sbusd and stops it at teardown."""
    started = []

    def start(*args, **kwargs):
        b = BrokerProcess(tmp_path, args, **kwargs)
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop(signal.SIGKILL if b.proc.poll() is None and False else signal.SIGTERM)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def broker(start_broker, backend):
    """A broker with default settings, once per event-loop backend."""
    return start_broker(backend=backend)


def recv_or_none(sock: socket.socket, timeout=0.2, size=1 << 20):
    """The next packet, or None if none arrives within ``timeout``."""
    old = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        return sock.recv(size)
    except (socket.timeout, BlockingIOError):
        return None
    finally:
        sock.settimeout(old)


def fd_count(pid: int) -> int:
    """How many file descriptors a process holds."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def report_line(request, text: str) -> None:
    """Write figures to the terminal even under -q and output capture."""
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if tr is None:
        return
    if capman is not None:
        with capman.global_and_fixture_disabled():
            tr.write_line(text)
    else:
        tr.write_line(text)
