"""Batched and buffered publishing, batched receiving (sbus._core.batch),
in sbus.Client and sbus.aio, against real sbusd processes and socket pairs.
The one-message-at-a-time calls and the plain-Python packing are the reference."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbus import BusClosedError, Client, MessageTooLargeError, ProtocolError, aio
from sbus.client import ControlMessage, Message, pack_publish
from sbus.errors import BatchInterruptedError, KeyRefusedError, MessageRefusedError

from support import Sbusd, recv_or_none
from support.clientfeed import far_end_packets, feed, feed_aio
from support.drivers import KINDS, clients_of

TIMEOUT = 5.0
LIMIT = 20_000      # a small --max-message keeps the largest payloads cheap to draw


@pytest.fixture(params=KINDS)
def connect(request):
    """Factory for clients of one kind (the parameter: each test taking it runs with both)."""
    yield from clients_of(request.param)


def key_strategy():
    # No NUL and no '!': refusals have tests of their own.
    return st.binary(max_size=40).filter(lambda k: b"\0" not in k and b"!" not in k)


def payload_strategy():
    room = LIMIT - 5 - 40
    return st.one_of(st.binary(max_size=200), st.integers(0, room).map(lambda n: b"p" * n),
                     st.just(b"x" * room))


ops_strategy = st.lists(
    st.one_of(st.tuples(st.just("pub"), key_strategy(), payload_strategy()),
              st.tuples(st.just("query"))),
    min_size=1, max_size=60)


def raw_subscriber(broker):
    s = broker.connect()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.send(b"SUB ")
    s.send(b"CMSG !/cred/whoami")
    assert s.recv(LIMIT + 1).startswith(b"CMSG !/cred/whoami\0")
    return s


def drain(sock, expected, *, timeout=TIMEOUT):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < expected and time.monotonic() < deadline:
        packet = recv_or_none(sock, 0.2, LIMIT + 1)
        if packet is not None:
            got.append(packet)
    return got


def run_one_at_a_time(c: Client, ops):
    for op in ops:
        if op[0] == "pub":
            c.publish(op[1], op[2])
        else:
            c.whoami(timeout=TIMEOUT)


def run_batched(c: Client, ops):
    run = []
    for op in ops + [("query",)]:
        if op[0] == "pub":
            run.append((op[1], op[2]))
            continue
        assert c.publish_many(run) == len(run)
        run = []
        c.whoami(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def module_broker(tmp_path_factory):
    b = Sbusd.foreground(tmp_path_factory.mktemp("batch"), "--max-message", str(LIMIT))
    yield b
    b.stop()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy)
def test_batched_and_buffered_publish_deliver_the_same_packets_in_order(module_broker, ops):
    sub = raw_subscriber(module_broker)
    n = sum(op[0] == "pub" for op in ops)
    try:
        streams = []
        for mode in ("one", "batched", "buffered"):
            with Client(module_broker.address, max_message=LIMIT,
                        buffered=mode == "buffered") as c:
                (run_batched if mode == "batched" else run_one_at_a_time)(c, ops)
                c.flush()
            streams.append(drain(sub, n))
        expected = [pack_publish(op[1], op[2]) for op in ops if op[0] == "pub"]
        assert streams[0] == expected
        assert streams[1] == expected
        assert streams[2] == expected
        assert recv_or_none(sub, 0.05) is None
    finally:
        sub.close()


@settings(max_examples=50, deadline=None)
@given(pairs=st.lists(st.tuples(key_strategy(), st.binary(max_size=3000)), max_size=700))
def test_packed_batches_are_the_reference_packets(pairs):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    got = []
    reader = threading.Thread(target=lambda: got.extend(iter(lambda: theirs.recv(1 << 16), b"")))
    reader.start()
    try:
        with Client(f"/dev/fd/{ours.detach()}") as c:
            assert c.publish_many(iter(pairs)) == len(pairs)
    finally:
        reader.join(TIMEOUT)
        theirs.close()
    assert got == [pack_publish(k, p) for k, p in pairs]


@pytest.mark.parametrize("bad, error", [
    ((b"a\0b", b""), KeyRefusedError),
    (("a/!/b", b""), KeyRefusedError),
    (("!/cred/x/1/2/k", b""), KeyRefusedError),
    (("big", b"x" * LIMIT), MessageTooLargeError),
])
def test_a_refused_message_mid_batch_is_reported_with_its_index(start_broker, bad, error,
                                                                connect):
    b = start_broker("--max-message", str(LIMIT))
    sub = raw_subscriber(b)
    with connect(b.address, max_message=LIMIT) as c:
        batch = [(f"ok/{i}", b"%d" % i) for i in range(700)]
        batch.insert(600, bad)
        with pytest.raises(error) as info:
            c.publish_many(batch)
        assert isinstance(info.value, MessageRefusedError)
        assert (info.value.index, info.value.sent) == (600, 600)
        # everything before it went out, nothing after it; the client goes on
        c.publish_many(batch[601:])
        c.whoami(timeout=TIMEOUT)
    got = drain(sub, 700)
    assert got == [pack_publish(k, p) for k, p in batch[:600] + batch[601:]]
    assert b.events("client_disconnect") == [] or all(
        r.get("reason") in ("eof", None) for r in b.events("client_disconnect"))


def test_a_key_is_checked_again_unless_it_is_the_same_immutable_object(start_broker, connect):
    # The outbox reuses the last key's checked bytes for the same str or bytes
    # object; a bytearray may change between pairs, so it is checked each time.
    b = start_broker("--max-message", str(LIMIT))
    sub = raw_subscriber(b)
    key = bytearray(b"a/b")

    def pairs():
        yield key, b"1"
        yield "s/k", b"2"
        yield "s/k", b"3"
        yield key, b"4"
        key[:] = b"a/!/b"
        yield key, b"5"

    with connect(b.address, max_message=LIMIT) as c:
        with pytest.raises(KeyRefusedError) as info:
            c.publish_many(pairs())
        assert (info.value.index, info.value.sent) == (4, 4)
        c.whoami(timeout=TIMEOUT)
    assert drain(sub, 4) == [b"MSG a/b\x001", b"MSG s/k\x002", b"MSG s/k\x003", b"MSG a/b\x004"]


def test_an_iterator_that_raises_ends_publish_many_with_its_error(broker, connect):
    def pairs():
        yield "a/b", b"1"
        raise ZeroDivisionError("the caller's own")

    with connect(broker.address) as c:
        with pytest.raises(ZeroDivisionError):
            c.publish_many(pairs())
        assert c.whoami(timeout=TIMEOUT).pid > 0     # still usable


def test_single_calls_refuse_what_the_broker_would_refuse_before_sending(broker, connect):
    with connect(broker.address, buffered=True) as c:
        with pytest.raises(KeyRefusedError):
            c.publish("x/!", b"")
        with pytest.raises(KeyRefusedError):
            c.subscribe("!/cred/1/2")
    with connect(broker.address) as c:
        with pytest.raises(KeyRefusedError):
            c.publish("!", b"")
        assert c.whoami(timeout=TIMEOUT).pid > 0     # still connected


def test_a_connection_failing_mid_batch_says_how_many_went_out():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    read = []

    def read_some_then_hang_up():
        for _ in range(50):
            read.append(theirs.recv(1 << 16))
        theirs.close()

    reader = threading.Thread(target=read_some_then_hang_up)
    with Client(f"/dev/fd/{ours.detach()}") as c:
        c.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        reader.start()
        with pytest.raises(BatchInterruptedError) as info:
            c.publish_many((f"k/{i}", b"v" * 1000) for i in range(5000))
        reader.join(TIMEOUT)
        assert isinstance(info.value, BusClosedError)
        assert 50 <= info.value.sent < 5000
        assert f"after {info.value.sent} of " in str(info.value)
    assert read == [pack_publish(f"k/{i}", b"v" * 1000) for i in range(50)]


def collect(next_item):
    """Items (or the type of the error raised) until BusClosedError."""
    out = []
    while True:
        try:
            out.append(next_item())
        except BusClosedError:
            return out
        except (ProtocolError, MessageTooLargeError) as exc:
            out.append(type(exc))


def test_receive_many_and_iteration_return_what_receive_returns():
    packets = far_end_packets()
    with feed(packets) as c:
        one = collect(c.receive)
    with feed(packets) as c:
        many = []
        sizes = iter([1, 7, 64, 3, 200] * 100)
        for chunk in iter(lambda: collect_many(c, next(sizes)), None):
            many.extend(chunk)
    with feed(packets) as c:
        iterated = []
        it = iter(c)
        while True:
            try:
                iterated.extend(it)
                break
            except ProtocolError as exc:        # the iterator ends at an error
                iterated.append(type(exc))
                it = iter(c)
    assert len(one) == len(packets)
    assert one[0] == Message(b"k/0", b"")
    assert ControlMessage(b"bare", b"") in one and ProtocolError in one
    assert many == one
    assert iterated == one


def collect_many(c, size):
    try:
        got = c.receive_many(size)
        assert 1 <= len(got) <= size
        return got
    except BusClosedError:
        return None
    except ProtocolError as exc:
        return [type(exc)]


def test_iteration_stops_midway_without_losing_the_rest_of_the_batch():
    packets = [b"MSG k\0%d" % i for i in range(100)]
    with feed(packets) as c:
        first = []
        for m in c:
            first.append(m)
            if len(first) == 10:
                break
        assert c.pending > 0
        rest = c.receive_many(1000) + c.receive_many(1000)
    assert [m.payload for m in first + rest] == [b"%d" % i for i in range(100)]


def test_messages_are_immutable_named_tuples():
    with feed([b"MSG a/b\0x", b"MSG a/b\0y"]) as c:
        first, second = c.receive_many(2)
    assert first.key is second.key or first.key == second.key
    assert (first.key, first.payload) == (b"a/b", b"x")
    with pytest.raises(AttributeError):
        first.key = b"other"
    assert first == Message(b"a/b", b"x") and first != ControlMessage(b"a/b", b"x")


def test_flags_pass_through_the_batched_calls():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with Client(f"/dev/fd/{ours.detach()}") as c:
            with pytest.raises(BlockingIOError):
                c.receive_many(10, flags=socket.MSG_DONTWAIT)
            with pytest.raises(BlockingIOError) as info:
                c.publish_many([("k", b"x" * 4000)] * 100_000, socket.MSG_DONTWAIT)
            assert 0 < info.value.sent < 100_000
            with pytest.raises(TimeoutError):
                c.receive_many(10, timeout=0.05)
            theirs.send(b"MSG a\0b")
            assert c.receive_many(10, timeout=TIMEOUT) == [Message(b"a", b"b")]
    finally:
        theirs.close()


def test_after_a_batch_that_emptied_the_socket_the_next_call_waits_as_asked():
    # A batch shorter than asked for emptied the socket; the next call then
    # waits at once (no non-blocking read first), which must change nothing seen.
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with Client(f"/dev/fd/{ours.detach()}") as c:
            theirs.send(b"MSG a\x001")
            assert c.receive_many(10) == [Message(b"a", b"1")]
            theirs.send(b"MSG a\x002")
            theirs.send(b"MSG a\x003")
            assert c.receive_many(10, timeout=0) == [Message(b"a", b"2"), Message(b"a", b"3")]
            with pytest.raises(TimeoutError):
                c.receive_many(10, timeout=0)
            with pytest.raises(BlockingIOError):
                c.receive_many(10, flags=socket.MSG_DONTWAIT)
            theirs.send(b"MSG a\x004")
            assert c.receive_many(10) == [Message(b"a", b"4")]
            later = threading.Timer(0.1, theirs.send, [b"MSG a\x005"])
            later.start()
            assert c.receive_many(10, timeout=TIMEOUT) == [Message(b"a", b"5")]
            later.join()
            for i in range(6, 16):
                theirs.send(b"MSG a\x00%d" % i)
            assert len(c.receive_many(10)) == 10        # a full batch: read first, as before
            with pytest.raises(TimeoutError):
                c.receive_many(10, timeout=0.05)
            theirs.close()
            with pytest.raises(BusClosedError):
                c.receive_many(10, timeout=TIMEOUT)
    finally:
        theirs.close()


def test_control_replies_reach_their_query_between_batches(broker, connect):
    with connect(broker.address) as c:
        c.subscribe("")
        c.publish_many((f"self/{i}", b"") for i in range(200))
        creds = c.whoami(timeout=TIMEOUT)          # the 200 are queued meanwhile
        c.publish_many((f"self/{i}", b"") for i in range(200, 300))
        got = []
        while len(got) < 300:
            got.extend(c.receive_many(64, timeout=TIMEOUT))
    assert creds.pid > 0
    assert [m.key for m in got] == [b"self/%d" % i for i in range(300)]


def test_buffered_client_flushes_before_a_query_and_on_close(broker, connect):
    sub = raw_subscriber(broker)
    with connect(broker.address, buffered=True) as c:
        c.publish("b/1", b"one")
        assert recv_or_none(sub, 0.1) is None      # still packed
        c.stats(timeout=TIMEOUT)
        assert recv_or_none(sub, TIMEOUT) == b"MSG b/1\0one"
        c.publish("b/2", b"two")
    assert recv_or_none(sub, TIMEOUT) == b"MSG b/2\0two"
    sub.close()


# -- asyncio ---------------------------------------------------------------------

def arun(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT * 6))


@pytest.mark.alone   # the flush within ten times its delay
def test_asyncio_buffered_publish_flushes_on_its_own_within_its_delay(broker):
    delay = 0.05
    sub = raw_subscriber(broker)

    async def main():
        c = aio.Client(broker.address, buffered=True, flush_delay=delay)
        await c.publish("t/1", b"x")
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        packet = await loop.run_in_executor(None, recv_or_none, sub, 10 * delay)
        waited = time.monotonic() - start
        c.close()
        return packet, waited

    packet, waited = arun(main())
    sub.close()
    assert packet == b"MSG t/1\0x"
    assert waited < 10 * delay


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy)
def test_asyncio_batched_and_buffered_publish_match_one_at_a_time(module_broker, ops):
    sub = raw_subscriber(module_broker)
    n = sum(op[0] == "pub" for op in ops)

    async def send(mode):
        async with aio.Client(module_broker.address, max_message=LIMIT,
                              buffered=mode == "buffered") as c:
            run = []
            for op in ops + [("query",)]:
                if op[0] == "pub" and mode == "batched":
                    run.append((op[1], op[2]))
                elif op[0] == "pub":
                    await c.publish(op[1], op[2])
                else:
                    if run:
                        assert await c.publish_many(run) == len(run)
                        run = []
                    await c.whoami()

    try:
        expected = [pack_publish(op[1], op[2]) for op in ops if op[0] == "pub"]
        for mode in ("one", "batched", "buffered"):
            arun(send(mode))
            assert drain(sub, n) == expected, mode
    finally:
        sub.close()


def test_asyncio_receive_many_and_async_for_return_what_receive_returns():
    packets = [p for p in far_end_packets() if p not in (b"NOPE", b"MSG no-nul")]

    async def one():
        async with feed_aio(packets) as c:
            return [m async for m in c]

    async def many():
        async with feed_aio(packets) as c:
            out = []
            while True:
                try:
                    out.extend(await c.receive_many(17))
                except BusClosedError:
                    return out

    async def single():
        async with feed_aio(packets) as c:
            out = []
            while True:
                try:
                    out.append(await c.receive())
                except BusClosedError:
                    return out

    reference = arun(single())
    assert len(reference) == len(packets)
    assert arun(one()) == reference
    assert arun(many()) == reference


def test_buffered_packets_keep_their_order_with_subscriptions(broker):
    # The client hears its own messages only once its SUB is registered: a
    # SUB that overtook the first publish would bring "o/1" back too.
    with Client(broker.address, buffered=True) as c:
        c.publish("o/1", b"")
        c.subscribe("o/")
        c.publish("o/2", b"")
        c.unsubscribe("o/")
        c.publish("o/3", b"")
        c.subscribe("o/")
        c.publish_many([("o/4", b""), ("o/5", b"")])
        got = [c.receive(timeout=TIMEOUT).key for _ in range(3)]
        with pytest.raises(TimeoutError):
            c.receive(timeout=0.1)
    assert got == [b"o/2", b"o/4", b"o/5"]

    async def main():
        async with aio.Client(broker.address, buffered=True) as a:
            await a.publish("q/1", b"")
            await a.subscribe("q/")
            await a.publish("q/2", b"")
            await a.unsubscribe("q/")
            await a.publish("q/3", b"")
            await a.whoami()
            first = await a.receive()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(a.receive(), 0.1)
            return first.key

    assert arun(main()) == b"q/2"
