"""The receive fast paths of sbus._core.batch (the C iterator behind ``for m in
client``, AsyncMessages behind ``async for``, take() behind receive_many and
the poll(2) behind a receive timeout), against socket pairs and real sbusd
processes. Per-message ``receive()`` is the reference they must match."""
from __future__ import annotations

import asyncio
import gc
import socket
import sys
import threading
import time

import pytest

from sbus import BusClosedError, Client, MessageTooLargeError, ProtocolError, aio
from sbus._core import batch
from sbus.client import ControlMessage, Message
from sbus.client.reconnect import Reconnect

from support.clientfeed import far_end_packets, feed, feed_aio

TIMEOUT = 5.0
ERRORS = (ProtocolError, MessageTooLargeError)


def arun(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT * 6))


def reference(packets):
    """What per-message receive() returns for ``packets``: items, or the type
    of each error raised in their place."""
    out = []
    with feed(packets) as c:
        while True:
            try:
                out.append(c.receive())
            except BusClosedError:
                return out
            except ERRORS as exc:
                out.append(type(exc))


def test_one_iterator_carries_on_after_raising_an_error_in_its_turn():
    packets = far_end_packets()
    with feed(packets) as c:
        it = iter(c)
        got = []
        while True:
            try:
                got.append(next(it))
            except StopIteration:
                break
            except ERRORS as exc:
                got.append(type(exc))
        with pytest.raises(StopIteration):
            next(it)                    # stays ended
    assert got == reference(packets)


def test_batches_return_what_receive_returns():
    packets = far_end_packets()
    expected = reference(packets)
    with feed(packets) as c:
        got, sizes = [], []
        while True:
            try:
                for batch in c.batches(10):
                    sizes.append(len(batch))
                    got.extend(batch)
                break
            except ERRORS as exc:       # raised in its turn, between batches
                got.append(type(exc))
    assert got == expected
    assert max(sizes) == 10 and min(sizes) >= 1


def test_received_messages_are_left_out_of_the_garbage_collector():
    with feed([b"MSG a\0x", b"CMSG stats\0{}"]) as c:
        message, control = c.receive_many(2)
    assert (message, control) == (Message(b"a", b"x"), ControlMessage(b"stats", b"{}"))
    assert not gc.is_tracked(message) and not gc.is_tracked(control)


def test_a_receive_timeout_returns_what_arrives_while_it_waits():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = threading.Timer(0.2, theirs.send, (b"MSG late\0x",))
    try:
        with Client(f"/dev/fd/{ours.detach()}") as c:
            sender.start()
            start = time.monotonic()
            assert c.receive_many(8, timeout=TIMEOUT) == [Message(b"late", b"x")]
            assert time.monotonic() - start < TIMEOUT
            with pytest.raises(TimeoutError):
                c.receive(timeout=0.05)
            theirs.close()
            with pytest.raises(BusClosedError):
                c.receive_many(8, timeout=TIMEOUT)
    finally:
        sender.cancel()
        theirs.close()


# -- asyncio ---------------------------------------------------------------------

async def collect_async(next_item):
    out = []
    while True:
        try:
            out.append(await next_item())
        except (BusClosedError, StopAsyncIteration):
            return out
        except ERRORS as exc:
            out.append(type(exc))


def test_async_for_returns_what_receive_returns_errors_included():
    packets = far_end_packets()

    async def iterated():
        async with feed_aio(packets) as c:
            it = c.__aiter__()
            assert type(it).__name__ == "AsyncMessages"
            return await collect_async(it.__anext__)

    async def received():
        async with feed_aio(packets) as c:
            return await collect_async(c.receive)

    async def batches():
        async with feed_aio(packets) as c:
            out = []
            while True:
                try:
                    async for batch in c.batches(10):
                        assert 1 <= len(batch) <= 10
                        out.extend(batch)
                    return out
                except ERRORS as exc:
                    out.append(type(exc))

    expected = reference(packets)
    assert arun(received()) == expected
    assert arun(iterated()) == expected
    assert arun(batches()) == expected


def test_the_awaitable_has_its_am_send_slot_where_python_has_one():
    assert batch.AM_SEND == (sys.version_info >= (3, 10))


def test_the_awaitable_without_am_send_returns_the_same_through_stop_iteration():
    async def main():
        async with feed_aio([b"MSG k\0a", b"MSG k\0b"]) as c:
            assert await c.receive() == Message(b"k", b"a")  # the rest is queued now
            awaitable = c.__aiter__().__anext__()
            with pytest.raises(StopIteration) as stop:
                awaitable.__await__().__next__()   # how Python 3.9 and 3.12+ take it
            return stop.value.value

    assert arun(main()) == Message(b"k", b"b")


