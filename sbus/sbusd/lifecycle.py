"""Process lifecycle for sbusd: the listening socket, daemonising, the
pidfile, signals, and systemd readiness notification.

Daemon mode follows the classic recipe: a readiness pipe, double fork, an
exclusive pidfile written by the daemon itself, and a launcher that exits 0
only once the daemon listens. Signal handlers only stop the loop; cleanup
happens in one ``finally`` in sbusd.main.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import stat
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

from ..address import SUN_PATH_SIZE, Address, format_abstract
from ..atomicfile import write_atomically

SD_LISTEN_FDS_START = 3


class StartupError(Exception):
    """A problem that stops sbusd from starting; the message says what."""


@dataclass
class Listener:
    sock: socket.socket
    path: Optional[bytes]       # the socket file we created and must remove
    printed_address: Optional[str] = None
    abstract: bool = False      # no file mode protects it: sbusd enforces one


def _systemd_socket() -> Optional[socket.socket]:
    """The socket systemd passed as fd 3, if LISTEN_FDS/LISTEN_PID say so."""
    fds, pid = os.environ.get("LISTEN_FDS"), os.environ.get("LISTEN_PID")
    if not fds or not pid:
        return None
    try:
        if int(pid) != os.getpid():
            return None          # meant for another process (e.g. our parent)
        count = int(fds)
    except ValueError:
        raise StartupError(f"bad LISTEN_FDS/LISTEN_PID: {fds!r}/{pid!r}") from None
    for name in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)   # not inherited by anything we start
    if count != 1:
        raise StartupError(f"systemd passed {count} sockets; sbusd takes exactly one")
    return _adopt_fd(SD_LISTEN_FDS_START)


def _adopt_fd(fd: int) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise StartupError(f"/dev/fd/{fd}: {e.strerror}") from None
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
        raise StartupError(f"/dev/fd/{fd} is not a Unix-domain SOCK_SEQPACKET socket")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.listen(socket.SOMAXCONN)
    os.set_inheritable(fd, False)
    return sock


def make_listener(addr: Address, *, reuse: bool, mode: int, warn: Callable[[str], None]) -> Listener:
    """Create (or adopt) the listening socket for an address."""
    inherited = _systemd_socket()
    if inherited is not None or addr.fd is not None:
        if mode != 0o700:
            warn("ignoring -g/-o: the socket was passed down, its mode is not ours to set")
        sock = inherited if inherited is not None else _adopt_fd(addr.fd)
        sock.setblocking(False)
        return Listener(sock, None)

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    if addr.random:
        while True:
            name = b"\0" + secrets.token_bytes(SUN_PATH_SIZE - 1)
            try:
                sock.bind(name)
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise StartupError(f"bind <random abstract address>: {e.strerror}") from None
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
        return Listener(sock, None, printed_address=format_abstract(name), abstract=True)

    path = addr.sun_path
    assert path is not None
    if addr.is_abstract:
        try:
            sock.bind(path)
        except OSError as e:
            raise StartupError(f"bind {addr.text}: {e.strerror}") from None
    else:
        _prepare_path(path, reuse)
        # bind creates the file with mode 0777 & ~umask: set the umask so it
        # gets its final mode at once (no window, and no chmod that could be
        # sent through a symlink swapped in after bind).
        old_umask = os.umask(0o777 & ~mode)
        try:
            sock.bind(path)
        except OSError as e:
            raise StartupError(f"bind {os.fsdecode(path)}: {e.strerror}") from None
        finally:
            os.umask(old_umask)
    sock.listen(socket.SOMAXCONN)
    sock.setblocking(False)
    # Absolute, so a daemon (which chdirs to "/") removes the right file.
    return Listener(sock, None if addr.is_abstract else os.path.abspath(path),
                    abstract=addr.is_abstract)


def _prepare_path(path: bytes, reuse: bool) -> None:
    """Refuse an existing path, or with -r remove it if, and only if, it is a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    shown = os.fsdecode(path)
    live = (f"{shown} is in use: a broker is listening there; use it, or stop it first, or "
            "give this one another -a (-r replaces only a stale socket)")
    if not reuse:
        # Say what is there: a second sbusd on a live socket is not helped by -r.
        if stat.S_ISSOCK(st.st_mode) and _listening(path) is True:
            raise StartupError(live)
        raise StartupError(f"{shown} already exists (use -r to replace a stale socket)")
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{shown} exists and is not a socket; refusing to remove it")
    # Stale means nobody listens: only then may it go.
    listening = _listening(path)
    if isinstance(listening, OSError):
        raise StartupError(f"{shown}: cannot tell whether it is in use ({listening.strerror})")
    if listening:
        raise StartupError(live)
    os.unlink(path)


