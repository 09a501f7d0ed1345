"""The spec's four-step identity proof as a call (sbus/client/proof.py,
docs/proof.md): both sides, on one real sbusd, with an impostor of another
uid at each side. Across a leaf and a private bridge: tests/test_hierarchy.py
and tests/test_bridge_private.py (tests/support/proof.py runs this library)."""
from __future__ import annotations

import asyncio
import subprocess
import threading
import time

import pytest

from sbus import Client
from sbus.aio import Client as AsyncClient
from sbus.client.proof import serve_proofs
from sbus.errors import BusClosedError, ProofError

from support import SBUS, asroot
from support.seconduser import NOBODY

TIMEOUT = 20.0
KEY = "svc/who"


def _responder(address, ctl, count=1, pattern=KEY):
    """A responder in its own process: its credentials, then every peer it proved."""
    with Client(address) as c:
        proofs = serve_proofs(c, pattern, count)
        ctl.send({"ready": str(c.whoami())})
        return [str(p) for p in proofs]


def _ready(bus, child, key=KEY):
    """Once a proof with the responder went through, its subscription is in place."""
    me = child.recv()["ready"]
    with Client(bus.address) as c:
        _prove_when_served(c, key)
    return me


def _prove_when_served(c, key=KEY):
    """``c.prove(key)``, asked again until the responder's subscription is in place."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return c.prove(key, 0.5)
        except ProofError as exc:
            assert exc.step == 2 and time.monotonic() < deadline


@asroot
def test_each_side_gets_the_others_verified_credentials(open_broker, spawn):
    bus = open_broker()
    b = spawn(lambda ctl: _responder(bus.address, ctl, count=3), uid=NOBODY, gid=NOBODY)
    b_cred = _ready(bus, b)
    with Client(bus.address) as a:
        peer = a.prove(KEY, TIMEOUT)
        assert str(peer) == b_cred and (peer.uid, peer.gid) == (NOBODY, NOBODY)
        me = str(a.whoami())

    async def aprove():
        async with AsyncClient(bus.address) as ac:
            return str(await ac.prove(KEY, TIMEOUT)), str(await ac.whoami())
    apeer, ame = asyncio.run(aprove())
    assert apeer == b_cred
    assert b.result(TIMEOUT)[1:] == [me, ame]


def test_nobody_serving_fails_at_step_2(start_broker):
    bus = start_broker()
    with Client(bus.address) as a:
        with pytest.raises(ProofError, match="step 2: nobody answered") as e:
            a.prove("svc/nobody", 0.5)
        assert e.value.step == 2


def test_other_messages_received_during_a_proof_stay_queued(start_broker):
    bus = start_broker()
    with Client(bus.address) as server:
        proofs = serve_proofs(server, KEY, 1)
        got = []
        t = threading.Thread(target=lambda: got.extend(proofs))
        t.start()
        with Client(bus.address) as a, Client(bus.address) as other:
            a.subscribe("k/")
            a.sync(TIMEOUT)
            other.publish_many((f"k/{i}", str(i)) for i in range(100))
            other.sync(TIMEOUT)
            peer = _prove_when_served(a)
            assert str(peer) == str(server.whoami())
            t.join(TIMEOUT)
            assert [str(p) for p in got] == [str(a.whoami())]
            ms = []
            while len(ms) < 100:
                ms += a.receive_many(1000, timeout=TIMEOUT)
            assert [m.payload for m in ms] == [str(i).encode() for i in range(100)]


def _impostor_responder(address, ctl, claim):
    """uid 65534 on the responder's key: answers step 2 claiming ``claim``'s
    credentials (its own if None), with a key under them."""
    with Client(address) as c:
        c.subscribe(KEY)
        me = str(c.whoami())
        ctl.send({"ready": me})
        m = c.receive(timeout=TIMEOUT)
        a_cred, _, k2 = m.payload.partition(b"\0")
        creds = claim or me
        c.publish(k2, f"{creds}\0{creds}/proof/0123456789abcdef/0123456789abcdef")
        c.sync(TIMEOUT)
        return a_cred.decode()


@asroot
def test_an_impostor_claiming_roots_credentials_fails_at_step_4(open_broker, spawn):
    bus = open_broker()
    with Client(bus.address) as root_b:
        claim = str(root_b.whoami())
        imp = spawn(lambda ctl: _impostor_responder(bus.address, ctl, claim))
        imp.recv()
        with Client(bus.address) as a:
            with pytest.raises(ProofError, match="step 4") as e:
                a.prove(KEY, 1.0)
            assert e.value.step == 4 and claim in str(e.value)
            assert imp.result(TIMEOUT) == str(a.whoami())


def _impostor_initiator(address, ctl, claim):
    """uid 65534 asks the responder, claiming root's credentials and a key under them."""
    with Client(address) as c:
        c.publish(KEY, f"{claim}\0{claim}/reply/0123456789abcdef/1")
        c.sync(TIMEOUT)
        return True


