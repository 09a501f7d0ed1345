"""systemd's part, played by the tests: the units under tools/systemd read as
systemd reads them, socket activation (ACTIVATE), the notify socket (Notify),
and the seccomp sandbox the broker's unit asks for (SANDBOX)."""
from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .sbusd import ROOT

TIMEOUT = 10.0

UNITS = ROOT / "tools" / "systemd"


def read_unit(name: str) -> dict:
    """{section: [(key, value), ...]} from a unit file, keeping repeated keys."""
    sections: dict = {}
    current = None
    for raw in (UNITS / name).read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def values(section: list, key: str) -> list:
    return [v for k, v in section if k == key]


# What systemd does between fork() and exec() for a socket-activated service
# (src/core/execute.c): the socket at fd 3 (inheritable), LISTEN_FDS,
# LISTEN_FDNAMES, and LISTEN_PID set to the pid that will exec the service.
# argv: FD LISTEN_PID|self PROGRAM ARGS...; exec keeps the pid, so the program
# (sbusd, or the sandbox below, which execs sbusd in turn) runs as that pid.
ACTIVATE = r"""
import os, sys
fd, listen_pid = int(sys.argv[1]), sys.argv[2]
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.set_inheritable(3, True)
os.environ["LISTEN_FDS"] = os.environ.get("TEST_LISTEN_FDS", "1")
os.environ["LISTEN_FDNAMES"] = "sbusd.socket"
os.environ["LISTEN_PID"] = str(os.getpid()) if listen_pid == "self" else listen_pid
os.execv(sys.argv[3], sys.argv[3:])
"""


class Notify:
    """The manager's end of ``$NOTIFY_SOCKET``: a datagram socket with SO_PASSCRED."""

    def __init__(self, tmp_path: Path, abstract: bool):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        if abstract:
            name = f"sbus-test-notify-{os.getpid()}-{time.monotonic_ns()}"
            self.sock.bind("\0" + name)
            self.env = "@" + name
        else:
            path = str(tmp_path / "notify")
            self.sock.bind(path)
            self.env = path
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)

    def recv(self, timeout=TIMEOUT):
        """(state, sender pid) of the next datagram; None if none within timeout."""
        self.sock.settimeout(timeout)
        try:
            data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except (socket.timeout, BlockingIOError):
            return None
        pid = None
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", payload[:12])[0]
        return data.decode(), pid

    def pending(self):
        """The datagram already queued, without waiting at all."""
        self.sock.setblocking(False)
        return self.recv(timeout=0)

    def close(self):
        self.sock.close()


def seqpacket_listener(path: Path, kind=socket.SOCK_SEQPACKET) -> socket.socket:
    """What systemd does for ListenSequentialPacket=: socket, bind, listen."""
    s = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
    s.bind(str(path))
    s.listen(socket.SOMAXCONN)
    return s


