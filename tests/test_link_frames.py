"""Frames (sbus/_core/frames.pxd) on a connection that asked with ``CMSG
link/frames`` and was answered "ok" (the link place, or any connection of the
broker's own uid or root: a bridge's): they go both ways, every packet exactly
and in order, on every backend and through the send queue. Another uid is
refused, a connection that did not ask never sends or gets one, and a bad
frame closes its sender alone."""
from __future__ import annotations

import json
import shutil
import socket
import struct

import pytest

from sbus import Client
from sbus._core.batch import Outbox
from sbus._core.linkpath import LinkInbox, Relay
from sbus.client.protocol import ControlMessage, Message

from support.conn import Conn
from support.frames import GRANTED, MAGIC, frame, link_place, publish_together, read_all
from support.sbusd import Sbusd
from support.seconduser import asroot, make_public_dir
from support.waiting import wait_until

FRAME_MSGS = 64


@pytest.mark.parametrize("granted", GRANTED.values(), ids=GRANTED.keys())
def test_deliveries_to_a_granted_connection_come_in_frames(broker, granted):
    link = granted(broker)
    link.sub("f/")
    link.sync()
    sent = [(b"f/%d" % i, b"x" * (i % 50)) for i in range(500)]
    publish_together(broker, sent)
    got, frames, _ = read_all(link, len(sent))
    assert got == [b"MSG " + k + b"\0" + p for k, p in sent]
    assert 0 < frames < len(sent)
    link.sync()
    # Counted as deliveries, one a message, in frames or not.
    assert broker.stats()["totals"]["msgs_out"] == len(sent)


def test_what_the_link_place_could_not_take_goes_out_of_its_queue_in_frames(broker):
    """A link place that does not read: the broker queues for it, and the
    queue drains in frames once it reads, with a control reply in the middle
    kept in its place."""
    link = link_place(broker)
    link.sub("q/")
    link.sync()
    # Unread, what the broker writes waits in its socket, then in its queue.
    first = [(b"q/%d" % i, b"y" * 500) for i in range(6000)]
    with Client(broker.address) as pub:
        pub.publish_many(first)
        pub.whoami()
        wait_until(lambda: broker.stats()["totals"]["queued_msgs"] > 0, 10)
        link.cmsg("!/cred/whoami")      # answered behind what is queued
        second = [(b"q/b%d" % i, b"z") for i in range(300)]
        pub.publish_many(second)
        pub.whoami()
    got, frames, reads = read_all(link, len(first) + 1 + len(second))
    whoami = [i for i, p in enumerate(got) if p.startswith(b"CMSG !/cred/whoami\0")]
    assert whoami == [len(first)], whoami
    del got[len(first)]
    assert got == [b"MSG " + k + b"\0" + p for k, p in first + second]
    # Thousands were queued: they came in frames too, not a packet each.
    assert reads < len(first) // 10, (reads, frames)


@pytest.mark.parametrize("granted", GRANTED.values(), ids=GRANTED.keys())
def test_frames_from_a_granted_connection_are_taken_packet_by_packet(broker, granted):
    link = granted(broker)
    sub = Conn.to(broker.address)
    sub.sub("a/")
    sub.sub("b/")
    sub.sync()
    packets = [b"MSG a/%d\0%s" % (i, b"p" * i) for i in range(FRAME_MSGS)]
    assert link.packet(frame(*packets[:10]))
    assert link.packet(frame(b"MSG b/one\0", b"SUB c/", b"MSG a/x\0last"))
    assert link.packet(frame(*packets[10:]))
    link.sync()
    expect = packets[:10] + [b"MSG b/one\0", b"MSG a/x\0last"] + packets[10:]
    got = [sub.next_packet(5) for _ in expect]
    assert got == expect
    # The SUB inside the frame holds: its sender gets c/ from now on.
    with Client(broker.address) as pub:
        pub.publish(b"c/1", b"to the link")
        pub.whoami()
    assert link.next_packet(5) == b"MSG c/1\0to the link"


