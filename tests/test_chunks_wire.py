"""A reassembler written only from docs/chunks.md, with no import of sbus's
chunking code, reassembles what the library publishes: the convention is
enough for a program in another language (C would do what this does with
struct: a 52-byte big-endian header after the NUL)."""
from __future__ import annotations

import os
import socket
import struct

import pytest

from sbus import Client
from sbus.client.protocol import Message

SUFFIX = b"/.sbus-chunk"                    # docs: the derived key's last segment
HEADER = struct.Struct(">4s16sQIIQQ")       # docs: magic, publisher, number, index, count, total, offset


@pytest.fixture
def broker(start_broker):
    """One broker on the default backend: chunking is the client's, the same on every loop."""
    return start_broker()


class DocReassembler:
    """Steps 1-5 of "Reassembling" in docs/chunks.md."""

    def __init__(self):
        self.progress = {}      # publisher -> [key, number, count, total, next, bytearray]
        self.lost = []
        self.dropped = 0

    def packet(self, packet: bytes):
        """A received packet: the message it completes (key, payload), or None."""
        assert packet.startswith(b"MSG ")
        key, _, body = packet[4:].partition(b"\0")
        if not key.endswith(SUFFIX):
            return key, body                                    # a message that fit one packet
        key = key[:-len(SUFFIX)]
        if len(body) < HEADER.size:
            self.dropped += 1
            return None
        magic, publisher, number, index, count, total, offset = HEADER.unpack_from(body)
        data = body[HEADER.size:]
        if magic != b"SBC1" or index >= count or offset + len(data) > total:   # step 1
            self.dropped += 1
            return None
        p = self.progress.get(publisher)
        if p is not None and (p[1] != number or p[0] != key):                # step 2
            if p[5] is not None:
                self.lost.append((p[0], p[1]))
            p = None
        if p is None:                                                          # step 3
            p = self.progress[publisher] = [key, number, count, total, 0, bytearray()]
            if index != 0:
                self.lost.append((key, number))
                p[5] = None
        if p[5] is None:                                                       # step 5
            self.dropped += 1
            return None
        if index != p[4] or offset != len(p[5]) or count != p[2] or total != p[3]:
            self.lost.append((key, number))
            p[5] = None
            return None
        p[5] += data                                                           # step 4
        p[4] += 1
        if p[4] < count:
            return None
        del self.progress[publisher]
        if len(p[5]) != total:
            self.lost.append((key, number))
            return None
        return key, bytes(p[5])


def test_a_reassembler_from_the_docs_reads_what_the_library_publishes(broker):
    raw = broker.connect()
    raw.settimeout(30)
    raw.sub(b"w/")
    raw.whoami()
    sent = [(b"w/a", os.urandom(3 * 409600 + 5)), (b"w/b", b"small"),
            (b"w/a", os.urandom(409600)), (b"w/c", b"")]
    with Client(broker.address) as a, Client(broker.address) as b:
        for i, (key, body) in enumerate(sent):
            (a if i % 2 == 0 else b).publish(key, body)
        a.sync()
        b.sync()
    r = DocReassembler()
    got = []
    while len(got) < len(sent):
        whole = r.packet(raw.next_packet())
        if whole is not None:
            got.append(whole)
    assert sorted(got) == sorted(sent) and r.lost == [] and r.dropped == 0   # two publishers: no order between them
    raw.close()


def doc_chunks(key: bytes, payload: bytes, publisher: bytes, number: int,
               max_message: int = 409600):
    """"Producing" in docs/chunks.md: the packets of one message."""
    room = max_message - 5 - len(key) - 12 - 52
    count = -(-len(payload) // room)
    return [b"MSG " + key + SUFFIX + b"\0"
            + HEADER.pack(b"SBC1", publisher, number, i, count, len(payload), i * room)
            + payload[i * room:(i + 1) * room] for i in range(count)]


def test_the_library_reassembles_what_a_producer_from_the_docs_sends(broker):
    body = os.urandom(2 * 409600 + 99)
    with Client(broker.address) as sub:
        sub.subscribe("w/d")
        sub.sync()
        raw = broker.connect()
        raw.setsockopt(socket.SOL_SOCKET, 32, 1 << 21)     # SO_SNDBUFFORCE: a full packet fits
        for packet in doc_chunks(b"w/d", body, os.urandom(16), 1):
            raw.packet(packet)
        assert sub.receive(timeout=30) == Message(b"w/d", body)
        assert sub.chunks.lost == 0
        raw.close()
