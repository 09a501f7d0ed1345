"""Each release wheel installed as on a host: a fresh virtual environment of
that version's interpreter (Debian's own python3.X when there is one: another
build of CPython than the one the wheel was built with), installed from dist/
with ``--no-index --only-binary :all:``; every compiler on PATH is a shim that
fails and CC is /bin/false. The installed ``sbusd`` runs, and the installed
``sbus`` tool and ``sbus.Client`` publish, subscribe, ask ``whoami`` and
``stats`` through it. A version without an interpreter is skipped, naming it.
"""
from __future__ import annotations

import json
import platform
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from support.release import (
    ROOT,
    TIMEOUT,
    check_installed,
    compiler_shims,
    host_env,
    host_python,
    install_wheel,
    make_venv,
    run,
    runtime_requirements,
    versions,
    wait_readable,
    wheel_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@versions
def test_wheel_installs_and_runs_without_a_compiler(dist, dependency_wheels, ver, tmp_path):
    wheel_for(dist, ver)
    venv = make_venv(host_python(ver), tmp_path / "host")
    home = tmp_path / "home"
    home.mkdir()
    env = host_env(venv, home, compiler_shims(tmp_path / "shims"))
    install_wheel(dist, dependency_wheels(ver, *runtime_requirements()), venv, env)
    check_installed(venv, home, env)
    if platform.machine() == "x86_64" and shutil.which("cc"):
        without_io_uring(venv / "bin", env, home, seccomp_launcher(tmp_path))


def seccomp_launcher(where: Path) -> Path:
    """tests/c/no_io_uring.c, built before the host's PATH hides the compiler."""
    exe = where / "no_io_uring"
    run(["cc", "-O2", "-Wall", "-o", exe, ROOT / "tests" / "c" / "no_io_uring.c"])
    return exe


def without_io_uring(bin_: Path, env: dict, work: Path, launcher: Path) -> None:
    """The installed sbusd asked for io_uring on a host that refuses it (a
    seccomp filter, as in containers): it serves on epoll and says so."""
    address = work / "no-uring.socket"
    log = work / "no-uring.log"
    broker = subprocess.Popen(
        [launcher, "38", bin_ / "sbusd", "-f", "-a", address, "--backend", "io_uring",
         "--log-format", "json", "--log-file", log],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=work)
    try:
        wait_readable(broker.stdout, "sbusd under the seccomp filter")
        assert broker.stdout.read() == b"" and address.exists(), broker.stderr.read()
        stats = json.loads(run([bin_ / "sbus", "stats", "-a", address], env=env, cwd=work).stdout)
        assert stats["backend"] == "epoll", stats
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(TIMEOUT) == 0, broker.stderr.read()
        warned = [r["detail"] for r in map(json.loads, log.read_text().splitlines())
                  if r["event"] == "config_warning"]
        assert warned == ["--backend io_uring: io_uring is unavailable "
                          "(io_uring_setup: Function not implemented): using epoll"], warned
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()
