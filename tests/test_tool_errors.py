"""What `sbus` says when something is wrong: the exact message, naming what
was tried and what to do (connections, files, usage, patterns from other
buses, a -W timeout). Real processes, real sockets."""
from __future__ import annotations

import os
import socket
import subprocess

import pytest

from sbus import Client

from support import SBUS, Sbusd, wait_until

TIMEOUT = 10.0
START = "  is sbusd running? start it (sbusd, or make run in a clone of sbus), or check -a ADDRESS or SBUS_ADDRESS\n"


def sbus(*args, input=b"", env=None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "SBUS_ADDRESS"}
    return subprocess.run([SBUS, *args], input=input, capture_output=True, timeout=TIMEOUT,
                          env={**environ, **(env or {})}, text=False)


def failed(proc, code=1) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stdout == b""
    return proc.stderr.decode()


# -- connecting -------------------------------------------------------------------

def test_no_broker_at_the_address(tmp_path):
    missing = tmp_path / "missing.socket"
    assert failed(sbus("pub", "-a", str(missing), "k", "v")) == (
        f"sbus: cannot connect to {missing} (from -a): no such socket\n" + START)
    assert failed(sbus("whoami", env={"SBUS_ADDRESS": str(missing)})) == (
        f"sbus: cannot connect to {missing} (from SBUS_ADDRESS): no such socket\n" + START)


def test_a_stale_socket(tmp_path):
    path = tmp_path / "stale.socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(str(path))       # bound, never listening: as a broker killed with -9 leaves it
    assert failed(sbus("sub", "-a", str(path), "x")) == (
        f"sbus: cannot connect to {path} (from -a): a socket is there but no broker listens "
        "on it (one that stopped without removing it)\n"
        "  start sbusd (-r replaces a stale socket), or check -a ADDRESS or SBUS_ADDRESS\n")


@pytest.mark.parametrize("kind", ["a directory", "a regular file"])
def test_not_a_socket(tmp_path, kind):
    path = tmp_path / "thing"
    if kind == "a directory":
        path.mkdir()
    else:
        path.write_text("")
    assert failed(sbus("stats", "-a", str(path))) == (
        f"sbus: cannot connect to {path} (from -a): it is {kind}, not a socket\n"
        "  check -a ADDRESS or SBUS_ADDRESS: it names sbusd's socket\n")


def test_a_socket_of_another_kind(tmp_path):
    path = tmp_path / "stream.socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen()
        assert failed(sbus("whoami", "-a", str(path))) == (
            f"sbus: cannot connect to {path} (from -a): the socket there is not a "
            "SOCK_SEQPACKET one, so not sbusd's\n  check -a ADDRESS or SBUS_ADDRESS\n")


def test_a_malformed_abstract_address():
    address = "/dev/unix/abstract/00zz"
    assert failed(sbus("whoami", "-a", address)) == (
        f"sbus: cannot connect to {address} (from -a): not an abstract address (hex digits, "
        "an even number of them, follow /dev/unix/abstract/), so it was tried as a file: "
        "No such file or directory\n"
        "  give the address sbusd printed when started with -a /dev/unix/abstract\n")


def test_an_abstract_address_without_a_broker():
    address = "/dev/unix/abstract/00" + os.urandom(8).hex()
    assert failed(sbus("whoami", "-a", address)) == (
        f"sbus: cannot connect to {address} (from -a): no broker listens on this abstract "
        "address\n" + START)


# -- files and usage ---------------------------------------------------------------

def test_pub_file_errors_name_the_file(broker, tmp_path):
    missing = tmp_path / "missing"
    assert failed(sbus("pub", "-a", broker.address, "--file", str(missing), "a/b")) == (
        f"sbus: pub --file {missing}: No such file or directory\n")
    assert failed(sbus("pub", "-a", broker.address, "--file", str(tmp_path), "a/b")) == (
        f"sbus: pub --file {tmp_path}: Is a directory\n")