def test_an_unawaited_anext_keeps_its_message_first():
    async def main():
        async with feed_aio([b"MSG k\0%d" % i for i in range(3)]) as c:
            assert await c.receive() == Message(b"k", b"0")  # the rest is queued now
            it = c.__aiter__()
            pending = it.__anext__()
            with pytest.raises(RuntimeError):
                it.__anext__()      # the first was never awaited
            first = await pending
            with pytest.raises(RuntimeError):
                await pending       # an awaitable completes once
            second = await it.__anext__()
            return first, second

    first, second = arun(main())
    assert (first, second) == (Message(b"k", b"1"), Message(b"k", b"2"))


def test_a_parked_async_for_wakes_when_a_message_arrives():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    async def main():
        c = aio.Client(f"/dev/fd/{ours.detach()}")
        got = []

        async def consume():
            async for message in c:
                got.append(message)

        consumer = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        assert not consumer.done() and got == []     # parked on the empty socket
        for i in range(200):
            theirs.send(b"MSG w\0%d" % i)
            if i % 50 == 0:
                await asyncio.sleep(0.01)   # some arrive while it is parked, some in a burst
        theirs.close()
        await consumer                      # ends at the broker's end of the connection
        c.close()
        return got

    try:
        got = arun(main())
    finally:
        theirs.close()
    assert got == [Message(b"w", b"%d" % i) for i in range(200)]


