"""Riding out a broker restart: a real sbusd is killed and started again on
the same address under subscribing and publishing clients (sync and asyncio)."""
from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest

from sbus import BusClosedError, Client, aio
from sbus.client import Message
from sbus.client.reconnect import Reconnect, Session
from sbus.errors import BacklogFullError

from support import wait_until
from support.drivers import KINDS, clients_of

TIMEOUT = 10.0


@pytest.fixture(params=KINDS)
def connect(request):
    """Factory for clients of one kind (the parameter: each test taking it runs with both)."""
    yield from clients_of(request.param)


def refuses(address) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        try:
            s.connect(address)
        except OSError:
            return True
    return False


def restartable(start_broker, backend="epoll"):
    """start() and crash() an sbusd that always listens on the same path."""
    first = start_broker("-r", backend=backend)
    state = {"broker": first}

    def crash():
        state["broker"].stop(signal.SIGKILL)
        # Its sockets close when the kernel lets go of them: at once for
        # epoll and select, a moment after the exit for io_uring, whose
        # polls hold the files until the ring is torn down in the background.
        wait_until(lambda: refuses(first.address), TIMEOUT, "the killed broker's socket to close")

    def start():
        state["broker"] = start_broker("-r", backend=backend, address=first.address)
        return state["broker"]

    return first.address, crash, start


class Events:
    """on_disconnect/on_reconnect calls, in order."""

    def __init__(self):
        self.seen = []
        self.up_at = []

    def policy(self, **kw):
        return Reconnect(initial_delay=0.01, max_delay=0.1, give_up_after=TIMEOUT,
                         on_disconnect=lambda exc: self.seen.append("down"),
                         on_reconnect=self._up, **kw)

    def _up(self):
        self.seen.append("up")
        self.up_at.append(time.monotonic())


def test_sync_clients_ride_out_a_restart(start_broker, backend):
    address, crash, start = restartable(start_broker, backend)
    sub_events, pub_events = Events(), Events()
    with Client(address, reconnect=sub_events.policy()) as sub, \
            Client(address, reconnect=pub_events.policy()) as pub:
        sub.subscribe("r/")
        sub.subscribe("r/")         # a multiset: one UNSUB leaves one
        sub.unsubscribe("r/")
        sub.send_cmsg("echo/off")
        sub.whoami(timeout=TIMEOUT)
        pub.publish_many((f"r/before/{i}", b"") for i in range(50))
        assert [m.key for m in take(sub, 50)] == [b"r/before/%d" % i for i in range(50)]

        crash()
        for i in range(100):                            # the broker is away: kept
            pub.publish(f"r/backlog/{i}", b"%d" % i)
        assert not pub.connected and pub.backlog > 0
        start()
        # The subscriber finds the connection gone and restores its
        # subscriptions before it waits again; then the backlog is sent.
        with pytest.raises(TimeoutError):
            sub.receive(timeout=0.3)
        assert sub_events.seen == ["down", "up"]
        pub.flush()
        assert pub_events.seen == ["down", "up"] and pub.backlog == 0
        got = take(sub, 100)
        assert got == [Message(b"r/backlog/%d" % i, b"%d" % i) for i in range(100)]
        pub.publish("r/after", b"x")
        assert take(sub, 1)[0].key == b"r/after"
        # one subscription, not two, and echo still off
        sub.publish("r/self", b"")
        pub.publish("r/last", b"")
        assert [m.key for m in take(sub, 1)] == [b"r/last"]
        with pytest.raises(TimeoutError):
            sub.receive(timeout=0.2)


def fill_backlog(pub, prefix):
    """Publish ``prefix``N, N = 0, 1, ... while the broker is away, until the
    backlog is full (BacklogFullError); how many it kept."""
    kept = 0
    with pytest.raises(BacklogFullError):
        while True:
            pub.publish(f"{prefix}{kept}", b"x" * 100)
            kept += 1
    return kept


def packets_within(bound, prefix, size):
    """How many of fill_backlog's packets (the spec's ``MSG key\\0payload``)
    fit in ``bound`` bytes, oldest first."""
    used = n = 0
    while True:
        packet = len(b"MSG %s%d\0" % (prefix.encode(), n)) + size
        if used + packet > bound:
            return n
        used, n = used + packet, n + 1


def take(c, n):
    got = []
    while len(got) < n:
        got.extend(c.receive_many(n - len(got), timeout=TIMEOUT))
    return got