BAD_FRAMES = {
    "entry longer than the frame": MAGIC + struct.pack("=I", 50) + b"MSG a/1\0",
    "a zero length": MAGIC + struct.pack("=I", 0) + b"MSG a/1\0",
    "a length cut short": frame(b"MSG a/1\0") + b"\1\0",
    "a frame in a frame": frame(frame(b"MSG a/1\0", b"MSG a/2\0")),
    "more packets than a flush holds": frame(*[b"MSG a/%d\0" % i for i in range(300)]),
    "a packet that is no packet": frame(b"MSG a/1\0", b"BOGUS"),
}


@pytest.mark.parametrize("granted", GRANTED.values(), ids=GRANTED.keys())
@pytest.mark.parametrize("bad", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_a_bad_frame_closes_its_sender_alone(broker, bad, granted):
    link = granted(broker)
    other = Conn.to(broker.address)
    other.sub("a/")
    other.sync()
    link.packet(bad)
    assert link.next_packet(5) == b""
    other.pub("a/after", "still here")
    # What the frame held before its fault was published, as packets alone are.
    while (packet := other.next_packet(5)) != b"MSG a/after\0still here":
        assert packet and packet.startswith(b"MSG a/"), packet
    wait_until(lambda: [r for r in broker.records() if r.get("event") == "client_disconnect"
                        and r.get("reason") == "protocol_error"], 5)
    assert other.sync()


def test_nobody_else_sends_or_gets_frames(broker):
    """Frames are not the protocol: a client that did not ask gets plain
    packets, and one that sends a frame is closed for a malformed packet."""
    plain = Conn.to(broker.address)
    plain.sub("p/")
    plain.sync()
    with Client(broker.address) as pub:
        pub.publish_many([(b"p/%d" % i, b"") for i in range(100)])
        pub.whoami()
    got = [plain.next_packet(5) for _ in range(100)]
    assert got == [b"MSG p/%d\0" % i for i in range(100)]
    sender = Conn.to(broker.address)
    sender.packet(frame(b"MSG p/x\0", b"MSG p/y\0"))
    assert sender.next_packet(5) == b""
    assert plain.sync()
    # The link place without asking: the same.
    link = link_place(broker, frames=False)
    link.packet(frame(b"MSG p/x\0", b"MSG p/y\0"))
    assert link.next_packet(5) == b""
    assert plain.next_packet(0.2) is None


@asroot
def test_another_uid_is_refused_frames(open_broker, spawn):
    """A client of another uid than the broker's (and not root) is refused
    frames: it gets plain packets after asking, and a frame it sends anyway
    closes it as a malformed packet, as anyone's that did not ask."""
    b = open_broker()
    feeder = Conn.to(b.address)

    def other_uid(ctl):
        c = Conn.to(b.address)
        c.cmsg("link/frames")
        answer = c.next_packet(5).decode()
        c.sub("p/")
        c.sync()
        ctl.send({"subscribed": True})
        got = [c.next_packet(5).decode() for _ in range(100)]
        c.packet(frame(b"MSG p/x\0", b"MSG p/y\0"))
        return {"answer": answer, "got": got, "after_frame": repr(c.next_packet(5))}

    child = spawn(other_uid)
    assert child.recv()["subscribed"]
    for i in range(100):
        feeder.pub(b"p/%d" % i, b"")
    report = child.result()
    assert report["answer"] == ("CMSG link/frames\0refused: only the broker's own uid "
                                "or root may take frames")
    assert report["got"] == ["MSG p/%d\0" % i for i in range(100)]
    assert report["after_frame"] == "b''"
    wait_until(lambda: [r for r in b.records() if r.get("event") == "client_disconnect"
                        and r.get("reason") == "protocol_error" and r.get("uid") == 65534], 5)


def test_a_full_upstream_leaves_the_links_batch_in_its_box():
    """The link's up Relay (sbus._core.linkpath) over real socketpairs: a
    batch of frames from its broker goes into the Outbox, and an upstream
    that takes only part of it leaves the rest there (blocked), in C, with
    nothing spilled into Python, until it takes more; every message arrives
    once, in order. While blocked, the pump reads nothing."""
    broker, link_local = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link_up, upstream = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link_up.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)   # fills within the batch
    for s in (link_local, link_up, upstream):
        s.setblocking(False)
    sent = [b"MSG up/%d\0%s" % (i, b"x" * (i % 40)) for i in range(8 * FRAME_MSGS)]
    for i in range(0, len(sent), FRAME_MSGS):
        broker.send(frame(*sent[i:i + FRAME_MSGS]))
    broker.send(frame(b"MSG later/1\0", b"MSG later/2\0"))  # for after the upstream took the box
    box = Outbox(1 << 16)
    relay = Relay(box, link_up.fileno(), lambda key, payload: key)
    relay.keep = True
    inbox = LinkInbox(1 << 16, Message, ControlMessage, 8)
    assert relay.pump(inbox, link_local.fileno(), 8, 4) == []
    relay.flush()
    assert relay.blocked and relay.take_spill() == [] and 0 < len(box) < len(sent)
    assert relay.pumped == len(sent)
    # Blocked, the next pump sends what it can of the box and reads nothing more.
    relay.pump(inbox, link_local.fileno(), 8, 4)
    assert relay.blocked and relay.pumped == 0 and relay.take_spill() == []
    got = []
    while relay.blocked:
        while True:
            try:
                got.append(upstream.recv(1 << 16))
            except BlockingIOError:
                break
        relay.flush()
    relay.pump(inbox, link_local.fileno(), 8, 4)
    relay.flush()
    while True:
        try:
            got.append(upstream.recv(1 << 16))
        except BlockingIOError:
            break
    assert got == sent + [b"MSG later/1\0", b"MSG later/2\0"]
    assert relay.sent == len(got)


