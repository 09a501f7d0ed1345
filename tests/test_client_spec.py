"""The behaviour both clients share, run against each: ``sbus.Client`` and
``sbus.aio.Client`` (driven through tests/support/drivers.py), on real sbusd
processes (both backends) and, where the broker cannot be made to misbehave
on cue, on the far end of a socket pair. What only one client has lives in
test_client.py (recv(2) flags, the blocking client under another loop) and
test_aio.py (concurrency, cancellation, back-pressure, the flush timer)."""
from __future__ import annotations

import asyncio
import errno
import os
import select
import selectors
import shutil
import signal
import socket
import stat

import pytest

from sbus import AddressError, BusClosedError, KeyRefusedError, MessageTooLargeError, ProtocolError, Reconnect
from sbus.client import MAX_MESSAGE, ControlMessage, Credentials, Message
from sbus.errors import ConnectError, PatternRefusedError
from sbus.logschema import SUBSCRIBE

from support import NOBODY, asroot, make_public_dir, recv_or_none
from support.drivers import KINDS, client_on_a_pair, clients_of, subscriber

TIMEOUT = 5.0


@pytest.fixture(params=KINDS)
def connect(request):
    """Factory for clients of one kind (the parameter: each test taking it runs with both)."""
    yield from clients_of(request.param)


@pytest.fixture
def pair(connect):
    yield from client_on_a_pair(connect)


def nothing_within(client, seconds=0.1):
    with pytest.raises(TimeoutError):
        client.receive(timeout=seconds)
    return True


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
    assert nothing_within(sub)


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
    assert nothing_within(sub, 0.2)


def test_publisher_receives_its_own_message_when_subscribed(broker, connect):
    client = subscriber(connect, broker.address, "echo")
    client.publish("echo", b"1")
    client.publish("other", b"2")
    assert client.receive(timeout=TIMEOUT) == Message(b"echo", b"1")
    assert nothing_within(client)


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


def test_packets_sent_are_exactly_the_protocol(pair):
    client, theirs = pair
    client.subscribe("a/*")
    client.unsubscribe(b"a/*")
    client.publish("k", b"p\0q")
    client.send_cmsg("echo/off")
    client.send_cmsg("k", b"")
    client.send_cmsg(b"k", "v")
    # A pattern not ending in '/' is followed by its chunk twin (docs/chunks.md).
    assert [theirs.recv(100) for _ in range(8)] == [
        b"SUB a/*", b"SUB a/*/.sbus-chunk", b"UNSUB a/*", b"UNSUB a/*/.sbus-chunk",
        b"MSG k\0p\0q", b"CMSG echo/off", b"CMSG k\0", b"CMSG k\0v"]


# -- readiness through fileno() ----------------------------------------------

def test_selectors_see_readiness(broker, connect):
    sub = subscriber(connect, broker.address, "sel")
    with selectors.DefaultSelector() as sel:
        sel.register(sub, selectors.EVENT_READ)
        assert sel.select(0.05) == []
        connect(broker.address).publish("sel", b"ready")
        events = sel.select(TIMEOUT)
        assert [key.fileobj for key, _ in events] == [sub]
    assert sub.receive(timeout=TIMEOUT).payload == b"ready"


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


# -- sizes ---------------------------------------------------------------------

def test_the_largest_packet_the_broker_accepts_round_trips(broker, connect):
    sub = subscriber(connect, broker.address, "big")
    pub = connect(broker.address)
    payload = os.urandom(MAX_MESSAGE - len(b"MSG big\0"))
    pub.publish("big", payload)
    assert sub.receive(timeout=TIMEOUT) == Message(b"big", payload)


def test_an_oversized_publish_goes_as_chunks(broker, connect):
    sub = subscriber(connect, broker.address, "big")
    pub = connect(broker.address)
    pub.publish("big", b"x" * MAX_MESSAGE)          # docs/chunks.md
    pub.publish("big", b"the connection is still fine")
    assert sub.receive(timeout=TIMEOUT).payload == b"x" * MAX_MESSAGE
    assert sub.receive(timeout=TIMEOUT).payload == b"the connection is still fine"
    with pytest.raises(MessageTooLargeError):       # no room for a chunk's data after the key
        pub.publish("k" * MAX_MESSAGE, b"x")


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
    with pytest.raises(MessageTooLargeError):
        small.query("k", b"x" * 10)     # CMSG k\0 and 10 bytes
    small.publish("k", b"x" * 10)
    assert theirs.recv(100) == b"MSG k\0" + b"x" * 10
    theirs.send(b"MSG k\0" + b"y" * 11)
    with pytest.raises(MessageTooLargeError):
        small.receive(timeout=TIMEOUT)


