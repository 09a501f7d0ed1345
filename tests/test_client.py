"""What only the blocking sbus.Client does: recv(2)/send(2) flags that reach
the kernel (MSG_PEEK, MSG_DONTWAIT on a full socket) and being driven by
another event loop through fileno(). The behaviour both clients share is
specified in test_client_spec.py."""
from __future__ import annotations

import asyncio
import socket

import pytest

from sbus.client import Credentials, Message, pack_publish

from support.drivers import client_on_a_pair, clients_of, subscriber

TIMEOUT = 5.0


@pytest.fixture
def connect():
    """Factory for blocking clients that are closed at teardown."""
    yield from clients_of("sync")


@pytest.fixture
def pair(connect):
    yield from client_on_a_pair(connect)


# -- flags pass through ------------------------------------------------------

def test_msg_dontwait_on_an_empty_socket_raises_blocking_io_error(broker, connect):
    client = connect(broker.address)
    with pytest.raises(BlockingIOError):
        client.receive(socket.MSG_DONTWAIT)


def test_msg_peek_leaves_the_packet(broker, connect):
    sub = subscriber(connect, broker.address, "peek")
    connect(broker.address).publish("peek", b"once")
    peeked = sub.receive(socket.MSG_PEEK, timeout=TIMEOUT)
    assert peeked == Message(b"peek", b"once")
    assert sub.receive(socket.MSG_PEEK | socket.MSG_DONTWAIT) == peeked
    assert sub.receive(socket.MSG_DONTWAIT) == peeked
    with pytest.raises(BlockingIOError):
        sub.receive(socket.MSG_DONTWAIT)


def test_send_flags_reach_send(pair):
    client, theirs = pair
    payload = b"x" * 4096
    with pytest.raises(BlockingIOError):
        for _ in range(100_000):  # the pair's buffer is finite and nobody reads
            client.publish("fill", payload, socket.MSG_DONTWAIT)
    for call in (lambda: client.subscribe("s", socket.MSG_DONTWAIT),
                 lambda: client.unsubscribe("s", socket.MSG_DONTWAIT),
                 lambda: client.send_cmsg("c", None, socket.MSG_DONTWAIT)):
        with pytest.raises(BlockingIOError):
            call()
    assert theirs.recv(8192) == pack_publish("fill", payload)


# -- readiness through fileno() ----------------------------------------------

def test_asyncio_add_reader_drives_a_blocking_client(broker, connect):
    sub = subscriber(connect, broker.address, "loop/*")
    pub = connect(broker.address)

    async def main():
        loop = asyncio.get_running_loop()
        got = []
        done = loop.create_future()

        def on_readable():
            while True:
                try:
                    got.append(sub.receive(socket.MSG_DONTWAIT).key_str)
                except BlockingIOError:
                    break
            if len(got) == 3 and not done.done():
                done.set_result(None)

        loop.add_reader(sub.fileno(), on_readable)
        try:
            for i in range(3):
                pub.publish(f"loop/{i}", b"")
            await asyncio.wait_for(done, TIMEOUT)
        finally:
            loop.remove_reader(sub.fileno())
        return got

    assert asyncio.run(main()) == ["loop/0", "loop/1", "loop/2"]


# -- flags on queued messages and queries ---------------------------------------

def test_messages_queued_during_whoami_can_be_peeked_and_taken_without_waiting(broker, connect):
    client = subscriber(connect, broker.address, "")
    for i in range(5):
        client.publish(f"early/{i}", b"")
    client.whoami(timeout=TIMEOUT)
    assert client.pending == 5
    assert client.receive(socket.MSG_PEEK).key == b"early/0"
    assert [client.receive(socket.MSG_DONTWAIT).key_str for _ in range(5)] == [
        f"early/{i}" for i in range(5)]
    assert client.pending == 0
    with pytest.raises(BlockingIOError):
        client.receive(socket.MSG_DONTWAIT)


def test_a_whoami_abandoned_by_msg_dontwait_has_its_reply_skipped(pair):
    client, theirs = pair
    with pytest.raises(BlockingIOError):
        client.whoami(socket.MSG_DONTWAIT)
    theirs.send(b"CMSG !/cred/whoami\0!/cred/1/2/3")
    theirs.send(b"CMSG !/cred/whoami\0!/cred/7/8/9/!/cred/0/0/1")
    creds = client.whoami(timeout=TIMEOUT)
    assert creds == Credentials("!/cred/7/8/9/!/cred/0/0/1", 7, 8, 9)
    assert [theirs.recv(100) for _ in range(2)] == [b"CMSG !/cred/whoami"] * 2
