"""Drop-in compatibility with the original sbusd: what programs written for
it rely on.

- The readiness line arrives in one write(2), whatever Python's buffering: a
  C launcher (tests/c/one_read.c) that reads the pipe once, 50 times in a row
  with PYTHONUNBUFFERED=1.
- Patterns may be as long as a packet allows (the spec sets no lower limit).
- Every option the usage line shows works with the others: -f -p writes the
  pidfile in the foreground too.
- -u on a socket whose mode keeps the listed users out warns, on stderr and
  as a config_warning record.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sbus import logschema as ls

from support import SBUSD, Sbusd, wait_until

C_DIR = Path(__file__).resolve().parent / "c"
RUNS = 50


@pytest.fixture(scope="module")
def one_read(tmp_path_factory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler (cc) to build the launcher")
    exe = tmp_path_factory.mktemp("one_read") / "one_read"
    proc = subprocess.run(["cc", "-std=c99", "-D_DEFAULT_SOURCE", "-O2", "-Wall", "-Wextra",
                           "-Werror", "-o", str(exe), str(C_DIR / "one_read.c")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return exe


@pytest.mark.parametrize("unbuffered", [{"PYTHONUNBUFFERED": "1"}, {"PYTHONUNBUFFERED": ""}],
                         ids=["PYTHONUNBUFFERED=1", "buffered"])
def test_one_read_gets_the_whole_address_line(one_read, unbuffered):
    runs = RUNS if unbuffered["PYTHONUNBUFFERED"] else 5
    env = {**os.environ, **unbuffered}
    if not unbuffered["PYTHONUNBUFFERED"]:
        env.pop("PYTHONUNBUFFERED")
    proc = subprocess.run([str(one_read), SBUSD, str(runs), "abstract"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout == "one_read: ok\n", proc.stdout + proc.stderr


def test_one_read_on_a_path_address_is_eof_once_listening(one_read, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([str(one_read), SBUSD, "10", str(tmp_path / "s")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout == "one_read: ok\n", proc.stdout + proc.stderr


def test_a_60000_byte_pattern_is_subscribed_and_matched(start_broker):
    b = start_broker()
    sub, pub = b.connect(), b.connect()
    key = b"/".join(b"segment%05d" % i for i in range(5000))[:60000]
    assert len(key) == 60000
    assert sub.sub_ok(key[:30000] + b"*")       # a wildcard pattern, half as long
    assert sub.sub_ok(key)
    pub.pub(key, b"payload")
    pub.sync()
    got = sub.collect()
    assert got == [b"MSG " + key + b"\0payload"]     # once, though both patterns match
    rec = b.wait_for_event(ls.SUBSCRIBE, predicate=lambda r: len(r["pattern"]) == 60000)
    assert rec["accepted"] is True


def test_max_pattern_is_still_an_option(start_broker):
    b = start_broker("--max-pattern", "5000")
    s = b.connect()
    assert s.sub_ok(b"p" * 5000)
    s.sub(b"p" * 5001)
    s.assert_closed()
    rec = b.wait_for_event(ls.CLIENT_DISCONNECT)
    assert rec["reason"] == ls.DISCONNECT_LIMIT and "5000" in rec["detail"]


def test_foreground_honours_the_pidfile_and_removes_it(tmp_path):
    pidfile = tmp_path / "sbusd.pid"
    b = Sbusd.foreground(tmp_path, "-p", str(pidfile))
    try:
        assert pidfile.read_text() == f"{b.pid}\n"
        start = b.wait_for_event(ls.BROKER_START)
        assert start["config"]["pidfile"] == str(pidfile)
    finally:
        assert b.stop() == 0
    assert not pidfile.exists()


def test_foreground_without_p_writes_no_pidfile(tmp_path):
    b = Sbusd.foreground(tmp_path)
    try:
        assert b.wait_for_event(ls.BROKER_START)["config"]["pidfile"] is None
    finally:
        b.stop()


def test_the_usage_line_shows_f_and_p_apart():
    out = subprocess.run([SBUSD, "--help"], capture_output=True, text=True, timeout=30).stdout
    assert out.startswith("usage: sbusd [-a address] [-f] [-p pidfile] [-u user] ... [-cgor]")


@pytest.mark.parametrize("address", ["path", "/dev/unix/abstract"])
def test_u_on_a_socket_that_keeps_the_user_out_warns(tmp_path, address):
    addr = str(tmp_path / "s") if address == "path" else address
    b = Sbusd.foreground(tmp_path, "-u", "nobody", "-u", "0", address=addr)
    try:
        uid = 65534
        stderr = wait_until(lambda: "keeps it out" in b.stderr_text() and b.stderr_text(),
                            what="the -u warning on stderr")
        assert f"-u nobody: uid {uid} cannot connect" in stderr and "(-o would let it in)" in stderr
        assert "-u 0" not in stderr         # root passes any mode
        rec = b.wait_for_event(ls.CONFIG_WARNING)
        assert rec["level"] == "warning" and f"uid {uid}" in rec["detail"] and "-o" in rec["detail"]
    finally:
        b.stop()


def test_u_with_o_does_not_warn(tmp_path):
    b = Sbusd.foreground(tmp_path, "-u", "nobody", "-o")
    try:
        b.wait_for_event(ls.BROKER_START)
        b.connect().sync()
        assert b.events(ls.CONFIG_WARNING) == [] and "cannot connect" not in b.stderr_text()
    finally:
        b.stop()
