"""The spec's four-step identity proof between two processes on any two
servers (brokers in a hierarchy, hosts joined by ``sbus bridge --private``),
with eavesdroppers of another uid on every server. Each party runs in its
own forked process (support.seconduser)."""
from __future__ import annotations

import time

from sbus import Client
from sbus.client.proof import serve_proofs
from sbus.errors import ProofError

from .conn import Conn


def proof_party(address, role, peer_hint, ctl):
    """One side of the spec's four-step identity proof, the library's
    (sbus.client.proof), run in its own process: B serves proofs on
    pub/hello, A proves with whoever serves it, asking again until B's
    subscription has reached A's server. Returns the verified peer."""
    with Client(address) as c:
        if role == "B":
            c.subscribe("pub/hello")    # in place (the whoami below answers after it)
        me = str(c.whoami())            # before A is told to go; serve_proofs adds its own
        ctl.send({"ready": me})
        ctl.wait()
        if role == "B":
            return {"me": me, "peer": [str(p) for p in serve_proofs(c, "pub/hello", 1)][0]}
        deadline = time.monotonic() + 20
        while True:
            try:
                return {"me": me, "peer": str(c.prove("pub/hello", 2.0)), "proved": True}
            except ProofError as exc:
                if exc.step != 2 or time.monotonic() > deadline:
                    raise


def eavesdropper(address, ctl):
    """uid 65534 holding every pattern it may: '', '*/', '*/*/', its own private
    keys, the public keys ('!/' and '!/cred/' are refused: the broker closes
    the connection that tries them)."""
    c = Conn.to(address, timeout=20)
    for pattern in ("", "*/", "*/*/", "!/cred////", "pub/", "pub/hello"):
        c.sub(pattern)
    c.sync()
    ctl.send({"ready": True})
    ctl.wait()
    return sorted({p.split(b"\0")[0][4:].decode() for p in c.drain(0.5)})


def run_proof(spawn, servers, a_on, b_on):
    everyone = [spawn(lambda ctl, s=s: eavesdropper(s.address, ctl)) for s in servers]
    a = spawn(lambda ctl: proof_party(a_on.address, "A", None, ctl), uid=0, gid=0)
    b = spawn(lambda ctl: proof_party(b_on.address, "B", None, ctl), uid=0, gid=0)
    creds = {}
    for name, child in (("A", a), ("B", b)):
        creds[name] = child.recv()["ready"]
    for e in everyone:
        e.recv()
    return a, b, everyone, creds


def check_proof(spawn, servers, a_on, b_on, wait):
    a, b, everyone, creds = run_proof(spawn, servers, a_on, b_on)
    wait()
    b.send({"go": True})
    a.send({"go": True})
    ra, rb = a.result(30), b.result(30)
    assert ra["proved"] and ra["peer"] == creds["B"] and rb["peer"] == creds["A"]
    for e in everyone:
        e.send({"stop": True})
    for e in everyone:
        heard = e.result(30)
        assert "pub/hello" in heard                         # they were listening
        assert not [k for k in heard if "!/cred/" in k], heard  # and heard nothing private
    return ra, rb
