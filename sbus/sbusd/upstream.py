"""Reaching the upstream sbusd of a leaf broker (``sbusd --upstream ADDRESS``).

What both sides of a leaf need to reach its upstream: sbusd checks at start
that the address is an sbusd that lets it in (``probe``, docs/hierarchy.md:
a missing socket, a refusal or an answer that is not sbusd's stops it with
the reason), and the link (``sbus/sbusd/link.py``) connects with the same
``connect`` on each (re)connection and reads its identity from whoami.
"""
from __future__ import annotations

import socket
from typing import Optional

from .. import address as addresses
from ..client.driver import grow_buffers
from ..client.protocol import MAX_MESSAGE, WHOAMI, ControlMessage, pack_control, parse
from ..errors import AddressError, ProtocolError

WHOAMI_TIMEOUT = 5.0        # seconds an upstream has to answer whoami
RECV_SIZE = 1 << 23         # above any --max-message
CRED = b"!/cred/"


class UpstreamError(Exception):
    """The upstream cannot be used; the text says why."""


def connect(text: str, max_message: int = MAX_MESSAGE) -> socket.socket:
    """A connected SOCK_SEQPACKET socket to the sbusd at ``text``, its buffers
    holding a ``max_message``-byte packet."""
    try:
        addr = addresses.parse(text)
    except AddressError as e:
        raise UpstreamError(str(e)) from None
    if addr.random:
        raise UpstreamError(f"{text}: a random abstract address names no broker")
    if addr.fd is not None:
        raise UpstreamError(f"{text}: a passed descriptor cannot be connected again; "
                            f"give the upstream's path or abstract name")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.connect(addr.sun_path)
        # A packet as large as the upstream takes (chunks are): the default
        # send buffer fails one over ~208 KiB with EMSGSIZE, for ever.
        grow_buffers(sock, max_message)
    except OSError as e:
        sock.close()
        raise UpstreamError(f"{text}: {e.strerror or e}") from None
    return sock


def whoami(sock: socket.socket, text: str, timeout: float = WHOAMI_TIMEOUT) -> bytes:
    """Ask an sbusd for our credentials over ``sock``; raise UpstreamError
    naming what went wrong when it refuses, closes or is no sbusd."""
    sock.settimeout(timeout)
    try:
        sock.send(pack_control(WHOAMI))
        reply = sock.recv(RECV_SIZE)
    except socket.timeout:
        raise UpstreamError(f"{text}: no answer to whoami within {timeout:g} s "
                            f"(not an sbusd?)") from None
    except (ConnectionResetError, BrokenPipeError):
        reply = b""
    except OSError as e:
        raise UpstreamError(f"{text}: {e.strerror or e}") from None
    finally:
        sock.settimeout(None)
    if not reply:
        raise UpstreamError(f"{text}: the upstream closed the connection (refused?)")
    try:
        creds = identity(parse(reply))
    except ProtocolError:
        creds = None
    if creds is None:
        raise UpstreamError(f"{text}: not an sbusd (answered {reply[:40]!r})")
    return creds


def identity(item) -> Optional[bytes]:
    """Our credentials, if ``item`` (a parsed packet) is the answer to whoami."""
    if type(item) is ControlMessage and item.key == WHOAMI and item.payload.startswith(CRED):
        return item.payload
    return None


def probe(text: str) -> bytes:
    """Check at start that ``text`` is an sbusd that lets us in; our credentials there."""
    sock = connect(text)
    try:
        return whoami(sock, text)
    finally:
        sock.close()
