"""One wrapper for a running ``sbus queue`` service process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from sbus import Client
from sbus.client.private import PrivateInbox
from sbus.queue import wire

from .procfs import end_process
from .sbusd import SBUS
from .waiting import read_records, wait_for_record


class QueueService:
    """``sbus -a ADDRESS queue PATTERN ARGS...`` logging JSON (debug) to a file in
    ``workdir``; ``start`` returns once its ``queue_start`` record is written."""

    _seq = 0

    def __init__(self, workdir: Path, address: str, pattern: str, *args: str):
        QueueService._seq += 1
        self.address = address
        self.pattern = pattern
        self.log_path = Path(workdir) / f"queue-{QueueService._seq}.log"
        self.stderr_path = self.log_path.with_suffix(".stderr")
        argv = [SBUS, "-a", address, "queue", pattern, *args, "--log-format", "json",
                "--log-file", str(self.log_path), "--log-level", "debug"]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err,
                                         env=dict(os.environ))

    @classmethod
    def start(cls, workdir: Path, address: str, pattern: str, *args: str,
              timeout: float = 20.0) -> "QueueService":
        q = cls(workdir, address, pattern, *args)
        try:
            q.start_record = q.wait_for_event("queue_start", timeout)
        except AssertionError:
            q.kill()
            raise AssertionError(f"sbus queue did not start: {q.stderr_text()}") from None
        return q

    @property
    def pid(self) -> int:
        return self.proc.pid

    def state(self, timeout: float = 10.0) -> dict:
        """The service's answer to ``sbus/queue/state``, through a fresh client."""
        with Client(self.address) as bus:
            inbox = PrivateInbox(bus.whoami(timeout=timeout), "state")
            bus.subscribe(inbox.pattern)
            bus.publish(wire.STATE_KEY, wire.pack_state_request(inbox.prefix, self.pattern))
            deadline = time.monotonic() + timeout
            while True:
                m = bus.receive(timeout=max(0.0, deadline - time.monotonic()))
                if inbox.suffix_of(m.key) == wire.STATE.encode():
                    return json.loads(m.payload)

    def stop(self, sig=signal.SIGTERM, timeout=10.0) -> int:
        return end_process(self.proc, sig, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def records(self) -> list:
        return read_records(self.log_path)

    def events(self, name: str) -> list:
        return [r for r in self.records() if r.get("event") == name]

    def wait_for_event(self, name: str, timeout=10.0, predicate=lambda r: True, since=0) -> dict:
        return wait_for_record(self.log_path, name, predicate, timeout, since)
