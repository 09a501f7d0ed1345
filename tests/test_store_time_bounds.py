"""The store's time bounds, asked as docs/store.md says a client asks: over
a raw connection, ``since``/``until`` as decimal seconds, inclusive and exact
to the nanosecond (a float resolves only about 240 ns at today's epoch)."""
from __future__ import annotations

import asyncio
import secrets
import subprocess

import pytest

from sbus import Client
from sbus.aio import Client as AsyncClient
from sbus.client.store import from_ns
from sbus.store import wire
from sbus.store.segments import HEADER, RECORD

from support import SBUS, Conn, StoreProcess


@pytest.fixture(autouse=True)
def no_store_left():
    yield
    StoreProcess.stop_all()


def ask(conn: Conn, **fields) -> list:
    """(seq, time_ns, key, payload) of every record a replay answers with,
    read off the wire (ok, data..., end), acknowledging as it goes."""
    me = conn.whoami(timeout=10)
    ident = secrets.token_hex(4)
    reply = f"{me}/sbus/store/{ident}"
    conn.sub(reply)
    conn.pub(wire.REQUEST_KEY, wire.request("replay", id=ident, reply=reply, **fields))
    stream, token = b"", b""
    while True:
        packet = conn.next_packet(timeout=10)
        assert packet, "no answer from the store"
        key, _, payload = packet[len(b"MSG "):].partition(b"\0")
        assert key == reply.encode(), packet[:80]
        kind, got, n, body = wire.parse_answer(payload)
        assert got == ident.encode()
        assert kind != wire.ERROR, body
        if kind == wire.OK:
            token = wire.decode_fields(body)["session"]
        elif kind == wire.DATA:
            stream += body
            conn.pub(wire.REQUEST_KEY, wire.request("ack", session=token, n=n))
        elif kind == wire.END:
            break
    conn.unsub(reply)
    records, pos = [], 0
    while pos < len(stream):
        size, _, seq, time_ns, key_len = RECORD.unpack_from(stream, pos)
        key = stream[pos + HEADER:pos + HEADER + key_len]
        records.append((seq, time_ns, key, stream[pos + HEADER + key_len:pos + size]))
        pos += size
    return records


def exact(time_ns: int) -> str:
    return f"{time_ns // 10**9}.{time_ns % 10**9:09d}"


def test_a_records_own_time_as_since_and_until_finds_the_records_stamped_then(
        start_broker, tmp_path):
    bus = start_broker()
    StoreProcess(tmp_path, bus.address, tmp_path / "log", ["t/"], "--stats-interval", "0").ready()
    conn = Conn.to(bus.address)
    # Three batches, each stamped with one time by the store.
    for batch in range(3):
        for i in range(4):
            conn.pub(f"t/{batch}", b"%d-%d" % (batch, i))
        conn.whoami(timeout=10)
        # The store has written them once it answers a replay sent after them.
        assert len(ask(conn, pattern="t/")) == 4 * (batch + 1)
    everything = ask(conn, pattern="t/")
    times = sorted({t for _, t, _, _ in everything})
    assert len(times) >= 2
    for t in times:
        stamped = [r for r in everything if r[1] == t]
        assert ask(conn, pattern="t/", since=exact(t), until=exact(t)) == stamped
        # Inclusive on each side alone, too; a nanosecond off excludes them.
        assert ask(conn, pattern="t/", since=exact(t)) == [r for r in everything if r[1] >= t]
        assert ask(conn, pattern="t/", until=exact(t)) == [r for r in everything if r[1] <= t]
        assert ask(conn, pattern="t/", since=exact(t + 1), until=exact(t)) == []
        assert ask(conn, pattern="t/", since=exact(t - 1), until=exact(t - 1)) == [
            r for r in everything if r[1] == t - 1]
    conn.close()


