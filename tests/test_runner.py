"""sbus.runner, the one way every service runs: a handler only notes the
signal and wakes the loop; the loop acts between turns (SIGHUP reopens the
log, SIGTERM and SIGINT stop). Real signals to this process, real files."""
from __future__ import annotations

import argparse
import os
import re
import select
import signal
import sys
from pathlib import Path

import sbus
from sbus.log import ReopenableStream
from sbus.runner import Runner, add_log_options


def readable(fd: int, timeout: float = 1.0) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def test_a_signal_is_noted_and_acted_on_between_turns(tmp_path):
    path = tmp_path / "service.log"
    stream = ReopenableStream(str(path), sys.stderr)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    with Runner(stream) as runner:
        stream.write("before\n")
        stream.flush()
        path.rename(tmp_path / "service.log.1")
        os.kill(os.getpid(), signal.SIGHUP)
        assert readable(runner.fileno()), "the handler wakes the loop"
        assert not path.exists(), "nothing reopened inside the handler"
        assert runner.between_turns() is False
        assert path.exists()
        stream.write("after\n")
        stream.flush()
        assert path.read_text() == "after\n"
        assert not readable(runner.fileno(), 0), "taken: the loop does not spin"

        os.kill(os.getpid(), signal.SIGTERM)
        assert readable(runner.fileno())
        assert runner.between_turns() is True
        assert runner.stop_signal == signal.SIGTERM
    # The handlers it replaced are back.
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_the_log_options_are_declared_once():
    p = argparse.ArgumentParser()
    add_log_options(p)
    args = p.parse_args(["--log-format", "json", "--log-level", "debug", "--log-file", "x"])
    assert (args.log_format, args.log_level, args.log_file) == ("json", "debug", "x")
    assert p.parse_args([]).log_level == "info"


def test_signal_handlers_are_installed_by_the_runner_alone():
    """Every handler in sbus is sbus.runner's, which only notes. The other:
    sbusd ignores SIGUSR2 until its loop runs (signal.SIG_IGN). A handler
    added anywhere else fails here (``sbus serve`` had asyncio's, and runs
    as the other asyncio services now): it belongs in sbus.runner."""
    root = Path(sbus.__file__).parent
    installing = re.compile(r"signal\.signal\(|add_signal_handler\(")
    found = {str(path.relative_to(root.parent)) for ext in ("*.py", "*.pyx")
             for path in root.rglob(ext) if installing.search(path.read_text())}
    assert found == {"sbus/runner.py", "sbus/sbusd/main.py"}
    main = (root / "sbusd" / "main.py").read_text()
    assert installing.findall(main) == ["signal.signal("]
    assert "signal.signal(signal.SIGUSR2, signal.SIG_IGN)" in main
