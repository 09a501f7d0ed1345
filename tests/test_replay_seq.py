"""``sbus replay --after SEQ`` resumes after a sequence number, and
``-F '{seq}'`` is where a user reads one: real sbusd, store and sbus."""
from __future__ import annotations

import subprocess

import pytest

import sbus
from sbus.client.store import store_stats

from support import SBUS, StoreProcess

TIMEOUT = 30.0


@pytest.fixture(autouse=True)
def no_store_left():
    yield
    StoreProcess.stop_all()


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([SBUS, *args], capture_output=True, text=True, timeout=TIMEOUT)


def test_replay_shows_seq_and_resumes_after_it(start_broker, tmp_path):
    bus = start_broker()
    StoreProcess(tmp_path, bus.address, tmp_path / "log", ["r/"], "--stats-interval", "0").ready()
    with sbus.Client(bus.address) as c:
        c.publish_many([("r/a", b"1"), ("r/b", b"2"), ("r/c", b"3")])
        c.whoami(timeout=10)
        store_stats(c)      # answered once the store has written what came before
    listed = run("-a", bus.address, "replay", "r/", "-F", "{seq} {key} {payload}")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split(" ") for line in listed.stdout.splitlines()]
    assert [r[1:] for r in rows] == [["r/a", "1"], ["r/b", "2"], ["r/c", "3"]]
    seqs = [int(r[0]) for r in rows]
    assert seqs == [seqs[0], seqs[0] + 1, seqs[0] + 2]
    resumed = run("-a", bus.address, "replay", "r/", "--after", str(seqs[0]), "-F", "{seq}")
    assert resumed.stdout.split() == [str(s) for s in seqs[1:]]
    last = run("-a", bus.address, "last", "r/b", "-F", "{seq}:{payload}")
    assert last.stdout == f"{seqs[1]}:2\n"
    # sub has no store behind it: {seq} is not one of its fields.
    sub = run("-a", bus.address, "sub", "-F", "{seq}", "r/")
    assert sub.returncode == 2 and "unknown field {seq}" in sub.stderr
