"""One wrapper for a running ``sbus store`` process."""
from __future__ import annotations

from pathlib import Path

from .logged import LoggedProcess
from .sbusd import SBUS


class StoreProcess(LoggedProcess):
    """``sbus -a ADDRESS store --dir DIRECTORY --record P ... ARGS``, logging
    JSON to its own file in ``workdir``; ``ready()`` waits for store_start."""

    every: list = []        # every one started, for fixtures to stop what a test left running

    def __init__(self, workdir: Path, address: str, directory, patterns, *args,
                 log_level="debug"):
        self.address = address
        self.directory = Path(directory)
        self.args = list(args)
        self.patterns = list(patterns)
        argv = [SBUS, "-a", address, "store", "--dir", str(directory)]
        for p in self.patterns:
            argv += ["--record", p]
        super().__init__(workdir, "store", [*argv, *self.args], log_level=log_level)
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

    def kill9(self) -> None:
        """SIGKILL, as a crash would end it."""
        self.kill()