def test_the_socket_buffers_hold_the_largest_packet(broker, connect):
    client = connect(broker.address)
    with socket.socket(fileno=os.dup(client.fileno())) as sock:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            assert sock.getsockopt(socket.SOL_SOCKET, option) > MAX_MESSAGE


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
    with pytest.raises(BusClosedError):
        client.whoami(timeout=TIMEOUT)
    assert isinstance(BusClosedError(), ConnectionError)


def test_a_client_the_broker_disconnects_sees_bus_closed_error(broker, connect):
    # A client that believes the limit is higher sends what sbusd refuses.
    client = connect(broker.address, max_message=MAX_MESSAGE + 100)
    client.publish("k", b"x" * MAX_MESSAGE)
    with pytest.raises(BusClosedError):
        client.receive(timeout=TIMEOUT)
    with pytest.raises(BusClosedError):
        client.publish("k", b"")


def test_a_closed_client_raises_bus_closed_error(broker, connect):
    with connect(broker.address) as client:
        fd = client.fileno()
    assert client.closed and not client.connected
    with pytest.raises(OSError):
        os.fstat(fd)  # the context manager closed the socket
    for call in (client.receive, client.fileno, lambda: client.publish("k"),
                 lambda: client.whoami()):
        with pytest.raises(BusClosedError, match="^the client is closed$"):
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
    assert [client.receive(timeout=TIMEOUT).key_str for _ in range(5)] == [
        f"early/{i}" for i in range(5)]
    assert client.pending == 0
    assert nothing_within(client)


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
    with pytest.raises(TimeoutError):
        client.whoami(timeout=0.05)
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
    assert nothing_within(sub)


def test_message_values_are_immutable_and_typed():
    m = Message(b"k", b"p")
    c = ControlMessage(b"k", b"p")
    assert m != c and len({m, c}) == 2
    assert m == Message(b"k", b"p") and hash(m) == hash(Message(b"k", b"p"))
    with pytest.raises(AttributeError):
        m.key = b"other"


# -- buffered mode ---------------------------------------------------------------

def test_buffered_packets_go_out_in_order_on_flush(pair, connect):
    client, theirs = pair
    buffered = connect(f"/dev/fd/{os.dup(client.fileno())}", buffered=True)
    assert buffered.buffered
    buffered.publish("k", b"1")
    buffered.subscribe("s")
    buffered.publish("k", b"2", socket.MSG_DONTWAIT)    # other flags: what is packed goes first
    buffered.send_cmsg("echo/off")
    buffered.flush()
    assert [theirs.recv(100) for _ in range(5)] == [
        b"MSG k\0001", b"SUB s", b"SUB s/.sbus-chunk", b"MSG k\0002", b"CMSG echo/off"]
    buffered.publish("k", b"3")
    buffered.buffered = False           # turning it off sends what is packed
    if connect.kind == "aio":    # it sends within its flush_delay, once the loop runs
        connect.loop.run_until_complete(asyncio.sleep(0.05))
    assert theirs.recv(100) == b"MSG k\0003"


def test_repr_names_the_client_and_its_state(broker, connect):
    client = connect(broker.address)
    name = "sbus.Client" if connect.kind == "sync" else "sbus.aio.Client"
    assert repr(client) == f"<{name} {broker.address!r} fd={client.fileno()}>"
    client.close()
    assert repr(client) == f"<{name} {broker.address!r} closed>"


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


def test_dev_fd_must_be_a_seqpacket_socket(connect):
    r, w = os.pipe()
    try:
        with pytest.raises(AddressError):
            connect(f"/dev/fd/{r}")
        os.fstat(r)  # still open: a rejected descriptor stays the caller's
    finally:
        os.close(r)
        os.close(w)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        with pytest.raises(AddressError):
            connect(f"/dev/fd/{s.fileno()}")


def test_sbus_address_from_the_environment(broker, monkeypatch, connect):
    monkeypatch.setenv("SBUS_ADDRESS", broker.address)
    with connect() as client:
        assert client.address == broker.address
        assert client.whoami(timeout=TIMEOUT).pid == os.getpid()


