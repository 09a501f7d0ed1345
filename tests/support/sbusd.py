"""One wrapper for a running sbusd process, and the paths of the installed commands."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .conn import Conn
from .procfs import end_process
from .waiting import read_records, readable, wait_for_record

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
BIN = Path(sys.executable).parent
SBUSD = str(BIN / "sbusd")
SBUS = str(BIN / "sbus")
BACKENDS = ("epoll", "select", "io_uring")


def read_to_eof(pipe, timeout=5.0) -> bytes:
    """Everything written to ``pipe`` until EOF; fail if EOF takes longer."""
    fd = pipe.fileno()
    data = b""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"stdout not closed within {timeout}s (got {data!r})")
        if readable(fd, remaining):
            chunk = os.read(fd, 65536)
            if not chunk:
                return data
            data += chunk


class Sbusd:
    """``sbusd`` with exactly the given arguments, plus JSON logging at
    ``log_level`` to ``log_path`` (none with ``log_level=None``). stdout is a
    pipe: sbusd closes it once it listens, which ``ready()`` waits for.
    ``address`` is where ``connect()`` goes (the caller passed it in args);
    ``command`` is the broker's argv before the arguments (another build), and
    ``wrapper`` a command that runs it (it gets that argv)."""

    _seq = 0

    def __init__(self, workdir: Path, args=(), *, address=None, log_level="debug", env=None,
                 pass_fds=(), umask=-1, cwd=None, command=(SBUSD,), wrapper=()):
        Sbusd._seq += 1
        self.workdir = Path(workdir)
        self.address = address
        self.log_path = self.workdir / f"sbusd-{Sbusd._seq}.log"
        self.stderr_path = self.log_path.with_suffix(".stderr")
        argv = [*wrapper, *command, *args]
        if log_level is not None:
            argv += ["--log-format", "json", "--log-file", str(self.log_path),
                     "--log-level", log_level]
        self.started = time.monotonic()
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                env={**os.environ, **(env or {})}, pass_fds=pass_fds, umask=umask, cwd=cwd)
        self.stdout = b""
        self.ready_s = None

    @classmethod
    def foreground(cls, workdir: Path, *args, backend="epoll", address=None,
                   log_level="debug") -> "Sbusd":
        """``sbusd -f -a ADDRESS --backend BACKEND ARGS...``, once it listens."""
        address = str(address or Path(workdir) / "sbus.socket")
        return cls(workdir, ["-f", "-a", address, "--backend", backend, *args],
                   address=address, log_level=log_level).ready(timeout=10.0)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self, timeout=5.0) -> "Sbusd":
        """Wait for stdout to close (readiness); the broker must still run."""
        self.stdout = read_to_eof(self.proc.stdout, timeout)
        self.ready_s = time.monotonic() - self.started
        self.proc.stdout.close()
        if self.proc.poll() is not None:
            raise AssertionError(f"sbusd exited with {self.proc.returncode}: "
                                 f"{self.stderr_text()}")
        return self

    def connect(self, timeout=5.0) -> Conn:
        return Conn.to(self.address, timeout)

    def stats(self) -> dict:
        """Stats through a fresh connection (only while the bus is not
        blocked: a new client is not read while it is)."""
        with self.connect(timeout=30) as s:
            return s.stats()

    def wait(self, timeout=5.0) -> int:
        return self.proc.wait(timeout)

    def stop(self, sig=signal.SIGTERM, timeout=10.0) -> int:
        """Signal it and wait (SIGKILL after ``timeout``); its exit status."""
        return end_process(self.proc, sig, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    # -- its JSON log ---------------------------------------------------------

    def records(self) -> list:
        """Every complete JSON log record written so far."""
        return read_records(self.log_path)

    def events(self, name: str) -> list:
        return [r for r in self.records() if r.get("event") == name]

    def wait_for_event(self, name: str, timeout=5.0, predicate=lambda r: True, since=0) -> dict:
        """The first ``name`` record matching ``predicate`` (from record ``since`` on)."""
        return wait_for_record(self.log_path, name, predicate, timeout, since)
