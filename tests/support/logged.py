"""The base of every wrapper around a process that logs JSON to a file: sbusd,
``sbus store``, ``sbus queue``, ``sbus bridge``. One place starts it with its stderr in a
file, reads its records, waits for an event and ends it."""
from __future__ import annotations

import itertools
import signal
import subprocess
from pathlib import Path

from .procfs import end_process
from .waiting import read_records, wait_for_record

# One numbering for every wrapper: the log files of one test never collide.
_numbers = itertools.count(1)


class LoggedProcess:
    """``argv`` and JSON logging at ``log_level`` to ``NAME-N.log`` in
    ``workdir`` (no log options with ``log_level=None``), stdin from
    /dev/null, stderr in ``NAME-N.stderr``; ``popen`` goes to Popen (stdout
    is /dev/null unless it says otherwise)."""

    # The default of wait_for_event's timeout.
    event_timeout = 10.0

    def __init__(self, workdir: Path, name: str, argv, *, log_level="debug", **popen):
        self.workdir = Path(workdir)
        self.log_path = self.workdir / f"{name}-{next(_numbers)}.log"
        self.stderr_path = self.log_path.with_suffix(".stderr")
        argv = list(argv)
        if log_level is not None:
            argv += ["--log-format", "json", "--log-file", str(self.log_path), "--log-level", log_level]
        popen.setdefault("stdout", subprocess.DEVNULL)
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=err, **popen)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig=signal.SIGTERM, timeout=10.0) -> int:
        """Signal it and wait (SIGKILL after ``timeout``); its exit status."""
        return end_process(self.proc, sig, timeout)

    def kill(self) -> None:
        """SIGKILL it if it still runs, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def records(self) -> list:
        """Every complete JSON log record written so far."""
        return read_records(self.log_path)

    def events(self, name: str) -> list:
        return [r for r in self.records() if r.get("event") == name]

    def wait_for_event(self, name: str, timeout=None, predicate=lambda r: True, since=0) -> dict:
        """The first ``name`` record matching ``predicate`` (from record ``since`` on)."""
        return wait_for_record(self.log_path, name, predicate,
                               self.event_timeout if timeout is None else timeout, since)
