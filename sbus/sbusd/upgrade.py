"""Live upgrade: a running sbusd hands its listening socket, every client
connection and their whole state to a freshly started sbusd (docs/upgrade.md).

The old process (``Predecessor``), on SIGUSR2:

1. makes a socketpair and starts a new sbusd from the executable on disk with
   its own command line, the other end inherited (``HANDOVER_FD_ENV``); it
   keeps serving while the new one starts;
2. once the new one says ``HELLO <format version>``, exports every
   connection's subscriptions between two turns and,
   from a thread while the loop serves, sends ``PREPARE`` (what the process
   knows: the socket's path, the link's pid; with the listening socket) and
   the subscriptions in ``SUBS`` chunks, then ``END``; the new one indexes
   them and says ``PREBUILT``;
3. stops its loop at the safe point (between turns, everything read
   delivered or queued, closings torn down: ``handover.quiesce``) and sends
   ``STATE``, the state blob in ``DATA`` chunks and the connections in
   ``FDS`` chunks (SCM_RIGHTS, at most ``SCM_MAX_FD`` each), then ``END``;
4. waits for ``READY`` (the new one rebuilt everything, read nothing), sends
   ``GO`` and waits for ``DONE`` (the new one owns the pidfile and told
   systemd its main pid); then exits without closing any client.

Anything that goes wrong before GO (the new one fails to start, dies, hangs,
speaks another format, refuses the state) kills the new one: the old one
resumes its loop with nothing lost, logs ``upgrade_failed`` and writes the
outcome beside the pidfile, where ``sbusd --upgrade`` (``request``) reads it.

``SBUSD_UPGRADE_FAIL=<step>`` (``FAIL_ENV``, one of ``STEPS``) makes either
process fail at that step, for the tests.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, List, Optional

from .. import logschema as schema
from .._version import __version__
from ..atomicfile import write_atomically
from .lifecycle import ON_ITS_WAY, alive, read_pid, signal_and_wait, write_outcome

HANDOVER_FD_ENV = "SBUSD_UPGRADE_FD"    # the new process's end of the socketpair
FAIL_ENV = "SBUSD_UPGRADE_FAIL"         # a step of STEPS: fail there (tests)
STEPS = (
    "spawn",         # old: the new sbusd cannot be started
    "start",         # new: exits before saying hello
    "hello",         # new: says something that is no hello
    "version",       # new: speaks a hand-over format the old one does not
    "prebuild",      # new: fails to index the subscriptions sent ahead
    "send-state",    # old: fails in the middle of sending the state
    "corrupt",       # old: sends a state with a flipped byte
    "blob-version",  # old: sends a state of an unknown format version
    "truncated",     # old: sends half the state
    "transfer",      # new: dies in the middle of the transfer
    "send-fds",      # old: fails in the middle of sending the descriptors
    "restore",       # new: fails to rebuild the state
    "ready",         # new: dies instead of saying ready
    "before-go",     # old: fails after ready, before go
)
STATUS_SUFFIX = ".upgrade"      # beside the pidfile: the last upgrade's outcome
HELLO_TIMEOUT = 30.0    # seconds the new sbusd has to start (the old one serves meanwhile)
STEP_TIMEOUT = 10.0     # seconds for each step of the transfer (nobody is served)
REQUEST_TIMEOUT = 60.0  # seconds sbusd --upgrade waits for the outcome
CHUNK = 65536           # state bytes per packet on the socketpair (its default
#                         send buffer, 208 KiB, holds a few)
SCM_MAX_FD = 253        # descriptors one sendmsg may carry (Linux)


def python_main(module: str) -> List[str]:
    """The command that runs ``module``'s ``main()`` in this Python, from the
    installed package: -c puts the working directory first on sys.path, and
    nothing may be imported from there, where a source checkout's ``sbus/``
    may be (python -P would say so, from 3.11 on). The new sbusd of an upgrade
    and the upstream link start this way."""
    return [sys.executable, "-c",
            f"import sys; del sys.path[0]; from {module} import main; sys.exit(main())"]


class UpgradeFailed(Exception):
    """A hand-over that cannot go on; ``step`` names where it stopped."""

    def __init__(self, step: str, reason: str):
        super().__init__(reason)
        self.step = step
        self.reason = reason


def ms_since(start: float) -> float:
    return round((time.monotonic() - start) * 1000, 3)


def injected(step: str) -> bool:
    return os.environ.get(FAIL_ENV) == step


def status_path(pidfile: str) -> str:
    return pidfile + STATUS_SUFFIX


def write_status(pidfile: Optional[str], **outcome) -> None:
    write_outcome(pidfile, STATUS_SUFFIX, outcome)


class Channel:
    """One end of the hand-over's SOCK_SEQPACKET socketpair."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setblocking(True)

    def send(self, packet: bytes, fds: List[int] = ()) -> None:
        self.sock.settimeout(STEP_TIMEOUT)
        try:
            if fds:
                socket.send_fds(self.sock, [packet], list(fds))
            else:
                self.sock.send(packet)
        except socket.timeout:
            raise UpgradeFailed("send", f"the other sbusd took no packet within "
                                        f"{STEP_TIMEOUT:g} s") from None
        except OSError as e:
            raise UpgradeFailed("send", f"the hand-over socket failed: {e.strerror or e}") from None

    def recv(self, step: str, timeout: float = STEP_TIMEOUT):
        """(packet, fds); the peer's end closing or silence is UpgradeFailed."""
        self.sock.settimeout(timeout)
        try:
            packet, fds, _, _ = socket.recv_fds(self.sock, CHUNK + 64, SCM_MAX_FD,
                                                socket.MSG_CMSG_CLOEXEC)
        except socket.timeout:
            raise UpgradeFailed(step, f"no answer within {timeout:g} s") from None
        except OSError as e:
            raise UpgradeFailed(step, f"the hand-over socket failed: {e.strerror or e}") from None
        if not packet:
            raise UpgradeFailed(step, "the other sbusd closed the hand-over socket "
                                      "(it exited?)")
        return packet, fds

    def close(self) -> None:
        self.sock.close()