@asroot
def test_an_impostor_initiator_is_never_proved(open_broker, spawn):
    bus = open_broker()
    with Client(bus.address) as server, Client(bus.address) as a:
        proofs = serve_proofs(server, KEY, 2)
        got = []
        t = threading.Thread(target=lambda: got.extend(proofs))
        t.start()
        _prove_when_served(a)       # the responder serves
        claim = str(a.whoami())
        assert spawn(lambda ctl: _impostor_initiator(bus.address, ctl, claim)).result(TIMEOUT)
        # The responder's step 2 went to ``a``'s credentials, which ignore it;
        # the next peer it proves is the real one.
        with Client(bus.address) as real:
            real.prove(KEY, TIMEOUT)
            t.join(TIMEOUT)
            assert [str(p) for p in got] == [claim, str(real.whoami())]


def test_the_cli_proves_and_serves(start_broker):
    bus = start_broker()
    server = subprocess.Popen([SBUS, "-a", bus.address, "whoami", "--serve-proofs", KEY,
                               "--count", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with Client(bus.address) as c:
            for _ in range(100):
                try:
                    peer = c.prove(KEY, 0.2)
                    break
                except ProofError:
                    continue
            me = str(c.whoami())
        out = subprocess.run([SBUS, "-a", bus.address, "whoami", "--prove", KEY],
                             capture_output=True, timeout=TIMEOUT)
        assert out.returncode == 0, out.stderr
        assert out.stdout.decode().strip() == str(peer)
        lines = server.communicate(timeout=TIMEOUT)[0].decode().split()
        assert lines[0] == me and len(lines) == 2
        failed = subprocess.run([SBUS, "-a", bus.address, "whoami", "--prove", "svc/none",
                                 "--timeout", "0.3"], capture_output=True, timeout=TIMEOUT)
        assert failed.returncode != 0 and b"step 2" in failed.stderr
    finally:
        server.kill()
        server.wait()


def test_both_sides_on_asyncio_clients(start_broker):
    bus = start_broker()

    async def run():
        async with AsyncClient(bus.address) as b, AsyncClient(bus.address) as a:
            async def serve():
                return [str(p) async for p in b.serve_proofs(KEY, 2)]
            server = asyncio.ensure_future(serve())
            peers = []
            while len(peers) < 2:
                try:
                    peers.append(str(await a.prove(KEY, 0.5)))
                except ProofError as exc:
                    assert exc.step == 2        # before the server subscribed
            proved = await asyncio.wait_for(server, TIMEOUT)
            return peers, proved, str(await a.whoami()), str(await b.whoami())

    peers, proved, a_cred, b_cred = asyncio.run(run())
    assert peers == [b_cred, b_cred] and proved == [a_cred, a_cred]


def test_a_broker_gone_mid_proof_ends_it_at_once(start_broker):
    bus = start_broker()
    with Client(bus.address) as a:
        a.sync(TIMEOUT)
        threading.Timer(0.3, bus.stop).start()
        started = time.monotonic()
        with pytest.raises(BusClosedError):
            a.prove("svc/nobody", 60)
        assert time.monotonic() - started < 30
