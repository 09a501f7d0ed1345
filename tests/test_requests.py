"""Requests and replies between clients (docs/requests.md), with real sbusd, server and
asker processes."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time

import pytest

from sbus import Client
from sbus.aio import Client as AsyncClient
from sbus.client.protocol import Message
from sbus.client.requests import IncomingRequest, pack_reply, pack_request, parse_reply, parse_request
from sbus.errors import HandlerError, KeyRefusedError, MessageTooLargeError, RequestTimeoutError

from support import SBUS, TESTS, Conn, asroot, start_worker, worker_report

TIMEOUT = 20.0
PATTERN = "svc/"


@pytest.fixture
def server(bus):
    """A server process (tests/workers/server.py) on PATTERN, ready."""
    proc = start_worker("server", bus.address, PATTERN)
    assert proc.stdout.readline() == b"ready\n", proc.stderr.read().decode()
    yield proc
    proc.kill()
    proc.wait()


def test_many_concurrent_askers_each_get_their_own_replies(bus, server):
    askers = [start_worker("asker", bus.address, f"svc/{i % 3}", 50, f"a{i}") for i in range(8)]
    for i, proc in enumerate(askers):
        assert worker_report(proc, TIMEOUT) == {
            "replies": [f"svc/{i % 3} a{i}:{n}" for n in range(50)]}


def test_many_requests_in_flight_on_one_asyncio_client(bus, server):
    async def run():
        async with AsyncClient(bus.address) as c:
            return await asyncio.gather(*(c.request(f"svc/{i}", str(i), TIMEOUT)
                                          for i in range(300)))

    assert asyncio.run(run()) == [f"svc/{i} {i}".encode() for i in range(300)]


def test_an_asyncio_server_runs_async_handlers_at_once(bus):
    async def run():
        async with AsyncClient(bus.address) as served, AsyncClient(bus.address) as asker:
            running = []

            async def handler(request):
                running.append(request.payload)
                await asyncio.sleep(0.2)    # all requests must be in the handler together
                return b"done " + request.payload

            serving = asyncio.ensure_future(served.serve(PATTERN, handler, concurrency=10))
            await served.whoami()   # the broker has taken the SUB
            replies = await asyncio.gather(*(asker.request("svc/x", str(i), TIMEOUT)
                                             for i in range(10)))
            serving.cancel()
            return replies, len(running)

    replies, ran = asyncio.run(run())
    assert (replies, ran) == ([f"done {i}".encode() for i in range(10)], 10)


def test_messages_arriving_while_a_request_waits_are_kept_in_order(bus, server):
    with Client(bus.address) as c, Client(bus.address) as pub:
        c.subscribe("news/")
        c.whoami(timeout=TIMEOUT)
        for i in range(5):
            pub.publish("news/a", f"n{i}")
        pub.whoami(timeout=TIMEOUT)
        assert c.receive(timeout=TIMEOUT) == Message(b"news/a", b"n0")
        assert c.request("svc/q", "x", TIMEOUT) == b"svc/q x"
        assert [c.receive(timeout=TIMEOUT).payload for _ in range(4)] == [
            b"n1", b"n2", b"n3", b"n4"]
        assert c.pending == 0


def test_an_unserved_request_times_out_on_time(bus):
    with Client(bus.address) as c:
        start = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            c.request("nobody/home", "x", 0.5)
        assert time.monotonic() - start >= 0.5

    async def run():
        async with AsyncClient(bus.address) as c:
            start = time.monotonic()
            with pytest.raises(RequestTimeoutError):
                await c.request("nobody/home", "x", 0.5)
            return time.monotonic() - start

    assert asyncio.run(run()) >= 0.5


def test_a_handler_error_reaches_the_asker_and_the_server_goes_on(bus, server):
    with Client(bus.address) as c:
        with pytest.raises(HandlerError, match="^ValueError: asked to fail$"):
            c.request("svc/x", "fail", TIMEOUT)
        assert c.request("svc/x", "again", TIMEOUT) == b"svc/x again"

    async def run():
        async with AsyncClient(bus.address) as c:
            with pytest.raises(HandlerError, match="^ValueError: asked to fail$"):
                await c.request("svc/y", "fail", TIMEOUT)
            return await c.request("svc/y", "after", TIMEOUT)

    assert asyncio.run(run()) == b"svc/y after"


def test_a_reply_larger_than_a_packet_goes_as_chunks(bus):
    with Client(bus.address) as served, Client(bus.address) as asker:
        served.subscribe(PATTERN)
        served.whoami(timeout=TIMEOUT)
        # Asked by hand: one process plays both sides, so the asker cannot wait.
        asker_box = asker.whoami(timeout=TIMEOUT)
        reply_to = f"{asker_box}/reply/t/1"
        asker.subscribe(reply_to)
        asker.whoami(timeout=TIMEOUT)
        asker.publish("svc/big", pack_request(reply_to, b"x"))
        assert served.serve(PATTERN, lambda r: b"y" * (served.max_message + 1), count=1) == 1
        reply = asker.receive(timeout=TIMEOUT)     # whole again (docs/chunks.md)
        assert reply.key == reply_to.encode()
        assert parse_reply(reply.payload) == b"y" * (served.max_message + 1)


def test_requests_the_server_must_not_answer_are_ignored(bus):
    with Client(bus.address) as served, Client(bus.address) as raw:
        served.subscribe(PATTERN)
        served.whoami(timeout=TIMEOUT)
        box = served.whoami(timeout=TIMEOUT)
        for payload in (b"no header", b"REQ pub/lic/key\nx", b"REQ !/cred/1\nx",
                        b"REQ " + f"{box}/reply/x/1".encode()):     # no newline
            raw.publish("svc/a", payload)
        raw.publish("svc/a", pack_request(f"{box}/reply/x/1", b"real"))
        got = []
        assert served.serve(PATTERN, lambda r: got.append(r), count=1) == 1
        assert got == [IncomingRequest(b"svc/a", b"real", f"{box}/reply/x/1".encode())]


@asroot
def test_an_eavesdropper_sees_requests_on_public_keys_but_no_reply(open_broker, spawn):
    broker = open_broker()
    proc = start_worker("server", broker.address, PATTERN)
    try:
        assert proc.stdout.readline() == b"ready\n"

        def child(ctl):
            held = {}
            for pattern in ("", "!/", "!/cred/", "*/"):
                c = Conn.to(broker.address)
                if c.sub_ok(pattern):
                    held[pattern] = c
            ctl.send({"held": sorted(held)})
            ctl.wait()
            return {p: [pkt[4:].split(b"\0", 1)[0].decode() for pkt in c.collect()
                        if pkt.startswith(b"MSG ")] for p, c in held.items()}

        eavesdropper = spawn(child)
        assert eavesdropper.recv() == {"held": ["", "*/"]}
        with Client(broker.address) as c:
            assert [c.request("svc/q", str(i), TIMEOUT) for i in range(3)] == [
                f"svc/q {i}".encode() for i in range(3)]
            c.whoami(timeout=TIMEOUT)
        eavesdropper.send({"go": True})
        seen = eavesdropper.result()
        assert seen == {"": ["svc/q"] * 3, "*/": ["svc/q"] * 3}
    finally:
        proc.kill()
        proc.wait()


def test_sbus_request_and_sbus_serve(bus, tmp_path):
    serve = subprocess.Popen([str(SBUS), "serve", "-a", bus.address, "-j", "4", PATTERN, "--",
                              "sh", "-c", 'printf "%s:" "$SBUS_REQUEST_KEY"; tr a-z A-Z; '
                                          'test "$SBUS_REQUEST_KEY" != svc/bad || '
                                          '{ echo broken >&2; exit 3; }'],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def ask(key, body, *more):
            return subprocess.run([str(SBUS), "request", "-a", bus.address, key, body, *more],
                                  capture_output=True, text=True, timeout=TIMEOUT)

        deadline = time.monotonic() + TIMEOUT
        while (first := ask("svc/up", "hello", "-W", "0.5")).returncode == 3:
            assert time.monotonic() < deadline, "sbus serve never answered"
        assert (first.returncode, first.stdout) == (0, "svc/up:HELLO\n")
        bad = ask("svc/bad", "x")
        assert (bad.returncode, bad.stdout) == (1, "")
        assert bad.stderr == ("sbus request: the server failed: RuntimeError: sh exited with "
                              "status 3: broken\n")
        late = ask("none/here", "x", "-W", "0.3")
        assert (late.returncode, late.stdout) == (3, "")
        assert "no reply" in late.stderr
    finally:
        serve.terminate()
        assert serve.wait(TIMEOUT) == 0, serve.stderr.read().decode()


def test_sbus_serve_says_ready_to_systemd_once_its_subscription_is_in_place(bus, tmp_path):
    """Issue 38: a unit or a script need not poll sbus serve: READY=1 on
    $NOTIFY_SOCKET, from its own pid, once the broker has its SUB."""
    from support.systemd import Notify
    notify = Notify(tmp_path, abstract=False)
    serve = subprocess.Popen([str(SBUS), "serve", "-a", bus.address, PATTERN, "--", "cat"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "NOTIFY_SOCKET": notify.env})
    try:
        assert notify.recv(timeout=TIMEOUT) == ("READY=1", serve.pid)
        r = subprocess.run([str(SBUS), "request", "-a", bus.address, "svc/x", "at once",
                            "-W", "10"], capture_output=True, text=True, timeout=TIMEOUT)
        assert (r.returncode, r.stdout) == (0, "at once\n"), r.stderr
        assert notify.pending() is None
    finally:
        notify.close()
        serve.terminate()
        assert serve.wait(TIMEOUT) == 0, serve.stderr.read().decode()


def test_sbus_serve_logs_service_ready_and_sbus_ready_serve_waits_for_it(bus, tmp_path):
    """Issue 38: sbus serve says it is ready as the other services do (one
    service_ready record, READY=1), and ``sbus ready serve PATTERN`` waits for
    it: exit 0 once its subscription is in place, 1 with a hint when no
    sbus serve for PATTERN answers."""
    from support.systemd import Notify

    def ready(pattern, wait):
        return subprocess.run([str(SBUS), "-a", bus.address, "ready", "serve", pattern,
                               "-W", wait], capture_output=True, text=True, timeout=TIMEOUT * 3)

    r = ready(PATTERN, "1")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.splitlines() == [
        "sbus ready: serve not ready within 1 s: no sbus serve for 'svc/' answered (asked on "
        "sbus/serve/state)",
        "  is it running? start one with: sbus serve svc/ -- COMMAND (the pattern must be the "
        "same, byte for byte), or wait longer with -W SECONDS"]

    notify = Notify(tmp_path, abstract=True)
    log = tmp_path / "serve.json"
    waiter = subprocess.Popen([str(SBUS), "-a", bus.address, "ready", "serve", PATTERN, "-W",
                               "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    serve = subprocess.Popen([str(SBUS), "serve", "-a", bus.address, "--log-format", "json",
                              "--log-file", str(log), PATTERN, "--", "cat"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "NOTIFY_SOCKET": notify.env})
    try:
        out, err = waiter.communicate(timeout=TIMEOUT * 3)
        assert (waiter.returncode, out, err) == (0, b"", b"")
        # Ready means served: a request at once is answered.
        r = subprocess.run([str(SBUS), "request", "-a", bus.address, "svc/x", "at once",
                            "-W", "10"], capture_output=True, text=True, timeout=TIMEOUT)
        assert (r.returncode, r.stdout) == (0, "at once\n"), r.stderr
        assert notify.recv(timeout=TIMEOUT) == ("READY=1", serve.pid)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        said = [rec for rec in records if rec["event"] == "service_ready"]
        assert [(rec["service"], rec["pid"], rec["pattern"]) for rec in said] == [
            ("serve", serve.pid, PATTERN)]
        from sbus import logschema as ls
        assert {n for n, _ in ls.SERVE_EVENT_FIELDS["service_ready"]} <= set(said[0])
        assert notify.pending() is None, "once"
        # Another pattern's server is not this one's, even one that covers it.
        assert ready("svc/x", "1").returncode == 1
        assert ready("", "1").returncode == 1
        # The state it answers counts what its command did.
        with Client(bus.address) as asker:
            from sbus.client.private import PrivateInbox
            inbox = PrivateInbox(asker.whoami(), "serve")
            asker.subscribe(inbox.pattern)
            asker.publish("sbus/serve/state", f"{inbox.prefix} {PATTERN}")
            got = asker.receive(timeout=TIMEOUT)
        assert got.key == inbox.key("state").encode()
        state = json.loads(got.payload)
        assert state == {"service": "serve", "pattern": PATTERN, "pid": serve.pid,
                         "command": ["cat"], "jobs": 64, "running": 0, "answered": 1,
                         "failed": 0}
    finally:
        notify.close()
        waiter.kill()
        serve.terminate()
        assert serve.wait(TIMEOUT) == 0, serve.stderr.read().decode()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_a_c_asker_written_from_the_docs(bus, server, tmp_path):
    exe = tmp_path / "request"
    built = subprocess.run(["gcc", "-std=c99", "-D_DEFAULT_SOURCE", "-O2", "-Wall", "-Wextra",
                            "-Werror", "-o", str(exe), str(TESTS / "c" / "request.c")],
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert built.returncode == 0, built.stderr
    run = subprocess.run([str(exe), bus.address, "svc/c", "from C"], capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert (run.returncode, run.stdout) == (0, "svc/c from C\n"), run.stderr
    run = subprocess.run([str(exe), bus.address, "svc/c", "fail"], capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert (run.returncode, run.stderr) == (1, "ValueError: asked to fail\n")


# -- the pieces, without processes ------------------------------------------------------

def test_wire_round_trips():
    packed = pack_request("!/cred/1/2/3/reply/ab/7", b"bo\ndy\0")
    assert packed == b"REQ !/cred/1/2/3/reply/ab/7\nbo\ndy\0"
    assert parse_request(Message(b"k", packed)) == IncomingRequest(
        b"k", b"bo\ndy\0", b"!/cred/1/2/3/reply/ab/7")
    assert parse_reply(pack_reply("r\n")) == b"r\n"
    assert parse_reply(pack_reply(None)) == b""
    with pytest.raises(HandlerError, match="^malformed reply"):
        parse_reply(b"what")


def test_a_request_the_broker_would_refuse_is_not_sent(bus):
    async def run():
        async with AsyncClient(bus.address) as c:
            with pytest.raises(KeyRefusedError):
                await c.request("!/not/a/key", "x", TIMEOUT)
            with pytest.raises(MessageTooLargeError):   # a key that leaves no room for a chunk
                await c.request("k" * c.max_message, b"y", TIMEOUT)
            return await c.stats()      # still connected

    assert "clients" in asyncio.run(run())
    with Client(bus.address) as c:
        with pytest.raises(KeyRefusedError):
            c.request("!/not/a/key", "x", TIMEOUT)
        assert "clients" in c.stats()
