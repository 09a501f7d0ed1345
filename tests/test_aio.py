"""What only sbus.aio.Client does, against real sbusd processes: async
iteration, concurrent tasks, cancellation, back-pressure on a full socket
(against a socket pair) and the buffered mode's flush timer. The behaviour
both clients share is specified in test_client_spec.py."""
from __future__ import annotations

import asyncio
import os
import random
import socket

import pytest

from sbus import BusClosedError, aio
from sbus.client import MAX_MESSAGE, ControlMessage, Message, pack_publish

TIMEOUT = 10.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT * 3))


async def subscriber(address, *patterns) -> aio.Client:
    c = aio.Client(address)
    for p in patterns:
        await c.subscribe(p)
    await c.whoami()  # the broker has registered the patterns once this returns
    return c


def test_publish_subscribe_and_async_for(broker):
    async def main():
        sub = await subscriber(broker.address, "t/*")
        async with sub, aio.Client(broker.address) as pub:
            for i in range(5):
                await pub.publish(f"t/{i}", b"%d" % i)
            await pub.publish(b"u/0", b"unmatched")
            got = []
            async for message in sub:
                got.append(message)
                if len(got) == 5:
                    break
            return got

    assert run(main()) == [Message(b"t/%d" % i, b"%d" % i) for i in range(5)]


def test_many_concurrent_publishers(broker):
    # 29 MB in all: more than the broker queues for one client (8 MiB), so with
    # blocking/hard/block it stops reading the publishers and their sockets fill.
    clients, tasks_per_client, per_task = 4, 8, 150
    payload = b"p" * 6000
    total = clients * tasks_per_client * per_task

    async def publisher(client, c, t):
        for seq in range(per_task):
            await client.publish(f"load/{c}/{t}", b"%d:" % seq + payload)
            if seq % 50 == 0:
                assert (await client.whoami()).pid == os.getpid()

    async def main():
        sub = aio.Client(broker.address)
        await sub.send_cmsg("blocking/hard/block")
        await sub.subscribe("load/")
        await sub.whoami()
        pubs = [aio.Client(broker.address) for _ in range(clients)]
        try:
            async def collect():
                seen = {}
                for _ in range(total):
                    message = await sub.receive()
                    seq = int(message.payload.split(b":", 1)[0])
                    seen.setdefault(message.key, []).append(seq)
                return seen

            collector = asyncio.ensure_future(collect())
            await asyncio.gather(*(publisher(pubs[c], c, t)
                                   for c in range(clients) for t in range(tasks_per_client)))
            seen = await asyncio.wait_for(collector, TIMEOUT)
            totals = (await pubs[0].stats())["totals"]
            return seen, totals
        finally:
            sub.close()
            for p in pubs:
                p.close()

    seen, totals = run(main())
    assert (totals["drops_soft"], totals["drops_hard"], totals["drops_disconnect"]) == (0, 0, 0)
    assert len(seen) == clients * tasks_per_client
    assert all(seqs == list(range(per_task)) for seqs in seen.values())


def test_a_cancelled_receiver_loses_nothing(broker):
    count = 300

    async def main():
        sub = await subscriber(broker.address, "c/*")
        pub = aio.Client(broker.address)
        got = []

        async def produce():
            for i in range(count):
                await pub.publish(f"c/{i}", b"")
                if i % 7 == 0:
                    await asyncio.sleep(0)

        producer = asyncio.ensure_future(produce())
        rng = random.Random(1)
        while len(got) < count:
            receiver = asyncio.ensure_future(sub.receive())
            for _ in range(rng.randrange(4)):
                await asyncio.sleep(0)
            receiver.cancel()
            try:
                got.append(await receiver)  # it may have finished before the cancel landed
            except asyncio.CancelledError:
                pass  # and the client stays usable: the loop goes on receiving
        await producer
        sub.close()
        pub.close()
        return got

    got = run(main())
    assert [m.key for m in got] == [b"c/%d" % i for i in range(count)]


def test_a_cancelled_whoami_does_not_leak_its_reply(broker):
    async def main():
        async with await subscriber(broker.address, "w") as c:
            task = asyncio.ensure_future(c.whoami())
            await asyncio.sleep(0)
            task.cancel()
            await c.publish("w", b"after")
            message = await c.receive()
            creds = await c.whoami()
            return message, creds

    message, creds = run(main())
    assert message == Message(b"w", b"after")
    assert creds.pid == os.getpid()


