"""`sbus bridge` on frames (docs/bridge.md, "Speed"): the bridge asks its
broker for frames, takes the broker's apart and sends its imports in them; the
hosts see exactly what a bridge on packets gives them, in order. Refused (a
uid the broker does not grant them), it goes on a packet per message.

Real processes throughout: two sbusd, nats-server, two bridges.
"""
from __future__ import annotations

import os
import shutil
import threading

from sbus import Client
from sbus.client import Message

from support import Sbusd, wait_until
from support.bridge import STATS_KEY, Collector, restart_under
from support.nats import Bridge, NatsServer, require_nats
from support.seconduser import NOBODY, asroot, make_public_dir

require_nats()



class Lossless(Collector):
    """A subscriber to everything in hard block mode (the broker holds its
    publishers rather than drop for it), collecting whole batches in a thread."""

    def __init__(self, host):
        super().__init__(host, "", modes=("blocking/soft/queue", "blocking/hard/block"))

    def _run(self):
        while not self._stop:
            try:
                batch = self.bus.receive_many(256)
            except Exception:
                return
            self.messages += [(m.key, m.payload) for m in batch
                              if type(m) is Message and m.key != STATS_KEY]

    def stop(self):
        self._stop = True
        self.bus.close()        # receive_many waits without a timeout: closing ends it
        self._thread.join(5)


def traffic() -> list:
    """Enough in bursts for frames both ways (many to a frame), of every size
    up to a frame's and past it, and keys in order per key."""
    out = [(b"seq/%d" % (i % 7), b"%d:" % i + os.urandom(i % 300)) for i in range(6000)]
    out += [(b"big/%d" % i, os.urandom(20000 + 7000 * i)) for i in range(4)]     # past a frame
    out += [(b"tail/%d" % i, b"t") for i in range(100)]
    return out


def run_pair(tmp_path, cleanup, *bridge_args) -> tuple:
    """A -> B through one nats-server, each bridge with ``bridge_args``:
    (what B received, A's bridge_start, B's bridge_start)."""
    server = NatsServer(tmp_path)
    cleanup(server)
    hosts = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        hosts.append(Sbusd.foreground(tmp_path / name))
        cleanup(hosts[-1])
    a, b = hosts
    # Lossless by design on both hosts: A's broker holds the publisher for its bridge.
    ba = Bridge(tmp_path, a.address, [server.url], "--export", "", "--local-flood", "block",
                *bridge_args)
    bb = Bridge(tmp_path, b.address, [server.url], "--import", "sbus.>", *bridge_args)
    cleanup(ba)
    cleanup(bb)
    ba.ready()
    bb.ready()
    at_b = Lossless(b)
    try:
        sent = traffic()
        with Client(a.address) as pub:
            for i in range(0, len(sent), 500):
                pub.publish_many(sent[i:i + 500])
            pub.whoami(timeout=10)
        got = list(at_b.wait_count(len(sent), 60))
        stats_a, stats_b = ba.stats(), bb.stats()      # nothing more comes meanwhile
        assert at_b.messages == got
    finally:
        at_b.stop()
    # Frames both ways where granted: A's broker to A's bridge, B's bridge to B's broker.
    frames = (stats_a["frames_in"], stats_b["frames_out"])
    return got, ba.events("bridge_start")[0], bb.events("bridge_start")[0], sent, frames


def test_a_pair_on_frames_delivers_what_a_pair_on_packets_does(tmp_path, cleanup):
    (tmp_path / "framed").mkdir()
    (tmp_path / "packets").mkdir()
    framed, start_a, start_b, sent, frames = run_pair(tmp_path / "framed", cleanup)
    assert start_a["frames"] == start_b["frames"] == "on"
    assert frames[0] > 0 and frames[1] > 0, frames
    plain, start_a, start_b, sent_plain, frames = run_pair(tmp_path / "packets", cleanup, "--no-frames")
    assert start_a["frames"] == start_b["frames"] == "off (--no-frames)"
    assert frames == (0, 0)
    # The same traffic shape both times (the payloads are random): each exact and in order.
    assert framed == sent
    assert plain == sent_plain
    assert [k for k, _ in framed] == [k for k, _ in plain]


