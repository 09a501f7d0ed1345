"""The compiled packet code (sbus._core.batch) held to the plain-Python
reference (sbus.client.protocol) on random keys, payloads and packets:
every way the clients pack a MSG gives the bytes of ``pack_publish``, and
``Inbox`` parses what a far end sends as ``parse`` does, errors included."""
from __future__ import annotations

import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbus._core import batch
from sbus.client import MAX_MESSAGE, ControlMessage, Message, pack_control, pack_publish, parse
from sbus.errors import ProtocolError

# Keys the broker takes: no NUL, and no '!' (its misuse is refused; the
# refusals have tests of their own). As str, any text, lone surrogates included.
raw_keys = st.binary(max_size=60).filter(lambda k: b"\0" not in k and b"!" not in k)
text_keys = st.text(max_size=30).filter(lambda k: "\0" not in k and "!" not in k)
keys = st.one_of(raw_keys, text_keys, raw_keys.map(bytearray), raw_keys.map(memoryview))
payloads = st.one_of(
    st.just(b""), st.binary(max_size=300), st.text(max_size=50),
    st.binary(max_size=40).map(lambda b: b"\0" + b + b"\0"),    # NUL in the payload
    st.integers(0, 30_000).map(lambda n: b"p" * n))   # four fit in a socket buffer

# What a far end could send: messages and control messages (with and
# without a payload) as the reference packs them, and anything else.
packets = st.one_of(
    st.builds(pack_publish, raw_keys, st.binary(max_size=200)),
    st.builds(pack_control, raw_keys, st.none() | st.binary(max_size=200)),
    st.builds(lambda k, p: b"CMSG " + k + b"\0" + p, st.binary(max_size=20), st.binary(max_size=20)),
    st.binary(min_size=1, max_size=80),
    st.sampled_from([b"MSG ", b"MSG k", b"MSG \0", b"CMSG ", b"CMSG \0", b"MSG", b"CMSG"]),
    st.binary(max_size=40).map(lambda b: b"MSG " + b.replace(b"\0", b"")))


@settings(max_examples=300, deadline=None)
@given(key=keys, payload=payloads)
def test_every_compiled_packer_gives_the_reference_bytes(key, payload):
    expected = pack_publish(key, payload)
    assert batch.pack_publish(key, payload, MAX_MESSAGE) == expected
    box = batch.Outbox(MAX_MESSAGE)
    assert box.add_publish(key, payload)
    assert box.pack_many(iter([(key, payload)]), 0) == 1
    assert box.add_packet(expected)
    assert box.unsent() == [expected] * 3
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        batch.send_publish(ours.fileno(), key, payload, 0, MAX_MESSAGE)
        assert box.send(ours.fileno()) == 3
        assert [theirs.recv(1 << 20) for _ in range(4)] == [expected] * 4


def reference(packet: bytes):
    try:
        return parse(packet)
    except ProtocolError as exc:
        return ProtocolError, str(exc)


def compiled(item):
    if isinstance(item, BaseException):
        return type(item), str(item)
    return item


@settings(max_examples=300, deadline=None)
@given(sent=st.lists(packets, min_size=1, max_size=40))
def test_the_inbox_parses_as_the_reference_does(sent):
    inbox = batch.Inbox(MAX_MESSAGE, Message, ControlMessage)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        for packet in sent:
            theirs.send(packet)
        got = []
        while len(got) < len(sent):
            got.extend(inbox.receive(ours.fileno(), 64, socket.MSG_DONTWAIT))
    # Message and ControlMessage compare equal only to their own type.
    assert [compiled(item) for item in got] == [reference(p) for p in sent]


@pytest.mark.parametrize("packet", [b"MSG k\0", b"CMSG k", b"CMSG k\0", b"MSG \0\0\0"])
def test_the_edges_parse_alike(packet):
    inbox = batch.Inbox(MAX_MESSAGE, Message, ControlMessage)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        theirs.send(packet)
        assert inbox.receive(ours.fileno(), 64) == [parse(packet)]
