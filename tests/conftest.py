"""Fixtures that start real ``sbusd`` processes (helpers live in tests/support)."""
from __future__ import annotations

import pytest

from support import BACKENDS, Sbusd


@pytest.fixture
def start_broker(tmp_path):
    """Factory: ``start_broker(*args, backend=..., address=..., log_level=...)``
    starts ``sbusd -f`` (``Sbusd.foreground``); it is stopped at teardown."""
    started = []

    def start(*args, **kwargs):
        b = Sbusd.foreground(tmp_path, *args, **kwargs)
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def broker(start_broker, backend):
    """A broker with default settings, once per event-loop backend."""
    return start_broker(backend=backend)
