"""The ``sbus`` console script, run as a real process against a real sbusd."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from sbus import Client
from sbus.client import Message

from support import SBUS

TIMEOUT = 10.0


def sbus(*args, input=b"", env=None, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([SBUS, *args], input=input, capture_output=True, timeout=TIMEOUT,
                          env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr.decode()
    return proc


def start_sub(address, *args, env=None) -> subprocess.Popen:
    """``sbus sub --ready ...``, returned once the broker has its patterns."""
    proc = subprocess.Popen([SBUS, "sub", "-a", address, "--ready", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})
    line = proc.stderr.readline()
    if line != b"ready\n":
        proc.kill()
        raise AssertionError(f"sbus sub did not start: {line + proc.stderr.read()!r}")
    return proc


@pytest.fixture
def listener(broker):
    """A client subscribed to everything, to see what the tool published."""
    with Client(broker.address) as c:
        c.subscribe("")
        c.whoami(timeout=TIMEOUT)
        yield c


def test_pub_sends_the_message_argument(broker, listener):
    sbus("pub", "-a", broker.address, "greet/en", "hello, world")
    sbus("-a", broker.address, "pub", "greet/none")
    assert listener.receive(timeout=TIMEOUT) == Message(b"greet/en", b"hello, world")
    assert listener.receive(timeout=TIMEOUT) == Message(b"greet/none", b"")


def test_pub_dash_reads_the_payload_from_stdin(broker, listener):
    payload = bytes(range(256)) * 100 + b"\0\n"
    sbus("pub", "-a", broker.address, "bin/blob", "-", input=payload)
    assert listener.receive(timeout=TIMEOUT) == Message(b"bin/blob", payload)


def test_sub_json_count(broker):
    sub = start_sub(broker.address, "--json", "--count", "3", "a/*", "b")
    with Client(broker.address) as pub:
        pub.publish("a/1", "ünïcode")
        pub.publish("c", b"not subscribed")
        pub.publish("b", b"\xff\xfe binary")
        pub.publish(b"a/\xff", b"")
        pub.publish("a/4", b"after the count")
    out, err = sub.communicate(timeout=TIMEOUT)
    assert sub.returncode == 0, err
    lines = [json.loads(line) for line in out.decode("utf-8").splitlines()]
    assert lines == [
        {"type": "msg", "key": "a/1", "payload": "ünïcode"},
        {"type": "msg", "key": "b", "payload_base64": "//4gYmluYXJ5"},
        {"type": "msg", "key_base64": "YS//", "payload": ""},
    ]


def test_sub_plain_output(broker):
    sub = start_sub(broker.address, "-n", "2", "")
    sbus("pub", "-a", broker.address, "k/1", "one")
    sbus("pub", "-a", broker.address, "k/2", "-", input=b"two\nlines")
    out, err = sub.communicate(timeout=TIMEOUT)
    assert sub.returncode == 0, err
    assert out == b"k/1\tone\nk/2\ttwo\nlines\n"


def test_sub_ends_with_an_error_when_the_broker_goes_away(start_broker):
    b = start_broker()
    sub = start_sub(b.address, "--no-reconnect", "x")
    b.stop()
    _, err = sub.communicate(timeout=TIMEOUT)
    assert sub.returncode == 1
    assert b"closed the connection" in err


def test_sub_rides_out_a_broker_restart_and_says_so(start_broker):
    b = start_broker("-r")
    sub = start_sub(b.address, "-n", "2", "x/*")
    try:
        sbus("pub", "-a", b.address, "x/1", "before")
        b.stop(signal.SIGKILL)
        assert sub.stderr.readline().endswith(b"the broker went away; reconnecting\n")
        b = start_broker("-r", address=b.address)
        assert sub.stderr.readline().endswith(b"reconnected; subscriptions restored\n")
        sbus("pub", "-a", b.address, "x/2", "after")
        out, _ = sub.communicate(timeout=TIMEOUT)
    finally:
        sub.kill()
    assert sub.returncode == 0
    assert out == b"x/1\tbefore\nx/2\tafter\n"


def test_sbus_address_from_the_environment(broker, listener):
    env = {"SBUS_ADDRESS": broker.address}
    sbus("pub", "env/key", "via SBUS_ADDRESS", env=env)
    assert listener.receive(timeout=TIMEOUT).payload == b"via SBUS_ADDRESS"
    assert sbus("whoami", env=env).stdout.startswith(b"!/cred/")
    sub = subprocess.Popen([SBUS, "sub", "--ready", "-n", "1", "env/*"], env={**os.environ, **env},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert sub.stderr.readline() == b"ready\n"
    sbus("pub", "env/2", "x", env=env)
    assert sub.communicate(timeout=TIMEOUT)[0] == b"env/2\tx\n"


def test_a_explicit_address_wins_over_the_environment(broker, listener, tmp_path):
    env = {"SBUS_ADDRESS": str(tmp_path / "no-such-socket")}
    sbus("pub", "-a", broker.address, "explicit", "yes", env=env)
    assert listener.receive(timeout=TIMEOUT).key == b"explicit"


def test_whoami_prints_the_credentials(broker):
    proc = subprocess.run([SBUS, "whoami", "-a", broker.address], capture_output=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    m = re.fullmatch(rb"!/cred/(\d+)/(\d+)/(\d+)\n", proc.stdout)
    assert m, proc.stdout
    assert (int(m[1]), int(m[2])) == (os.getgid(), os.getuid())


def test_stats_prints_pretty_json(broker):
    out = sbus("stats", "-a", broker.address).stdout.decode()
    stats = json.loads(out)
    assert isinstance(stats, dict) and stats
    assert out == json.dumps(stats, indent=2) + "\n"


def test_abstract_address(start_broker):
    b = start_broker(address="/dev/unix/abstract")
    address = b.stdout.decode().strip()
    assert sbus("whoami", "-a", address).stdout.startswith(b"!/cred/")


def test_errors_exit_1_and_usage_errors_2(tmp_path):
    missing = str(tmp_path / "missing")
    proc = sbus("pub", "-a", missing, "k", "v", check=False)
    assert proc.returncode == 1
    assert proc.stderr.decode().split("\n")[0] == \
        f"sbus: cannot connect to {missing} (from -a): no such socket"
    proc = sbus("sub", check=False)
    assert proc.returncode == 2  # usage: at least one pattern


def test_a_payload_larger_than_a_packet_goes_as_chunks(broker, listener):
    sbus("pub", "-a", broker.address, "big", "-", input=b"x" * 409600)     # docs/chunks.md
    assert listener.receive(timeout=TIMEOUT) == Message(b"big", b"x" * 409600)
    proc = sbus("pub", "-a", broker.address, "--max-message", "100", "k" * 40, "x" * 99,
                check=False)
    assert proc.returncode == 1 and b"leaves no room for a chunk" in proc.stderr


def test_pub_fails_when_the_broker_refuses_the_message(start_broker):
    b = start_broker("--max-message", "1000")
    proc = sbus("pub", "-a", b.address, "big", "-", input=b"x" * 2000, check=False)
    assert proc.returncode == 1
    assert b"the broker closed the connection" in proc.stderr
    assert b.wait_for_event("client_disconnect")["reason"] == "oversize"
    proc = sbus("pub", "-a", b.address, "a/!/b", "x", check=False)     # a misused '!'
    assert proc.returncode == 1


def test_max_message_matches_a_broker_with_a_raised_limit(start_broker):
    b = start_broker("--max-message", "1000000")
    with Client(b.address, max_message=1_000_000) as listener:
        listener.subscribe("big")
        listener.whoami(timeout=TIMEOUT)
        payload = os.urandom(600_000)
        # At the default limit it goes as chunks; at the broker's, as one packet.
        sbus("pub", "-a", b.address, "big", "-", input=payload)
        assert listener.receive(timeout=TIMEOUT) == Message(b"big", payload)
        sbus("pub", "-a", b.address, "--max-message", "1000000", "big", "-", input=payload)
        assert listener.receive(timeout=TIMEOUT) == Message(b"big", payload)
    proc = sbus("pub", "-a", b.address, "--max-message", "lots", "k", check=False)
    assert proc.returncode == 2 and b"not a whole number: 'lots'" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["sub", "-W", "-1", "k"], "argument -W/--timeout: out of range: '-1' (0 or more)"),
    (["top", "-i", "nan"], "argument -i/--interval: not a finite number: 'nan'"),
    (["pub", "--repeat", "2.5", "k", "x"], "argument --repeat: not a whole number: '2.5'"),
    (["bridge", "--nats", "nats://127.0.0.1:4222", "--stats-interval", "0"],
     "argument --stats-interval: out of range: '0' (more than 0)"),
])
def test_numbers_on_every_command_line_follow_one_rule(argv, message):
    proc = sbus(*argv, check=False)
    assert proc.returncode == 2 and message.encode() in proc.stderr, proc.stderr
