"""The fd hand-over convention, for the service and both sides (docs/fds.md).

The broker carries one packet per message and no ancillary data, so fds
travel over the service's own ``SOCK_SEQPACKET`` socket, one request and one
answer per packet, with ``SCM_RIGHTS``:

    giver    -> service   ``OFFER !/cred/G/U/P\\0NOTE``  + 1..253 fds
    service  -> giver     ``TICKET T``  or  ``ERR CODE TEXT``
    service  -> bus       key ``!/cred/G/U/P/fds/T``,  payload ``N !/cred/g/u/p\\0NOTE``
    receiver -> service   ``CLAIM T``
    service  -> receiver  ``FDS T !/cred/g/u/p\\0NOTE``  + the fds,  or  ``ERR CODE TEXT``
    receiver -> service   ``WAIT``: the same answer for its next offer, when it comes

``T`` is 32 lowercase hex digits; ``!/cred/g/u/p`` in the answers is the
giver as the service saw it (``SO_PEERCRED``). Nothing here does I/O beyond
the two ``sendmsg``/``recvmsg`` helpers.
"""
from __future__ import annotations

import array
import os
import re
import socket
from typing import List, NamedTuple, Optional, Sequence, Tuple

from ..address import parse as parse_address

# The kernel's SCM_MAX_FD: the most fds one sendmsg carries.
MAX_FDS = 253
MAX_NOTE = 4096
# The largest packet either side sends, header and note included.
MAX_PACKET = MAX_NOTE + 256
TICKET_BYTES = 16
# The receiver's inbox: the service publishes to ``<address>/fds/<ticket>``.
INBOX = "fds"
# The socket's default path is the bus socket's with this appended.
SOCKET_SUFFIX = ".fds"
ENV_SOCKET = "SBUS_FDS_SOCKET"

OFFER = b"OFFER "
CLAIM = b"CLAIM "
WAIT = b"WAIT"
TICKET = b"TICKET "
FDS = b"FDS "
ERR = b"ERR "

# ERR codes (the first word after ERR): what a client may act on.
E_MALFORMED = "malformed"   # not a request of this convention
E_ADDRESS = "address"       # OFFER: not a local !/cred/G/U/P address
E_NOFDS = "nofds"           # OFFER without fds (or with more than MAX_FDS)
E_LIMIT = "limit"           # OFFER: the giver's uid (or the service) holds too many
E_UNKNOWN = "unknown"       # CLAIM: no such ticket for this process (never "not yours")

CRED = re.compile(rb"!/cred/(\d+)/(\d+)/(\d+)")
TICKET_RE = re.compile(rb"[0-9a-f]{%d}" % (2 * TICKET_BYTES))


class Peer(NamedTuple):
    gid: int
    uid: int
    pid: int

    def __str__(self) -> str:
        return f"!/cred/{self.gid}/{self.uid}/{self.pid}"


def parse_cred(raw: bytes) -> Optional[Peer]:
    """``!/cred/G/U/P`` (exactly: one machine, one process) as a Peer."""
    m = CRED.fullmatch(raw)
    if m is None:
        return None
    gid, uid, pid = (int(x) for x in m.groups())
    if max(gid, uid, pid) >= 1 << 32:
        return None
    return Peer(gid, uid, pid)


def peer_of(sock: socket.socket) -> Peer:
    """The credentials the kernel recorded when ``sock``'s peer connected."""
    import struct
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(gid, uid, pid)


def new_ticket() -> str:
    return os.urandom(TICKET_BYTES).hex()


def default_socket(bus_address: str) -> str:
    """``$SBUS_FDS_SOCKET``, else the bus socket's path + ``.fds``."""
    env = os.environ.get(ENV_SOCKET)
    if env:
        return env
    parsed = parse_address(bus_address)
    if parsed.sun_path is None or parsed.is_abstract:
        raise ValueError(f"no default fd socket for the bus address {bus_address!r}: "
                         f"give one (--socket, ${ENV_SOCKET})")
    return os.fsdecode(parsed.sun_path) + SOCKET_SUFFIX


def notification_key(receiver: Peer, ticket: str) -> str:
    return f"{receiver}/{INBOX}/{ticket}"


def pack_notification(count: int, giver: Peer, note: bytes) -> bytes:
    return b"%d %s\0%s" % (count, str(giver).encode(), note)


def parse_notification(payload: bytes) -> Optional[Tuple[int, bytes, bytes]]:
    """(fd count, giver, note) of a notification, or None."""
    head, sep, note = payload.partition(b"\0")
    count, _, giver = head.partition(b" ")
    if not sep or not count.isdigit() or parse_cred(giver) is None:
        return None
    return int(count), giver, note


def pack_fds(ticket: str, giver: Peer, note: bytes) -> bytes:
    return FDS + f"{ticket} {giver}".encode() + b"\0" + note


def parse_fds(packet: bytes) -> Optional[Tuple[str, str, bytes]]:
    """(ticket, giver, note) of an ``FDS`` answer, or None."""
    if not packet.startswith(FDS):
        return None
    head, sep, note = packet[len(FDS):].partition(b"\0")
    ticket, _, giver = head.partition(b" ")
    if not sep or not TICKET_RE.fullmatch(ticket) or parse_cred(giver) is None:
        return None
    return ticket.decode(), giver.decode(), note


def pack_error(code: str, text: str) -> bytes:
    return ERR + f"{code} {text}".encode("utf-8", "backslashreplace")


def parse_error(packet: bytes) -> Tuple[str, str]:
    code, _, text = packet[len(ERR):].decode("utf-8", "replace").partition(" ")
    return code, text


def send_fds(sock: socket.socket, packet: bytes, fds: Sequence[int] = (), flags: int = 0) -> None:
    """One packet, with ``fds`` as SCM_RIGHTS if any."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sent = sock.sendmsg([packet], anc, flags)
    if sent != len(packet):
        raise OSError(f"short send on a SOCK_SEQPACKET socket ({sent} of {len(packet)})")


# As plain ints: an operator on socket's IntFlag members makes a new member
# (enum's __call__), 1.7 us a receive, on each side of every hand-over.
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS * 4)
_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_CUT = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)


def recv_fds(sock: socket.socket, flags: int = 0) -> Tuple[bytes, List[int], bool]:
    """One packet, the fds that came with it (close-on-exec, the caller's
    to close) and whether anything was cut (packet or fds)."""
    data, anc, msg_flags, _ = sock.recvmsg(MAX_PACKET, _ANC_SPACE, flags | _CLOEXEC)
    fds: List[int] = []
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(raw[:len(raw) - len(raw) % a.itemsize])
            fds.extend(a)
    return data, fds, bool(msg_flags & _CUT)


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
