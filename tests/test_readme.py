"""README's examples run as written: its Python client example, its
request/reply and shared-queue command lines, each taken from README.md
itself and run by sh or python against a real sbusd, with SBUS_ADDRESS set
as `make run` tells a reader to set it."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from sbus import Client
from sbus.client.private import PrivateInbox
from sbus.queue import wire

from support import BIN, ROOT, QueueService, StoreProcess

TIMEOUT = 20.0


def section(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def blocks(heading: str, lang: str) -> list:
    return re.findall(rf"```{lang}\n(.*?)```", section(heading), re.S)


@pytest.fixture
def env(start_broker):
    broker = start_broker()
    return {**os.environ, "SBUS_ADDRESS": broker.address,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def sh(line: str, env: dict, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", line], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, **kwargs)


def background(line: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", f"exec {line}"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def test_the_client_library_example(env, tmp_path):
    example = blocks("The client library", "python")[0]
    assert "/run/sbus.socket\")" not in example     # the reader's bus, not a fixed path
    # From a folder of the reader's own, with the Python that has sbus.
    r = subprocess.run([sys.executable, "-c", example], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    printed = r.stdout.splitlines()
    shown = re.findall(r"print\(.*?\)\s*# (.*)", example)
    assert printed[0] == shown[0] == "news/today b'hello'"
    assert re.fullmatch(r"!/cred/\d+/\d+/\d+", printed[1])
    assert printed[1] == f"!/cred/{os.getgid()}/{os.getuid()}/{printed[1].split('/')[-1]}"
    assert re.fullmatch(r"!/cred/\d+/\d+/\d+ \(GID/UID/PID\)", shown[1])


def test_the_request_reply_example_prints_6(env):
    serve_line, request_line = blocks("Requests and replies", "sh")[0].strip().splitlines()
    assert "# prints 6" in request_line
    server = background(serve_line, env)
    try:
        waited = sh(f"sbus ready serve 'calc/' -W {TIMEOUT:g}", env)
        assert waited.returncode == 0, waited.stderr
        r = sh(request_line, env)
        assert (r.returncode, r.stdout, r.stderr) == (0, "6\n", "")
    finally:
        assert "Traceback" not in stop(server)


def test_the_is_it_serving_example_of_docs_requests_prints_6(env, tmp_path):
    text = (ROOT / "docs" / "requests.md").read_text()
    example = re.findall(r"```sh\n(.*?)```", text[text.index("## Is it serving?"):], re.S)[0]
    assert "sbus ready serve" in example and "# prints 6" in example
    # As a reader runs it: one shell, the server in the background (so it
    # keeps the shell's output open: files, not pipes), in a session of its
    # own so that the server can be stopped afterwards.
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(["sh", "-c", example], env=env, stdin=subprocess.DEVNULL,
                                stdout=o, stderr=e, start_new_session=True)
    try:
        assert proc.wait(timeout=TIMEOUT * 2) == 0, err.read_text()
        assert out.read_text() == "6\n", err.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)


def test_a_served_command_that_only_complains_sends_an_error_reply(env):
    # What the example's first version did: bc, given no final newline,
    # says "syntax error" on stderr and exits 0; that is no answer.
    server = background("sbus serve 'calc/' -- sh -c 'cat >/dev/null; echo no answer >&2'", env)
    try:
        deadline = time.monotonic() + TIMEOUT
        while (r := sh("sbus request -W 0.5 calc/sum '1 2 3'", env)).returncode == 3:
            assert time.monotonic() < deadline, "sbus serve never answered"
        assert (r.returncode, r.stdout) == (1, "")
        assert r.stderr == ("sbus request: the server failed: RuntimeError: sh wrote nothing "
                            "to stdout, only to stderr: no answer\n")
        # Nothing on either stream is an empty reply, as before.
    finally:
        stop(server)
    server = background("sbus serve 'calc/' -- true", env)
    try:
        deadline = time.monotonic() + TIMEOUT
        while (r := sh("sbus request -W 0.5 calc/sum x", env)).returncode == 3:
            assert time.monotonic() < deadline, "sbus serve never answered"
        assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    finally:
        stop(server)


def test_the_shared_queue_example(env):
    service_line, consumer_line, producer_line = [
        line.split("  #")[0].strip()
        for line in blocks("Shared queues", "sh")[0].strip().splitlines()]
    assert service_line.startswith("sbus queue ")
    service = background(service_line, env)
    consumer = background(consumer_line, env)
    try:
        wait_for_queue_service(env["SBUS_ADDRESS"], "jobs/")
        r = sh(producer_line, env)
        assert r.returncode == 0, r.stderr
        ready, _, _ = select.select([consumer.stdout], [], [], TIMEOUT)
        assert ready, "the consumer printed nothing"
        line = consumer.stdout.readline()
        assert json.loads(line) == {"type": "msg", "key": "jobs/resize", "payload": "img-42.png"}
    finally:
        stop(consumer)
        stop(service)


def wait_for_queue_service(address: str, pattern: str) -> None:
    """Until the service for ``pattern`` answers a state request (docs/queues.md)."""
    with Client(address) as bus:
        inbox = PrivateInbox(bus.whoami(timeout=10), "queue")
        bus.subscribe(inbox.pattern)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            bus.publish(wire.STATE_KEY, wire.pack_state_request(inbox.prefix, pattern))
            try:
                bus.receive(timeout=0.5)
                return
            except TimeoutError:
                pass
        raise AssertionError(f"no queue service for {pattern!r}")


def test_import_sbus_from_a_source_folder_without_the_compiled_core_says_so(tmp_path):
    # A copy of the sources, as a clone is before make build, found first on sys.path.
    for path in (ROOT / "sbus").rglob("*.py"):
        target = tmp_path / "sbus" / path.relative_to(ROOT / "sbus")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    r = subprocess.run([sys.executable, "-c", "import sbus; sbus.Client"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1] == (
        f"ImportError: sbus's compiled core (sbus._core.batch) is not built in "
        f"{tmp_path / 'sbus'}: this is sbus's source folder, not an installed sbus; build it "
        "(make build, then use .venv/bin/python) or run Python from elsewhere")


def test_the_basic_calls_page_of_docs_clients(env, tmp_path):
    text = (ROOT / "docs" / "clients.md").read_text()
    page = text[text.index("## The basic calls on one page"):]
    example = re.findall(r"```python\n(.*?)```", page, re.S)[0]
    address = env["SBUS_ADDRESS"]
    queue = QueueService.start(tmp_path, address, "jobs/")
    StoreProcess(tmp_path, address, tmp_path / "log", ["sensors/"],
                 "--stats-interval", "0").ready()
    try:
        r = subprocess.run([sys.executable, "-c", example], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    finally:
        queue.stop()
        StoreProcess.stop_all()
    assert r.returncode == 0, r.stderr
    shown = re.findall(r"print\(.*?\)\s*# (.*)", example)
    assert r.stdout.splitlines() == shown
