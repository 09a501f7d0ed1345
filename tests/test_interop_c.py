"""A C client written against the original libsbus API (tests/c/) must work
unchanged with sbusd, which it starts itself the way the original C test
suite did: fork/exec ``sbusd -fa/dev/unix/abstract`` with stdout on a pipe,
read the printed address until EOF (under alarm(1)), then connect."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from support import SBUSD

C_DIR = Path(__file__).resolve().parent / "c"
TIMEOUT = 30.0

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def interop(tmp_path_factory) -> Path:
    """tests/c/interop.c compiled (warnings are errors: it is our own code)."""
    exe = tmp_path_factory.mktemp("interop") / "interop"
    proc = subprocess.run(
        ["gcc", "-std=c99", "-D_DEFAULT_SOURCE", "-O2", "-Wall", "-Wextra", "-Werror",
         "-o", str(exe), str(C_DIR / "interop.c")],
        capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    return exe


def run_interop(exe: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(exe), SBUSD, *args], capture_output=True, text=True,
                          timeout=TIMEOUT)
    # stderr carries sbusd's own log records too; the verdict is ours.
    assert proc.returncode == 0 and proc.stdout == "interop: ok\n", (
        f"rc={proc.returncode} stdout={proc.stdout!r}\nstderr:\n{proc.stderr}")
    return proc


def test_c_client_random_abstract_address_sigint_ends_sbusd_with_0(interop):
    """sbusd -fa/dev/unix/abstract: subscribe, unsubscribe, 100 ordered
    messages, EAGAIN under MSG_DONTWAIT; SIGINT then gives exit status 0."""
    run_interop(interop, "abstract")


def test_c_client_auto_close_ends_sbusd_with_0(interop):
    """sbusd -cfa/dev/unix/abstract: closing the only client ends it with 0."""
    run_interop(interop, "abstract", "-c")


def test_c_client_filesystem_socket_with_fa_path_cr(interop, tmp_path):
    """sbusd -fa PATH -cr over a stale socket left at PATH: it replaces it,
    serves the C client, exits 0 when the client leaves and removes PATH."""
    path = tmp_path / "interop.socket"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(path))
    stale.close()
    assert path.exists()
    run_interop(interop, "path", str(path))
    assert not os.path.lexists(path)