def test_a_full_backlog_raises_and_keeps_what_it_holds(start_broker, connect):
    address, crash, start = restartable(start_broker)
    bound = 10_000
    # The publisher tries again only a second after its first attempt failed
    # (the asyncio one in the background): by then the subscriber is back.
    slow = Reconnect(initial_delay=1.0, max_delay=1.0, max_backlog=bound)
    with connect(address, reconnect=slow) as pub, \
            connect(address, reconnect=Reconnect(initial_delay=0.01)) as sub:
        sub.subscribe("f/")
        sub.whoami(timeout=TIMEOUT)
        crash()
        kept = fill_backlog(pub, "f/")
        assert 0 < pub.backlog <= bound
        assert kept == packets_within(bound, "f/", 100)
        with pytest.raises(BacklogFullError):
            pub.publish_many([("f/more", b"x" * 100)])
        start()
        sub.whoami(timeout=TIMEOUT)     # answered once the subscription is restored
        pub.flush()
        got = take(sub, kept)
    assert [m.key for m in got] == [b"f/%d" % i for i in range(kept)]


def test_a_full_backlog_does_not_stop_the_client_reconnecting(start_broker):
    address, crash, start = restartable(start_broker)
    policy = Reconnect(initial_delay=0.01, max_delay=0.05, max_backlog=1000)
    with Client(address, reconnect=policy) as pub, Client(address, reconnect=policy) as sub:
        sub.subscribe("g/")
        sub.whoami(timeout=TIMEOUT)
        crash()
        kept = fill_backlog(pub, "g/")
        start()
        with pytest.raises(TimeoutError):
            sub.receive(timeout=0.3)     # restores the subscription
        deadline = time.monotonic() + TIMEOUT
        while True:                      # no flush(): publishing finds the broker again
            try:
                pub.publish("g/last", b"")
                break
            except BacklogFullError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert pub.connected and pub.backlog == 0
        got = take(sub, kept + 1)
    assert [m.key for m in got] == [b"g/%d" % i for i in range(kept)] + [b"g/last"]


def test_without_reconnect_a_restart_raises_bus_closed_error_at_once(start_broker, connect):
    address, crash, start = restartable(start_broker)
    with connect(address) as pub, connect(address) as sub:
        sub.subscribe("")
        sub.whoami(timeout=TIMEOUT)
        crash()
        start()
        began = time.monotonic()
        with pytest.raises(BusClosedError):
            pub.publish("k", b"")
        with pytest.raises(BusClosedError):
            sub.receive(timeout=TIMEOUT)
        with pytest.raises(BusClosedError):
            pub.publish_many([("k", b"")] * 10)
        assert time.monotonic() - began < TIMEOUT


def test_a_client_gives_up_after_its_limit(start_broker, connect):
    address, crash, start = restartable(start_broker)
    events = Events()
    policy = Reconnect(initial_delay=0.01, max_delay=0.02, max_attempts=3,
                       on_disconnect=lambda exc: events.seen.append("down"))
    with connect(address, reconnect=policy) as sub:
        sub.subscribe("")
        sub.whoami(timeout=TIMEOUT)
        crash()
        with pytest.raises(BusClosedError, match="no broker after 3 attempts"):
            sub.receive(timeout=TIMEOUT)
        assert sub.closed and events.seen == ["down"]


def test_the_session_is_a_multiset_with_the_last_settings():
    s = Session()
    for packet in (b"SUB a", b"SUB a", b"SUB b", b"UNSUB a", b"UNSUB c",
                   b"CMSG echo/off", b"CMSG blocking/soft/queue", b"CMSG echo/on",
                   b"CMSG order/stack", b"CMSG stats"):
        s.note(packet)
    assert sorted(s.replay()) == sorted([b"CMSG echo/on", b"CMSG blocking/soft/queue",
                                         b"CMSG order/stack", b"SUB a", b"SUB b"])
    assert Session.covers(b"UNSUB x") and not Session.covers(b"MSG a\0b")


# -- asyncio ---------------------------------------------------------------------

def arun(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT * 3))


