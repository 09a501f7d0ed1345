"""One wrapper for a running ``sbus store`` process."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from .procfs import end_process
from .sbusd import SBUS
from .waiting import read_records, wait_for_record


class StoreProcess:
    """``sbus -a ADDRESS store --dir DIRECTORY --record P ... ARGS``, logging
    JSON to its own file in ``workdir``; ``ready()`` waits for store_start."""

    _seq = 0
    every: list = []        # every one started, for fixtures to stop what a test left running

    def __init__(self, workdir: Path, address: str, directory, patterns, *args,
                 log_level="debug"):
        StoreProcess._seq += 1
        self.workdir = Path(workdir)
        self.address = address
        self.directory = Path(directory)
        self.args = list(args)
        self.patterns = list(patterns)
        self.log_path = self.workdir / f"store-{StoreProcess._seq}.log"
        self.stderr_path = self.log_path.with_suffix(".stderr")
        argv = [SBUS, "-a", address, "store", "--dir", str(directory)]
        for p in self.patterns:
            argv += ["--record", p]
        argv += [*self.args, "--log-format", "json", "--log-file", str(self.log_path),
                 "--log-level", log_level]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err)
        StoreProcess.every.append(self)

    @classmethod
    def stop_all(cls) -> None:
        """Stop every store still running (restarted ones included)."""
        while cls.every:
            s = cls.every.pop()
            if s.proc.poll() is None:
                s.stop()

    def ready(self, timeout=20.0) -> "StoreProcess":
        try:
            self.wait_for_event("store_start", timeout)
        except AssertionError:
            raise AssertionError(f"store not ready: {self.stderr_path.read_text()}") from None
        return self

    def restart(self, *args) -> "StoreProcess":
        """A new store process on the same directory (this one must have ended)."""
        return StoreProcess(self.workdir, self.address, self.directory, self.patterns,
                            *(args or self.args)).ready()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout=10.0) -> int:
        return end_process(self.proc, signal.SIGTERM, timeout)

    def records(self) -> list:
        return read_records(self.log_path)

    def events(self, name: str) -> list:
        return [r for r in self.records() if r.get("event") == name]

    def wait_for_event(self, name: str, timeout=10.0, predicate=lambda r: True, since=0) -> dict:
        return wait_for_record(self.log_path, name, predicate, timeout, since)
