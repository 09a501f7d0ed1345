"""Frames as a connection granted them has them (sbus/_core/frames.pxd,
docs/hierarchy.md, docs/bridge.md): built and taken apart from the documented
layout alone."""
from __future__ import annotations

import os
import signal
import socket
import struct

from .conn import Conn

MAGIC = b"\0FRM"


def frame(*packets: bytes) -> bytes:
    return MAGIC + b"".join(struct.pack("=I", len(p)) + p for p in packets)


def unframe(packet: bytes) -> list:
    """The packets of a frame (checked whole), or [packet] for any other."""
    if not packet.startswith(MAGIC):
        return [packet]
    out, at = [], len(MAGIC)
    while at < len(packet):
        (length,) = struct.unpack_from("=I", packet, at)
        assert 0 < length <= len(packet) - at - 4, (at, length)
        out.append(packet[at + 4:at + 4 + length])
        at += 4 + length
    assert out, "an empty frame"
    return out


def read_all(c: Conn, count: int) -> tuple:
    """(packets, frames, reads): ``count`` packets, frames taken apart."""
    got, frames, reads = [], 0, 0
    while len(got) < count:
        packet = c.next_packet(10)
        assert packet, f"nothing more after {len(got)} of {count}"
        frames += packet.startswith(MAGIC)
        reads += 1
        got += unframe(packet)
    return got, frames, reads


def publish_together(broker, messages) -> None:
    """Publish ``messages`` ((key, payload) pairs) while ``broker`` is
    stopped, so that they wait in its socket together and it reads many at a
    time: its deliveries to one connection then go in frames however busy
    the machine is (a publisher it keeps up with is read a packet at a time,
    and a light turn sends each read's deliveries at once). They must fit
    the socket's buffers: a few hundred small ones."""
    from sbus import Client
    with Client(broker.address) as pub:
        pub.whoami()    # accepted and served: from here on the broker only queues
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            sent = pub.publish_many(messages, socket.MSG_DONTWAIT)
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        assert sent == len(messages)
        pub.whoami()


def link_place(broker, frames=True) -> Conn:
    """A connection that took the link place (the broker's uid: root here)
    and, with ``frames``, was answered "ok" for frames."""
    return own_uid(broker, frames, attach=True)


def own_uid(broker, frames=True, attach=False) -> Conn:
    """A connection of the broker's own uid (root here), outside the link
    place (as a bridge's is) unless ``attach``; with ``frames``, answered
    "ok" for frames."""
    c = Conn.to(broker.address)
    if attach:
        c.cmsg("link/attach")
        assert c.next_packet() == b"CMSG link/attach\0ok"
    c.cmsg("blocking/hard/block")
    c.cmsg("blocking/soft/queue")
    if frames:
        c.cmsg("link/frames")
        assert c.next_packet() == b"CMSG link/frames\0ok"
    return c


# Who may ask: the link place, and any connection of the broker's own uid or root.
GRANTED = {"link place": link_place, "own uid": own_uid}