def test_whoami_while_another_task_iterates(broker):
    async def main():
        async with await subscriber(broker.address, "") as c:
            got = []

            async def consume():
                async for message in c:
                    got.append(message)
                    if len(got) == 3:
                        return

            consumer = asyncio.ensure_future(consume())
            await asyncio.sleep(0.01)  # the consumer now waits on the socket
            await c.publish("x/1", b"")
            creds = await c.whoami()
            await c.publish("x/2", b"")
            await c.publish("x/3", b"")
            await consumer
            return creds, got

    creds, got = run(main())
    assert creds.pid == os.getpid()
    assert got == [Message(b"x/%d" % i, b"") for i in (1, 2, 3)]
    assert not any(isinstance(m, ControlMessage) for m in got)


def test_back_pressure_when_the_socket_is_full():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    payload = b"x" * 8192

    async def main():
        client = aio.Client(f"/dev/fd/{ours.detach()}")
        sent = 0
        # Fill the socket: nobody reads the other end yet.
        while True:
            publish = asyncio.ensure_future(client.publish("bp", b"%06d" % sent + payload))
            await asyncio.sleep(0)  # one step: an unblocked send completes in it
            if not publish.done():
                break
            sent += 1
        # These queue up behind the blocked one, in call order.
        later = [asyncio.ensure_future(client.publish("bp", b"%06d" % (sent + 1 + i) + payload))
                 for i in range(5)]
        cancelled = asyncio.ensure_future(client.publish("bp", b"cancelled"))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        assert not publish.done() and not any(t.done() for t in later)

        loop = asyncio.get_running_loop()
        received = []
        theirs.setblocking(False)
        while len(received) < sent + 6:
            await asyncio.sleep(0.001)
            try:
                received.append(theirs.recv(MAX_MESSAGE))
            except BlockingIOError:
                continue
        await asyncio.gather(publish, *later)
        with pytest.raises(BlockingIOError):
            theirs.recv(MAX_MESSAGE)  # the cancelled publish never went out
        await client.publish("bp", b"still usable")
        theirs.setblocking(True)
        received.append(theirs.recv(MAX_MESSAGE))
        client.close()
        assert loop.is_running()
        return sent, received

    sent, received = run(main())
    theirs.close()
    assert sent > 0
    assert received[:-1] == [pack_publish("bp", b"%06d" % i + payload) for i in range(sent + 6)]
    assert received[-1] == b"MSG bp\0still usable"


def test_buffered_messages_go_out_after_another_call_held_the_send_lock():
    """A buffered message packed while publish_packed waits for a full socket
    (holding the send lock) is sent once the socket drains: its flush timer
    looks again instead of giving up."""
    from sbus._core.batch import Outbox
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    payload = b"x" * 8192

    async def main():
        client = aio.Client(f"/dev/fd/{ours.detach()}", buffered=True, flush_delay=0.001)
        sent = 0
        while True:     # fill the socket: nobody reads the other end yet
            box = Outbox(MAX_MESSAGE)
            while box.add_publish("bp", payload):
                sent += 1
            holder = asyncio.ensure_future(client.publish_packed(box))
            await asyncio.sleep(0)
            if not holder.done():
                break
        await client.publish("late", b"buffered")
        await asyncio.sleep(0.05)       # its flush timer fires while the lock is held
        theirs.setblocking(False)
        received = []
        deadline = asyncio.get_running_loop().time() + TIMEOUT
        while b"MSG late\0buffered" not in received[-1:]:
            assert asyncio.get_running_loop().time() < deadline, "the buffered message stalled"
            try:
                received.append(theirs.recv(MAX_MESSAGE))
            except BlockingIOError:
                await asyncio.sleep(0.001)
        await holder
        client.close()
        return sent, received

    sent, received = run(main())
    theirs.close()
    assert len(received) == sent + 1


def test_the_broker_closing_ends_iteration_and_fails_calls(start_broker, backend):
    b = start_broker(backend=backend)

    async def main():
        c = await subscriber(b.address, "")
        waiter = asyncio.ensure_future(c.receive())
        await asyncio.sleep(0.01)
        b.stop()
        with pytest.raises(BusClosedError):
            await waiter
        with pytest.raises(BusClosedError):
            await c.receive()
        assert [m async for m in c] == []
        with pytest.raises(BusClosedError):
            await c.publish("k", b"")
        with pytest.raises(BusClosedError):
            await c.whoami()
        c.close()

    run(main())


def test_close_wakes_waiters(broker):
    async def main():
        c = aio.Client(broker.address)
        receiver = asyncio.ensure_future(c.receive())
        await asyncio.sleep(0.01)
        c.close()
        with pytest.raises(BusClosedError):
            await receiver
        with pytest.raises(BusClosedError):
            await c.publish("k")
        c.close()

    run(main())


def test_the_client_needs_a_running_loop(broker):
    with pytest.raises(RuntimeError):
        aio.Client(broker.address)