# ---- the old process -----------------------------------------------------------

class Attempt:
    """One upgrade under way: the new process and the channel to it."""

    def __init__(self, argv: List[str], start_dir: str, meta: dict, listen_fd: int):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.channel = Channel(ours)
        self.meta = meta
        self.listen_fd = listen_fd
        # The phase the thread reached, for the loop: "starting", "hello" (the
        # loop is to export the subscriptions), "prebuilt" (to stop at the
        # safe point); or a failure.
        self.phase = "starting"
        self.failure: Optional[UpgradeFailed] = None
        self.subscriptions: Optional[bytes] = None
        self.exported = threading.Event()
        self.aborted = False        # the thread's last wake-up is no one's any more
        try:
            if injected("spawn"):
                raise OSError("injected failure")
            self.proc = subprocess.Popen(
                [*python_main("sbus.sbusd.main"), *argv],
                pass_fds=(theirs.fileno(),), cwd=start_dir, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env={**os.environ, HANDOVER_FD_ENV: str(theirs.fileno())})
        except OSError as e:
            self.channel.close()
            raise UpgradeFailed("spawn", f"cannot start {sys.executable}: "
                                         f"{e.strerror or e}") from None
        finally:
            theirs.close()
        threading.Thread(target=self.prepare, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def prepare(self) -> None:
        """In a thread, so the loop serves meanwhile: wait for the new one's
        hello, have the loop export the subscriptions, send them with the
        listening socket and wait until the new one has indexed them. Wakes
        the loop with SIGUSR2 after the hello and at the end, either way."""
        try:
            self.hello()
            self.phase = "hello"
            self.wake()
            if not self.exported.wait(HELLO_TIMEOUT) or self.subscriptions is None:
                raise UpgradeFailed("prebuild", "the subscriptions were not exported")
            ch = self.channel
            ch.send(b"PREPARE " + json.dumps(self.meta).encode(), [self.listen_fd])
            blob, self.subscriptions = self.subscriptions, None
            for at in range(0, len(blob), CHUNK):
                ch.send(b"SUBS" + blob[at:at + CHUNK])
            ch.send(b"END")
            packet, _ = ch.recv("prebuild", HELLO_TIMEOUT)
            if packet.startswith(b"ERROR "):
                raise UpgradeFailed("prebuild", packet[6:].decode("utf-8", "replace"))
            if packet != b"PREBUILT":
                raise UpgradeFailed("prebuild", f"the new sbusd said {packet[:60]!r}")
            self.phase = "prebuilt"
        except UpgradeFailed as e:
            self.failure = e
        self.wake()

    def wake(self) -> None:
        """Have the loop look at the phase (SIGUSR2), unless it gave up on us."""
        if not self.aborted:
            os.kill(os.getpid(), signal.SIGUSR2)

    def hello(self) -> None:
        from .._core.handover import FORMAT_VERSION
        packet, _ = self.channel.recv("hello", HELLO_TIMEOUT)
        if packet.startswith(b"REFUSE "):
            step, _, reason = packet[7:].decode("utf-8", "replace").partition(" ")
            raise UpgradeFailed(step, reason)
        words = packet.split()
        if len(words) < 2 or words[0] != b"HELLO" or not words[1].isdigit():
            raise UpgradeFailed("hello", f"the new sbusd said {packet[:60]!r}, not hello")
        if int(words[1]) != FORMAT_VERSION:
            raise UpgradeFailed("version", f"the new sbusd speaks hand-over format "
                                           f"{int(words[1])}, this one {FORMAT_VERSION}")

    def abort(self) -> None:
        """Make sure the new process is gone: it has read nothing."""
        self.aborted = True
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def transfer(self, broker) -> dict:
        """At the safe point: the state, the connections; returns the figures
        for the log. Raises
        UpgradeFailed before GO; after GO the new process serves."""
        from .._core import handover
        handover.quiesce(broker)
        paused_at = time.monotonic()
        try:
            blob, fds = handover.export_state(broker)
        except (handover.HandoverError, MemoryError) as e:
            raise UpgradeFailed("export", str(e)) from None
        export_ms = ms_since(paused_at)
        if injected("corrupt"):
            blob = blob[:-1] + bytes([blob[-1] ^ 0xFF])
        elif injected("blob-version"):
            blob = blob[:8] + (99).to_bytes(4, "little") + blob[12:]
        elif injected("truncated"):
            blob = blob[:len(blob) // 2]
        ch = self.channel
        # fds[0], the listening socket, went with the subscriptions.
        ch.send(b"STATE " + json.dumps({"bytes": len(blob), "fds": len(fds) - 1}).encode())
        for at in range(0, len(blob), CHUNK):
            ch.send(b"DATA" + blob[at:at + CHUNK])
            if injected("send-state"):
                raise UpgradeFailed("send-state", "injected failure")
        for at in range(1, len(fds), SCM_MAX_FD):
            ch.send(b"FDS", fds[at:at + SCM_MAX_FD])
            if injected("send-fds"):
                raise UpgradeFailed("send-fds", "injected failure")
        ch.send(b"END")
        packet, _ = ch.recv("ready")
        if packet.startswith(b"ERROR "):
            raise UpgradeFailed("restore", packet[6:].decode("utf-8", "replace"))
        if packet != b"READY":
            raise UpgradeFailed("ready", f"the new sbusd said {packet[:60]!r}, not ready")
        if injected("before-go"):
            raise UpgradeFailed("before-go", "injected failure")
        ch.send(b"GO")
        # From here the new process serves: there is no way back.
        try:
            ch.recv("done")
        except UpgradeFailed:
            pass        # it serves all the same; it could not tell us it took over
        return {"new_pid": self.pid, "clients": len(fds) - 1, "state_bytes": len(blob),
                "pause_ms": ms_since(paused_at), "export_ms": export_ms}


class Predecessor:
    """The running broker's side of an upgrade. SIGUSR2, the operator's or
    the attempt's thread's, only ends the loop's turn; the loop then calls
    act(), between two turns, where starting a process, logging, exporting
    and handing over are safe."""

    def __init__(self, cfg, argv: List[str], start_dir: str, log, listener,
                 link_pid: Callable[[], Optional[int]]):
        self.cfg = cfg
        self.argv = argv
        self.start_dir = start_dir
        self.log = log
        self.listener = listener
        self.link_pid = link_pid    # the running link's, now: it may have been restarted
        self.broker = None
        self.attempt: Optional[Attempt] = None

    def act(self) -> bool:
        """Between two turns, after a SIGUSR2: start an upgrade, or take the
        one under way a step further (the new sbusd said hello, has indexed
        the subscriptions, or failed). True once the new process serves."""
        attempt = self.attempt
        if attempt is None:
            self.start()
        elif attempt.failure is not None:
            self.failed(attempt.failure)
        elif attempt.phase == "hello" and not attempt.exported.is_set():
            self.export_subscriptions()
        elif attempt.phase == "prebuilt":
            return self.hand_over()
        # else: the operator again, while one is under way: one upgrade at a time
        return False

    def start(self) -> None:
        meta = {"old_pid": os.getpid(), "version": __version__,
                "path": os.fsdecode(self.listener.path) if self.listener.path else None,
                "printed_address": self.listener.printed_address,
                "abstract": self.listener.abstract, "link_pid": self.link_pid()}
        try:
            self.attempt = Attempt(self.argv, self.start_dir, meta, self.listener.sock.fileno())
        except UpgradeFailed as e:
            return self.failed(e)
        self.log.info(schema.UPGRADE_STARTED, new_pid=self.attempt.pid)

    def export_subscriptions(self) -> None:
        """The subscriptions, for the new process to index while this one serves on."""
        from .._core import handover
        self.attempt.subscriptions = handover.export_subscriptions(self.broker)
        self.attempt.exported.set()

    def failed(self, e: UpgradeFailed) -> None:
        new_pid = None
        if self.attempt is not None:
            new_pid = self.attempt.pid
            self.attempt.abort()
            self.attempt = None
        self.log.error(schema.UPGRADE_FAILED, step=e.step, reason=e.reason, new_pid=new_pid)
        write_status(self.cfg.pidfile, result="failed", pid=os.getpid(), step=e.step,
                     reason=e.reason)

    def hand_over(self) -> bool:
        """At the safe point (between two turns): True once the new process
        serves; False when it failed and this one serves on."""
        try:
            figures = self.attempt.transfer(self.broker)
        except UpgradeFailed as e:
            self.failed(e)
            return False
        self.log.info(schema.UPGRADE_HANDED_OVER, **figures)
        return True

    def abandon(self) -> None:
        """Stopping for another reason: an upgrade under way ends with us."""
        if self.attempt is not None:
            self.attempt.abort()
            self.attempt = None


# ---- the new process -----------------------------------------------------------

class AdoptedLink:
    """The running upstream link of the old process, watched through a pidfd:
    it is not our child, so it has no exit status for us."""

    returncode = None

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError:
            self.pidfd = None       # gone already

    def wait(self, timeout: float) -> None:
        if self.pidfd is None:
            return
        # poll(2): after a hand-over of many clients the pidfd is past select's 1024.
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            raise subprocess.TimeoutExpired(["sbusd-link"], timeout)

    def poll(self) -> Optional[bool]:
        """None while it runs; True once it is gone (with no status for us)."""
        if self.pidfd is None:
            return True
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return True if poller.poll(0) else None

    def kill(self) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass


class Successor:
    """The new process's side: hello, the listener and the subscriptions
    (prebuild), the state (restore), ready, and on GO take over the pidfile
    and systemd's main pid."""

    def __init__(self, fd: int):
        self.channel = Channel(socket.socket(fileno=fd))
        self.meta: dict = {}
        self.blob = b""
        self.fds: List[int] = []      # the listening socket, then the connections
        self.subscriptions = b""
        self.prebuilt = None
        self.started = 0.0
        self.figures: dict = {}     # for the upgrade_done record

    @classmethod
    def from_env(cls) -> Optional["Successor"]:
        fd = os.environ.pop(HANDOVER_FD_ENV, None)
        if fd is None:
            return None
        os.set_inheritable(int(fd), False)
        return cls(int(fd))

    def hello(self) -> None:
        from .._core.handover import FORMAT_VERSION
        if injected("start"):
            os._exit(3)
        if injected("hello"):
            self.channel.send(b"HOLA")
        elif injected("version"):
            self.channel.send(b"HELLO 999 " + __version__.encode())
        else:
            self.channel.send(b"HELLO %d %s" % (FORMAT_VERSION, __version__.encode()))

    def refuse(self, step: str, reason: str) -> None:
        """Instead of hello: this process cannot serve (its --policy file does
        not load); the old one serves on and gives reason as the failure's."""
        try:
            self.channel.send(b"REFUSE %s %s" % (step.encode(), reason.encode()))
        except UpgradeFailed:
            pass        # the old one gave up on us already
        self.channel.close()

    def receive_listener(self):
        """What the old one sends while it still serves: the listening socket
        and the subscriptions, to index ahead (prebuild); the listener."""
        from .lifecycle import Listener
        packet, fds = self.channel.recv("prebuild", HELLO_TIMEOUT)
        if not packet.startswith(b"PREPARE ") or len(fds) != 1:
            raise UpgradeFailed("prebuild", f"expected the listening socket, got {packet[:40]!r}")
        self.meta = json.loads(packet[8:])
        self.fds = fds
        self.subscriptions = self.collect(b"SUBS", "prebuild")
        path = self.meta["path"]
        sock = socket.socket(fileno=fds[0])
        sock.setblocking(False)
        return Listener(sock, os.fsencode(path) if path else None,
                        printed_address=self.meta["printed_address"],
                        abstract=self.meta["abstract"])

    def collect(self, kind: bytes, step: str) -> bytes:
        """The ``kind`` chunks up to END, joined; descriptors go to self.fds."""
        parts = []
        while True:
            packet, fds = self.channel.recv(step)
            self.fds.extend(fds)
            if packet.startswith(kind):
                parts.append(packet[len(kind):])
            elif packet == b"END":
                return b"".join(parts)
            if injected("transfer") and kind == b"DATA" and len(self.fds) > 1:
                os._exit(3)

    def prebuild(self, broker) -> None:
        """Index the subscriptions in ``broker``; PREBUILT or ERROR to the old one."""
        from .._core import handover
        indexing = time.monotonic()
        try:
            if injected("prebuild"):
                raise handover.HandoverError("injected failure")
            self.prebuilt = handover.prebuild(broker, self.subscriptions)
        except (handover.HandoverError, MemoryError) as e:
            self.channel.send(b"ERROR " + str(e).encode())
            raise UpgradeFailed("prebuild", str(e)) from None
        self.subscriptions = b""
        self.figures["prebuild_ms"] = ms_since(indexing)
        self.channel.send(b"PREBUILT")

    def receive_state(self) -> None:
        """At the old one's safe point: the state and the connections."""
        packet, _ = self.channel.recv("state", HELLO_TIMEOUT)
        if not packet.startswith(b"STATE "):
            raise UpgradeFailed("state", f"expected the state, got {packet[:40]!r}")
        self.started = time.monotonic()     # the old one's safe point, near enough
        expected = json.loads(packet[6:])
        self.blob = self.collect(b"DATA", "transfer")
        self.figures["transfer_ms"] = ms_since(self.started)
        if len(self.fds) - 1 != expected["fds"]:
            raise UpgradeFailed("transfer", f"{len(self.fds) - 1} descriptors of "
                                            f"{expected['fds']} arrived")

    def restore(self, broker) -> None:
        """Rebuild the old one's state in ``broker``; READY or ERROR to the old one."""
        from .._core import handover
        rebuilding = time.monotonic()
        try:
            if injected("restore"):
                raise handover.HandoverError("injected failure")
            handover.restore_state(broker, self.blob, self.fds, self.prebuilt)
            self.figures["rebuild_ms"] = ms_since(rebuilding)
        except (handover.HandoverError, MemoryError) as e:
            self.channel.send(b"ERROR " + str(e).encode())
            raise UpgradeFailed("restore", str(e)) from None
        self.blob = b""
        self.prebuilt = None
        if injected("ready"):
            os._exit(3)
        self.channel.send(b"READY")

    def take_over(self, pidfile: Optional[str]) -> None:
        """Wait for GO; then the pidfile, systemd's main pid, DONE."""
        from ..runner import sd_notify
        packet, _ = self.channel.recv("go")
        if packet != b"GO":
            raise UpgradeFailed("go", f"expected go, got {packet[:40]!r}")
        # From here we serve, whatever else fails.
        if pidfile:
            try:
                write_atomically(pidfile, b"%d\n" % os.getpid())
            except OSError as e:
                self.figures["pidfile_error"] = f"{pidfile}: {e.strerror}"
            write_status(pidfile, result="done", pid=os.getpid(), old_pid=self.meta["old_pid"])
        sd_notify(f"MAINPID={os.getpid()}")
        sd_notify("READY=1")
        try:
            self.channel.send(b"DONE")
        except UpgradeFailed:
            pass        # the old one left already: nothing to tell
        self.channel.close()

    def link(self) -> Optional[AdoptedLink]:
        pid = self.meta.get("link_pid")
        return AdoptedLink(pid) if pid else None


# ---- sbusd --upgrade -----------------------------------------------------------

def request(pidfile: Optional[str], timeout: float = REQUEST_TIMEOUT) -> int:
    """``sbusd --upgrade -p PIDFILE``: upgrade the sbusd the pidfile names and
    wait for the outcome: 0 once a new pid serves, 1 with the reason when the
    old one reports a failure (it then serves on), or on a timeout."""
    def judge(pid: int, outcome: dict):
        if outcome.get("result") == "failed" and outcome.get("pid") == pid:
            return 1, (f"pid {pid} serves on; the upgrade failed at "
                       f"{outcome.get('step')}: {outcome.get('reason')}")
        if outcome.get("result") == "done" and outcome.get("old_pid") == pid:
            new = outcome.get("pid")
            if read_pid(pidfile) == new and alive(new):
                return 0, f"sbusd: upgraded: pid {pid} handed over to pid {new}"
            return ON_ITS_WAY   # the old one leaves before the pidfile names the new
        return None

    return signal_and_wait("upgrade", pidfile, STATUS_SUFFIX, signal.SIGUSR2, judge,
                           "exited without handing over", timeout)
