"""One wrapper for a running ``sbus queue`` service process, and one for its
consumer worker processes."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from sbus import Client
from sbus.client.private import PrivateInbox
from sbus.queue import wire

from .logged import LoggedProcess
from .sbusd import SBUS
from .waiting import wait_until
from .worker import start_worker

TIMEOUT = 20.0


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


def wait_state(q, predicate, what, timeout=TIMEOUT):
    """The service's state once ``predicate`` holds for it."""
    def matching():
        state = q.state()
        return state if predicate(state) else None
    return wait_until(matching, timeout, what, interval=0.05)


class Consumers:
    """Consumer worker processes (tests/workers/consumer.py) and the jobs each printed."""

    def __init__(self, address):
        self.address = address
        self.procs = []
        self.jobs = []      # per consumer: the JSON lines it printed so far
        self._lock = threading.Lock()

    def start(self, prefetch, mode, pattern="jobs/") -> int:
        proc = start_worker("consumer", self.address, pattern, prefetch, mode)
        index = len(self.procs)
        self.procs.append(proc)
        self.jobs.append([])
        threading.Thread(target=self._read, args=(proc, index), daemon=True).start()
        return index

    def _read(self, proc, index):
        for line in proc.stdout:
            with self._lock:
                self.jobs[index].append(json.loads(line))

    def all(self) -> list:
        with self._lock:
            return [j for jobs in self.jobs for j in jobs]

    def printed(self, n: int, timeout: float = TIMEOUT) -> list:
        """All jobs once ``n`` are printed. A job is acked after its line is
        written, but the line reaches us on a reader thread: the service's
        ack count can run ahead of what ``all`` holds."""
        wait_until(lambda: sum(self.counts()) >= n, timeout, f"{n} jobs printed")
        return self.all()

    def counts(self) -> list:
        with self._lock:
            return [len(j) for j in self.jobs]

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
