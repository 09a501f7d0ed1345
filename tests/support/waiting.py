"""Waiting for a condition or a log record, never for a fixed time."""
from __future__ import annotations

import json
import select
import time
from pathlib import Path


def wait_until(predicate, timeout=60.0, what="condition", interval=0.02, fail=True):
    """The first truthy value of ``predicate()``, polled every ``interval``
    seconds. At ``timeout``: AssertionError naming ``what``, or with
    ``fail=False`` the last (falsy) value, for callers that report first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            if not fail:
                return value
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def readable(fd, timeout: float) -> bool:
    """Whether ``fd`` (or an object with fileno()) becomes readable within
    ``timeout`` seconds. poll(2), not select(2): a test process holding many
    connections has descriptors past select's 1024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def read_records(log_path: Path) -> list:
    """The complete JSON records in a log file; a torn last line (the broker
    is mid-write) is skipped."""
    try:
        text = Path(log_path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def wait_for_record(log_path: Path, event: str, predicate=lambda r: True, timeout=5.0,
                    since=0) -> dict:
    """The first ``event`` record matching ``predicate`` among the log's
    records from index ``since`` on (a mark taken with ``len(records)``)."""
    def found():
        for r in read_records(log_path)[since:]:
            if r.get("event") == event and predicate(r):
                return r
        return None
    try:
        return wait_until(found, timeout, interval=0.01)
    except AssertionError:
        seen = [r.get("event") for r in read_records(log_path)[since:]]
        raise AssertionError(f"no {event!r} record matching within {timeout}s in {log_path}; "
                             f"saw {seen}") from None
