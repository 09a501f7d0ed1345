"""The second user: a forked child that drops to uid 65534 before it touches a socket.

The test process runs as root. The child reports what it saw back over a pipe
as JSON lines and ends with os._exit, never returning into pytest. Brokers
such a child must reach listen in a dedicated 0755 directory under /tmp
(pytest's own tmp dirs may sit under 0700 parents): ``make_public_dir``.
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path

import pytest

from .waiting import readable


def asroot(test):
    """For tests that fork a second user: they need root to drop privileges."""
    return pytest.mark.asroot(pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root to drop privileges to another uid")(test))


NOBODY = 65534          # uid and gid of the second user
OTHER_GID = 65533       # a group the second user is not in (unless we say so)


class _ChildSide:
    def __init__(self, w, r):
        self.w, self.r, self.buf = w, r, b""

    def send(self, obj):
        os.write(self.w, (json.dumps(obj) + "\n").encode())

    def wait(self, timeout=15.0):
        while b"\n" not in self.buf:
            if not readable(self.r, timeout):
                raise TimeoutError("parent never answered")
            chunk = os.read(self.r, 4096)
            if not chunk:
                raise EOFError("parent went away")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


class Child:
    """A forked process that drops to ``uid``/``gid`` (supplementary ``groups``)
    and runs ``fn(ctl)``; ``ctl.send(obj)`` and ``ctl.wait()`` talk to the
    parent, and fn's return value is the final report."""

    def __init__(self, fn, *, uid=NOBODY, gid=NOBODY, groups=()):
        up_r, up_w = os.pipe()
        down_r, down_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            # The child: no pytest machinery from here on, and always os._exit.
            status = 0
            try:
                os.close(up_r)
                os.close(down_w)
                os.setgroups(list(groups))
                os.setgid(gid)
                os.setuid(uid)
                if (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) != (uid, uid, gid, gid):
                    raise RuntimeError("privileges not dropped")
                ctl = _ChildSide(up_w, down_r)
                ctl.send({"result": fn(ctl)})
            except BaseException as e:     # noqa: BLE001 - report everything
                status = 1
                try:
                    report = json.dumps({"error": f"{type(e).__name__}: {e}"})
                    os.write(up_w, (report + "\n").encode())
                except BaseException:      # noqa: BLE001
                    pass
            finally:
                os._exit(status)
        os.close(up_w)
        os.close(down_r)
        self.pid = pid
        self._r, self._w = up_r, down_w
        self._buf = b""
        self._reaped = False

    def recv(self, timeout=15.0):
        while b"\n" not in self._buf:
            if not readable(self._r, timeout):
                raise AssertionError(f"child {self.pid} said nothing within {timeout}s")
            chunk = os.read(self._r, 65536)
            if not chunk:
                raise AssertionError(f"child {self.pid} exited without a report")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        obj = json.loads(line)
        if "error" in obj:
            raise AssertionError(f"child {self.pid} failed: {obj['error']}")
        return obj

    def send(self, obj):
        os.write(self._w, (json.dumps(obj) + "\n").encode())

    def result(self, timeout=15.0):
        while True:
            obj = self.recv(timeout)
            if "result" in obj:
                self.reap()
                return obj["result"]

    def reap(self):
        if not self._reaped:
            _, status = os.waitpid(self.pid, 0)
            self._reaped = True
            return status

    def kill(self):
        if not self._reaped:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.reap()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


def spawn_children():
    """Factory for Child processes; any still running when it ends is killed
    (the ``spawn`` fixture in conftest.py)."""
    children = []

    def make(fn, **kwargs) -> Child:
        c = Child(fn, **kwargs)
        children.append(c)
        return c

    yield make
    for c in children:
        c.kill()


def run_as(spawn, fn, **kwargs):
    """Run ``fn()`` (no parent interaction) as the second user; its report."""
    return spawn(lambda ctl: fn(), **kwargs).result()


def make_public_dir(group=None) -> Path:
    """A fresh 0755 directory under /tmp (setgid and owned by ``group`` if given,
    so sockets created in it belong to that group)."""
    d = Path(tempfile.mkdtemp(prefix="sbus-sec-", dir="/tmp"))
    if group is None:
        os.chmod(d, 0o755)
    else:
        os.chown(d, 0, group)
        os.chmod(d, 0o2755)
    return d