def recorded_in_batches(start_broker, tmp_path):
    """A store holding three batches on t/, each stamped with one time;
    (bus, every record as ask() gives it)."""
    bus = start_broker()
    StoreProcess(tmp_path, bus.address, tmp_path / "log", ["t/"], "--stats-interval", "0").ready()
    with Conn.to(bus.address) as conn:
        for batch in range(3):
            for i in range(3):
                conn.pub(f"t/{batch}", b"%d-%d" % (batch, i))
            conn.whoami(timeout=10)
            assert len(ask(conn, pattern="t/")) == 3 * (batch + 1)
        return bus, ask(conn, pattern="t/")


def test_the_clients_and_sbus_replay_find_a_record_by_its_exact_time(start_broker, tmp_path):
    """Issue 38: the bounds stay exact from the caller to the store: a record's
    time_ns given back through the Python clients (a Decimal, a decimal str)
    or to ``sbus replay --since/--until`` (as its {unix} printed it) finds
    the records stamped then, and only those. Through a float it missed them."""
    bus, everything = recorded_in_batches(start_broker, tmp_path)
    times = sorted({t for _, t, _, _ in everything})
    assert len(times) >= 2
    stamped = {t: [(seq, payload) for seq, tt, _, payload in everything if tt == t]
               for t in times}

    with Client(bus.address) as c:
        for t in times:
            for bound in (from_ns(t), exact(t)):
                it = c.replay("t/", since=bound, until=bound)
                got = [(it.seq, m.payload) for m in it]
                assert got == stamped[t], (t, bound)
                assert it.time_ns == t

    async def asynchronously():
        async with AsyncClient(bus.address) as c:
            for t in times:
                it = await c.replay("t/", since=from_ns(t), until=from_ns(t))
                assert [(it.seq, m.payload) async for m in it] == stamped[t]

    asyncio.run(asynchronously())

    def sbus_replay(*args):
        r = subprocess.run([SBUS, "-a", bus.address, "replay", "t/", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    printed = [line.split() for line in sbus_replay("-F", "{seq} {unix} {payload}")]
    assert [(int(seq), unix) for seq, unix, _ in printed] == [
        (seq, exact(t)) for seq, t, _, _ in everything]
    for seq, unix, _ in printed:
        t = everything[int(seq) - everything[0][0]][1]
        assert sbus_replay("--since", unix, "--until", unix, "-F", "{seq} {payload}") == [
            f"{s} {p.decode()}" for s, p in stamped[t]]


def test_bounds_read_as_exact_decimals_rounding_inward():
    t = 1_764_000_000_123_456_789

    def bounds(since: bytes, until: bytes):
        r = wire.parse_request(wire.request("replay", id="x", reply="!/cred/0/0/1/r",
                                            pattern="", since=since, until=until))
        return r.since_ns, r.until_ns

    assert bounds(b"1764000000.123456789", b"1764000000.123456789") == (t, t)
    # Below a nanosecond: since rounds up, until down, so both stay inclusive.
    assert bounds(b"1764000000.1234567885", b"1764000000.1234567895") == (t, t)
    assert bounds(b"1.764e9", b"1764000000") == (1_764_000_000 * 10**9,) * 2
    for bad in (b"nan", b"inf", b"1e400", b"0x10", b"ten"):
        with pytest.raises(wire.RequestError):
            bounds(bad, b"")


def test_the_client_writes_a_bound_with_every_digit_it_was_given():
    from decimal import Decimal

    from sbus.client.store import _seconds
    assert _seconds(from_ns(1_764_000_000_000_000_120)) == "1764000000.000000120"
    assert _seconds("1764000000.123456789") == "1764000000.123456789"
    assert _seconds(Decimal("1.764e9")) == "1764000000"
    assert _seconds(1_764_000_000) == "1764000000"
    assert _seconds(1764000000.5) == "1764000000.5"     # a float as Python writes it
    np = pytest.importorskip("numpy")
    assert (_seconds(np.int64(7)), _seconds(np.float64(1.5))) == ("7", "1.5")
    for bad in ("ten", "nan", Decimal("inf")):
        with pytest.raises(ValueError):
            _seconds(bad)
    with pytest.raises(TypeError):
        _seconds(True)
