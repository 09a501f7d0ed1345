"""The spec's four-step identity proof between two processes on any two
servers (brokers in a hierarchy, hosts joined by ``sbus bridge --private``),
with eavesdroppers of another uid on every server. Each party runs in its
own forked process (support.seconduser)."""
from __future__ import annotations

import secrets
import time

from .conn import Conn


def proof_party(address, role, peer_hint, ctl):
    """One side of the spec's four-step identity proof, run in its own process.
    The initiator (A) publishes its credentials on pub/hello until B answers
    on A's private key; B proves it holds its claimed identity by returning A's
    nonce. Returns what was proved and every key received."""
    c = Conn.to(address, timeout=20)
    me = c.whoami()
    c.sub(me + "/proof/")               # the nested form on a leaf: accepted
    if role == "B":
        c.sub("pub/")
    c.sync()
    ctl.send({"ready": me})
    ctl.wait()
    keys = []
    deadline = time.monotonic() + 20
    if role == "A":
        nonce = secrets.token_hex(8)
        while time.monotonic() < deadline:
            c.pub("pub/hello", me)                          # 1. A's credentials to B
            p = c.next_packet(0.3)
            if p and b"/proof/2\0" in p:
                keys.append(p.split(b"\0")[0][4:].decode())
                b_cred = p.split(b"\0", 1)[1].decode()
                break
        else:
            raise AssertionError("no answer from B")
        c.pub(b_cred + "/proof/3", nonce)                   # 3. a nonce, private to B
        while time.monotonic() < deadline:
            p = c.next_packet(1.0)
            if p and b"/proof/4\0" in p:
                keys.append(p.split(b"\0")[0][4:].decode())
                return {"me": me, "peer": b_cred, "proved": p.split(b"\0", 1)[1].decode() == nonce,
                        "keys": keys}
        raise AssertionError("the nonce never came back")
    a_cred = None
    while time.monotonic() < deadline:
        p = c.next_packet(1.0)
        if not p:
            continue
        key, _, body = p[4:].partition(b"\0")
        keys.append(key.decode())
        if key == b"pub/hello" and a_cred is None:
            a_cred = body.decode()
            c.pub(a_cred + "/proof/2", me)                  # 2. B's credentials, private to A
        elif key.endswith(b"/proof/3"):
            c.pub(a_cred + "/proof/4", body)                # 4. the nonce back, private to A
            return {"me": me, "peer": a_cred, "keys": keys}
    raise AssertionError("no nonce from A")


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
    # A receives on its local form: a leaf takes its own prefix off
    local = "!/cred/" + creds["A"].rsplit("!/cred/", 1)[1]
    assert ra["keys"] == [local + "/proof/2", local + "/proof/4"]
    for e in everyone:
        e.send({"stop": True})
    for e in everyone:
        heard = e.result(30)
        assert "pub/hello" in heard                         # they were listening
        assert not [k for k in heard if "proof" in k], heard   # and heard nothing private
    return ra, rb