class Records:
    """A bridge's logger in a second user's process: each record to the parent."""

    def __init__(self, ctl):
        self.ctl = ctl

    def _record(self, event, **fields):
        self.ctl.send({"record": {"event": event, **{k: str(v) for k, v in fields.items()}}})

    info = warning = error = _record


def nobodys_bridge(address, url):
    """ctl -> a bridge of ``address`` exporting x/, run as the forked second user
    (its python cannot start anew as that user: the interpreter is under /root),
    until the parent says stop."""
    import asyncio

    import nats.aio.client  # noqa: F401 - what the bridge imports late, imported as root
    import nats.errors  # noqa: F401

    from sbus.bridge.forward import Bridge as InProcess
    from sbus.bridge.forward import Settings

    def run(ctl):
        async def main():
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            threading.Thread(target=lambda: (ctl.wait(60), loop.call_soon_threadsafe(stop.set)),
                             daemon=True).start()
            bridge = InProcess(Settings(address=address, servers=[url], exports=["x/"],
                                        local_flood="block", stats_interval=60), Records(ctl))
            return await bridge.run(stop)
        return asyncio.run(main())
    return run


@asroot
def test_a_bridge_refused_frames_goes_on_in_packets(tmp_path, cleanup, spawn):
    """A bridge of another uid than its broker's: refused frames, said so in
    bridge_start, and it bridges all the same."""
    d = make_public_dir()
    cleanup(type("Rm", (), {"stop": lambda self: shutil.rmtree(d, ignore_errors=True)})())
    server = NatsServer(tmp_path)
    cleanup(server)
    a = Sbusd.foreground(d, "-o", address=str(d / "a.socket"))
    cleanup(a)
    b = Sbusd.foreground(tmp_path)
    cleanup(b)
    bb = Bridge(tmp_path, b.address, [server.url], "--import", "sbus.x.>")
    cleanup(bb)
    bb.ready()
    ba = spawn(nobodys_bridge(a.address, server.url), uid=NOBODY, gid=NOBODY)
    records = []
    while not [r for r in records if r.get("event") == "bridge_connected"]:
        records.append(ba.recv(30)["record"])
    start = next(r for r in records if r.get("event") == "bridge_start")
    assert start["frames"] == "off (refused: only the broker's own uid or root may take frames)"
    assert bb.events("bridge_start")[0]["frames"] == "on"
    at_b = Lossless(b)
    try:
        sent = [(b"x/%d" % i, b"p" * (i % 100)) for i in range(2000)]
        with Client(a.address) as pub:
            pub.publish_many(sent)
            pub.whoami(timeout=10)
        assert at_b.wait_count(len(sent), 60) == sent
    finally:
        at_b.stop()
    ba.send({"stop": True})
    assert ba.result(30) == "signal"     # runner.STOPPED: as a stop by SIGTERM


def test_frames_are_asked_for_again_when_the_broker_comes_back(tmp_path, cleanup):
    """A new connection starts without frames: the bridge sends its imports
    in packets until the broker that came back granted them again (a frame
    before would close it), and then in frames."""
    server = NatsServer(tmp_path)
    cleanup(server)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    a, b = Sbusd.foreground(tmp_path / "a"), Sbusd.foreground(tmp_path / "b")
    cleanup(a)
    cleanup(b)
    ba = Bridge(tmp_path, a.address, [server.url], "--import", "sbus.>")
    bb = Bridge(tmp_path, b.address, [server.url], "--export", "", "--local-flood", "block")
    cleanup(ba)
    cleanup(bb)
    ba.ready()
    bb.ready()
    a2 = restart_under(ba, a, tmp_path / "a", cleanup)
    wait_until(lambda: a2.stats()["clients"], 10)
    at_a = Lossless(a2)
    try:
        sent = [(b"again/%d" % (i % 5), b"%d" % i) for i in range(5000)]
        with Client(b.address) as pub:
            for i in range(0, len(sent), 500):
                pub.publish_many(sent[i:i + 500])
            pub.whoami(timeout=10)
        assert at_a.wait_count(len(sent), 60) == sent
        assert ba.stats()["frames_out"] > 0
        assert not [r for r in a2.records() if r.get("event") == "client_disconnect"
                    and r.get("reason") == "protocol_error"]
    finally:
        at_a.stop()
