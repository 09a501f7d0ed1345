"""Shared fixtures: real ``sbusd`` processes (helpers live in tests/support) and a Spark session;
and how the suite shares the machine when pytest-xdist runs it over workers (``make test``)."""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from support import BACKENDS, Sbusd, make_public_dir, spawn_children
from support.systemd import sandbox_command

# ---- running over workers ------------------------------------------------------
#
# A test marked ``alone`` measures time or CPU (a start-up within a second, a
# broker's CPU share), so another worker's load would fail it: it runs while no
# other test runs. Two lock files shared by the workers make a readers-writer
# lock that favours the writer: every test holds the room shared, an ``alone``
# test holds it exclusive; whoever wants the room first passes the turnstile,
# and an ``alone`` test keeps the turnstile while it waits, so the others let
# the room empty instead of starving it.
#
# PySpark's tests run on one worker, one after the other (``--dist loadgroup``),
# so that one JVM serves them all: a session per worker would start one each.


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("spark") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("spark"))


def _locks(config):
    """The worker's (turnstile, room) files, opened once; None outside xdist."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    locks = getattr(config, "_sbus_locks", None)
    if locks is None:
        # Every worker's basetemp is a directory of the run's one basetemp.
        shared = Path(config._tmp_path_factory.getbasetemp()).parent
        locks = tuple(open(shared / f"sbus-{name}.lock", "a+") for name in ("turnstile", "room"))
        config._sbus_locks = locks
    return locks


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown inside the lock (and outside pytest-timeout's
    clock, which starts in a wrapper inside this one)."""
    locks = _locks(item.config)
    if locks is None:
        yield
        return
    turnstile, room = locks
    alone = item.get_closest_marker("alone") is not None
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    finally:
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(room, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)


# ---- brokers ------------------------------------------------------------------

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


@pytest.fixture(scope="session")
def spark():
    """One local Spark session for every analytics test file."""
    pytest.importorskip("pyspark", reason="needs the extra: pip install 'pysbus[analytics]'")
    from pyspark.sql import SparkSession

    from sbus.analytics import spark_session

    # A session something else started is not this fixture's to stop.
    owned = SparkSession.getActiveSession() is None

    session = spark_session("local[2]", app_name="sbus-tests", conf={
        "spark.sql.shuffle.partitions": "2",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": "1g",
        # Tiny inputs: skip adaptive re-planning, whole-stage code generation and
        # the JVM's optimising compiler, whose fixed costs dominate here and
        # change no result.
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.codegen.wholeStage": "false",
        "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
    })
    session.sparkContext.setLogLevel("ERROR")
    yield session
    if owned:
        session.stop()


@pytest.fixture(scope="module")
def sandbox():
    """argv prefix running a program in tools/systemd/sbusd.service's seccomp
    sandbox, built as systemd builds it (support.systemd.SANDBOX)."""
    return sandbox_command()
