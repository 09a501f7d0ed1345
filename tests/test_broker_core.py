"""The compiled broker in-process: its boundary with Python callbacks, and
its agreement with the log schema.

A Broker runs here on a real listening socket in a temporary directory, with
real client sockets; run() is called from the test and returns (or raises)
when the broker says so.
"""
import re
import socket
import time
from pathlib import Path

import pytest

from sbus import logschema as ls
from sbus._core import report
from sbus._core.broker import Broker
from sbus.sbusd.config import Config

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "sbus" / "_core"
SAFETY_S = 10.0     # run() is stopped by the tick after this long: a failing test must not hang


def config(**overrides):
    """sbusd's own Config, with small limits so a test reaches them quickly."""
    values = dict(max_message=4096, queue_max_bytes=1 << 20, queue_max_msgs=1024,
                  total_max_bytes=16 << 20, max_subscriptions=64, max_pattern=256)
    values.update(overrides)
    return Config(**values)


class InProcess:
    """A Broker on a listening socket under tmp_path, and a way to connect."""

    def __init__(self, tmp_path, on_event=None, on_message=None, **cfg):
        self.path = str(tmp_path / "bus")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.deadline = 0.0
        self.broker = Broker(self.listener.fileno(), config(**cfg), on_event=on_event,
                             on_message=on_message, on_tick=self.on_tick, tick_interval=0.1)
        self.clients = []

    def on_tick(self):
        if time.monotonic() > self.deadline:
            self.broker.stop("safety timeout")

    def run(self):
        self.deadline = time.monotonic() + SAFETY_S
        return self.broker.run()

    def connect(self, *packets):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(self.path)
        for p in packets:
            s.send(p)
        self.clients.append(s)
        return s

    def close(self):
        for s in self.clients:
            s.close()
        self.listener.close()


def test_a_raising_callback_leaves_the_batch_whole_and_is_raised_once(tmp_path):
    events = []
    raising = [True]
    messages = []

    def on_event(name, fields):
        events.append((name, fields))
        if name == ls.SUBSCRIBE and raising[0]:
            raise RuntimeError(f"subscribe {fields['pattern']}")
        if name == ls.CLIENT_DISCONNECT:
            bus.broker.stop("done")

    def on_message(client, pid, uid, key, size, fanout):
        messages.append(key)
        raise RuntimeError(f"message {len(messages)}")

    bus = InProcess(tmp_path, on_event=on_event, on_message=on_message, log_messages=1.0)
    try:
        # Three SUBs in one receive batch: the first event raises.
        sub = bus.connect(b"SUB a/1", b"SUB a/2", b"SUB a/3")
        with pytest.raises(RuntimeError, match="^subscribe a/1$"):
            bus.run()
        assert [f["pattern"] for n, f in events if n == ls.SUBSCRIBE] == ["a/1", "a/2", "a/3"]
        assert bus.broker.totals()["subscriptions"] == 3

        # Five MSGs in one batch, each sampled, each sample raising: all five
        # are delivered, and only the first error is raised.
        raising[0] = False
        payloads = [b"MSG a/2\0%d" % i for i in range(5)]
        bus.connect(*payloads)
        with pytest.raises(RuntimeError, match="^message 1$"):
            bus.run()
        assert messages == [b"a/2"] * 5
        got = []
        sub.setblocking(False)
        while True:
            try:
                got.append(sub.recv(100))
            except BlockingIOError:
                break
        assert got == payloads
        totals = bus.broker.totals()
        assert (totals["msgs_in"], totals["msgs_out"]) == (5, 5)

        # The four errors after the first were not kept: the next turn
        # that stops the broker returns normally.
        bus.clients.pop().close()
        assert bus.run() == "done"
    finally:
        bus.close()


def test_close_raises_a_callback_error_after_closing_everyone(tmp_path):
    closed = []

    def on_event(name, fields):
        if name == ls.CLIENT_DISCONNECT:
            closed.append(fields["reason"])
            raise ValueError("logger broke")
        if name == ls.SUBSCRIBE:
            bus.broker.stop("subscribed")

    bus = InProcess(tmp_path, on_event=on_event)
    try:
        bus.connect()
        bus.connect(b"SUB x")
        assert bus.run() == "subscribed"
        with pytest.raises(ValueError, match="logger broke"):
            bus.broker.close()
        assert closed == [ls.DISCONNECT_SHUTDOWN] * 2
        assert bus.broker.client_count == 0
    finally:
        bus.close()


def test_compiled_reasons_are_logschemas():
    assert report.reason_names() == ls.DISCONNECT_REASONS


