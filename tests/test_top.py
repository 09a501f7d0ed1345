"""`sbus top` in a pseudo-terminal: its screen, read through a terminal emulator
(pyte), follows the broker; a key changes the sort column; `q` quits."""
from __future__ import annotations

import os
import time

import pexpect
import pyte
import pytest

from support import NOBODY, SBUS, Conn, asroot

ROWS, COLS = 30, 120


class Terminal:
    """``sbus top`` on a pty of ROWS x COLS, its output fed to an emulated screen."""

    def __init__(self, address, term):
        self.screen = pyte.Screen(COLS, ROWS)
        self.stream = pyte.ByteStream(self.screen)
        self.child = pexpect.spawn(SBUS, ["top", "-a", address, "--interval", "0.2"],
                                   env={**os.environ, "TERM": term}, dimensions=(ROWS, COLS))

    def read(self):
        while True:
            try:
                self.stream.feed(self.child.read_nonblocking(65536, timeout=0.05))
            except pexpect.TIMEOUT:
                return
            except pexpect.EOF:
                return

    def lines(self):
        self.read()
        return [line.rstrip() for line in self.screen.display]

    def wait_for(self, predicate, what, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.lines()
            if predicate(lines):
                return lines
        raise AssertionError(f"timed out waiting for {what}; the screen:\n" +
                             "\n".join(self.lines()))

    def close(self):
        if self.child.isalive():
            self.child.terminate(force=True)


def client_rows(lines):
    """The client table's rows: (client id, the row), in screen order."""
    at = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("CLIENT"))
    rows = []
    for ln in lines[at + 1:]:
        cells = ln.split()
        if not cells or not cells[0].isdigit():
            break
        rows.append((int(cells[0]), ln))
    return rows


def header(lines):
    return next(ln for ln in lines if ln.lstrip().startswith("CLIENT"))


@pytest.mark.parametrize("term", ["xterm-256color", "vt100"])
def test_top_shows_clients_switches_sort_and_quits(start_broker, term):
    b = start_broker()
    sub, pub = b.connect(), b.connect()
    sub.sub("t/*")
    sub.sync()
    for _ in range(30):
        pub.pub("t/x", b"payload")
    pub.sync()
    sub.whoami()                        # the 30 deliveries are made
    # sub: client 1, in 0 out 30; pub: client 2, in 30 out 0.
    term_ = Terminal(b.address, term)
    try:
        lines = term_.wait_for(lambda ls: any(ln.lstrip().startswith("CLIENT") for ln in ls)
                               and len(client_rows(ls)) == 2, "the client table")
        assert any(ln.startswith("sbus top") and b.address in ln for ln in lines)
        # Its own connection (client 3) is counted but not listed.
        assert any("clients 3 (one is this view)" in ln for ln in lines)
        assert sorted(c for c, _ in client_rows(lines)) == [1, 2]
        assert any("total 30" in ln for ln in lines)
        # Sort by total IN: the publisher first; by total OUT: the subscriber first.
        term_.child.send("I")
        lines = term_.wait_for(lambda ls: "IN*" in header(ls), "IN* in the header")
        assert client_rows(lines)[0][0] == 2
        term_.child.send("O")
        lines = term_.wait_for(lambda ls: "OUT*" in header(ls), "OUT* in the header")
        assert client_rows(lines)[0][0] == 1
        assert client_rows(lines)[0][1].split()[6] == "30"      # its OUT column
        # s moves the sort to the next column (QUEUE).
        term_.child.send("s")
        term_.wait_for(lambda ls: "QUEUE*" in header(ls), "QUEUE* in the header")
        # A client that leaves leaves the table at the next refresh.
        pub.close()
        term_.wait_for(lambda ls: [c for c, _ in client_rows(ls)] == [1], "client 2 gone")
        term_.child.send("q")
        term_.child.expect(pexpect.EOF, timeout=10)
        term_.child.close()
        assert term_.child.exitstatus == 0
    finally:
        term_.close()


def test_top_needs_a_terminal(start_broker):
    broker = start_broker()
    import subprocess
    proc = subprocess.run([SBUS, "top", "-a", broker.address], capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=10)
    assert proc.returncode == 1 and b"needs a terminal" in proc.stderr


@asroot
def test_top_shows_each_uids_use_of_its_budgets(open_broker, spawn):
    """A second user's connections and subscription bytes appear in the
    per-uid table beside its budgets (sbusd's own uid has none)."""
    b = open_broker("--user-max-connections", "7", "--user-sub-max-bytes", "5000000")

    def child(ctl):
        held = [Conn.to(b.address, timeout=10) for _ in range(3)]
        held[0].sub("budget/x")
        held[0].sync()
        ctl.send({"ready": True})
        ctl.wait()
        return True

    kid = spawn(child)
    kid.recv(timeout=30)
    term_ = Terminal(b.address, "xterm-256color")
    try:
        def nobody_row(ls):
            at = next((i for i, ln in enumerate(ls) if ln.lstrip().startswith("UID")), None)
            if at is None:
                return None
            return next((ln.split() for ln in ls[at + 1:]
                         if ln.split() and ln.split()[0] == str(NOBODY)), None)
        lines = term_.wait_for(lambda ls: nobody_row(ls) is not None, "the uid table")
        row = nobody_row(lines)
        assert row[1] == "3/7", row                    # connections against the budget
        used, budget = row[2].split("/")
        assert used != "0" and budget == "5.0M", row    # 5,000,000 B
        term_.child.send("q")
        term_.child.expect(pexpect.EOF, timeout=10)
    finally:
        term_.close()
        kid.send({"done": True})
        kid.result()
