"""Clients fed by a far end that has already said everything: the packets a
broker could send, oddities included, are written into one end of a
SOCK_SEQPACKET pair, which is then closed; the client adopts the other end."""
from __future__ import annotations

import socket
from typing import List

from sbus import Client, aio


def far_end_packets() -> List[bytes]:
    """What a broker could send, oddities included."""
    out = []
    for i in range(300):
        out.append(b"MSG k/%d\0" % (i % 7) + b"p" * (i * 37 % 900))
        if i % 50 == 3:
            out.append(b"CMSG stats\0{}")
        if i % 90 == 5:
            out.append(b"CMSG bare")
    out.insert(120, b"NOPE")
    out.insert(200, b"MSG no-nul")
    return out


def _fed_address(packets: List[bytes]) -> str:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    for p in packets:
        theirs.send(p)
    theirs.close()
    return f"/dev/fd/{ours.detach()}"


def feed(packets: List[bytes]) -> Client:
    """A blocking client that will read ``packets``, then the end of the connection."""
    return Client(_fed_address(packets))


def feed_aio(packets: List[bytes]) -> aio.Client:
    """The same for the asyncio client (call it inside a running loop)."""
    return aio.Client(_fed_address(packets))
