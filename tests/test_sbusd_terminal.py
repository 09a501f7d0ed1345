"""A plain `sbusd` typed at a terminal daemonises, as the original does, and
says in one line on the terminal where it listens, its pid and how to stop it;
started by a script (stderr not a terminal) it says nothing."""
from __future__ import annotations

import os
import pty
import signal
import subprocess

from support import SBUSD
from support.procfs import alive, wait_gone

TIMEOUT = 10.0


def read_all(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:         # EIO: every writer of the pty's other side is gone
            return out
        if not chunk:
            return out
        out += chunk


def test_a_daemon_started_from_a_terminal_says_where_and_how_to_stop_it(tmp_path):
    address, pidfile = tmp_path / "bus.socket", tmp_path / "sbusd.pid"
    master, slave = pty.openpty()
    try:
        launcher = subprocess.run([SBUSD, "-a", str(address), "-p", str(pidfile)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=slave, timeout=TIMEOUT)
        os.close(slave)
        slave = -1
        pid = int(pidfile.read_text())
        try:
            assert launcher.returncode == 0
            assert alive(pid)
            assert read_all(master).decode() == (
                f"sbusd: listening on {address} in the background as pid {pid}; "
                f"stop it with: kill {pid}\r\n")
        finally:
            os.kill(pid, signal.SIGTERM)
            assert wait_gone(pid, TIMEOUT)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


def test_a_daemon_started_by_a_script_says_nothing(tmp_path):
    address, pidfile = tmp_path / "bus.socket", tmp_path / "sbusd.pid"
    launcher = subprocess.run([SBUSD, "-a", str(address), "-p", str(pidfile)],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=TIMEOUT)
    pid = int(pidfile.read_text())
    try:
        assert (launcher.returncode, launcher.stdout, launcher.stderr) == (0, b"", b"")
    finally:
        os.kill(pid, signal.SIGTERM)
        assert wait_gone(pid, TIMEOUT)