def test_what_the_links_box_held_for_a_dead_upstream_goes_to_the_next(tmp_path):
    """A leaf whose upstream stopped reading (its subscriber holds the bus)
    has a batch left in the link's box; the upstream dies. What the box
    held joins what the link holds for the next upstream, first: the next
    one gets an unbroken run of the messages, up to the last, each once.
    What the dead one had taken into its socket went with it."""
    work_up, work_leaf = tmp_path / "up", tmp_path / "leaf"
    work_up.mkdir()
    work_leaf.mkdir()
    address = str(tmp_path / "up.socket")
    up = Sbusd.foreground(work_up, "--queue-max-bytes", "65536", address=address, log_level="info")
    leaf = Sbusd.foreground(work_leaf, "--upstream", address, log_level="info")
    try:
        leaf.wait_for_event("upstream_connected", timeout=10)
        stuck = Client(address)
        stuck.send_cmsg("blocking/hard/block")
        stuck.subscribe("up/")
        stuck.whoami()
        wait_until(lambda: sum(c["subscriptions"] for c in up.stats()["clients"]) >= 2, 10,
                   "the link's subscription upstream")
        n = 20000
        with Client(leaf.address) as pub:
            pub.publish_many((b"up/%d" % i, b"p" * 60) for i in range(n))
            pub.whoami()
        # The upstream holds its bus for the stuck subscriber: the link is
        # behind, reads no more, and its broker queues for it.
        wait_until(lambda: leaf.stats()["totals"]["queued_msgs"] > 0, 10, "the leaf's queue for its link")
        up.kill()
        stuck.close()
        state = wait_until(lambda: (s := leaf.stats()["upstream"])["state"] == "away"
                           and s["held"] > 0 and s, 10, "the link holding for the next upstream")
        assert state["overflow_dropped"] == 0
        up = Sbusd.foreground(work_up, "-r", address=address, log_level="info")
        with Client(address) as sub:
            sub.send_cmsg("blocking/hard/block")
            sub.subscribe("up/")
            sub.whoami()
            keys = []
            while not keys or keys[-1] != b"up/%d" % (n - 1):
                keys += [m.key for m in sub.receive_many(1024, timeout=20)]
        first = int(keys[0].split(b"/")[1])
        assert keys == [b"up/%d" % i for i in range(first, n)]
        assert n - first >= state["held"]
    finally:
        leaf.stop()
        up.stop()


