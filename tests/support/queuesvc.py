"""One wrapper for a running ``sbus queue`` service process."""
from __future__ import annotations

import json
import time
from pathlib import Path

from sbus import Client
from sbus.client.private import PrivateInbox
from sbus.queue import wire

from .logged import LoggedProcess
from .sbusd import SBUS


class QueueService(LoggedProcess):
    """``sbus -a ADDRESS queue PATTERN ARGS...`` logging JSON (debug) to a file in
    ``workdir``; ``start`` returns once its ``queue_start`` record is written."""

    def __init__(self, workdir: Path, address: str, pattern: str, *args: str):
        self.address = address
        self.pattern = pattern
        super().__init__(workdir, "queue", [SBUS, "-a", address, "queue", pattern, *args])

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
