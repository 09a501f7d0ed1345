"""The fixtures of the queue's test modules (test_queue, test_queue_puts),
loaded by conftest.py's ``pytest_plugins``."""
from __future__ import annotations

import pytest

from .queuesvc import Consumers, QueueService
from .started import Started

PATTERN = "jobs/"   # what the queue serves unless a test names another pattern


@pytest.fixture
def queues(tmp_path):
    """Factory: ``queues(address, PATTERN, ARGS...)`` starts ``sbus queue``; stopped at teardown."""
    started = Started()

    def start(address, pattern=PATTERN, *args):
        return started.add(QueueService.start(tmp_path, address, pattern, *args))

    yield start
    started.end()


@pytest.fixture
def consumers(bus):
    c = Consumers(bus.address)
    yield c
    c.stop()
