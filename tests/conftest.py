"""Shared fixtures: real ``sbusd`` processes (helpers live in tests/support) and a Spark session;
and how the suite shares the machine when pytest-xdist runs it over workers (``make test``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from support import BACKENDS, Sbusd, Started, spawn_children
from support.report import PENDING
from support.systemd import sandbox_command

# dist and dependency_wheels, for the release's test modules.
pytest_plugins = ("support.release_fixtures", "support.queue_fixtures")

# ---- running over workers ------------------------------------------------------
#
# ``make test`` hands whole modules to its workers (``--dist loadscope``; the
# Spark modules as one, see SPARK_MODULES), so a module's fixtures (a compiled
# C client, a broker, a Spark session) are made once, by one worker. Then it
# runs the tests marked ``alone`` (they time a start-up or a deadline, which
# another worker's load would stretch) in a second run, one at a time.

# The modules that take longest (pytest --durations), longest first. Workers take
# modules in collection order, so these start first rather than last, when one
# of them would run on while the other workers idle.
SLOW_MODULES = (
    # The Spark unit first (see SPARK_MODULES): the longest chain on one worker.
    "test_analytics_cluster.py", "test_analytics_dataset.py", "test_analytics_daytables.py",
    "test_analytics.py", "test_make_run.py", "test_queue.py", "test_analytics_tablefiles.py",
    # Then, in turn, a module that keeps the CPU busy (the release's installs,
    # `make test` compiled it before pytest; the notebook's JVM) and one that
    # mostly waits out a slow reader or a deadline, so that while two workers
    # compute the third leaves them the cores.
    "test_wheel_sdist.py", "test_flood.py", "test_wheel_source.py", "test_tool_waits.py",
    "test_notebook.py", "test_hierarchy.py", "test_wheel_install.py", "test_soak.py",
    "test_wheel.py", "test_properties.py", "test_upgrade.py", "test_fuzz.py",
    "test_client_spec.py", "test_tool.py", "test_sbusd_cli.py",
    "test_bridge.py", "test_protocol.py", "test_compat.py",
)


# The modules whose tests use the session's `spark` fixture run as one unit of
# work, on one worker, so one JVM serves them all: a Spark session costs some
# 20 CPU-s to start and warm. Every other module is a unit of its own, as
# --dist loadscope makes it.
SPARK_MODULES = (
    "test_analytics_cluster.py", "test_analytics_dataset.py", "test_analytics_daytables.py",
    "test_analytics.py", "test_make_run.py", "test_queue.py", "test_analytics_tablefiles.py",
)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndSpark(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            if Path(nodeid.split("::", 1)[0]).name in SPARK_MODULES:
                return "spark"
            return super()._split_scope(nodeid)

    return ModulesAndSpark(config, log) if config.getvalue("dist") == "loadscope" else None


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(SLOW_MODULES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    strays = sorted({item.path.name for item in items if item.path.name not in SPARK_MODULES
                     and "spark" in getattr(item, "fixturenames", ())})
    if strays:
        raise pytest.UsageError(f"tests/conftest.py: add {', '.join(strays)} to SPARK_MODULES "
                                "(its tests use the spark fixture)")


# A worker's support.report_line figures travel with a test's report (a module
# fixture's too: it ends in the teardown of the module's last test), and the
# controller writes them.
_REPORT_LINES = "sbus_report_lines"
_config = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if PENDING:
        outcome.get_result().user_properties.append((_REPORT_LINES, list(PENDING)))
        PENDING.clear()


def pytest_configure(config):
    global _config
    _config = config
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # A worker's environment says COLUMNS=80 and LINES=24, and curses (sbus
        # top) believes them over the pty a test gives it: drop them, as a
        # run without workers has none.
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    tr = _config.pluginmanager.getplugin("terminalreporter")
    for name, value in report.user_properties:
        if name == _REPORT_LINES and tr is not None:
            for line in value:
                tr.write_line(line)


# ---- brokers ------------------------------------------------------------------

@pytest.fixture
def cleanup():
    """``cleanup(thing)``: thing is stopped (or killed) at the test's end,
    whatever happened, the last started first."""
    started = []
    yield started.append
    for thing in reversed(started):
        (thing.stop if hasattr(thing, "stop") else thing.kill)()


@pytest.fixture
def start_broker(tmp_path):
    """Factory: ``start_broker(*args, backend=..., address=..., log_level=...)``
    starts ``sbusd -f`` (``Sbusd.foreground``); it is stopped at teardown."""
    started = Started()

    def start(*args, **kwargs):
        return started.add(Sbusd.foreground(tmp_path, *args, **kwargs))

    yield start
    started.end()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def broker(start_broker, backend):
    """A broker with default settings, once per event-loop backend."""
    return start_broker(backend=backend)


@pytest.fixture
def bus(start_broker):
    """A broker with default settings on the default backend, for what runs on
    top of it (services, clients); a module whose bus differs (world-reachable,
    with a policy, shared) says so in its own fixture."""
    return start_broker()


@pytest.fixture
def spawn():
    """Factory for second-user processes (support.Child); killed at teardown."""
    yield from spawn_children()


@pytest.fixture
def open_broker(tmp_path):
    """Factory: sbusd -f -o ARGS on a socket in a world-reachable directory."""
    started = Started()

    def start(*args):
        return started.add(Sbusd.foreground(tmp_path, "-o", "--stats-interval", "0.2", *args,
                                            address=started.public_dir() / "sbus.socket"))

    yield start
    started.end()


@pytest.fixture(scope="session")
def spark():
    """One local Spark session for every analytics test file."""
    pytest.importorskip("pyspark", reason="needs the extra: pip install 'pysbus[analytics]'")
    from pyspark.sql import SparkSession

    from sbus.analytics import spark_session

    # A session something else started is not this fixture's to stop.
    owned = SparkSession.getActiveSession() is None

    session = spark_session("local[1]", app_name="sbus-tests", conf={
        "spark.sql.shuffle.partitions": "1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": "1g",
        # Tiny inputs: skip adaptive re-planning, whole-stage code generation and
        # the JVM's optimising compiler, whose fixed costs dominate here and
        # change no result.
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.codegen.wholeStage": "false",
        "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
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
