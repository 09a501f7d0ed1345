"""The upstream link's life, seen from its broker (``sbusd --upstream``).

sbusd starts the link (``sbus/sbusd/link.py``) as a child process on one end
of a socketpair whose other end the broker takes on as its link connection.

* At start the link must say it runs, or sbusd exits 1 with the reason: the
  child's stderr is a pipe until the link has imported and set itself up;
  then it writes ``STARTED`` on it and puts sbusd's own stderr back. What it
  wrote before (an import error's traceback) is the reason.
* A link that dies later is started again with the client's back-off
  (``sbus.client.reconnect.Reconnect``); each death is logged
  (``upstream_link_failed``) and, until a new link reports, ``CMSG stats``
  shows the upstream ``away`` with the reason.
* Nothing here runs inside a callback of the broker loop but ``tick()``,
  which only looks (``waitpid`` with WNOHANG, a pidfd poll) and stops the
  turn; the loop calls ``act()`` between two turns, where starting a
  process and attaching a socket are safe.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from typing import Callable, Optional

from .. import logschema as schema
from ..client.reconnect import Reconnect

STARTED = b"\0sbusd-link started\n"     # what the link writes on its start pipe, then leaves it
START_TIMEOUT = 30.0    # seconds the first link has to import and set itself up
EXIT_WAIT = 5.0         # seconds the link has to leave after the broker
# The client's policy, never giving up: 0.1 s before the first restart,
# doubling up to 5 s; a link that ran this long counts as healthy again.
BACKOFF = Reconnect(initial_delay=0.1, max_delay=5.0, give_up_after=None)
HEALTHY_AFTER = 10.0


class LinkFailed(Exception):
    """The link could not start; the text says why."""


def last_line(text: bytes) -> str:
    lines = [line.strip() for line in text.decode("utf-8", "replace").splitlines()]
    lines = [line for line in lines if line]
    return lines[-1] if lines else ""


def ended(returncode: Optional[int]) -> str:
    if returncode is None:
        return "it exited"
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class Uplink:
    """The link process of one broker run: started, watched, restarted.

    ``process`` is a running link to watch (a ``Popen``, or after a live
    upgrade the old process's ``AdoptedLink``); None starts one at the first
    ``act()``. ``stop_turn`` ends the broker loop's turn (``Broker.stop``).
    """

    def __init__(self, cfg, log, stop_turn: Callable[[], None]):
        self.cfg = cfg
        self.log = log
        self.stop_turn = stop_turn
        self.broker = None
        self.process = None
        self.start_pipe: Optional[int] = None   # the child's stderr until it started
        self.early = b""                        # what it wrote there
        self.started_at = 0.0
        self.failures = 0                       # deaths in a row, for the back-off
        self.restarts = 0
        self.restart_at: Optional[float] = None
        self.due = False
        self.away: Optional[str] = None         # a reason stats could not show yet

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None else None

    # ---- starting
    def spawn(self) -> None:
        """Start a link process on a new socketpair the broker takes on."""
        from .upgrade import python_main

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        try:
            self.broker.attach_link(ours.fileno())
        except ValueError:
            ours.close()
            theirs.close()
            raise
        ours.detach()
        r, w = os.pipe()
        real_stderr = os.dup(2)
        # Not "python -m": the directory sbusd was started in must not shadow the package.
        argv = [*python_main("sbus.sbusd.link"), "--fd", str(theirs.fileno()),
                "--upstream", self.cfg.upstream, "--buffer", str(self.cfg.upstream_buffer),
                "--flood", self.cfg.upstream_flood, "--stderr-fd", str(real_stderr),
                "--max-message", str(self.cfg.max_message)]
        for pattern in self.cfg.upstream_export:
            argv += ["--export", pattern]
        try:
            # stdout is how a parent learns that sbusd listens: the link must not hold it.
            self.process = subprocess.Popen(
                argv, pass_fds=(theirs.fileno(), real_stderr), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=w)
        finally:
            theirs.close()
            os.close(w)
            os.close(real_stderr)
        os.set_blocking(r, False)
        self.start_pipe = r
        self.early = b""
        self.started_at = time.monotonic()

    def start(self, broker) -> None:
        """The first link: wait until it runs; LinkFailed says why it does not."""
        self.broker = broker
        self.spawn()
        deadline = time.monotonic() + START_TIMEOUT
        late = False
        while self.start_pipe is not None and not late:
            left = deadline - time.monotonic()
            late = left <= 0
            if not late:
                select.select([self.start_pipe], [], [], left)
                self.read_start_pipe()
        if self.early.endswith(STARTED):
            return
        try:
            self.process.wait(0 if late else EXIT_WAIT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        reason = f"the link did not start within {START_TIMEOUT:g} s" if late else self.reason()
        self.log.error(schema.UPSTREAM_LINK_FAILED, address=self.cfg.upstream, reason=reason,
                       returncode=self.process.returncode, restarts=0, in_s=None)
        raise LinkFailed(reason)

    def adopt(self, broker, process) -> None:
        """A live upgrade's new process: watch the old one's link, or start one."""
        self.broker = broker
        self.process = process
        self.started_at = time.monotonic()
        if process is None:
            self.restart_at = time.monotonic()
            self.due = True

    def read_start_pipe(self) -> None:
        """What the link wrote on its stderr before it started: passed on to
        ours, kept for the reason; closed at its end (the link started, or died)."""
        while self.start_pipe is not None:
            try:
                data = os.read(self.start_pipe, 65536)
            except BlockingIOError:
                return
            if data:
                self.early = (self.early + data)[-65536:]
                said = data.replace(STARTED, b"")
                if said:
                    try:
                        os.write(2, said)
                    except OSError:
                        pass
                continue
            os.close(self.start_pipe)
            self.start_pipe = None

    def reason(self) -> str:
        """Why the link ended: its last words on stderr before it started, or how it ended."""
        how = ended(self.process.returncode if self.process is not None else None)
        if self.early.endswith(STARTED) or not last_line(self.early):
            return f"the link ended ({how})"
        return f"the link could not start ({how}): {last_line(self.early)}"

    # ---- watching
    def tick(self) -> None:
        """Each broker tick, inside the loop: only look; act() does the rest."""
        if self.start_pipe is not None:
            self.read_start_pipe()
        if self.due:
            return
        if self.away is not None:
            self.due = True
            self.stop_turn()
        elif self.process is None:
            if self.restart_at is not None and time.monotonic() >= self.restart_at:
                self.due = True
                self.stop_turn()
        elif self.process.poll() is not None:
            self.due = True
            self.stop_turn()

    def act(self) -> None:
        """Between two turns: note a dead link, or start the next one."""
        if not self.due:
            return
        self.due = False
        if self.away is not None:
            self.show_away(self.away)
        if self.process is not None:
            self.died()
        elif self.restart_at is not None and time.monotonic() >= self.restart_at:
            try:
                self.spawn()
            except ValueError:
                # The broker has not closed the old connection yet: next tick.
                self.restart_at = time.monotonic()
                return
            except OSError as e:
                self.process = None
                self.early = str(e).encode()
                self.died()
                return
            self.restart_at = None
            self.restarts += 1
            self.log.info(schema.UPSTREAM_LINK_RESTARTED, address=self.cfg.upstream,
                          pid=self.process.pid, restarts=self.restarts)

    def died(self) -> None:
        if self.start_pipe is not None:
            self.read_start_pipe()
        if self.start_pipe is not None:
            os.close(self.start_pipe)
            self.start_pipe = None
        reason = self.reason()
        returncode = self.process.returncode if self.process is not None else None
        if time.monotonic() - self.started_at >= HEALTHY_AFTER:
            self.failures = 0
        self.failures += 1
        wait = BACKOFF.delay(self.failures)
        self.process = None
        self.restart_at = time.monotonic() + wait
        self.log.error(schema.UPSTREAM_LINK_FAILED, address=self.cfg.upstream, reason=reason,
                       returncode=returncode, restarts=self.restarts, in_s=round(wait, 3))
        self.show_away(f"{reason}; restarting in {wait:.1f} s")

    def show_away(self, reason: str) -> None:
        """``CMSG stats`` shows the upstream away with the reason until a new
        link reports: a connection that says so as a link would, and leaves."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.broker.attach_link(ours.fileno())
        except ValueError:
            # The dead link's connection is not closed yet: again next tick.
            ours.close()
            theirs.close()
            self.away = reason
            return
        ours.detach()
        self.away = None
        state = {"state": "away", "address": self.cfg.upstream, "identity": None,
                 "patterns": 0, "held": 0, "reason": reason, "link_restarts": self.restarts}
        theirs.send(b"CMSG link/state\0" + json.dumps(state).encode())
        theirs.close()

    # ---- stopping
    def stop(self) -> None:
        """After the broker closed: the link leaves once its end of the
        socketpair closes; logged with how it ended."""
        if self.process is not None:
            try:
                self.process.wait(EXIT_WAIT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(EXIT_WAIT)
            self.log.info(schema.UPSTREAM_LINK_EXIT, returncode=self.process.returncode)
        if self.start_pipe is not None:
            self.read_start_pipe()      # it died starting: its words go to our stderr
        if self.start_pipe is not None:
            os.close(self.start_pipe)
            self.start_pipe = None


def announce_started(stderr_fd: Optional[int]) -> None:
    """In the link, once it runs: say so on the start pipe and put sbusd's
    stderr back in its place."""
    if stderr_fd is None:
        return
    sys.stderr.flush()
    os.write(2, STARTED)
    os.dup2(stderr_fd, 2)
    os.close(stderr_fd)
