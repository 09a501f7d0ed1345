"""Chunked messages (docs/chunks.md) cross what relays packets, each a real
process: a leaf broker (both ways), the store (replay in Python and with
``sbus replay --raw``) and the NATS bridge, which forwards chunks, never a
whole message over NATS's max_payload."""
from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from sbus import Client
from sbus.client.protocol import MAX_MESSAGE, Message

from support import SBUS, StoreProcess
from support.sbusd import Sbusd
from support.waiting import wait_until

BIG = 3 * MAX_MESSAGE + 4321


@pytest.fixture
def started():
    things = []
    yield things.append
    for thing in reversed(things):
        thing.stop()
    StoreProcess.stop_all()


def _subscriptions(broker, pid):
    return sum(e["subscriptions"] for e in broker.stats()["clients"] if e["pid"] == pid)


def test_through_a_leaf_both_ways(tmp_path, started):
    """Up through an --upstream-export that does not end in '/' (the link adds
    its twin), down through the subscriptions the leaf holds upstream."""
    up = Sbusd.foreground(tmp_path, address=str(tmp_path / "up"))
    started(up)
    leaf = Sbusd.foreground(tmp_path, "--upstream", up.address, "--upstream-export", "up/*",
                            address=str(tmp_path / "leaf"))
    started(leaf)
    leaf.wait_for_event("upstream_connected", timeout=10)
    big = os.urandom(BIG)
    with Client(up.address) as at_up, Client(leaf.address) as at_leaf:
        at_up.subscribe("up/*")
        at_up.sync()
        at_leaf.subscribe("down/*")
        at_leaf.whoami()    # the barrier: sync()'s message to itself is not in the export
        link = int(at_leaf.whoami().text.split("/!/cred/")[0].rsplit("/", 1)[1])
        # The pattern and its chunk twin both reach the upstream (with the link's own !/cred////).
        wait_until(lambda: _subscriptions(up, link) == 3, timeout=10,
                   what="the leaf's two subscriptions upstream")
        at_leaf.publish("up/x", big)
        assert at_up.receive(timeout=30) == Message(b"up/x", big)
        at_up.publish("down/y", big[::-1])
        assert at_leaf.receive(timeout=30) == Message(b"down/y", big[::-1])


def test_recorded_by_the_store_and_replayed_whole(tmp_path, started):
    b = Sbusd.foreground(tmp_path)
    started(b)
    StoreProcess(tmp_path, b.address, tmp_path / "log", ["s/"], "--stats-interval", "0").ready()
    big = os.urandom(BIG)
    with Client(b.address) as pub:
        pub.publish("s/a", b"before")
        pub.publish("s/a", big)
        pub.publish("s/b", b"after")
        pub.sync()

        def replayed(pattern):
            return [(m.key, m.payload) for m in pub.replay(pattern)]
        want = [(b"s/a", b"before"), (b"s/a", big), (b"s/b", b"after")]
        wait_until(lambda: len(replayed("s/")) == 3, timeout=20, what="three records replayed")
        assert replayed("s/") == want
        assert replayed("s/*") == want      # the store adds the chunk keys of what * matches
        assert replayed("s/a") == want[:2]
    out = subprocess.run([SBUS, "-a", b.address, "replay", "s/a", "--raw"], capture_output=True,
                         timeout=60, check=True).stdout
    assert hashlib.sha256(out).digest() == hashlib.sha256(b"before" + big).digest()


def test_across_the_bridge_as_chunks(tmp_path, started):
    pytest.importorskip("nats", reason="nats-py is in the dev extra")
    from support.nats import Bridge, NatsServer, nats_server_path
    if nats_server_path() is None:
        pytest.skip("nats-server is not installed")
    server = NatsServer(tmp_path)
    started(server)
    hosts = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        host = Sbusd.foreground(tmp_path / name)
        started(host)
        bridge = Bridge(tmp_path / name, host.address, [server.url], "--export", "n/*",
                        "--import", "sbus.n.>")
        started(bridge)
        bridge.ready()
        hosts.append((host, bridge))
    (a, bridge_a), (b, bridge_b) = hosts
    big = os.urandom(3 * 1024 * 1024 + 17)     # over NATS's default 1 MB max_payload
    with Client(a.address) as pub, Client(b.address) as sub:
        sub.subscribe("n/*")
        sub.sync()
        pub.publish("n/pic", big)
        pub.publish("n/pic", b"small")
        assert sub.receive(timeout=60) == Message(b"n/pic", big)
        assert sub.receive(timeout=60) == Message(b"n/pic", b"small")
    stats = bridge_a.stats()
    room = MAX_MESSAGE - len(b"MSG n/pic/.sbus-chunk\0") - 52
    assert stats["out_forwarded"] == -(-len(big) // room) + 1     # the chunks, then "small"
    assert stats["out_dropped"] == 0