def test_asyncio_clients_ride_out_a_restart(start_broker, backend):
    address, crash, start = restartable(start_broker, backend)
    sub_events, pub_events = Events(), Events()

    async def main():
        sub = aio.Client(address, reconnect=sub_events.policy())
        pub = aio.Client(address, reconnect=pub_events.policy(), buffered=True)
        await sub.subscribe("a/")
        await sub.whoami()
        got = []

        async def consume():
            async for m in sub:
                got.append(m)
                if m.key == b"a/after":
                    return

        consumer = asyncio.ensure_future(consume())
        await pub.publish_many((f"a/before/{i}", b"") for i in range(20))
        await pub.flush()
        while len(got) < 20:
            await asyncio.sleep(0.01)

        crash()
        await asyncio.sleep(0.05)       # the subscriber's reader sees the hang-up
        for i in range(100):
            await pub.publish(f"a/backlog/{i}", b"%d" % i)
        await asyncio.sleep(0.05)       # the buffer's flush finds the broker gone
        assert not pub.connected or pub.backlog > 0 or sub_events.seen
        start()
        while sub_events.seen != ["down", "up"]:
            await asyncio.sleep(0.01)
        # The subscriber's subscriptions are back: now the backlog may go.
        await pub.whoami()
        assert pub_events.seen == ["down", "up"]
        await pub.publish("a/after", b"")
        await pub.flush()
        await asyncio.wait_for(consumer, TIMEOUT)
        sub.close()
        pub.close()
        return got

    got = arun(main())
    assert [m.key for m in got[:20]] == [b"a/before/%d" % i for i in range(20)]
    # Both clients come back in background tasks, in either order. What the
    # publisher's backlog sent before the subscriber's SUB was restored is
    # gone, as docs/clients.md says ("What is lost"); the rest arrives in
    # order, once each, with nothing missing after it.
    backlog = [Message(b"a/backlog/%d" % i, b"%d" % i) for i in range(100)]
    arrived = got[20:-1]
    assert arrived == backlog[len(backlog) - len(arrived):]
    if len(arrived) < len(backlog):
        assert pub_events.up_at[0] <= sub_events.up_at[0], "lost although the subscriber came back first"
    assert got[-1].key == b"a/after"


def test_asyncio_full_backlog_raises_and_reconnect_off_fails_at_once(start_broker):
    address, crash, start = restartable(start_broker)

    async def main():
        plain = aio.Client(address)
        keeping = aio.Client(address, reconnect=Reconnect(initial_delay=0.5, max_backlog=2000))
        await plain.whoami()
        await keeping.whoami()
        crash()
        await asyncio.sleep(0.05)
        with pytest.raises(BusClosedError):
            await plain.publish("k", b"")
            await plain.whoami()
        with pytest.raises(BacklogFullError):
            for i in range(100):
                await keeping.publish(f"k/{i}", b"x" * 100)
        assert 0 < keeping.backlog <= 2000
        plain.close()
        keeping.close()

    arun(main())


def test_asyncio_batches_published_while_away_keep_their_order(start_broker):
    """publish_many and publish_packed while the broker is away queue behind
    what was published before them, as publish() does."""
    from sbus._core.batch import Outbox
    from sbus.client import MAX_MESSAGE
    address, crash, start = restartable(start_broker)

    async def main():
        bus = aio.Client(address, reconnect=Reconnect(initial_delay=0.3, max_delay=0.3,
                                                      give_up_after=TIMEOUT))
        await bus.subscribe("o/")
        await bus.whoami()
        crash()
        await asyncio.sleep(0.05)
        await bus.publish("o/1", b"a")
        await bus.publish("o/2", b"b")
        assert not bus.connected
        await bus.publish_many([("o/3", b"c"), ("o/4", b"d")])
        box = Outbox(MAX_MESSAGE)
        box.add_publish("o/5", b"e")
        box.add_publish("o/6", b"f")
        assert await bus.publish_packed(box) == 2
        await bus.publish("o/7", b"g")
        start()
        got = [await asyncio.wait_for(bus.receive(), TIMEOUT) for _ in range(7)]
        bus.close()
        return got

    got = arun(main())
    assert got == [Message(b"o/%d" % i, bytes([c])) for i, c in zip(range(1, 8), b"abcdefg")]


def test_asyncio_batches_published_while_away_respect_the_backlog_bound(start_broker):
    from sbus._core.batch import Outbox
    from sbus.client import MAX_MESSAGE
    address, crash, start = restartable(start_broker)

    async def main():
        bus = aio.Client(address, reconnect=Reconnect(initial_delay=0.5, max_backlog=2000))
        await bus.whoami()
        crash()
        await asyncio.sleep(0.05)
        await bus.publish("k/0", b"x" * 100)
        with pytest.raises(BacklogFullError) as many:
            await bus.publish_many([(f"k/{i}", b"x" * 100) for i in range(100)])
        assert 0 < many.value.sent < 100
        assert bus.backlog <= 2000
        box = Outbox(MAX_MESSAGE)
        box.add_publish("k/more", b"x" * 100)
        with pytest.raises(BacklogFullError) as packed:
            await bus.publish_packed(box)
        assert packed.value.sent == 0 and len(box) == 0
        assert bus.backlog <= 2000
        bus.close()

    arun(main())