def _listening(path: bytes):
    """Whether something listens on the socket at ``path``: True, False, or
    the error that keeps us from telling (permission denied, say)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return False
        except OSError as e:
            return e
        return True


def resolve_users(specs) -> list:
    """uids for -u arguments: a number is a uid, anything else a user name."""
    import pwd
    uids = []
    for spec in specs:
        if spec.isdigit():
            uids.append(int(spec))
            continue
        try:
            uids.append(pwd.getpwnam(spec).pw_uid)
        except KeyError:
            raise StartupError(f"unknown user {spec!r}") from None
    return uids


def remove_quietly(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_pidfile(path: str) -> None:
    """Create the pidfile exclusively, never through a symlink."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StartupError(f"pidfile {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")


def daemonise(on_ready: Optional[Callable[[int], None]] = None) -> Callable[[], None]:
    """Double-fork into the background. Returns, in the daemon, a function to
    call once it is ready; the launcher then calls ``on_ready(daemon_pid)``
    and exits 0, or exits 1 if the daemon dies first."""
    r, w = os.pipe()
    pid = os.fork()
    if pid > 0:
        os.close(w)
        os.waitpid(pid, 0)
        news = os.read(r, 32)
        if news[:1] != b"\x01":
            os._exit(1)
        if on_ready is not None:
            on_ready(int(news[1:]))
        os._exit(0)
    os.close(r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")

    def ready() -> None:
        # One write: the launcher reads once.
        os.write(w, b"\x01%d" % os.getpid())
        os.close(w)
    return ready


def ensure_stdio() -> None:
    """Open /dev/null on any of fds 0-2 we were started without, before any
    socket is created: else the listening socket could become fd 1, which
    readiness (detach_stdio) then replaces."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)      # the lowest free fd: this one


def announce(text: str) -> None:
    """Print a line on stdout for whoever started us, in one write(2): a
    parent may read the pipe once (the original sbusd's test suite does),
    and Python's own stdout writes the newline apart when unbuffered
    (PYTHONUNBUFFERED=1, python -u). Nobody listening (stdout closed, or a
    pipe whose reader left) is not an error."""
    data = (text + "\n").encode()
    try:
        if sys.stdout is not None:
            sys.stdout.flush()      # anything printed before goes first
        while data:
            data = data[os.write(1, data):]
    except (OSError, ValueError):
        pass


def kept_out(uids, mode: int, own_uid: int, own_gid: int) -> list:
    """The uids of an -u list that the socket's mode keeps out (neither root
    nor sbusd's own uid, no 'other' bits, and outside the group or no group
    bits), with the flag that would let each in."""
    import grp
    import pwd
    if mode & 0o007:
        return []
    try:
        members = set(grp.getgrgid(own_gid).gr_mem)
    except KeyError:
        members = set()
    out = []
    for uid in uids:
        if uid in (0, own_uid):
            continue
        try:
            pw = pwd.getpwuid(uid)
            in_group = pw.pw_gid == own_gid or pw.pw_name in members
        except KeyError:
            in_group = False
        if mode & 0o070 and in_group:
            continue
        out.append((uid, "-g or -o" if in_group else "-o"))
    return out


def detach_stdio() -> None:
    """Readiness for a parent reading our stdout: close it (and stdin)."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except (OSError, ValueError):
        pass
    # stdout goes last, with no descriptor of ours left open in between: a
    # parent that counts our descriptors once it sees EOF sees them settled.
    devnull = os.open(os.devnull, os.O_RDWR)
    if devnull != 0:        # fd 0 was free: the open already put /dev/null there
        os.dup2(devnull, 0)
        os.close(devnull)
    os.dup2(0, 1)


def release_stderr() -> None:
    """A daemon lets go of a terminal it left, and of a pipe: whoever
    launched it (`$(sbusd ... 2>&1)`, subprocess with captured output)
    would otherwise wait for EOF until the daemon exits. A file or a socket
    (the journal) is kept for its logs."""
    try:
        st = os.fstat(2)
    except OSError:
        return
    if os.isatty(2) or stat.S_ISFIFO(st.st_mode):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


# ---- sbusd --upgrade, sbusd --reload: a signal, then the outcome beside the pidfile ----

# What a judge returns for an outcome that is this request's but not final:
# wait on, and the process may exit meanwhile (an upgrade's old one does).
ON_ITS_WAY = "on its way"
Verdict = Union[None, str, Tuple[int, str]]


def read_pid(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_outcome(pidfile: Optional[str], suffix: str, outcome: dict) -> None:
    """The running sbusd's answer to a request, at PIDFILE + ``suffix``."""
    if pidfile:
        try:
            write_atomically(pidfile + suffix, (json.dumps(outcome) + "\n").encode())
        except OSError:
            pass        # the log says it too


def signal_and_wait(flag: str, pidfile: Optional[str], suffix: str, signum: int,
                    judge: Callable[[int, dict], Verdict], gone: str, timeout: float) -> int:
    """``sbusd --FLAG -p PIDFILE``: send ``signum`` to the sbusd the pidfile
    names and wait for the outcome it writes at PIDFILE + ``suffix``.
    ``judge(pid, outcome)`` reads each version of it (``{}`` while there is
    none): ``(0, line)`` succeeded (the line goes to stdout), ``(1, reason)``
    failed, ``ON_ITS_WAY``, or None (nothing of this request's yet: the
    process must still run, or it ``gone``). Returns the exit status; a
    failure is said on stderr."""
    def fail(text: str) -> int:
        print(f"sbusd --{flag}: {text}", file=sys.stderr)
        return 1

    if not pidfile:
        return fail("give the running sbusd's pidfile with -p")
    pid = read_pid(pidfile)
    if pid is None:
        return fail(f"no pid in {pidfile}")
    if not alive(pid):
        return fail(f"pid {pid} (from {pidfile}) is not running")
    status = pidfile + suffix
    try:
        os.unlink(status)       # so the outcome we read is this request's
    except FileNotFoundError:
        pass
    except OSError as e:
        return fail(f"{status}: {e.strerror}")
    os.kill(pid, signum)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(status) as f:
                outcome = json.load(f)
        except (OSError, ValueError):
            outcome = {}
        verdict = judge(pid, outcome)
        if verdict is None and not alive(pid):
            return fail(f"pid {pid} {gone}")
        if isinstance(verdict, tuple):
            if verdict[0]:
                return fail(verdict[1])
            print(verdict[1])
            return 0
        time.sleep(0.02)
    return fail(f"no outcome within {timeout:g} s")
