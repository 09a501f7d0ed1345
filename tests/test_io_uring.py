"""The io_uring backend where the kernel allows it, and the fallback to epoll
where it does not: sbusd run under a seccomp filter (tests/c/no_io_uring.c)
that refuses the io_uring syscalls as container profiles and
kernel.io_uring_disabled do. (Its behaviour under load runs with every
other backend's: the ``backend`` fixture.)"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from sbus import logschema as ls

from support import Sbusd

C_DIR = Path(__file__).resolve().parent / "c"
ENOSYS, EPERM = 38, 1


@pytest.fixture(scope="module")
def no_io_uring(tmp_path_factory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler (cc) to build the seccomp launcher")
    if platform.machine() != "x86_64":
        pytest.skip("the seccomp filter names x86_64's syscall numbers")
    exe = tmp_path_factory.mktemp("no_io_uring") / "no_io_uring"
    proc = subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(exe),
                           str(C_DIR / "no_io_uring.c")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return exe


def kernel_offers_io_uring() -> bool:
    try:
        return Path("/proc/sys/kernel/io_uring_disabled").read_text().strip() == "0"
    except OSError:
        return False


def round_trip(b: Sbusd) -> None:
    with b.connect() as s:
        s.sub("hello/")
        s.sync()
        s.pub("hello/there", b"hi")
        assert s.next_packet(timeout=5) == b"MSG hello/there\0hi"


def warnings(b: Sbusd) -> list:
    return [r["detail"] for r in b.events(ls.CONFIG_WARNING)]


@pytest.mark.skipif(not kernel_offers_io_uring(), reason="this kernel does not offer io_uring")
def test_io_uring_serves_where_the_kernel_offers_it(tmp_path):
    address = str(tmp_path / "sbus.socket")
    b = Sbusd(tmp_path, ["-f", "-a", address, "--backend", "io_uring"], address=address).ready(10)
    try:
        round_trip(b)
        assert b.stats()["backend"] == "io_uring"
        assert warnings(b) == []
        start = b.events(ls.BROKER_START)[0]
        assert start["config"]["backend"] == "io_uring"
    finally:
        assert b.stop() == 0


@pytest.mark.parametrize("err, why", [(ENOSYS, "Function not implemented"),
                                      (EPERM, "Operation not permitted")],
                         ids=["ENOSYS", "EPERM"])
def test_refused_io_uring_falls_back_to_epoll_with_a_warning(tmp_path, no_io_uring, err, why):
    address = str(tmp_path / "sbus.socket")
    b = Sbusd(tmp_path, ["-f", "-a", address, "--backend", "io_uring"], address=address,
              wrapper=[str(no_io_uring), str(err)]).ready(10)
    try:
        round_trip(b)
        assert b.stats()["backend"] == "epoll"
        assert warnings(b) == [
            f"--backend io_uring: io_uring is unavailable (io_uring_setup: {why}): using epoll"]
    finally:
        assert b.stop() == 0


def test_the_filter_refuses_io_uring_and_nothing_else(no_io_uring):
    # The launcher itself: io_uring_setup fails with the errno asked for,
    # and an ordinary syscall still works.
    probe = ("import ctypes, os\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "r = libc.syscall(425, 4, ctypes.create_string_buffer(120))\n"
             "print(r, ctypes.get_errno(), os.getpid() > 0)\n")
    out = subprocess.run([str(no_io_uring), str(EPERM), os.sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["-1", str(EPERM), "True"], out.stderr
