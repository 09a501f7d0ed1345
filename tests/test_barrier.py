"""The processed-ack barrier, ``Client.sync()`` and its asyncio twin
(sbus/client/barrier.py, docs/clients.md "A barrier"), against a real sbusd."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from sbus import Client, Reconnect
from sbus.aio import Client as AsyncClient

TIMEOUT = 20.0
# Enough packets ahead of a SUB that the broker reads another client's
# publish before it (it serves its connections in turns).
AHEAD = 20000


def _subscribe_behind_a_load(a: Client, barrier: bool) -> None:
    a.publish_many(("nobody/listens", b"") for _ in range(AHEAD))
    a.subscribe("k/")
    if barrier:
        a.sync(TIMEOUT)


def test_after_sync_a_subscription_is_in_place_for_another_publisher(bus):
    with Client(bus.address) as a, Client(bus.address) as b:
        for n in range(5):
            _subscribe_behind_a_load(a, barrier=True)
            b.publish("k/now", str(n))
            m = a.receive(timeout=TIMEOUT)
            assert (m.key, m.payload) == (b"k/now", str(n).encode())
            a.unsubscribe("k/")


@pytest.mark.alone     # it needs the race to happen: on a loaded machine it may not
def test_without_the_barrier_the_same_publish_can_be_missed(bus):
    """What the test above holds would fail without sync(): the broker reads
    the other client's publish before the SUB queued behind the load."""
    missed = 0
    with Client(bus.address) as a, Client(bus.address) as b:
        for n in range(200):    # most rounds miss it; under load, fewer: stop at the first
            _subscribe_behind_a_load(a, barrier=False)
            b.publish("k/now", str(n))
            a.sync(TIMEOUT)     # now the SUB is in place: a late publish is seen
            b.publish("k/late", str(n))
            first = a.receive(timeout=TIMEOUT)
            if first.key == b"k/late":
                missed += 1
                break
            assert a.receive(timeout=TIMEOUT).key == b"k/late"
            a.unsubscribe("k/")
    assert missed > 0


def test_sync_returns_after_the_clients_own_messages_and_keeps_them_in_order(bus):
    with Client(bus.address) as a:
        a.subscribe("k/")
        a.publish_many((f"k/{i}", str(i)) for i in range(500))
        a.sync(TIMEOUT)
        # Delivered to itself before the barrier's message: all already read, in order.
        assert a.pending == 500
        got = a.receive_many(1000, timeout=0)
        assert [m.key for m in got] == [f"k/{i}".encode() for i in range(500)]
        with pytest.raises(TimeoutError):
            a.receive(timeout=0.2)      # the barrier's own message never shows


def test_messages_of_others_received_meanwhile_stay_queued_in_order(bus):
    with Client(bus.address) as a, Client(bus.address) as b:
        a.subscribe("k/")
        a.sync(TIMEOUT)
        b.publish_many((f"k/{i}", str(i)) for i in range(300))
        b.sync(TIMEOUT)     # all of b's are queued for a before a's barrier
        a.sync(TIMEOUT)
        a.sync(TIMEOUT)
        got = []
        while len(got) < 300:
            got += a.receive_many(1000, timeout=TIMEOUT)
        assert [m.payload for m in got] == [str(i).encode() for i in range(300)]


def test_buffered_mode_is_flushed_first(bus):
    with Client(bus.address, buffered=True) as a, Client(bus.address) as b:
        a.subscribe("k/")               # packed, not sent
        a.publish("k/own", "mine")      # packed behind it
        a.sync(TIMEOUT)
        assert a.pending == 1           # the SUB and the publish went first, in order
        b.publish("k/other", "theirs")
        assert a.receive(timeout=TIMEOUT).key == b"k/own"
        assert a.receive(timeout=TIMEOUT).key == b"k/other"


def test_a_client_with_echo_off_syncs_and_keeps_echo_off(bus):
    with Client(bus.address) as a:
        a.subscribe("k/")
        a.send_cmsg("echo/off")
        a.publish("k/own", "not for me")
        a.sync(TIMEOUT)
        a.publish("k/own", "still not for me")
        a.sync(TIMEOUT)
        assert a.pending == 0
        a.send_cmsg("echo/on")
        a.publish("k/own", "now mine")
        a.sync(TIMEOUT)
        assert a.pending == 1


def test_subscribed_to_its_whole_private_key_it_still_sees_nothing_of_the_barrier(bus):
    with Client(bus.address) as a:
        a.subscribe("!/cred////")
        a.sync(TIMEOUT)
        a.sync(TIMEOUT)
        assert a.pending == 0


def test_a_stalled_broker_times_the_barrier_out(bus):
    with Client(bus.address) as a:
        a.sync(TIMEOUT)     # the reply inbox is open: only the barrier waits
        os.kill(bus.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError, match="did not come back"):
                a.sync(0.3)
        finally:
            os.kill(bus.proc.pid, signal.SIGCONT)
        a.sync(TIMEOUT)


def test_asyncio_twin(bus):
    async def run():
        async with AsyncClient(bus.address, buffered=True) as a, AsyncClient(bus.address) as b:
            await a.subscribe("k/")
            await a.publish_many((f"k/{i}", str(i)) for i in range(200))
            await a.sync(TIMEOUT)
            assert a.pending == 200
            await b.publish("k/other", "theirs")
            got = []
            while len(got) < 201:
                got += await asyncio.wait_for(a.receive_many(1000), TIMEOUT)
            assert [m.key for m in got] == [f"k/{i}".encode() for i in range(200)] + [b"k/other"]
            # many barriers at once on one client each return
            await asyncio.wait_for(asyncio.gather(*(a.sync(TIMEOUT) for _ in range(20))), TIMEOUT)
            assert a.pending == 0
    asyncio.run(run())


def test_after_a_restart_the_barrier_returns_behind_the_backlog(start_broker):
    from test_reconnect import restartable
    address, crash, start = restartable(start_broker)
    policy = Reconnect(initial_delay=0.01, max_delay=0.1, give_up_after=TIMEOUT)
    with Client(address, reconnect=policy) as a:
        a.subscribe("r/")
        a.sync(TIMEOUT)
        crash()
        a.publish_many((f"r/{i}", str(i)) for i in range(100))     # kept in the backlog
        assert a.backlog > 0
        start()
        # On the new broker: the subscription replayed, the backlog, then the barrier.
        a.sync(TIMEOUT)
        assert a.backlog == 0 and a.pending == 100
        assert [m.key for m in a.receive_many(1000, timeout=0)] == [
            f"r/{i}".encode() for i in range(100)]


def test_after_a_restart_the_asyncio_barrier_returns_behind_the_backlog(start_broker):
    from test_reconnect import restartable
    address, crash, start = restartable(start_broker)

    async def run():
        policy = Reconnect(initial_delay=0.01, max_delay=0.1, give_up_after=TIMEOUT)
        async with AsyncClient(address, reconnect=policy) as a:
            await a.subscribe("r/")
            await a.sync(TIMEOUT)
            crash()
            await asyncio.sleep(0.2)        # the client sees the broker gone
            await a.publish_many((f"r/{i}", str(i)) for i in range(100))
            start()
            await a.sync(TIMEOUT)
            assert a.backlog == 0 and a.pending == 100
    asyncio.run(run())
