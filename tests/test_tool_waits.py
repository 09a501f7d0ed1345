"""Commands that wait for a service, or take a pattern, never wait in silence:
``sbus consume`` says when no queue service answers and gives up after -W
seconds, every command taking a pattern warns about other buses' wildcards
as ``sbus sub`` does, and a replay with no store running says to start
``sbus store``. Real sbusd,
real ``sbus`` processes."""
from __future__ import annotations

import os
import queue
import shlex
import subprocess
import threading
import time

import pytest

from sbus import Client
from sbus.cli.consume import NOTICE_AFTER
from sbus.queue.defaults import CLI_WAIT

from support import SBUS, QueueService, StoreProcess

TIMEOUT = 20.0


@pytest.fixture
def broker(start_broker):
    return start_broker()


class Running:
    """An ``sbus`` process whose stderr and stdout lines are read as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([SBUS, *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=dict(os.environ))
        self.err: queue.Queue = queue.Queue()
        self.out: queue.Queue = queue.Queue()
        for stream, lines in ((self.proc.stderr, self.err), (self.proc.stdout, self.out)):
            threading.Thread(target=self._read, args=(stream, lines), daemon=True).start()

    @staticmethod
    def _read(stream, lines: queue.Queue) -> None:
        for line in stream:
            lines.put(line.decode())
        lines.put(None)

    def line(self, lines: queue.Queue, timeout: float = TIMEOUT) -> str:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout} s") from None
        assert line is not None, "the stream ended"
        return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_consume_says_when_no_queue_service_answers_then_when_one_does(broker, tmp_path):
    consumer = Running("-a", broker.address, "consume", "-W", "0", "nosuchqueue/")
    service = None
    try:
        started = time.monotonic()
        said = consumer.line(consumer.err)
        assert NOTICE_AFTER <= time.monotonic() - started < NOTICE_AFTER + 5
        assert said == (
            "sbus: no queue service for 'nosuchqueue/' answered within 3 s (asked on "
            "sbus/queue/state); start one with: sbus queue nosuchqueue/  (the pattern must "
            "be the same, byte for byte); still waiting for it (Ctrl-C stops)\n")
        time.sleep(CLI_WAIT - NOTICE_AFTER + 1)      # -W 0: past the default, still waiting
        assert consumer.proc.poll() is None
        # Still waiting: the service it was told to start serves it.
        command = shlex.split(said.split("start one with: ")[1].split("  (")[0])
        assert command == ["sbus", "queue", "nosuchqueue/"]
        service = QueueService.start(tmp_path, broker.address, *command[2:])
        assert consumer.line(consumer.err) == (
            "sbus: the queue service for 'nosuchqueue/' answered; taking its jobs\n")
        with Client(broker.address) as producer:
            producer.publish("nosuchqueue/1", b"job one")
            producer.whoami(timeout=10)
        assert consumer.line(consumer.out) == "nosuchqueue/1\tjob one\n"
    finally:
        consumer.stop()
        if service is not None:
            service.stop()


def test_consume_gives_up_after_its_wait_with_a_hint(broker):
    started = time.monotonic()
    r = subprocess.run([SBUS, "-a", broker.address, "consume", "nosuchqueue/"],
                       capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert (r.returncode, r.stdout) == (1, "")
    assert CLI_WAIT <= took < CLI_WAIT + 10
    assert r.stderr.splitlines() == [
        "sbus: no queue service for 'nosuchqueue/' answered within 3 s (asked on "
        "sbus/queue/state); start one with: sbus queue nosuchqueue/  (the pattern must "
        "be the same, byte for byte); still waiting for it (gives up after 10 s, -W)",
        "sbus: no queue service for 'nosuchqueue/' answered within 10 s (asked on "
        "sbus/queue/state)",
        "  is sbus queue running? start one with: sbus queue nosuchqueue/ (the pattern must "
        "be the same, byte for byte), or wait longer with -W SECONDS (0: for ever)",
    ]
    r = subprocess.run([SBUS, "-a", broker.address, "consume", "-W", "1", "jobs/"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "answered within 1 s" in r.stderr and "still waiting" not in r.stderr


def test_consume_is_quiet_when_its_service_answers(broker, tmp_path):
    service = QueueService.start(tmp_path, broker.address, "jobs/")
    consumer = Running("-a", broker.address, "consume", "-n", "1", "jobs/")
    try:
        time.sleep(NOTICE_AFTER + 1)
        with Client(broker.address) as producer:
            producer.publish("jobs/a", b"x")
            producer.whoami(timeout=10)
        assert consumer.proc.wait(TIMEOUT) == 0
        assert consumer.line(consumer.out) == "jobs/a\tx\n"
        assert consumer.err.get(timeout=5) is None      # stderr ended with nothing said
    finally:
        consumer.stop()
        service.stop()


def warning_of(pattern: str, meant: str, does: str) -> str:
    return (f"sbus: warning: pattern {pattern!r} is MQTT's: sbus reads '#' and '+' literally; "
            f"{meant!r} {does}\n")


def test_every_command_that_takes_a_pattern_warns_about_other_buses_wildcards(
        broker, tmp_path):
    StoreProcess(tmp_path, broker.address, tmp_path / "log", ["sensors/"],
                 "--stats-interval", "0").ready()
    try:
        last = subprocess.run([SBUS, "-a", broker.address, "last", "sensors/+"],
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert last.returncode == 0 and last.stdout == ""
        assert last.stderr == warning_of("sensors/+", "sensors/*",
                                         "matches any one segment in place of each '*'")
        replay = subprocess.run([SBUS, "-a", broker.address, "replay", "sensors/#"],
                                capture_output=True, text=True, timeout=TIMEOUT)
        assert replay.returncode == 0
        assert replay.stderr == warning_of("sensors/#", "sensors/",
                                           "matches every key under sensors/")
    finally:
        StoreProcess.stop_all()
    for args, warning in (
            (["consume", "jobs/#"], warning_of("jobs/#", "jobs/", "matches every key under jobs/")),
            (["serve", "calc/+", "--", "cat"],
             warning_of("calc/+", "calc/*", "matches any one segment in place of each '*'")),
            (["queue", "work/#"], warning_of("work/#", "work/", "matches every key under work/"))):
        waiting = Running("-a", broker.address, *args)
        try:
            # Said at once, before any waiting.
            assert waiting.line(waiting.err, timeout=10) == warning
        finally:
            waiting.stop()


def test_replay_with_no_store_running_says_to_start_sbus_store(broker):
    for command in ("replay", "last"):
        r = subprocess.run([SBUS, "-a", broker.address, command, "sensors/"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1
        assert r.stderr.splitlines() == [
            "sbus: no answer from the store on 'sbus/store/request' within 10 s",
            "  is sbus store running? replay and last ask it: start one recording the keys, "
            "sbus store --dir DIR --record sensors/ (docs/store.md), or give its --request-key",
        ]


def test_a_request_nobody_serves_says_to_start_a_server(broker):
    r = subprocess.run([SBUS, "-a", broker.address, "request", "-W", "0.5", "calc/sum", "1 2"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert (r.returncode, r.stdout) == (3, "")
    assert r.stderr.splitlines() == [
        "sbus request: no reply to a request on 'calc/sum' within 0.5 s",
        "  is anything serving 'calc/sum'? start a server (sbus serve PATTERN -- COMMAND, or a "
        "client's serve()), or wait longer with -W SECONDS",
    ]