@pytest.mark.parametrize("argv, complaint", [
    (["pub", "--bogus", "a", "b"], "unrecognized arguments: --bogus"),
    (["pub", "a/b", "hi", "extra"], "unrecognized arguments: extra"),
    (["pub", "--file", "x", "a/b", "hi"], "give MESSAGE, --file or --lines, not two of them"),
])
def test_a_command_line_mistake_shows_that_command_usage(argv, complaint):
    err = failed(sbus(*argv), code=2)
    assert err.startswith("usage: sbus pub [-h] [-a ADDRESS]"), err
    assert err.endswith(f"sbus pub: error: {complaint}\n"), err


# -- patterns from other buses -----------------------------------------------------

FOREIGN = {
    "sensors/#": "is MQTT's: sbus reads '#' and '+' literally; 'sensors/' matches every key "
                 "under sensors/",
    "sensors/+/temp": "is MQTT's: sbus reads '#' and '+' literally; 'sensors/*/temp' matches "
                      "any one segment in place of each '*'",
    "sensors.>": "is NATS's: sbus separates segments with '/' and reads '>' literally; "
                 "'sensors/' matches every key under sensors/",
    "*": "matches only keys without a '/': '*' stops at '/'; '' matches every key",
    "*b": "never matches: '*' takes the rest of its segment, so nothing can follow it there; "
          "'*' matches any one segment in place of each '*'",
}


def test_sub_warns_about_patterns_of_other_buses(broker):
    patterns = list(FOREIGN)
    proc = sbus("sub", "-a", broker.address, "-W", "0.1", *patterns, "weather/*", "news/", "")
    assert proc.returncode == 0
    assert proc.stderr.decode().splitlines() == [
        *(f"sbus: warning: pattern {p!r} {FOREIGN[p]}" for p in patterns),
        "sbus: -W 0.1: stopped after 0.1 s (0 messages)"]


def test_sub_strict_refuses_them_before_connecting(tmp_path):
    proc = sbus("sub", "-a", str(tmp_path / "no-broker-needed"), "--strict", "sensors/#", "ok/")
    assert failed(proc, code=2) == (
        f"sbus: pattern 'sensors/#' {FOREIGN['sensors/#']} (refused: --strict)\n")


def test_a_timeout_says_so(broker):
    with Client(broker.address) as pub:
        proc = subprocess.Popen([SBUS, "sub", "-a", broker.address, "--ready", "-W", "0.5",
                                 "-n", "2", "w"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stderr.readline() == b"ready\n"
        pub.publish("w", b"only one")
        pub.whoami(timeout=TIMEOUT)
        out, err = proc.communicate(timeout=TIMEOUT)
    assert (proc.returncode, out) == (3, b"w\tonly one\n")
    assert err == b"sbus: -W 0.5: timed out: 1 of 2 messages came within 0.5 s\n"


def test_sub_whose_pattern_a_restarted_broker_refuses_stops_and_names_it(tmp_path):
    """No retry loop every second: the replayed subscription is refused twice,
    so `sbus sub` exits 1 with the library's PatternRefusedError text."""
    first = Sbusd.foreground(tmp_path, "-r")
    sub = subprocess.Popen([SBUS, "-a", first.address, "sub", "a/long/pattern/"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    second = None
    try:
        wait_until(lambda: first.stats()["totals"]["subscriptions"] == 1, TIMEOUT,
                   "sbus sub to subscribe")
        first.stop()
        second = Sbusd.foreground(tmp_path, "-r", "--max-pattern", "8", address=first.address)
        out, err = sub.communicate(timeout=TIMEOUT)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
        if second is not None:
            second.stop()
    assert sub.returncode == 1, err
    assert err.decode().splitlines()[-1] == (
        f"sbus: {first.address}: the broker closed the connection twice when the subscription "
        f"to 'a/long/pattern/' was replayed: it refuses the pattern (its log says why); "
        f"the client stopped")