def _receive(client, n):
    got = []
    while len(got) < n:
        got += client.receive_many(256, timeout=30)
    return [(m.key, m.payload) for m in got]


def test_a_link_of_the_upstreams_uid_takes_frames_both_ways_upstream(tmp_path):
    """The leaf's link asks its upstream for frames as it asks its own broker:
    granted (the same uid, or root), what it relays up goes in frames and what
    comes down arrives in them, every message exact and in order."""
    up = Sbusd.foreground(tmp_path, address=str(tmp_path / "up"), log_level="warning")
    leaf = Sbusd.foreground(tmp_path, "--upstream", up.address, address=str(tmp_path / "leaf"),
                            log_level="warning")
    try:
        wait_until(lambda: leaf.stats().get("upstream", {}).get("state") == "up", 10)
        ups = [(b"fu/%d" % i, b"u" * (i % 300)) for i in range(5000)]
        downs = [(b"fd/%d" % i, b"d" * (i % 300)) for i in range(5000)]
        with Client(up.address) as at_up, Client(leaf.address) as at_leaf:
            at_up.subscribe("fu/")
            at_leaf.subscribe("fd/")
            at_up.whoami()
            wait_until(lambda: [c for c in up.stats()["clients"]
                                if not c["echo"] and c["subscriptions"] >= 2], 10)
            with Client(leaf.address) as pub:
                pub.publish_many(ups)
                pub.whoami()
            assert _receive(at_up, len(ups)) == ups
            with Client(up.address) as pub:
                pub.publish_many(downs)
                pub.whoami()
            assert _receive(at_leaf, len(downs)) == downs
        state = wait_until(lambda: (lambda s: s if s["down_msgs"] == len(downs) else None)(
            leaf.stats()["upstream"]), 10, "the link's report")
        assert state["upstream_frames"] == "on" and state["up_msgs"] == len(ups)
        assert state["frames_from_upstream"] > 0 and state["frames_to_upstream"] > 0
    finally:
        leaf.stop()
        up.stop()


@asroot
def test_a_link_refused_frames_upstream_relays_a_packet_a_message(spawn):
    """A link of another uid than its upstream's (and not root) is refused
    frames there: it says so in its state and goes on a packet per message,
    which the upstream takes (a frame would close it). The leaf broker's side
    of the socketpair is the test's."""
    from sbus.sbusd.link import Link

    d = make_public_dir()
    up = Sbusd.foreground(d, "-o", address=str(d / "up.socket"), log_level="info")
    leaf_end, link_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with Client(up.address) as at_up:
            at_up.subscribe("x/")
            at_up.whoami()

            def nobodys_link(ctl):
                leaf_end.close()
                Link(link_end, up.address, [""], 100_000).run()

            child = spawn(nobodys_link)
            link_end.close()
            leaf_end.settimeout(10)
            state = {}
            while state.get("state") != "up":
                packet = leaf_end.recv(1 << 16)
                if packet.startswith(b"CMSG link/state\0"):
                    state = json.loads(packet.split(b"\0", 1)[1])
            assert state["upstream_frames"] == "off"
            sent = [b"MSG x/%d\0" % i + b"p" * (i % 50) for i in range(3000)]
            for packet in sent:
                leaf_end.send(packet)
            got = _receive(at_up, len(sent))
            assert [b"MSG " + k + b"\0" + p for k, p in got] == sent
        assert not [r for r in up.records() if r.get("reason") == "protocol_error"]
        child.kill()
    finally:
        leaf_end.close()
        up.stop()
        shutil.rmtree(d, ignore_errors=True)
