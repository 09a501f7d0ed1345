"""Messages of any size (docs/chunks.md), against real sbusd processes: whole
messages back on both clients, what a plain subscriber sees, many publishers
interleaved, the same key from two at once, a chunk lost to flood control, a
publisher killed mid-message, the memory bounds, a chunked request and reply
on private keys with an eavesdropper of another uid, and the sbus command."""
from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import sbus.aio
from sbus import Client
from sbus.client import chunks
from sbus.client.protocol import MAX_MESSAGE, Message

from support import SBUS
from support.conn import Conn
from support.sbusd import Sbusd
from support.seconduser import make_public_dir

BIG = 3 * MAX_MESSAGE + 12345       # four chunks


@pytest.fixture
def broker(start_broker):
    """One broker on the default backend: chunking is the client's, the same on every loop."""
    return start_broker()


def payload(n: int, seed: int = 0) -> bytes:
    return (hashlib.sha256(b"%d" % seed).digest() * (n // 32 + 1))[:n]


# -- the convention without a broker ---------------------------------------------------

def test_chunker_and_reassembler_round_trip_and_refuse_what_is_not_whole():
    ch = chunks.Chunker(1000)
    data = os.urandom(5000)
    packets = list(ch.packets(b"k", data))
    assert len(packets) > 5 and all(len(p) <= 1000 for p in packets)
    parsed = [p[4:].partition(b"\0") for p in packets]
    assert {k for k, _, _ in parsed} == {b"k/.sbus-chunk"}
    r = chunks.Reassembler()
    out = [r.feed(k, body) for k, _, body in parsed]
    assert out[:-1] == [None] * (len(out) - 1) and out[-1] == Message(b"k", data)
    # One chunk missing: never delivered, reported when the next message begins.
    lost = []
    r.on_lost = lost.append
    again = [p[4:].partition(b"\0") for p in ch.packets(b"k", data)]
    for k, _, body in again[:2] + again[3:]:
        assert r.feed(k, body) is None
    assert r.lost == 1 and "chunk 2" in lost[0].reason and r.pending_bytes == 0
    # Spliced: the start of one message and the rest of another never make one.
    a = [p[4:].partition(b"\0") for p in ch.packets(b"k", data)]
    b = [p[4:].partition(b"\0") for p in ch.packets(b"k", data[::-1])]
    assert [r.feed(k, body) for k, _, body in a[:3] + b[3:]] == [None] * len(a)
    assert r.lost == 3 and r.messages == 1 and r.pending_bytes == 0


def test_the_chunk_pattern_of_each_kind_of_pattern():
    assert chunks.chunk_pattern(b"a/*") == b"a/*/.sbus-chunk"
    assert chunks.chunk_pattern(b"!/cred/1/2/3/x") == b"!/cred/1/2/3/x/.sbus-chunk"
    assert chunks.chunk_pattern(b"a/") is None and chunks.chunk_pattern(b"") is None


# -- through a broker -------------------------------------------------------------------

@pytest.mark.parametrize("pattern", ["big/*", "big/", "big/one", ""])
def test_a_large_message_comes_back_whole_and_a_small_one_is_one_packet(broker, pattern):
    raw_exact, raw_prefix = broker.connect(), broker.connect()
    with Client(broker.address) as pub, Client(broker.address) as sub:
        raw_exact.sub(b"big/one")
        raw_prefix.sub(b"big/")
        sub.subscribe(pattern)
        sub.sync()
        raw_exact.whoami()
        raw_prefix.whoami()
        small, big = b"x" * 100, payload(BIG)
        pub.publish("big/one", small)
        pub.publish("big/one", big)
        pub.publish("big/one", b"after")
        assert sub.receive(timeout=30) == Message(b"big/one", small)
        assert sub.receive(timeout=30) == Message(b"big/one", big)
        assert sub.receive(timeout=30) == Message(b"big/one", b"after")
        assert sub.chunks.stats()["messages"] == 1 and sub.chunks.lost == 0
    # A plain subscriber to the key sees only the messages that fit; one to
    # the prefix sees the chunks, on the reserved key.
    assert [raw_exact.next_packet(5), raw_exact.next_packet(5)] == [
        b"MSG big/one\0" + small, b"MSG big/one\0after"]
    seen = [raw_prefix.next_packet(5) for _ in range(6)]
    assert seen[0] == b"MSG big/one\0" + small and seen[5] == b"MSG big/one\0after"
    assert all(p.startswith(b"MSG big/one/.sbus-chunk\0") for p in seen[1:5])
    raw_exact.close()
    raw_prefix.close()


def test_asyncio_client_publishes_and_receives_chunked_messages(broker):
    async def main():
        async with sbus.aio.Client(broker.address) as pub, \
                sbus.aio.Client(broker.address) as sub:
            await sub.subscribe("a/*")
            await sub.sync()
            sent = [payload(BIG, i) for i in range(3)]
            for p in sent:
                await pub.publish("a/b", p)
            got = [await asyncio.wait_for(sub.receive(), 30) for _ in sent]
            assert got == [Message(b"a/b", p) for p in sent]
            # Two tasks publishing at once: each message's chunks stay together.
            await asyncio.gather(*(pub.publish("a/c", p) for p in sent))
            got = [await asyncio.wait_for(sub.receive(), 30) for _ in sent]
            assert sorted(m.payload for m in got) == sorted(sent)
            assert sub.chunks.lost == 0
    asyncio.run(main())


def test_many_publishers_interleaved_on_one_key(broker):
    n_pubs, each = 4, 3
    with Client(broker.address) as sub:
        sub.send_cmsg("blocking/hard/block")    # past --queue-max-bytes, hold the publishers
        sub.subscribe("same/key")
        sub.sync()

        def publish(i):
            with Client(broker.address) as pub:
                for j in range(each):
                    pub.publish("same/key", payload(BIG + 1000 * j, 10 * i + j))
        threads = [threading.Thread(target=publish, args=(i,)) for i in range(n_pubs)]
        for t in threads:
            t.start()
        got = [sub.receive(timeout=60).payload for _ in range(n_pubs * each)]
        for t in threads:
            t.join()
    want = [payload(BIG + 1000 * j, 10 * i + j) for i in range(n_pubs) for j in range(each)]
    assert sorted(got) == sorted(want)
    assert sub.chunks.lost == 0


def test_a_chunk_lost_to_flood_control_loses_the_message_and_nothing_else(
        start_broker, caplog):
    b = start_broker("--stats-interval", "0")
    with Client(b.address) as pub, Client(b.address) as slow, Client(b.address) as fast:
        slow.send_cmsg("blocking/soft/discard")
        fast.send_cmsg("blocking/hard/block")   # the fast one loses nothing, however far behind
        for c in (slow, fast):
            c.subscribe("f/x")
            c.sync()
        got = []
        reader = threading.Thread(target=lambda: got.extend(
            fast.receive(timeout=60) for _ in range(2)))
        reader.start()
        first, second = payload(40 * MAX_MESSAGE, 1), payload(BIG, 2)
        pub.publish("f/x", first)       # the slow one does not read: most chunks dropped
        pub.sync()
        lost = []
        slow.chunks.on_lost = lost.append
        # What its socket held (the first chunks) is read, and nothing comes of it.
        with pytest.raises(TimeoutError):
            slow.receive(timeout=1.0)
        # From here the slow one loses nothing more, so what follows shows
        # that the reassembler recovered, not the luck of flood control. Both
        # modes: with soft/discard left on, the broker still dropped chunks of
        # the second message past the soft limit (under load, 2 runs in 12).
        slow.send_cmsg("blocking/soft/queue")
        slow.send_cmsg("blocking/hard/block")
        slow.sync()
        pub.publish("f/x", second)
        assert slow.receive(timeout=30) == Message(b"f/x", second)
        reader.join()
    assert got == [Message(b"f/x", first), Message(b"f/x", second)]
    assert slow.chunks.lost == 1 and lost[0].total == len(first) and lost[0].received < len(first)
    assert slow.chunks.messages == 1 and slow.chunks.dropped >= 1
    assert any("lost" in r.getMessage() for r in caplog.records if r.name == "sbus.chunks")


def test_a_publisher_killed_mid_message_times_out(broker):
    with Client(broker.address) as sub, Client(broker.address) as pub:
        sub.chunks.timeout = 0.5
        sub.subscribe("d/k")
        sub.sync()
        child = subprocess.Popen([sys.executable, "-c", f"""
import os, signal, sys
from sbus.client.chunks import Chunker
from support.conn import Conn
from support.sbusd import Sbusd
from support.seconduser import make_public_dir
c = Conn.to({broker.address!r}, sndbuf=1 << 21)
packets = list(Chunker({MAX_MESSAGE}).packets(b"d/k", b"z" * {BIG}))
for p in packets[:2]:
    c.packet(p)
c.whoami()
sys.stdout.write("half\\n"); sys.stdout.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""], stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
        assert child.stdout.readline() == b"half\n"
        assert child.wait(30) == -signal.SIGKILL
        with pytest.raises(TimeoutError):       # half a message never comes out
            sub.receive(timeout=1.0)
        assert sub.chunks.stats()["pending"] == 1
        time.sleep(0.6)
        pub.publish("d/k", payload(BIG, 5))
        assert sub.receive(timeout=30) == Message(b"d/k", payload(BIG, 5))
        assert sub.chunks.lost == 1 and sub.chunks.stats()["pending_bytes"] == 0


def test_memory_bounds_per_publisher_and_in_total(broker):
    with Client(broker.address) as sub:
        sub.subscribe("m/")
        sub.sync()
        sub.chunks.max_message_bytes = 2 * MAX_MESSAGE
        sub.chunks.max_total_bytes = 3 * MAX_MESSAGE
        lost = []
        sub.chunks.on_lost = lost.append
        a, b = Conn.to(broker.address, sndbuf=1 << 21), Conn.to(broker.address, sndbuf=1 << 21)
        # Per publisher: over the bound, lost at its first chunk; under it, delivered.
        for p in chunks.Chunker(MAX_MESSAGE).packets(b"m/over", payload(BIG)):
            a.packet(p)
        under = payload(2 * MAX_MESSAGE - 100, 3)
        for p in chunks.Chunker(MAX_MESSAGE).packets(b"m/under", under):
            a.packet(p)
        assert sub.receive(timeout=30) == Message(b"m/under", under)
        assert len(lost) == 1 and "bound" in lost[0].reason
        # In total: two publishers' messages in progress together may not pass it.
        pa = list(chunks.Chunker(MAX_MESSAGE).packets(b"m/a", payload(2 * MAX_MESSAGE - 100, 4)))
        pb = list(chunks.Chunker(MAX_MESSAGE).packets(b"m/b", payload(2 * MAX_MESSAGE - 100, 5)))
        a.packet(pa[0])
        a.whoami()
        b.packet(pb[0])
        b.whoami()
        for p in pb[1:]:
            b.packet(p)
        for p in pa[1:]:
            a.packet(p)
        assert sub.receive(timeout=30).key == b"m/a"
        assert len(lost) == 2 and "reassembly" in lost[1].reason
        assert sub.chunks.stats()["pending_bytes"] == 0
        a.close()
        b.close()


def _eavesdrop(address, ctl):
    with Client(address) as spy:
        spy.subscribe("")
        spy.subscribe("calc/")
        spy.sync()
        ctl.send({"ready": True})
        ctl.wait()
        seen = []
        try:
            while True:
                m = spy.receive(timeout=1.0)
                seen.append(m.key.decode("utf-8", "replace"))
        except TimeoutError:
            pass
        return seen


def test_chunked_request_and_reply_on_private_keys(open_broker, spawn):
    b = open_broker()
    spy = spawn(lambda ctl: _eavesdrop(b.address, ctl))
    assert spy.recv()["ready"]
    question, answer = payload(BIG, 7), payload(BIG + 99, 8)
    with Client(b.address) as server, Client(b.address) as asker:
        server.subscribe("calc/big")
        server.sync()
        done = threading.Thread(target=lambda: [
            server.publish(r.reply_to, b"OK\n" + answer) for r in [_one_request(server)]])
        done.start()
        assert asker.request("calc/big", question, timeout=60) == answer
        done.join()
    spy.send({"go": True})
    seen = spy.result(30)
    assert all(not k.startswith("!") and "/reply/" not in k for k in seen), seen


def _one_request(server):
    from sbus.client.requests import parse_request
    m = server.receive(timeout=60)
    return parse_request(m)


# -- the sbus command ---------------------------------------------------------------------

def test_sbus_pub_file_and_sub_raw_byte_for_byte(broker, tmp_path):
    data = os.urandom(5 * 1024 * 1024 + 7)
    src = tmp_path / "in.bin"
    src.write_bytes(data)
    sub = subprocess.Popen([SBUS, "-a", broker.address, "sub", "--raw", "-n", "1", "--ready",
                            "pics/*"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert sub.stderr.readline() == b"ready\n"
    subprocess.run([SBUS, "-a", broker.address, "pub", "pics/one", "--file", str(src)],
                   check=True, timeout=60)
    out, _ = sub.communicate(timeout=60)
    assert sub.returncode == 0
    assert hashlib.sha256(out).hexdigest() == hashlib.sha256(data).hexdigest()


def test_sbus_sub_says_which_message_was_lost(broker):
    sub = subprocess.Popen([SBUS, "-a", broker.address, "sub", "-n", "1", "--ready", "l/k"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert sub.stderr.readline() == b"ready\n"
    c = Conn.to(broker.address, sndbuf=1 << 21)
    packets = list(chunks.Chunker(MAX_MESSAGE).packets(b"l/k", payload(BIG)))
    for p in packets[:1] + packets[2:]:
        c.packet(p)
    c.pub(b"l/k", b"fine")
    out, err = sub.communicate(timeout=60)
    c.close()
    assert out == b"l/k\tfine\n"
    assert b"lost a chunked message on 'l/k'" in err and b"chunk 1" in err


# -- under an enforced access policy ------------------------------------------------------

POLICY = """
default = "deny"

[[rule]]
uid = 0
allow = ["publish", "subscribe"]
pattern = ""

[[rule]]
allow = ["publish", "subscribe"]
pattern = "cam/frame"
"""


def _nobody_round_trip(address, ctl):
    with Client(address) as c:
        c.subscribe("cam/frame")        # and its twin, judged as cam/frame
        c.whoami()      # the barrier (sync() needs a private key this policy does not allow)
        ctl.send({"ready": True})
        m = c.receive(timeout=60)
        c.publish("cam/frame", m.payload[::-1])
        c.whoami()
        return {"size": len(m.payload), "sha": hashlib.sha256(m.payload).hexdigest()}


def test_a_policy_judges_chunks_as_their_message(tmp_path, spawn):
    d = make_public_dir()
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    b = Sbusd.foreground(tmp_path, "-o", "--policy", str(policy), "--stats-interval", "0",
                         address=d / "sbus.socket")
    try:
        child = spawn(lambda ctl: _nobody_round_trip(b.address, ctl))
        assert child.recv()["ready"]
        big = payload(BIG, 9)
        with Client(b.address) as root:
            root.subscribe("cam/frame")
            root.sync()
            root.publish("cam/frame", big)
            assert root.receive(timeout=60) == Message(b"cam/frame", big)      # its own, echoed
            assert root.receive(timeout=60) == Message(b"cam/frame", big[::-1])
        assert child.result(60) == {"size": len(big), "sha": hashlib.sha256(big).hexdigest()}
        assert not [r for r in b.events("subscribe") if r["accepted"] is False]
        assert not b.events("publish_denied")
    finally:
        b.stop()
        shutil.rmtree(d, ignore_errors=True)
