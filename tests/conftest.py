"""Fixtures that start real ``sbusd`` processes (helpers live in tests/support)."""
from __future__ import annotations

import shutil

import pytest

from support import BACKENDS, Sbusd, make_public_dir, spawn_children


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


@pytest.fixture
def spawn():
    """Factory for second-user processes (support.Child); killed at teardown."""
    yield from spawn_children()


@pytest.fixture
def open_broker(tmp_path):
    """Factory: sbusd -f -o ARGS on a socket in a world-reachable directory."""
    started, dirs = [], []

    def start(*args):
        d = make_public_dir()
        dirs.append(d)
        b = Sbusd.foreground(tmp_path, "-o", "--stats-interval", "0.2", *args,
                             address=d / "sbus.socket")
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
