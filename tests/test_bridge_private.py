"""`sbus bridge --private`: private keys between hosts, with real processes.

Two sbusd "hosts", one nats-server whose authorization gives each host a user
allowed only its own private subjects, and a bridge per host. The spec's
four-step identity proof runs between the hosts with eavesdroppers of another
uid on both; a bridge holding another host's NATS user receives nothing of
that host's private messages, and NATS refuses a forged publication. The
broker's side (the link place a bridge takes) is tested without NATS.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from sbus import Client
from sbus.bridge import mapping

from support import SBUS, Sbusd, wait_until
from support.bridge import STATS_KEY
from support.conn import Conn
from support.nats import Bridge, NatsServer, require_nats
from support.proof import check_proof
from support.seconduser import asroot, make_public_dir, run_as

nats = require_nats()

NO_ONE = mapping.NO_ONE
STATS = b"MSG " + STATS_KEY + b"\0"
# NATS users: host N may publish on every host's private subjects as sender N
# and subscribe to its own; both use the public subjects of the exported keys.
AUTHORIZATION = """
authorization {
  users = [
%s
  ]
}
"""
USER = """    {user: "host%(n)d", password: "pw%(n)d", permissions: {
      publish: {allow: ["sbus.>", "sbus-private.*.%(n)d.>"]},
      subscribe: {allow: ["sbus.>", "sbus-private.%(n)d.>"]}}}"""



def nats_with_hosts(workdir: Path, cleanup, *hosts: int) -> NatsServer:
    conf = workdir / "nats-auth.conf"
    conf.write_text(AUTHORIZATION % "\n".join(USER % {"n": n} for n in hosts))
    server = NatsServer(workdir, extra=["-c", str(conf)])
    cleanup(server)
    return server


def host(workdir: Path, name: str, cleanup, *args) -> Sbusd:
    b = Sbusd.foreground(workdir, *args, address=str(workdir / name), log_level="info")
    cleanup(b)
    return b


def private_bridge(workdir, cleanup, broker, server, host_id, user=None) -> Bridge:
    """A --private bridge of ``broker`` as host ``host_id`` (NATS user host<user>)."""
    user = host_id if user is None else user
    b = Bridge(workdir, broker.address, [server.url], "--private", "--host-id", str(host_id),
               "--user", f"host{user}", "--password", f"pw{user}",
               "--export", "pub/", "--import", "sbus.pub.>")
    cleanup(b)
    return b


def identity(host_id: int) -> str:
    return f"!/cred/{host_id}/{NO_ONE}/0"


# ---- the broker's link place ---------------------------------------------------

@asroot
def test_the_link_place_is_for_the_brokers_uid_and_one_holder(tmp_path, spawn):
    d = make_public_dir()
    try:
        b = Sbusd.foreground(d, "-o", address=str(d / "sbus.socket"), log_level="info")
        try:
            def claim(c: Conn) -> str:
                c.cmsg("link/attach")
                return c.next_packet(5).split(b"\0", 1)[1].decode()

            assert run_as(spawn, lambda: claim(Conn.to(b.address))).startswith(
                "refused: only the broker's own uid")
            holder, other = b.connect(), b.connect()
            assert claim(holder) == "ok"
            assert claim(other).startswith("refused: the broker has a link already")
            me = other.whoami()
            holder.cmsg("link/identity", identity(7))
            holder.sync()
            assert other.whoami() == f"{identity(7)}/{me}"
            # the holder may hold every host's identity; anyone else is refused
            assert holder.sub_ok(mapping.host_pattern())
            assert not other.sub_ok(mapping.host_pattern())
            # a key under a host's identity reaches the holder alone
            listener = b.connect()
            listener.sub("")
            listener.sync()
            key = f"{identity(3)}/{me}/x"
            b.connect().pub(key, "hi")
            assert holder.next_packet(5) == f"MSG {key}\0hi".encode()
            assert listener.drain(0.3) == []
            holder.close()
            # once the holder is gone whoami answers the local form again
            wait_until(lambda: b.connect().whoami() == me, 5, "whoami in the local form")
        finally:
            b.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("args, says", [
    (["--private"], "needs --host-id"),
    (["--host-id", "3"], "for --private only"),
    (["--private", "--host-id", "03"], "without leading zeros"),
    (["--private", "--host-id", "4294967296"], "from 0 to 4294967295"),
    (["--private", "--host-id", "a/b"], "a host id is a number"),
])
def test_private_settings_refused_at_start(tmp_path, args, says):
    run = subprocess.run([SBUS, "-a", str(tmp_path / "none"), "bridge", "--nats",
                          "nats://127.0.0.1:1", "--export", "x/", *args],
                         capture_output=True, timeout=60)
    assert run.returncode == 2
    assert says in run.stderr.decode()


def test_a_second_private_bridge_on_a_host_is_refused(tmp_path, cleanup):
    server = nats_with_hosts(tmp_path, cleanup, 1)
    a = host(tmp_path, "a", cleanup)
    private_bridge(tmp_path, cleanup, a, server, 1).ready()
    second = private_bridge(tmp_path, cleanup, a, server, 1)
    assert second.proc.wait(30) == 1
    assert "the broker has a link already" in second.stderr_path.read_text()


# ---- between hosts -------------------------------------------------------------

@asroot
def test_identity_proof_between_two_bridged_hosts(tmp_path, cleanup, spawn):
    d = make_public_dir()
    try:
        server = nats_with_hosts(tmp_path, cleanup, 1, 2)
        one = host(d, "one", cleanup, "-g", "-o")
        two = host(d, "two", cleanup, "-g", "-o")
        b1 = private_bridge(tmp_path, cleanup, one, server, 1).ready()
        b2 = private_bridge(tmp_path, cleanup, two, server, 2).ready()
        # A third host with host 2's NATS user claims host 1's identity: NATS
        # refuses its subscription to host 1's private subjects.
        three = host(d, "three", cleanup, "-g", "-o")
        impostor = private_bridge(tmp_path, cleanup, three, server, 1, user=2).ready()
        refused = impostor.wait_for("bridge_refused")
        assert "sbus-private.1.>" in refused["error"]
        with one.connect() as c:
            assert c.whoami() == f"{identity(1)}/{c.me}"
        ra, rb = check_proof(spawn, (one, two, three), one, two, lambda: None)
        assert ra["me"].startswith(identity(1) + "/") and rb["me"].startswith(identity(2) + "/")
        check_proof(spawn, (one, two, three), two, one, lambda: None)
        s1, s2, s3 = b1.stats(), b2.stats(), impostor.stats()
        # each direction: step 2 or 4 into one host, step 3 into the other
        assert (s1["private_in"], s1["private_out"]) == (3, 3)
        assert (s2["private_in"], s2["private_out"]) == (3, 3)
        assert (s3["private_in"], s3["private_out"]) == (0, 0)
        assert s1["in_dropped"] == s2["in_dropped"] == s3["in_dropped"] == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_nats_refuses_a_forged_sender_and_a_foreign_subscription(tmp_path, cleanup):
    server = nats_with_hosts(tmp_path, cleanup, 1, 2)

    async def main():
        errors = []

        async def on_error(exc):
            errors.append(str(exc))

        got1, got_thief = [], []

        def collect(into):
            async def cb(msg):
                into.append(msg.subject)
            return cb

        h1 = await nats.connect(server.url, user="host1", password="pw1")
        h2 = await nats.connect(server.url, user="host2", password="pw2", error_cb=on_error)
        await h1.subscribe("sbus-private.1.>", cb=collect(got1))
        await h2.subscribe("sbus-private.1.>", cb=collect(got_thief))
        await h1.flush()
        await h2.flush()
        await h2.publish("sbus-private.1.3.!.cred.0.0.1.x", b"forged: from host 3")
        await h2.publish("sbus-private.1.2.!.cred.0.0.1.x", b"from host 2")
        await h2.flush()
        await h1.flush()
        for _ in range(100):
            if got1 and len(errors) == 2:
                break
            await asyncio.sleep(0.05)
        await h1.close()
        await h2.close()
        return got1, got_thief, errors

    got1, got_thief, errors = asyncio.run(main())
    assert got1 == ["sbus-private.1.2.!.cred.0.0.1.x"], errors
    assert got_thief == []
    assert sorted(errors) == [
        'nats: permissions violation for publish to "sbus-private.1.3.!.cred.0.0.1.x"',
        'nats: permissions violation for subscription to "sbus-private.1.>"']


def test_without_private_the_host_form_stays_home(tmp_path, cleanup):
    server = NatsServer(tmp_path)
    cleanup(server)
    a, b = host(tmp_path, "a", cleanup), host(tmp_path, "b", cleanup)
    plain = [Bridge(tmp_path, h.address, [server.url], "--export", "", "--import", "sbus.>")
             for h in (a, b)]
    for p in plain:
        cleanup(p)
        p.ready()
    with a.connect() as c, b.connect() as listener:
        assert c.whoami() == c.me                     # no host identity without --private
        listener.sub("")
        listener.sync()
        c.pub(f"{identity(2)}/{listener.me}/x", "private")
        c.pub("pub/x", "public")
        # the bridges' periodic stats (every 5 s) may come too: a loaded run is that slow
        got = []
        while b"MSG pub/x\0public" not in got:
            got += [p for p in [listener.next_packet(10)] if not p.startswith(STATS)]
        assert got + [p for p in listener.drain(0.3) if not p.startswith(STATS)] == [
            b"MSG pub/x\0public"]
    assert plain[0].stats()["out_private"] == 0       # not even offered: no one may receive it


def test_request_and_reply_across_bridged_hosts(tmp_path, cleanup):
    server = nats_with_hosts(tmp_path, cleanup, 1, 2)
    one, two = host(tmp_path, "one", cleanup), host(tmp_path, "two", cleanup)
    private_bridge(tmp_path, cleanup, one, server, 1).ready()
    private_bridge(tmp_path, cleanup, two, server, 2).ready()
    with Client(two.address) as srv, Client(one.address) as asker:
        served = threading.Thread(target=srv.serve, args=("pub/echo", lambda r: r.payload[::-1]),
                                  kwargs={"count": 2}, daemon=True)
        served.start()
        wait_until(lambda: subscriptions_of(two, os.getpid()) == 2, 10,     # and its chunk twin
                   "the server subscribed")
        assert str(asker.whoami()).startswith(identity(1) + "/")
        assert asker.request("pub/echo", b"abc", timeout=10) == b"cba"
        assert asker.request("pub/echo", b"xyz", timeout=10) == b"zyx"
        served.join(10)
        assert not served.is_alive()


def subscriptions_of(broker: Sbusd, pid: int) -> int:
    return sum(c["subscriptions"] for c in broker.stats()["clients"] if c["pid"] == pid)


def test_the_bridge_takes_the_link_place_again_after_a_broker_restart(tmp_path, cleanup):
    server = nats_with_hosts(tmp_path, cleanup, 1, 2)
    one, two = host(tmp_path, "one", cleanup), host(tmp_path, "two", cleanup)
    b1 = private_bridge(tmp_path, cleanup, one, server, 1).ready()
    private_bridge(tmp_path, cleanup, two, server, 2).ready()
    mark = b1.mark()
    one.stop()
    one = host(tmp_path, "one", cleanup)
    b1.wait_for("bridge_local_back", 30, since=mark)
    wait_until(lambda: one.connect().whoami().startswith(identity(1) + "/"), 30,
               "whoami under host 1's identity again")
    with one.connect() as here, two.connect() as there:
        who = here.whoami()
        here.sub(who + "/back")
        here.sync()
        there.pub(who + "/back", "again")
        assert here.next_packet(10) == f"MSG {here.me}/back\0again".encode()


def test_a_process_on_a_leaf_under_a_bridged_host_is_reached_from_another_host(tmp_path,
                                                                                cleanup):
    server = nats_with_hosts(tmp_path, cleanup, 1, 2)
    one, two = host(tmp_path, "one", cleanup), host(tmp_path, "two", cleanup)
    private_bridge(tmp_path, cleanup, one, server, 1).ready()
    private_bridge(tmp_path, cleanup, two, server, 2).ready()
    leaf = host(tmp_path, "leaf", cleanup, "--upstream", two.address)
    leaf.wait_for_event("upstream_connected", timeout=10)
    with leaf.connect() as there, one.connect() as here:
        who = there.whoami()        # nested twice: host 2, then the leaf's link there
        assert who.startswith(identity(2) + "/!/cred/") and who.endswith("/" + there.me)
        there.sub(who + "/x")
        there.sync()
        here.pub(who + "/x", "from host 1")
        assert there.next_packet(10) == f"MSG {there.me}/x\0from host 1".encode()
