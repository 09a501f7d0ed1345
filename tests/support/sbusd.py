"""One wrapper for a running sbusd process, and the paths of the installed commands."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .conn import Conn
from .logged import LoggedProcess
from .waiting import readable

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


class Sbusd(LoggedProcess):
    """``sbusd`` with exactly the given arguments, plus JSON logging at
    ``log_level`` to ``log_path`` (none with ``log_level=None``). stdout is a
    pipe: sbusd closes it once it listens, which ``ready()`` waits for.
    ``address`` is where ``connect()`` goes (the caller passed it in args);
    ``command`` is the broker's argv before the arguments (another build), and
    ``wrapper`` a command that runs it (it gets that argv)."""

    event_timeout = 5.0

    def __init__(self, workdir: Path, args=(), *, address=None, log_level="debug", env=None,
                 pass_fds=(), umask=-1, cwd=None, command=(SBUSD,), wrapper=()):
        self.address = address
        self.started = time.monotonic()
        super().__init__(workdir, "sbusd", [*wrapper, *command, *args], log_level=log_level,
                         stdout=subprocess.PIPE, env={**os.environ, **(env or {})},
                         pass_fds=pass_fds, umask=umask, cwd=cwd)
        self.stdout = b""
        self.ready_s = None

    @classmethod
    def foreground(cls, workdir: Path, *args, backend="epoll", address=None,
                   log_level="debug") -> "Sbusd":
        """``sbusd -f -a ADDRESS --backend BACKEND ARGS...``, once it listens."""
        address = str(address or Path(workdir) / "sbus.socket")
        return cls(workdir, ["-f", "-a", address, "--backend", backend, *args],
                   address=address, log_level=log_level).ready(timeout=10.0)

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