# Installs, like systemd 252 (src/shared/seccomp-util.c), an allow-list filter
# whose default action kills the process (SystemCallFilter=), a filter making
# W+X mmap and PROT_EXEC mprotect/pkey_mprotect and SHM_EXEC shmat fail with
# EPERM (MemoryDenyWriteExecute=), and one making socket() of other families
# fail with EAFNOSUPPORT (RestrictAddressFamilies=AF_UNIX); optionally a new
# network namespace first (PrivateNetwork=). argv: SPEC_JSON PROGRAM ARGS...
SANDBOX = r"""
import ctypes, errno, json, os, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
if spec["netns"] and libc.unshare(0x40000000) != 0:
    sys.exit("sandbox: unshare(CLONE_NEWNET): " + os.strerror(ctypes.get_errno()))
if libc.prctl(38, 1, 0, 0, 0) != 0:
    sys.exit("sandbox: PR_SET_NO_NEW_PRIVS failed")
lib = ctypes.CDLL(spec["libseccomp"])
class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                       ctypes.c_uint, ctypes.POINTER(Cmp)]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
ALLOW, KILL_PROCESS = 0x7fff0000, 0x80000000
ERRNO = lambda e: 0x00050000 | e
NE, MASKED_EQ = 1, 7
def nr(name):
    return lib.seccomp_syscall_resolve_name(name.encode())
filters = []
if spec["mdwe"]:
    f = lib.seccomp_init(ALLOW)
    for name, mask in (("mmap", 2 | 4), ("mprotect", 4), ("pkey_mprotect", 4),
                       ("shmat", 0o100000)):
        cmp = Cmp(2, MASKED_EQ, mask, mask)
        assert lib.seccomp_rule_add_array(f, ERRNO(errno.EPERM), nr(name), 1, ctypes.byref(cmp)) == 0
    filters.append(f)
if spec["families"] is not None:
    f = lib.seccomp_init(ALLOW)
    assert spec["families"] == [1], "only AF_UNIX is emulated"
    cmp = Cmp(0, NE, 1, 0)
    assert lib.seccomp_rule_add_array(f, ERRNO(errno.EAFNOSUPPORT), nr("socket"), 1, ctypes.byref(cmp)) == 0
    filters.append(f)
if spec["allow"] is not None:       # last: it does not allow seccomp(2) itself
    f = lib.seccomp_init(KILL_PROCESS)
    for name in spec["allow"]:
        if nr(name) >= 0:
            lib.seccomp_rule_add_array(f, ALLOW, nr(name), 0, None)
    filters.append(f)
for f in filters:
    if lib.seccomp_load(ctypes.c_void_p(f)) != 0:
        sys.exit("sandbox: seccomp_load failed")
os.execv(sys.argv[2], sys.argv[2:])
"""


def syscall_group(analyze: str, name: str, seen=None) -> set:
    """The syscalls in a systemd @group, nested groups expanded."""
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    out = subprocess.run([analyze, "syscall-filter", name], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    names = set()
    for line in out.splitlines()[1:]:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        names |= syscall_group(analyze, line, seen) if line.startswith("@") else {line}
    return names


def sandbox_spec(analyze: str, libseccomp: str) -> dict:
    """The seccomp setup tools/systemd/sbusd.service asks systemd for."""
    svc = read_unit("sbusd.service")["Service"]
    allow = None
    for value in values(svc, "SystemCallFilter"):
        deny = value.startswith("~")
        items = set()
        for item in value.lstrip("~").split():
            items |= syscall_group(analyze, item) if item.startswith("@") else {item}
        if allow is None:
            # The first assignment decides: an allow list, plus @default.
            assert not deny, "the unit should start from an allow list"
            allow = items | syscall_group(analyze, "@default")
        elif deny:
            allow -= items
        else:
            allow |= items
    families = values(svc, "RestrictAddressFamilies")
    return {
        "libseccomp": libseccomp,
        "allow": sorted(allow) if allow is not None else None,
        "mdwe": values(svc, "MemoryDenyWriteExecute") == ["yes"],
        "families": [int(socket.AF_UNIX)] if families == ["AF_UNIX"] else None,
        "netns": values(svc, "PrivateNetwork") == ["yes"],
    }


def sandbox_command() -> list:
    """argv prefix that runs a program inside the unit's sandbox (SANDBOX);
    skips the calling test where this host cannot build it."""
    analyze = shutil.which("systemd-analyze")
    libseccomp = ctypes.util.find_library("seccomp")
    if analyze is None or libseccomp is None:
        pytest.skip("needs systemd-analyze and libseccomp (Debian: apt-get install systemd)")
    spec = sandbox_spec(analyze, libseccomp)
    if spec["netns"]:
        probe = subprocess.run(
            [sys.executable, "-c", "import ctypes, sys; "
             "sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0)"],
            timeout=TIMEOUT)
        if probe.returncode != 0:
            pytest.skip("cannot create a network namespace here to emulate PrivateNetwork=yes")
    return [sys.executable, "-c", SANDBOX, json.dumps(spec)]
