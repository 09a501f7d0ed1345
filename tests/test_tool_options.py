"""`sbus sub` and `sbus pub` options (templates, -v, --raw, -W; --lines, --repeat,
--interval, --file), each run as a real process against a real sbusd."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import time

import pytest

from sbus import Client
from sbus.client import Message

from support import SBUS

TIMEOUT = 10.0


def sbus(*args, input=b"", check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([SBUS, *args], input=input, capture_output=True, timeout=TIMEOUT)
    if check:
        assert proc.returncode == 0, proc.stderr.decode()
    return proc


def start_sub(address, *args) -> subprocess.Popen:
    proc = subprocess.Popen([SBUS, "sub", "-a", address, "--ready", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stderr.readline()
    if line != b"ready\n":
        proc.kill()
        raise AssertionError(f"sbus sub did not start: {line + proc.stderr.read()!r}")
    return proc


def publish(address, *messages):
    with Client(address) as pub:
        for key, payload in messages:
            pub.publish(key, payload)
        pub.whoami(timeout=TIMEOUT)


@pytest.fixture
def broker(start_broker):
    """One backend is enough: these test the tool, not the event loop."""
    return start_broker()


@pytest.fixture
def listener(broker):
    with Client(broker.address) as c:
        c.subscribe("")
        c.whoami(timeout=TIMEOUT)
        yield c


def received(listener, n):
    return [listener.receive(timeout=TIMEOUT) for _ in range(n)]


# -- sbus sub -------------------------------------------------------------------

def test_sub_format_template_fields(broker):
    before = time.time()
    sub = start_sub(broker.address, "-n", "2", "--format",
                    "{key}|{payload}|{size}|{hex}|{base64}|{type}|{json}|{time}|{unix}", "t/*")
    publish(broker.address, ("t/a", "héllo"), ("t/b", b"\xff\x00"))
    out, err = sub.communicate(timeout=TIMEOUT)
    after = time.time()
    assert sub.returncode == 0, err
    first, second = out.split(b"\n")[:2]
    f = first.decode().split("|", 7)
    assert f[:6] == ["t/a", "héllo", "6", "68c3a96c6c6f", "aMOpbGxv", "msg"]
    j, t, unix = f[6:7] + f[7].rsplit("|", 1)
    assert json.loads(j) == {"type": "msg", "key": "t/a", "payload": "héllo"}
    assert before - 1 <= datetime.datetime.fromisoformat(t).timestamp() <= after + 1
    assert before <= float(unix) <= after
    # Undecodable payload bytes show as \xNN in {payload}; {hex} has them exactly.
    assert second.split(b"|")[:4] == [b"t/b", b"\\xff\x00", b"2", b"ff00"]
    assert out.endswith(b"\n") and out.count(b"\n") == 2


def test_sub_format_escapes_and_a_bad_field_is_a_usage_error(broker):
    sub = start_sub(broker.address, "-n", "1", "-F", r"{key}\t{size}\n--", "e")
    publish(broker.address, ("e", "12345"))
    assert sub.communicate(timeout=TIMEOUT)[0] == b"e\t5\n--\n"
    proc = sbus("sub", "-a", broker.address, "-F", "{colour}", "x", check=False)
    assert proc.returncode == 2 and b"unknown field {colour}" in proc.stderr


def test_sub_verbose_shows_key_and_payload(broker):
    sub = start_sub(broker.address, "-v", "-n", "2", "v/*")
    publish(broker.address, ("v/1", "one"), ("v/2", "two words"))
    assert sub.communicate(timeout=TIMEOUT)[0] == b"v/1 one\nv/2 two words\n"


def test_sub_raw_writes_payload_bytes_only(broker):
    blobs = [bytes(range(256)), b"\n\0\n", os.urandom(5000)]
    sub = start_sub(broker.address, "--raw", "-n", "3", "bin")
    publish(broker.address, *[("bin", b) for b in blobs])
    out, err = sub.communicate(timeout=TIMEOUT)
    assert sub.returncode == 0, err
    assert out == b"".join(blobs)


def test_sub_timeout_exit_status_says_whether_the_count_was_reached(broker):
    # Not reached: exit 3, with what did come printed.
    sub = start_sub(broker.address, "-W", "0.5", "-n", "2", "w")
    publish(broker.address, ("w", "only one"))
    out, _ = sub.communicate(timeout=TIMEOUT)
    assert (sub.returncode, out) == (3, b"w\tonly one\n")
    # Reached before the timeout: exit 0 at once.
    sub = start_sub(broker.address, "-W", "30", "-n", "1", "w")
    t0 = time.monotonic()
    publish(broker.address, ("w", "in time"))
    out, _ = sub.communicate(timeout=TIMEOUT)
    assert (sub.returncode, out) == (0, b"w\tin time\n")
    assert time.monotonic() - t0 < 30
    # No --count: the timeout is the expected end.
    proc = sbus("sub", "-a", broker.address, "-W", "0.2", "nothing/comes", check=False)
    assert (proc.returncode, proc.stdout) == (0, b"")


def test_sub_output_options_exclude_each_other(broker):
    proc = sbus("sub", "-a", broker.address, "--raw", "--json", "x", check=False)
    assert proc.returncode == 2 and b"not allowed with" in proc.stderr


# -- sbus pub -------------------------------------------------------------------

def test_pub_lines_sends_one_message_per_line(broker, listener):
    sbus("pub", "-a", broker.address, "--lines", "l", input=b"a\nb b\n\nlast without newline")
    assert [m.payload for m in received(listener, 4)] == [b"a", b"b b", b"", b"last without newline"]
    with pytest.raises(TimeoutError):
        listener.receive(timeout=0.2)


def test_pub_lines_sends_each_line_as_it_comes(broker, listener):
    proc = subprocess.Popen([SBUS, "pub", "-a", broker.address, "-l", "live"],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for word in (b"first", b"second"):
            proc.stdin.write(word + b"\n")
            proc.stdin.flush()
            assert listener.receive(timeout=TIMEOUT) == Message(b"live", word)
    finally:
        proc.stdin.close()
    assert proc.wait(timeout=TIMEOUT) == 0, proc.stderr.read()


def test_pub_repeat_and_interval(broker, listener):
    t0 = time.monotonic()
    sbus("pub", "-a", broker.address, "--repeat", "3", "--interval", "0.1", "r", "again")
    assert time.monotonic() - t0 >= 0.2            # two waits between three messages
    assert received(listener, 3) == [Message(b"r", b"again")] * 3
    sbus("pub", "-a", broker.address, "--repeat", "0", "r", "never")
    with pytest.raises(TimeoutError):
        listener.receive(timeout=0.2)


def test_pub_file_payload(broker, listener, tmp_path):
    path = tmp_path / "payload.bin"
    path.write_bytes(bytes(range(256)) * 4)
    sbus("pub", "-a", broker.address, "--file", str(path), "--repeat", "2", "f")
    assert received(listener, 2) == [Message(b"f", path.read_bytes())] * 2
    proc = sbus("pub", "-a", broker.address, "--file", str(path), "f", "and a message",
                check=False)
    assert proc.returncode == 2 and b"not two of them" in proc.stderr
    proc = sbus("pub", "-a", broker.address, "--file", str(tmp_path / "missing"), "f",
                check=False)
    assert proc.returncode == 1
    assert proc.stderr.decode() == f"sbus: pub --file {tmp_path / 'missing'}: No such file or directory\n"


def test_pub_lines_stops_with_an_error_when_a_line_is_refused(start_broker):
    b = start_broker("--max-message", "1000")
    with Client(b.address) as listener:
        listener.subscribe("big")
        listener.whoami(timeout=TIMEOUT)
        proc = sbus("pub", "-a", b.address, "--lines", "big",
                    input=b"small\n" + b"x" * 2000 + b"\nnever\n", check=False)
        assert proc.returncode == 1 and b"closed the connection" in proc.stderr
        assert listener.receive(timeout=TIMEOUT).payload == b"small"
        with pytest.raises(TimeoutError):
            listener.receive(timeout=0.2)


@pytest.mark.alone   # a deadline held within two seconds
def test_sub_timeout_counts_reconnect_attempts(broker):
    """-W bounds the whole command: a broker that goes away while sbus sub
    waits makes it retry (it reconnects by default), and the retries are
    inside the timeout, not on top of it."""
    sub = start_sub(broker.address, "-n", "2", "-W", "3", "k")
    publish(broker.address, ("k", b"one"))
    assert sub.stdout.readline() == b"k\tone\n"
    started = time.monotonic()
    broker.stop()                               # the bus is gone; nothing else will come
    try:
        rc = sub.wait(TIMEOUT)
    finally:
        sub.kill()
    elapsed = time.monotonic() - started
    stderr = sub.stderr.read().decode()
    assert rc == 3, stderr                      # --count not reached within -W
    assert "went away" in stderr and "reconnecting" in stderr, stderr
    assert elapsed < 3.0 + 2.0, elapsed         # the deadline held while it retried