def test_control_replies_reach_their_waiters_while_async_for_drains_a_burst(broker):
    n = 5000

    async def main():
        async with aio.Client(broker.address) as sub:
            await sub.subscribe("burst/")
            await sub.whoami()
            got = []

            async def consume():
                async for message in sub:
                    got.append(message)
                    if len(got) == n:
                        return

            consumer = asyncio.ensure_future(consume())
            with Client(broker.address) as pub:
                pub.publish_many((f"burst/{i}", b"x") for i in range(n // 2))
                asked = [asyncio.ensure_future(sub.whoami()) for _ in range(3)]
                stats = await sub.stats()
                pub.publish_many((f"burst/{i}", b"x") for i in range(n // 2, n))
            creds = await asyncio.gather(*asked)
            await consumer
            return got, creds, stats

    got, creds, stats = arun(main())
    assert [m.key for m in got] == [b"burst/%d" % i for i in range(n)]
    assert all(type(m) is Message for m in got)
    assert len({c.text for c in creds}) == 1 and isinstance(stats, dict)


# -- after a reconnect -------------------------------------------------------------

class ScriptedBroker:
    """A listening unix socket whose first connection is closed at once and
    whose second gets ``script`` once the replayed session's whoami has come
    (then it accepts no more):
    messages sent before the whoami reply arrive while the client confirms
    its reconnect, and are queued by it."""

    def __init__(self, path, script):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(2)
        self.script = script
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        first, _ = self.listener.accept()
        first.recv(100)                     # the client's SUB
        first.close()
        second, _ = self.listener.accept()
        self.listener.close()               # a third connect is refused
        while not second.recv(100).startswith(b"CMSG !/cred/whoami"):
            pass
        for packet in self.script:
            second.send(packet)
        self.done.wait(TIMEOUT)     # open until the client is done: no second reconnect
        second.close()

    def close(self):
        self.done.set()
        self.thread.join(TIMEOUT)
        self.listener.close()


@pytest.mark.parametrize("how", ["receive_many", "iteration"])
def test_messages_queued_during_a_reconnect_keep_their_order(tmp_path, how):
    before = [b"MSG k\0%d" % i for i in range(5)]       # arrive before the whoami reply
    after = [b"MSG k\0%d" % i for i in range(5, 8)]
    broker = ScriptedBroker(str(tmp_path / "s"),
                            before + [b"CMSG !/cred/whoami\0!/cred/0/0/1"] + after)
    try:
        # a lost message would leave iteration waiting: the scripted broker
        # hangs up after TIMEOUT, and the client then gives up
        policy = Reconnect(give_up_after=TIMEOUT, confirm_timeout=1.0)
        with Client(str(tmp_path / "s"), reconnect=policy) as c:
            c.subscribe("k")
            got = []
            if how == "receive_many":
                while len(got) < 8:
                    got.extend(c.receive_many(3, timeout=TIMEOUT))
            else:
                for message in c:
                    got.append(message)
                    if len(got) == 8:
                        break
    finally:
        broker.close()
    assert [m.payload for m in got] == [b"%d" % i for i in range(8)]


def test_a_late_reply_among_plain_messages_is_routed_not_received(broker):
    """Once a client has asked (its reply inbox open), the Inbox tells its
    replies apart in C (Inbox.route): one in a batch of plain messages is
    routed (here: dropped, its request abandoned), the rest received in order."""
    from sbus.client.requests import OK, parse_request
    from sbus.errors import RequestTimeoutError
    with Client(broker.address) as asker, Client(broker.address) as server:
        server.subscribe("svc")
        asker.subscribe("k/")
        server.sync(TIMEOUT)
        with pytest.raises(RequestTimeoutError):
            asker.request("svc", b"q", timeout=0.2)
        request = parse_request(server.receive(timeout=TIMEOUT))
        server.publish_many([("k/0", b"a"), (request.reply_to, OK + b"late"), ("k/1", b"b")])
        got = []
        while len(got) < 2:
            got += asker.receive_many(10, timeout=TIMEOUT)
        assert got == [Message(b"k/0", b"a"), Message(b"k/1", b"b")]
        assert asker.pending == 0


def test_freed_messages_keep_their_types_counted_and_deep_nesting_freed():
    """Messages go back to batch's freelist when freed; instances of a
    subclass, or with items other than bytes, are freed as before, and each
    holds (then gives back) one reference to its type."""
    class Tagged(Message):
        pass

    before = sys.getrefcount(Tagged)
    for i in range(3000):
        Tagged(b"k", b"p")
        Message("k", i)
        Message(b"k", b"p")
    assert sys.getrefcount(Tagged) == before
    nested = Message(b"k", b"p")
    for _ in range(100_000):    # freed through the trashcan, as a tuple's items are
        nested = Message(nested, b"")
    del nested
    with feed([b"MSG k\0%d" % i for i in range(3000)]) as c:
        got = []
        while len(got) < 3000:
            got += [m.payload for m in c.receive_many(64)]     # each batch freed, refilled
    assert got == [b"%d" % i for i in range(3000)]


def test_receive_into_routes_a_late_reply_away_from_its_sink(broker):
    """A reply that receive_into reads is told apart in C and routed (here:
    dropped, its request abandoned), not handed to the sink as a message."""
    from sbus._core.natswire import Exporter
    from sbus.bridge import mapping
    from sbus.client.requests import OK, parse_request
    from sbus.errors import RequestTimeoutError

    def map_out(key):
        return mapping.key_to_subject(key), mapping.encode_header(key)

    def exporter():
        return Exporter(map_out, Message, 1 << 30, False)

    sent = [(b"k/%d" % i, b"p") for i in range(200)]

    async def main():
        async with aio.Client(broker.address) as asker, aio.Client(broker.address) as server:
            await server.subscribe("svc")
            await asker.subscribe("k/")
            await server.sync(TIMEOUT)
            with pytest.raises(RequestTimeoutError):
                await asker.request("svc", b"q", timeout=0.2)
            request = parse_request(await asyncio.wait_for(server.receive(), TIMEOUT))
            await server.publish_many(sent[:100] + [(request.reply_to, OK + b"late")] + sent[100:])
            sink = exporter()
            sink.private = lambda key, payload: private.append(key)   # what the sink was given
            while sink.pending_msgs < len(sent):
                assert await asyncio.wait_for(asker.receive_into(sink, 64), TIMEOUT) == []
            await asker.whoami()
            assert asker.pending == 0
            return sink.take(1 << 30)[0]

    private = []
    frames = arun(main())
    assert private == []
    expected = exporter()
    expected.add([Message(k, p) for k, p in sent])
    assert frames == expected.take(1 << 30)[0]


def test_receive_many_with_a_timeout_returns_what_receive_returns():
    """The usual call is C (Inbox.take_batch) and the rest the client's own
    path, batch by batch: a batch with a control message or an error in it
    goes to the client's path as it was read, so the order and the errors
    are those of per-message receive(), a timeout given or not."""
    packets = far_end_packets()
    got = []
    with feed(packets) as c:
        sizes = iter([1, 7, 64, 3, 200] * 100)
        while True:
            try:
                got.extend(c.receive_many(next(sizes), timeout=TIMEOUT))
            except BusClosedError:
                break
            except ERRORS as exc:
                got.append(type(exc))
    assert got == reference(packets)


def test_a_buffered_client_sends_what_it_packed_before_receive_many_reads(broker):
    """What the buffered mode packed goes first: a receive_many that read
    without flushing would wait here for its own message (echo is on)."""
    with Client(broker.address, buffered=True) as c:
        c.subscribe("fast/k")
        c.flush()
        c.publish("fast/k", b"1")
        assert c.receive_many(8, timeout=TIMEOUT) == [Message(b"fast/k", b"1")]


def test_the_blocking_receive_many_keeps_its_signature_in_c():
    import inspect
    assert str(inspect.signature(Client.receive_many)) == "(self, max=64, *, timeout=None, flags=0)"
    assert "recvmmsg" in Client.receive_many.__doc__