def test_every_event_the_broker_emits_is_in_logschema(tmp_path):
    known = set(ls.EVENT_FIELDS) | set(ls.OPERATIONAL_EVENTS)
    # Every emit names its event by a logschema constant, never a literal.
    for pyx in sorted(CORE.glob("*.pyx")):
        source = pyx.read_text()
        for arg in re.findall(r"\.emit\(\s*([^,]+),", source):
            if arg == "event":      # the upstream link's records, checked by name first
                # (by control.pyx, whose CTL_LOG decision hub.pyx acts on)
                checked = source + (CORE / "control.pyx").read_text() * (pyx.name == "hub.pyx")
                assert "if event in UPSTREAM_EVENTS:" in checked, pyx.name
                assert set(ls.UPSTREAM_EVENTS) <= known
                continue
            assert arg.isidentifier() and arg.isupper(), f"{pyx.name}: emit({arg}, ...)"
            assert getattr(ls, arg) in known, f"{pyx.name}: {arg} is no logschema event"
    # And what a short session really emits is known, with its fields.
    seen = []

    def on_event(name, fields):
        seen.append(name)
        if name == ls.CLIENT_DISCONNECT:
            bus.broker.stop("done")

    bus = InProcess(tmp_path, on_event=on_event)
    try:
        bus.connect(b"SUB a", b"UNSUB a", b"UNSUB b", b"CMSG no/such", b"MSG !\0")
        assert bus.run() == "done"
    finally:
        bus.close()
    assert seen == [ls.CLIENT_CONNECT, ls.SUBSCRIBE, ls.UNSUBSCRIBE, ls.UNSUBSCRIBE,
                    ls.CMSG_IGNORED, ls.CLIENT_DISCONNECT]
    assert set(seen) <= known


def test_records_carry_logschemas_fields(tmp_path):
    records = {}

    def on_event(name, fields):
        records[name] = fields
        if name == ls.CLIENT_DISCONNECT:
            bus.broker.stop("done")

    bus = InProcess(tmp_path, on_event=on_event)
    try:
        bus.connect(b"SUB a", b"MSG a\0hello", b"MSG !\0")
        assert bus.run() == "done"
        totals, delta = bus.broker.take_stats_delta()
    finally:
        bus.close()
    names = lambda event: [n for n, _ in ls.EVENT_FIELDS[event]]    # noqa: E731
    assert set(names(ls.CLIENT_DISCONNECT)) == set(records[ls.CLIENT_DISCONNECT])
    counters = records[ls.CLIENT_DISCONNECT]["counters"]
    assert list(counters) == list(ls.CLIENT_COUNTER_FIELDS)
    # its own message was still pending when its next packet closed it
    assert (counters["msgs_in"], counters["bytes_in"], counters["msgs_out"],
            counters["drops_disconnect"]) == (1, 11, 0, 1)
    assert records[ls.CLIENT_DISCONNECT]["reason"] == ls.DISCONNECT_BANG_MISUSE
    assert list(totals) == list(ls.TOTALS_FIELDS)
    assert list(delta) == list(ls.DELTA_FIELDS)
    assert (totals["connects"], totals["disconnects"], delta["msgs_in"],
            delta["drops_disconnect"]) == (1, 1, 1, 1)


def test_a_refused_pattern_is_logged_cut_to_256_bytes_whatever_refused_it(tmp_path):
    records = []

    def on_event(name, fields):
        if name in (ls.SUBSCRIBE, ls.UNSUBSCRIBE):
            records.append((fields["reason"], fields["pattern"]))
        if name == ls.CLIENT_DISCONNECT and len(records) == 6:
            bus.broker.stop("done")

    cut = lambda p: p[:256].decode() + "..."       # noqa: E731
    accepted, unheld, second = b"a" * 300, b"u" * 300, b"b" * 300
    too_long, bang, short = b"c" * 1001, b"d" * 300 + b"/!/x", b"a/!/b"
    bus = InProcess(tmp_path, on_event=on_event, max_pattern=1000, max_subscriptions=1)
    try:
        bus.connect(b"SUB " + accepted, b"UNSUB " + unheld, b"SUB " + second)
        bus.connect(b"SUB " + too_long)
        bus.connect(b"SUB " + bang)
        bus.connect(b"SUB " + short)
        assert bus.run() == "done"
    finally:
        bus.close()
    assert records == [
        (None, accepted.decode()),
        (ls.REFUSE_NOT_SUBSCRIBED, cut(unheld)),
        (ls.REFUSE_TOO_MANY, cut(second)),
        (ls.REFUSE_PATTERN_TOO_LONG, cut(too_long)),
        (ls.REFUSE_BANG_MISUSE, cut(bang)),
        (ls.REFUSE_BANG_MISUSE, short.decode()),
    ]