def test_a_missing_socket_is_file_not_found(tmp_path, connect):
    with pytest.raises(FileNotFoundError):
        connect(str(tmp_path / "nothing-here"))
    with pytest.raises(AddressError):
        connect("/dev/unix/abstract")  # binding a random name is for sbusd


# -- errors that say what to do --------------------------------------------------

CHECK = "check -a / SBUS_ADDRESS"


def connect_error(connect, address, expected_type, **kwargs):
    """The error connecting to ``address`` raises: an ``expected_type`` (the
    OSError subclass of its errno) and a ConnectError carrying the address
    and connect(2)'s own words (what the sbus command builds its message on)."""
    with pytest.raises(expected_type) as info:
        connect(address, **kwargs)
    assert isinstance(info.value, ConnectError)
    assert info.value.filename == address
    assert info.value.strerror == os.strerror(info.value.errno)     # connect(2)'s own words
    return info.value


@pytest.mark.parametrize("reconnect", [False, True], ids=["plain", "reconnecting"])
def test_no_broker_names_the_path_and_what_to_do(tmp_path, connect, reconnect):
    path = str(tmp_path / "nothing-here")
    exc = connect_error(connect, path, FileNotFoundError, reconnect=reconnect)
    assert exc.errno == errno.ENOENT
    assert str(exc) == f"no sbus broker at {path}: start sbusd, or {CHECK}"


def test_a_stale_socket_says_nobody_listens(start_broker, connect):
    b = start_broker()
    b.stop(signal.SIGKILL)      # a broker that died leaves its socket file
    assert stat.S_ISSOCK(os.stat(b.address).st_mode)
    exc = connect_error(connect, b.address, ConnectionRefusedError)
    assert str(exc) == (f"nobody listens on {b.address}: a broker that died left its socket "
                        f"behind; start sbusd (-r replaces a stale socket), or {CHECK}")


def test_a_path_that_is_not_a_socket(tmp_path, connect):
    regular = tmp_path / "file"
    regular.write_text("")
    for path, kind in ((str(regular), "a regular file"), (str(tmp_path), "a directory")):
        exc = connect_error(connect, path, ConnectionRefusedError)
        assert str(exc) == f"{path} is {kind}, not an sbus socket: {CHECK}"


