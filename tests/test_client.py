"""sbus.Client against real sbusd processes (every backend) and, where the
broker cannot be made to misbehave on cue, against the far end of a socket pair."""
from __future__ import annotations

import asyncio
import os
import select
import selectors
import socket

import pytest

from sbus import AddressError, BusClosedError, Client, MessageTooLargeError, ProtocolError
from sbus.client import MAX_MESSAGE, ControlMessage, Credentials, Message, pack_publish

from support import recv_or_none

TIMEOUT = 5.0


@pytest.fixture
def connect(request):
    """Factory for clients that are closed at teardown."""
    clients = []

    def make(*args, **kwargs) -> Client:
        c = Client(*args, **kwargs)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def pair(connect):
    """A Client on one end of a SOCK_SEQPACKET pair (via /dev/fd/N) and the raw other end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client = connect(f"/dev/fd/{ours.detach()}")
    theirs.settimeout(TIMEOUT)
    yield client, theirs
    theirs.close()


def subscriber(connect, address, *patterns) -> Client:
    c = connect(address)
    for p in patterns:
        c.subscribe(p)
    c.whoami(timeout=TIMEOUT)
    return c


# -- publishing and receiving ---------------------------------------------------

def test_publish_reaches_subscriber_byte_identical(broker, connect):
    sub = subscriber(connect, broker.address, "a/*/c/")
    pub = connect(broker.address)
    payload = bytes(range(256)) + b"\0tail\0"
    pub.publish(b"a/b/c/d/e", payload)
    pub.publish("a/b/c", b"not matched: the pattern's trailing '/' needs a '/'")
    pub.publish("a/x/c/", "")
    assert sub.receive(timeout=TIMEOUT) == Message(b"a/b/c/d/e", payload)
    assert sub.receive(timeout=TIMEOUT) == Message(b"a/x/c/", b"")
    with pytest.raises(BlockingIOError):
        sub.receive(socket.MSG_DONTWAIT)


def test_packets_on_the_wire_are_the_protocol(broker, connect):
    raw = broker.connect()
    raw.send(b"SUB k/*")
    assert raw.sync().startswith("!/cred/")
    client = connect(broker.address)
    client.publish("k/é", b"\x00\xff")
    assert raw.recv(1024) == b"MSG k/\xc3\xa9\x00\x00\xff"
    client.subscribe(b"k/*")
    client.whoami(timeout=TIMEOUT)
    raw.send(b"MSG k/raw\0" + b"p" * 100)
    assert client.receive(timeout=TIMEOUT) == Message(b"k/raw", b"p" * 100)
    raw.close()


def test_str_and_bytes_keys_are_interchangeable(broker, connect):
    sub = subscriber(connect, broker.address, "ключ/*", b"bytes/*")
    pub = connect(broker.address)
    pub.publish("ключ/str", "текст")
    pub.publish(b"bytes/b", bytearray(b"ba"))
    pub.publish("bytes/mv", memoryview(b"mv"))
    first = sub.receive(timeout=TIMEOUT)
    assert first.key == "ключ/str".encode() and first.key_str == "ключ/str"
    assert first.text == "текст"
    assert sub.receive(timeout=TIMEOUT) == Message(b"bytes/b", b"ba")
    assert sub.receive(timeout=TIMEOUT).payload == b"mv"


def test_non_utf8_keys_survive_a_round_trip_through_str(broker, connect):
    sub = subscriber(connect, broker.address, b"raw/\xff")
    pub = connect(broker.address)
    received_key_str = Message(b"raw/\xff", b"").key_str
    pub.publish(received_key_str, b"x")  # surrogateescape maps it back to the same bytes
    assert sub.receive(timeout=TIMEOUT).key == b"raw/\xff"


@pytest.mark.parametrize("call", [
    lambda c: c.subscribe("a\0b"),
    lambda c: c.unsubscribe(b"a\0"),
    lambda c: c.publish("k\0", b""),
    lambda c: c.send_cmsg(b"\0stats"),
    lambda c: c.query("x\0y"),
])
def test_nul_in_a_key_or_pattern_is_a_value_error(pair, call):
    client, theirs = pair
    with pytest.raises(ValueError):
        call(client)
    assert recv_or_none(theirs, 0.05) is None  # nothing was sent


def test_unsubscribe_removes_one_of_two_identical_patterns(broker, connect):
    sub = subscriber(connect, broker.address, "dup/*", "dup/*")
    pub = connect(broker.address)
    sub.unsubscribe("dup/*")
    sub.whoami(timeout=TIMEOUT)
    pub.publish("dup/1", b"still subscribed once")
    assert sub.receive(timeout=TIMEOUT).payload == b"still subscribed once"
    sub.unsubscribe(b"dup/*")
    sub.whoami(timeout=TIMEOUT)
    pub.publish("dup/2", b"gone")
    pub.publish("dup-control", b"")
    pub.whoami(timeout=TIMEOUT)
    with pytest.raises(TimeoutError):
        sub.receive(timeout=0.2)


def test_publisher_receives_its_own_message_when_subscribed(broker, connect):
    client = subscriber(connect, broker.address, "echo")
    client.publish("echo", b"1")
    client.publish("other", b"2")
    assert client.receive(timeout=TIMEOUT) == Message(b"echo", b"1")
    with pytest.raises(TimeoutError):
        client.receive(timeout=0.1)


def test_iteration_ends_when_the_broker_closes(start_broker, connect):
    b = start_broker()
    sub = subscriber(connect, b.address, "it/*")
    pub = connect(b.address)
    for i in range(3):
        pub.publish(f"it/{i}", b"")
    pub.whoami(timeout=TIMEOUT)
    seen = []
    for message in sub:
        seen.append(message.key_str)
        if len(seen) == 3:
            b.stop()
    assert seen == ["it/0", "it/1", "it/2"]


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


def test_packets_sent_are_exactly_the_protocol(pair):
    client, theirs = pair
    client.subscribe("a/*")
    client.unsubscribe(b"a/*")
    client.publish("k", b"p\0q")
    client.send_cmsg("echo/off")
    client.send_cmsg("k", b"")
    client.send_cmsg(b"k", "v")
    assert [theirs.recv(100) for _ in range(6)] == [
        b"SUB a/*", b"UNSUB a/*", b"MSG k\0p\0q", b"CMSG echo/off", b"CMSG k\0", b"CMSG k\0v"]


# -- readiness through fileno() ----------------------------------------------

def test_selectors_see_readiness(broker, connect):
    sub = subscriber(connect, broker.address, "sel")
    with selectors.DefaultSelector() as sel:
        sel.register(sub, selectors.EVENT_READ)
        assert sel.select(0.05) == []
        connect(broker.address).publish("sel", b"ready")
        events = sel.select(TIMEOUT)
        assert [key.fileobj for key, _ in events] == [sub]
    assert sub.receive(socket.MSG_DONTWAIT).payload == b"ready"


def test_select_poll_and_epoll_see_readiness(broker, connect):
    sub = subscriber(connect, broker.address, "poll")
    pub = connect(broker.address)
    assert select.select([sub], [], [], 0) == ([], [], [])
    pub.publish("poll", b"1")
    assert select.select([sub], [], [], TIMEOUT)[0] == [sub]
    poller = select.poll()
    poller.register(sub, select.POLLIN)
    assert poller.poll(TIMEOUT * 1000) == [(sub.fileno(), select.POLLIN)]
    with select.epoll() as ep:
        ep.register(sub.fileno(), select.EPOLLIN)
        assert ep.poll(TIMEOUT) == [(sub.fileno(), select.EPOLLIN)]
        sub.receive()
        assert ep.poll(0.05) == []


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


# -- sizes ---------------------------------------------------------------------

def test_the_largest_packet_the_broker_accepts_round_trips(broker, connect):
    sub = subscriber(connect, broker.address, "big")
    pub = connect(broker.address)
    payload = os.urandom(MAX_MESSAGE - len(b"MSG big\0"))
    pub.publish("big", payload)
    assert sub.receive(timeout=TIMEOUT) == Message(b"big", payload)


def test_an_oversized_publish_raises_before_sending(broker, connect):
    sub = subscriber(connect, broker.address, "big")
    pub = connect(broker.address)
    with pytest.raises(MessageTooLargeError):
        pub.publish("big", b"x" * MAX_MESSAGE)
    pub.publish("big", b"the connection is still fine")
    assert sub.receive(timeout=TIMEOUT).payload == b"the connection is still fine"


def test_an_oversized_packet_received_raises_and_is_dropped(pair):
    client, theirs = pair
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_MESSAGE)
    if theirs.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < MAX_MESSAGE + 64:
        pytest.skip("net.core.wmem_max is too small to send an oversized packet")
    # Blocking, not a timeout: Python would first poll for POLLOUT, which a
    # unix socket reports only while less than a quarter of its buffer is used.
    theirs.settimeout(None)
    theirs.send(b"MSG k\0" + b"x" * MAX_MESSAGE)
    theirs.send(b"MSG k\0next")
    with pytest.raises(MessageTooLargeError):
        client.receive(timeout=TIMEOUT)
    assert client.receive(timeout=TIMEOUT) == Message(b"k", b"next")


def test_a_smaller_limit_is_enforced_both_ways(pair, connect):
    client, theirs = pair
    small = connect(f"/dev/fd/{os.dup(client.fileno())}", max_message=16)
    with pytest.raises(MessageTooLargeError):
        small.publish("k", b"x" * 11)  # 17 bytes on the wire
    small.publish("k", b"x" * 10)
    assert theirs.recv(100) == b"MSG k\0" + b"x" * 10
    theirs.send(b"MSG k\0" + b"y" * 11)
    with pytest.raises(MessageTooLargeError):
        small.receive(timeout=TIMEOUT)


def test_the_socket_buffers_hold_the_largest_packet(broker, connect):
    client = connect(broker.address)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        assert client.socket.getsockopt(socket.SOL_SOCKET, option) > MAX_MESSAGE


# -- a closed bus --------------------------------------------------------------

def test_a_closed_bus_raises_bus_closed_error(start_broker, backend, connect):
    b = start_broker(backend=backend)
    client = subscriber(connect, b.address, "x")
    b.stop()
    with pytest.raises(BusClosedError):
        client.receive(timeout=TIMEOUT)
    with pytest.raises(BusClosedError):
        client.receive(timeout=TIMEOUT)  # and again: EOF is sticky
    with pytest.raises(BusClosedError):
        client.publish("x", b"")
    assert isinstance(BusClosedError(), ConnectionError)


def test_a_client_the_broker_disconnects_sees_bus_closed_error(broker, connect):
    # A client that believes the limit is higher sends what sbusd refuses.
    client = connect(broker.address, max_message=MAX_MESSAGE + 100)
    client.publish("k", b"x" * MAX_MESSAGE)
    with pytest.raises(BusClosedError):
        client.receive(timeout=TIMEOUT)
    with pytest.raises(BusClosedError):
        client.publish("k", b"")


def test_a_closed_client_raises_bus_closed_error(broker):
    with Client(broker.address) as client:
        fd = client.fileno()
    assert client.closed
    with pytest.raises(OSError):
        os.fstat(fd)  # the context manager closed the socket
    for call in (client.receive, client.fileno, lambda: client.publish("k"),
                 lambda: client.whoami()):
        with pytest.raises(BusClosedError):
            call()
    client.close()  # idempotent


def test_a_malformed_packet_raises_protocol_error(pair):
    client, theirs = pair
    theirs.send(b"HELLO")
    theirs.send(b"MSG no-nul")
    theirs.send(b"MSG ok\0")
    with pytest.raises(ProtocolError):
        client.receive(timeout=TIMEOUT)
    with pytest.raises(ProtocolError):
        client.receive(timeout=TIMEOUT)
    assert client.receive(timeout=TIMEOUT) == Message(b"ok", b"")


# -- control messages and credentials ------------------------------------------

def test_whoami_reports_our_credentials(broker, connect):
    creds = connect(broker.address).whoami(timeout=TIMEOUT)
    assert isinstance(creds, Credentials)
    assert (creds.gid, creds.uid, creds.pid) == (os.getgid(), os.getuid(), os.getpid())
    assert str(creds) == creds.text
    assert creds.text.startswith(f"!/cred/{os.getgid()}/{os.getuid()}/{os.getpid()}")


def test_messages_that_arrive_during_whoami_are_kept(broker, connect):
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


def test_a_late_reply_to_an_abandoned_whoami_is_discarded(pair):
    client, theirs = pair
    with pytest.raises(TimeoutError):
        client.whoami(timeout=0.05)
    assert theirs.recv(100) == b"CMSG !/cred/whoami"
    theirs.send(b"CMSG !/cred/whoami\0!/cred/1/2/3")  # the late reply
    theirs.send(b"MSG k\0after")
    assert client.receive(timeout=TIMEOUT) == Message(b"k", b"after")
    theirs.send(b"CMSG !/cred/whoami\0!/cred/4/5/6")
    assert client.receive(timeout=TIMEOUT) == ControlMessage(b"!/cred/whoami", b"!/cred/4/5/6")


def test_a_later_whoami_skips_the_abandoned_reply(pair):
    client, theirs = pair
    with pytest.raises(BlockingIOError):
        client.whoami(socket.MSG_DONTWAIT)
    theirs.send(b"CMSG !/cred/whoami\0!/cred/1/2/3")
    theirs.send(b"CMSG !/cred/whoami\0!/cred/7/8/9/!/cred/0/0/1")
    creds = client.whoami(timeout=TIMEOUT)
    assert creds == Credentials("!/cred/7/8/9/!/cred/0/0/1", 7, 8, 9)
    assert [theirs.recv(100) for _ in range(2)] == [b"CMSG !/cred/whoami"] * 2


def test_stats_is_a_json_object(broker, connect):
    stats = connect(broker.address).stats(timeout=TIMEOUT)
    assert isinstance(stats, dict) and stats


def test_control_messages_are_not_forwarded(broker, connect):
    sub = subscriber(connect, broker.address, "")
    other = connect(broker.address)
    other.send_cmsg("some/key", b"payload")
    other.whoami(timeout=TIMEOUT)
    with pytest.raises(TimeoutError):
        sub.receive(timeout=0.1)


def test_message_values_are_immutable_and_typed():
    m = Message(b"k", b"p")
    c = ControlMessage(b"k", b"p")
    assert m != c and len({m, c}) == 2
    assert m == Message(b"k", b"p") and hash(m) == hash(Message(b"k", b"p"))
    with pytest.raises(AttributeError):
        m.key = b"other"


# -- addresses -------------------------------------------------------------------

def test_abstract_address(start_broker, backend, connect):
    b = start_broker(backend=backend, address="/dev/unix/abstract")
    address = b.stdout.decode().strip()
    assert address.startswith("/dev/unix/abstract/")
    sub = subscriber(connect, address, "abs")
    connect(address).publish("abs", b"over an abstract socket")
    assert sub.receive(timeout=TIMEOUT).payload == b"over an abstract socket"


def test_dev_fd_adopts_the_descriptor(broker, connect):
    raw = broker.connect()
    fd = raw.detach()
    client = connect(f"/dev/fd/{fd}")
    assert client.fileno() == fd
    assert client.whoami(timeout=TIMEOUT).pid == os.getpid()
    client.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_dev_fd_must_be_a_seqpacket_socket():
    r, w = os.pipe()
    try:
        with pytest.raises(AddressError):
            Client(f"/dev/fd/{r}")
        os.fstat(r)  # still open: a rejected descriptor stays the caller's
    finally:
        os.close(r)
        os.close(w)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        with pytest.raises(AddressError):
            Client(f"/dev/fd/{s.fileno()}")


def test_sbus_address_from_the_environment(broker, monkeypatch):
    monkeypatch.setenv("SBUS_ADDRESS", broker.address)
    with Client() as client:
        assert client.address == broker.address
        assert client.whoami(timeout=TIMEOUT).pid == os.getpid()


def test_a_missing_socket_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        Client(str(tmp_path / "nothing-here"))
    with pytest.raises(AddressError):
        Client("/dev/unix/abstract")  # binding a random name is for sbusd
