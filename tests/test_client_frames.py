"""The clients' frames (``take_frames()``, docs/clients.md): granted, both
the asyncio and the blocking client send their batches in frames and take the
broker's frames apart, every message exact and in order, through every read
path (the C ``take_batch`` too) and across a reconnect; a blocking batch
waits for room as a blocking send does."""
from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from sbus import Client, Reconnect
from sbus.aio import Client as AsyncClient

from support.conn import Conn
from support.frames import publish_together


def test_a_client_granted_frames_sends_them_and_takes_them_apart(broker):
    """sbus.aio.Client.take_frames (the bridge's way): its batches go in
    frames, its deliveries come in frames and are taken apart, chunks are
    reassembled as ever, exactly and in order."""
    sub = Conn.to(broker.address)
    sub.sub("s/")
    sub.sync()
    sent = [(b"s/%d" % i, b"v" * (i % 200)) for i in range(2000)]
    back = [(b"r/%d" % i, b"w" * (i % 90)) for i in range(2000)]
    big = bytes(range(256)) * 2000     # chunks: larger than a packet

    async def main():
        async with AsyncClient(broker.address) as c:
            await c.subscribe("r/")
            assert await c.take_frames(timeout=5) == b"ok"
            await c.publish_many(sent)
            await c.whoami()
            publish_together(broker, back[:300])    # read together: frames for certain
            with Client(broker.address) as pub:
                pub.publish_many(back[300:])
                pub.publish("r/big", big)
                pub.whoami()
            got = []
            while len(got) < len(back) + 1:
                batch = await c.receive_many(10)
                assert 0 < len(batch) <= 10
                got += batch
            return [(m.key, m.payload) for m in got], c.frames

    got, (frames_in, frames_out) = asyncio.run(main())
    assert got == back + [(b"r/big", big)]
    assert frames_in > 0 and frames_out > 0
    assert [sub.next_packet(5) for _ in sent] == [b"MSG " + k + b"\0" + p for k, p in sent]


def test_a_blocking_client_takes_frames_apart_as_it_waits(broker):
    """A receive that waits still waits, and what comes in frames comes
    whole and in order, through receive_many's C path and receive()."""
    back = [(b"r/%d" % i, b"w" * (i % 90)) for i in range(1000)]
    with Client(broker.address) as c:
        c.subscribe("r/")
        assert c.take_frames(timeout=5) == b"ok"
        with pytest.raises(TimeoutError):
            c.receive(timeout=0.2)
        publish_together(broker, back[:300])
        with Client(broker.address) as pub:
            pub.publish_many(back[300:])
            pub.whoami()
        got = [c.receive(timeout=5)]
        while len(got) < len(back):
            batch = c.receive_many(10, timeout=5)
            assert 0 < len(batch) <= 10     # frames hold more: the rest waits
            got += batch
        assert [(m.key, m.payload) for m in got] == back
        assert c.frames[0] > 0
        c.publish("r/own", "x")     # one message alone: a packet, as ever
        assert c.whoami()


def test_a_blocking_clients_batches_go_in_frames(broker):
    """publish_many and a buffered client's flush, once granted: frames,
    which the broker takes apart into exactly the packets a plain client
    would have sent, in order."""
    sub = Conn.to(broker.address)
    sub.sub("s/")
    sub.sync()
    sent = [(b"s/%d" % i, b"v" * (i % 300)) for i in range(3000)]
    with Client(broker.address, buffered=True) as c:
        assert c.take_frames(timeout=5) == b"ok"
        assert c.publish_many(sent[:2000]) == 2000
        for key, payload in sent[2000:]:
            c.publish(key, payload)
        c.flush()
        c.whoami()
        frames_out = c.frames[1]
    assert [sub.next_packet(5) for _ in sent] == [b"MSG " + k + b"\0" + p for k, p in sent]
    assert 0 < frames_out < len(sent) // 10


def test_a_blocking_batch_in_frames_waits_for_room(bus):
    """A subscriber in blocking/hard/block that does not read stops the
    broker reading the publisher, whose socket fills: publish_many in frames
    (sent MSG_DONTWAIT underneath) waits as a blocking sendmmsg would, and
    goes on when the subscriber reads. Nothing is lost or reordered; with
    MSG_DONTWAIT the same full socket raises BlockingIOError."""
    sent = [(b"s/%d" % i, b"p" * 1000) for i in range(20000)]   # far more than the buffers hold
    with Client(bus.address) as sub, Client(bus.address) as pub:
        sub.send_cmsg("blocking/hard/block")
        sub.subscribe("s/")
        sub.whoami()
        assert pub.take_frames(timeout=5) == b"ok"
        outcome = []
        publisher = threading.Thread(
            target=lambda: outcome.append(pub.publish_many(sent)), daemon=True)
        publisher.start()
        publisher.join(1.0)
        assert publisher.is_alive() and not outcome     # waiting for room, not failed
        got = []
        while len(got) < len(sent):
            got += sub.receive_many(256, timeout=10)
        publisher.join(10)
        assert outcome == [len(sent)]
        assert [(m.key, m.payload) for m in got] == sent
        assert pub.frames[1] > 0

        # The same full socket again, without waiting:
        more = [(b"s/x", b"p" * 1000)] * 20000
        with pytest.raises(BlockingIOError) as raised:
            while True:
                pub.publish_many(more, socket.MSG_DONTWAIT)
        assert 0 <= raised.value.sent < len(more)


@pytest.mark.parametrize("driver", ["blocking", "asyncio"])
def test_a_reconnecting_client_has_its_frames_again(start_broker, driver):
    """Frames are part of the session a reconnecting client replays: asked
    again before the replay's whoami, so the new broker's frames are taken
    apart (through receive_many's C path too: the frames reader keeps the
    client's socket and queue) and the client's batches go in frames."""
    first = start_broker()
    back = [(b"r/%d" % i, b"w" * (i % 90)) for i in range(1000)]
    sent = [(b"s/%d" % i, b"v" * (i % 70)) for i in range(1000)]
    policy = Reconnect(initial_delay=0.01)

    def restart():
        first.stop()
        second = start_broker(address=first.address)
        sub = Conn.to(second.address)
        sub.sub("s/")
        sub.sync()
        return second, sub

    def publish_back(broker):
        publish_together(broker, back[:300])
        with Client(broker.address) as pub:
            pub.publish_many(back[300:])
            pub.whoami()

    if driver == "blocking":
        with Client(first.address, reconnect=policy) as c:
            c.subscribe("r/")
            assert c.take_frames(timeout=5) == b"ok"
            second, sub = restart()
            c.whoami(timeout=10)    # reconnected, the session replayed
            before = c.frames
            publish_back(second)
            got = []
            while len(got) < len(back):
                got += c.receive_many(256, timeout=5)
            c.publish_many(sent)
            c.whoami()
            after = c.frames
    else:
        async def main():
            async with AsyncClient(first.address, reconnect=policy) as c:
                await c.subscribe("r/")
                assert await c.take_frames(timeout=5) == b"ok"
                second, sub = restart()
                await c.whoami(timeout=10)
                before = c.frames
                await asyncio.get_running_loop().run_in_executor(None, publish_back, second)
                got = []
                while len(got) < len(back):
                    got += await c.receive_many(256)
                await c.publish_many(sent)
                await c.whoami()
                return second, sub, got, before, c.frames
        second, sub, got, before, after = asyncio.run(main())
    assert [(m.key, m.payload) for m in got] == back
    assert after[0] > before[0] and after[1] > before[1]
    assert [sub.next_packet(5) for _ in sent] == [b"MSG " + k + b"\0" + p for k, p in sent]