def test_a_socket_of_another_type(tmp_path, connect):
    path = str(tmp_path / "stream.socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen()
        exc = connect_error(connect, path, OSError)
    assert exc.errno == errno.EPROTOTYPE
    assert str(exc) == f"{path} is not a SOCK_SEQPACKET socket, so not sbusd's: {CHECK}"


def test_abstract_addresses_malformed_or_unused(connect):
    for text in ("/dev/unix/abstract/xyz", "/dev/unix/abstract/00a"):
        exc = connect_error(connect, text, FileNotFoundError)
        assert str(exc) == (f"no sbus broker at {text}: no such file, and not an abstract "
                            f"address (/dev/unix/abstract/ then an even number of hex digits, "
                            f"beginning 00); {CHECK}")
    unused = "/dev/unix/abstract/00" + os.urandom(8).hex()
    exc = connect_error(connect, unused, ConnectionRefusedError)
    assert str(exc) == f"no sbus broker at {unused}: start sbusd, or {CHECK}"


def _connect_as_nobody(address):
    """Inside a second-user child: how each client fails to connect."""
    from sbus import Client, aio
    seen = {}
    for kind, make in (("sync", lambda: Client(address)),
                       ("aio", lambda: asyncio.run(aio.connect(address)))):
        try:
            make()
        except OSError as exc:
            seen[kind] = [isinstance(exc, PermissionError), exc.filename, str(exc)]
    return seen


@asroot
def test_permission_denied_says_what_keeps_the_user_out(start_broker, spawn):
    d = make_public_dir()
    try:
        b = start_broker(address=str(d / "sbus.socket"))    # mode 0700: root only
        got = spawn(lambda ctl: _connect_as_nobody(b.address)).result()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    message = (f"permission denied connecting to {b.address} (uid {NOBODY}): the socket's "
               f"mode or its directory's keeps this user out (sbusd -g, -o); {CHECK}")
    assert got == {kind: [True, b.address, message] for kind in KINDS}


def test_a_reconnecting_client_that_gives_up_names_the_last_failure(start_broker, connect):
    b = start_broker()
    client = connect(b.address, reconnect=Reconnect(initial_delay=0.01, max_attempts=2,
                                                    give_up_after=None))
    client.whoami(timeout=TIMEOUT)
    b.stop(signal.SIGKILL)
    with pytest.raises(BusClosedError) as info:
        client.receive(timeout=TIMEOUT)
    stale = (f"nobody listens on {b.address}: a broker that died left its socket behind; "
             f"start sbusd (-r replaces a stale socket), or {CHECK}")
    assert str(info.value) == (f"{b.address}: no broker after 2 attempts to reconnect; "
                               f"the last: {stale}")
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    assert info.value.__cause__.filename == b.address
    with pytest.raises(BusClosedError) as again:
        client.receive(timeout=TIMEOUT)
    assert again.value is info.value


def test_someone_elses_private_pattern_is_refused_before_sending(broker, connect):
    client = connect(broker.address)
    gid, uid, pid = os.getegid(), os.geteuid(), os.getpid()
    for pattern in ("!/cred/0/0/1/", f"!/cred/{gid}/{uid}/{pid + 1}/x", f"!/cred/{gid + 1}///"):
        with pytest.raises(KeyRefusedError) as info:
            client.subscribe(pattern)
        assert str(info.value) == (
            f"private pattern {pattern!r} names other credentials than this client's, "
            f"!/cred/{gid}/{uid}/{pid}/: only they may subscribe to it (the broker would "
            f"close the connection); leave a field empty to mean this client's")
    for pattern in (f"!/cred/{gid}/{uid}/{pid}/own", f"!/cred/0{gid}//{pid}/", "!/cred////"):
        client.subscribe(pattern)
    client.publish(f"!/cred/{gid}/{uid}/{pid}/own", b"mine")
    assert client.receive(timeout=TIMEOUT) == Message(f"!/cred/{gid}/{uid}/{pid}/own".encode(),
                                                      b"mine")


def test_an_adopted_descriptor_leaves_private_patterns_to_the_broker(pair):
    client, theirs = pair
    client.subscribe("!/cred/0/0/1/")     # who connected the descriptor is unknown
    assert theirs.recv(1024) == b"SUB !/cred/0/0/1/"


def test_a_replay_the_broker_refuses_stops_the_client_with_the_pattern(start_broker, connect):
    first = start_broker("-r")
    client = connect(first.address, reconnect=Reconnect(initial_delay=0.01, max_delay=0.05,
                                                        give_up_after=TIMEOUT))
    client.subscribe("a/long/pattern/")
    client.whoami(timeout=TIMEOUT)
    first.stop(signal.SIGKILL)
    second = start_broker("-r", "--max-pattern", "8", address=first.address)
    with pytest.raises(PatternRefusedError) as info:
        client.receive(timeout=TIMEOUT)
    assert str(info.value) == (
        f"{first.address}: the broker closed the connection twice when the subscription "
        f"to 'a/long/pattern/' was replayed: it refuses the pattern (its log says why); "
        f"the client stopped")
    assert info.value.patterns == (b"a/long/pattern/",)
    assert client.closed
    with pytest.raises(PatternRefusedError):
        client.whoami(timeout=TIMEOUT)
    refused = [r for r in second.events(SUBSCRIBE) if not r["accepted"]]
    assert [r["reason"] for r in refused] == ["pattern_too_long"] * 2


def test_a_refused_replay_of_several_patterns_lists_them(start_broker, connect):
    first = start_broker("-r")
    client = connect(first.address, reconnect=Reconnect(initial_delay=0.01, max_delay=0.05,
                                                        give_up_after=TIMEOUT))
    client.subscribe("ok/")
    client.subscribe("a/long/pattern/")
    client.whoami(timeout=TIMEOUT)
    first.stop(signal.SIGKILL)
    start_broker("-r", "--max-pattern", "8", address=first.address)
    with pytest.raises(PatternRefusedError) as info:
        client.receive(timeout=TIMEOUT)
    assert str(info.value) == (
        f"{first.address}: the broker closed the connection twice when the subscriptions "
        f"to 'ok/', 'a/long/pattern/' were replayed: it refuses one of them (its log says "
        f"which and why); the client stopped")
    assert info.value.patterns == (b"ok/", b"a/long/pattern/")
