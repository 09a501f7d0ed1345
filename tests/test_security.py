"""Security properties of sbusd, tested across a real uid boundary.

The test process runs as root. A second user is a forked child that drops to
uid 65534 (and gid 65534, or 65533 for group checks) before it touches a
socket; it reports what it saw back over a pipe as JSON lines and ends with
os._exit, never returning into pytest. Brokers that such a child must reach
listen in a dedicated 0755 directory under /tmp (pytest's own tmp dirs may sit
under 0700 parents).

Covered: who can connect (socket mode, -g, -o, -u); !/cred/ subscriptions in
every spelling a second user might try; delivery-time protection of !/cred/
messages against wildcard subscribers; control messages never forwarded;
the reserved '!'; -r never removing a non-socket; the pidfile never followed
through a symlink.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from sbus import address as addresses
from sbus._core.protocol import matches

from support import BACKENDS, NOBODY, OTHER_GID, SBUSD, WHOAMI, Conn, Sbusd, asroot, make_public_dir, run_as, wait_until

TIMEOUT = 5.0
WHOAMI_REPLY = WHOAMI + b"\0"


def _b(x) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def _s(pkts) -> list:
    """Packets as JSON-safe strings (latin-1 round-trips every byte)."""
    return [p.decode("latin-1") for p in pkts]


def _pkts(strs) -> list:
    return [s.encode("latin-1") for s in strs]


def msg(key, payload=b"") -> bytes:
    return b"MSG " + _b(key) + b"\0" + _b(payload)


def try_connect(address):
    """Inside a child: connect and ask whoami. {'errno': n} if connect fails;
    {'whoami': creds or None (closed by the broker)} otherwise."""
    try:
        c = Conn.to(address)
    except OSError as e:
        return {"errno": e.errno}
    return {"whoami": c.whoami()}


# -- directories and brokers ----------------------------------------------------

@pytest.fixture
def pubdir():
    d = make_public_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def groupdir():
    d = make_public_dir(OTHER_GID)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module", params=BACKENDS)
def bus(request, tmp_path_factory):
    """One world-connectable broker (-g -o) per backend, shared by the module:
    every test uses fresh connections, and a refused client only loses its own."""
    d = make_public_dir()
    b = Sbusd.foreground(tmp_path_factory.mktemp(f"bus-{request.param}"), "-g", "-o",
                         backend=request.param, address=d / "sbus.socket")
    yield b
    b.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def conns():
    """Factory for root-side Conn objects, closed at teardown."""
    made = []

    def make(address) -> Conn:
        c = Conn.to(address)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def log_mark(bus) -> int:
    """How many records the broker's log holds now. Waits look only past the
    mark, so a record from an earlier test (or an earlier process with the
    same pid) is never taken for this one's."""
    return len(bus.records())


def refused(bus, since, pid, reason="cred_refused", refusal="cred_mismatch"):
    """Assert the broker logged, since the mark, for the client with this pid,
    a refused subscribe (its ``reason``: ``refusal``) and then a disconnect
    for ``reason``; returns the subscribe record."""
    sub = bus.wait_for_event("subscribe", TIMEOUT, since=since,
                             predicate=lambda r: r.get("pid") == pid)
    assert sub["accepted"] is False and sub["reason"] == refusal, sub
    disc = bus.wait_for_event("client_disconnect", TIMEOUT, since=since,
                              predicate=lambda r: r.get("client") == sub["client"])
    assert disc["reason"] == reason, disc
    return sub


# -- who can connect --------------------------------------------------------------

@asroot
def test_default_socket_mode_shuts_out_other_users(start_broker, pubdir, spawn):
    b = start_broker(address=str(pubdir / "s"))
    assert stat.S_IMODE(os.stat(b.address).st_mode) == 0o700
    assert run_as(spawn, lambda: try_connect(b.address)) == {"errno": errno.EACCES}
    assert Conn.to(b.address).whoami() == f"!/cred/0/0/{os.getpid()}"


@pytest.mark.parametrize("gid,groups,ok", [
    (OTHER_GID, (), True),            # the socket's group as primary group
    (NOBODY, (OTHER_GID,), True),     # ... or as a supplementary group
    (NOBODY, (), False),              # not in the group
], ids=["primary", "supplementary", "outsider"])
@asroot
def test_group_flag_admits_only_the_sockets_group(start_broker, groupdir, spawn, gid, groups, ok):
    b = start_broker("-g", address=str(groupdir / "s"))
    st = os.stat(b.address)
    assert stat.S_IMODE(st.st_mode) == 0o770 and st.st_gid == OTHER_GID
    got = spawn(lambda ctl: try_connect(b.address), gid=gid, groups=groups)
    report = got.result()
    if ok:
        # SO_PEERCRED gives the effective gid, never a supplementary one.
        assert report == {"whoami": f"!/cred/{gid}/{NOBODY}/{got.pid}"}
    else:
        assert report == {"errno": errno.EACCES}


@asroot
def test_other_flag_admits_others_but_not_the_group(start_broker, groupdir, spawn):
    b = start_broker("-o", address=str(groupdir / "s"))
    assert stat.S_IMODE(os.stat(b.address).st_mode) == 0o707
    other = spawn(lambda ctl: try_connect(b.address))
    assert other.result() == {"whoami": f"!/cred/{NOBODY}/{NOBODY}/{other.pid}"}
    # Unix permissions use the first class that applies: the group class, 0.
    in_group = spawn(lambda ctl: try_connect(b.address), gid=OTHER_GID)
    assert in_group.result() == {"errno": errno.EACCES}


@asroot
@pytest.mark.parametrize("user", [str(NOBODY), "nobody"])
def test_user_list_admits_only_listed_uids_and_our_own(start_broker, pubdir, spawn, user):
    b = start_broker("-g", "-o", "-u", user, address=str(pubdir / "s"))
    assert stat.S_IMODE(os.stat(b.address).st_mode) == 0o777
    listed = spawn(lambda ctl: try_connect(b.address))
    assert listed.result() == {"whoami": f"!/cred/{NOBODY}/{NOBODY}/{listed.pid}"}
    stranger = spawn(lambda ctl: try_connect(b.address), uid=NOBODY - 1, gid=NOBODY - 1)
    assert stranger.result() == {"whoami": None}        # accepted by the kernel, closed by sbusd
    r = b.wait_for_event("client_disconnect", predicate=lambda r: r.get("pid") == stranger.pid)
    assert r["reason"] == "user_refused" and r["uid"] == NOBODY - 1
    assert not [e for e in b.events("client_connect") if e.get("pid") == stranger.pid]
    assert Conn.to(b.address).whoami() == f"!/cred/0/0/{os.getpid()}"   # our own uid always


@asroot
def test_abstract_address_without_g_or_o_shuts_out_other_users(start_broker, spawn):
    b = start_broker(address="/dev/unix/abstract")
    sun = addresses.parse(b.stdout.decode().strip()).sun_path
    assert sun.startswith(b"\0")

    def child(ctl):
        with open("/proc/net/unix", "rb") as f:
            listed = sun[1:].replace(b"\0", b"@") in f.read()
        try:
            c = Conn.to(sun)
        except OSError as e:
            return {"listed": listed, "errno": e.errno}
        return {"listed": listed, "whoami": c.whoami()}

    report = spawn(child).result()
    assert report["listed"], "a random abstract name is no secret"
    assert report.get("whoami") is None, report


def test_abstract_address_with_o_admits_other_users_and_logs_refusals_without(start_broker, spawn):
    open_bus = start_broker("-o", address="/dev/unix/abstract")
    sun = addresses.parse(open_bus.stdout.decode().strip()).sun_path
    child = spawn(lambda ctl: Conn.to(sun).whoami())
    assert child.result() == f"!/cred/{NOBODY}/{NOBODY}/{child.pid}"
    closed = start_broker(address="/dev/unix/abstract")
    sun = addresses.parse(closed.stdout.decode().strip()).sun_path

    def try_whoami(ctl):
        try:
            return Conn.to(sun).whoami()
        except OSError as e:
            return e.errno
    spawn(try_whoami).result()
    rec = closed.wait_for_event("client_disconnect", predicate=lambda r: r["reason"] == "user_refused")
    assert rec["uid"] == NOBODY and "mode 0700" in rec["detail"]


def test_log_file_is_created_private(start_broker):
    b = start_broker()
    b.wait_for_event("broker_start")
    assert os.stat(b.log_path).st_mode & 0o777 == 0o600


@asroot
def test_whoami_reports_the_callers_peer_credentials(bus, spawn):
    for gid in (NOBODY, OTHER_GID):
        child = spawn(lambda ctl: Conn.to(bus.address).whoami(), gid=gid)
        assert child.result() == f"!/cred/{gid}/{NOBODY}/{child.pid}"


# -- !/cred/ subscriptions ---------------------------------------------------------

# Patterns naming root's key (gid 0, uid 0, pid {rp}) or another process's,
# spelt every way a second user might try. {rp}: root client's pid; {cp},
# {cg}, {cu}: the child's own pid, gid and uid. Each must get the child
# disconnected with the given reason, after a refused ``subscribe`` record
# giving the finer one (cred_mismatch: a well-formed key for other
# credentials; cred_malformed: not a well-formed !/cred/ form at all).
FOREIGN = [
    ("explicit", "!/cred/0/0/{rp}/x", "cred_refused", "cred_mismatch"),
    ("prefix-only", "!/cred/0/0/{rp}/", "cred_refused", "cred_mismatch"),
    ("empty-gid", "!/cred//0/{rp}/x", "cred_refused", "cred_mismatch"),
    ("empty-uid", "!/cred/0//{rp}/x", "cred_refused", "cred_mismatch"),
    ("empty-pid", "!/cred/0/0//x", "cred_refused", "cred_mismatch"),
    ("empty-gid-uid", "!/cred///{rp}/x", "cred_refused", "cred_mismatch"),
    ("empty-uid-pid", "!/cred/0///x", "cred_refused", "cred_mismatch"),
    ("own-user-other-pid", "!/cred/{cg}/{cu}/{rp}/x", "cred_refused", "cred_mismatch"),
    ("own-user-pid-1", "!/cred/{cg}/{cu}/1/x", "cred_refused", "cred_mismatch"),
    ("other-gid", "!/cred/0/{cu}/{cp}/x", "cred_refused", "cred_mismatch"),
    ("other-uid", "!/cred/{cg}/0/{cp}/x", "cred_refused", "cred_mismatch"),
    ("leading-zeros", "!/cred/00/000/0{rp}/x", "cred_refused", "cred_mismatch"),
    ("many-zeros", "!/cred/" + "0" * 40 + "/0/{rp}/x", "cred_refused", "cred_mismatch"),
    ("plus", "!/cred/+0/+0/+{rp}/x", "cred_refused", "cred_malformed"),
    ("plus-own", "!/cred/+{cg}/+{cu}/+{cp}/x", "cred_refused", "cred_malformed"),
    ("minus", "!/cred/-0/0/{rp}/x", "cred_refused", "cred_malformed"),
    ("space-before", "!/cred/ 0/0/{rp}/x", "cred_refused", "cred_malformed"),
    ("space-after", "!/cred/0 /0/{rp}/x", "cred_refused", "cred_malformed"),
    ("space-own", "!/cred/{cg}/ {cu}/{cp}/x", "cred_refused", "cred_malformed"),
    ("tab", "!/cred/0/0/\t{rp}/x", "cred_refused", "cred_malformed"),
    ("hex", "!/cred/0x0/0x0/{rp}/x", "cred_refused", "cred_malformed"),
    ("fullwidth-digit", "!/cred/\uff10/\uff10/{rp}/x", "cred_refused", "cred_malformed"),
    ("overlong-2^32", "!/cred/4294967296/4294967296/{rp}/x", "cred_refused", "cred_malformed"),
    ("overlong-2^64", "!/cred/18446744073709551616/18446744073709551616/{rp}/x",
     "cred_refused", "cred_malformed"),
    ("overlong-wraps-to-own-uid", "!/cred/{cg}/{cu_wrap}/{cp}/x", "cred_refused", "cred_malformed"),
    ("overlong-wraps-to-own-pid", "!/cred/{cg}/{cu}/{cp_wrap}/x", "cred_refused", "cred_malformed"),
    ("overlong-huge", "!/cred/" + "9" * 400 + "/0/{rp}/x", "cred_refused", "cred_malformed"),
    ("star-all", "!/cred/*/*/*/x", "cred_refused", "cred_malformed"),
    ("star-all-prefix", "!/cred/*/*/*/", "cred_refused", "cred_malformed"),
    ("star-gid-own-rest", "!/cred/*/{cu}/{cp}/x", "cred_refused", "cred_malformed"),
    ("star-pid", "!/cred/0/0/*/x", "cred_refused", "cred_malformed"),
    ("star-suffix", "!/cred/0/0/{rp}*/x", "cred_refused", "cred_malformed"),
    ("star-empty-own", "!/cred///*/x", "cred_refused", "cred_malformed"),
    ("truncated-no-slash", "!/cred/0/0/{rp}", "cred_refused", "cred_malformed"),
    ("truncated-two-fields", "!/cred/0/0/", "cred_refused", "cred_malformed"),
    ("truncated-two-no-slash", "!/cred/0/0", "cred_refused", "cred_malformed"),
    ("truncated-empty-own", "!/cred///", "cred_refused", "cred_malformed"),
    ("truncated-bare", "!/cred/", "cred_refused", "cred_malformed"),
    ("truncated-by-nul", "!/cred/0/0/{rp}\0/x", "cred_refused", "cred_malformed"),
    ("nested-foreign-outer", "!/cred/0/0/{rp}/!/cred/{cg}/{cu}/{cp}/x",
     "cred_refused", "cred_mismatch"),
    ("nested-malformed-inner", "!/cred////!/cred/x/", "cred_refused", "cred_malformed"),
    ("nested-truncated-inner", "!/cred////!/cred/0/0", "cred_refused", "cred_malformed"),
    # Not a !/cred/ form, so the '!' itself is the misuse.
    ("uppercase", "!/CRED/0/0/{rp}/x", "bang_misuse", "bang_misuse"),
    ("no-slash", "!/cred", "bang_misuse", "bang_misuse"),
    ("double-slash", "!//cred/0/0/{rp}/x", "bang_misuse", "bang_misuse"),
    ("star-in-cred", "!/cre*/0/0/{rp}/x", "bang_misuse", "bang_misuse"),
    ("bang-slash", "!/", "bang_misuse", "bang_misuse"),
    ("nested-bang-misuse", "!/cred////a/!/b", "bang_misuse", "bang_misuse"),
]


def fill(template: str, rp: int) -> bytes:
    cg, cu, cp = os.getgid(), os.getuid(), os.getpid()
    return template.format(rp=rp, cg=cg, cu=cu, cp=cp, cu_wrap=cu + 2 ** 32,
                           cp_wrap=cp + 2 ** 32).encode()


@asroot
@pytest.mark.parametrize("template,reason,refusal", [f[1:] for f in FOREIGN],
                         ids=[f[0] for f in FOREIGN])
def test_second_user_cannot_subscribe_to_foreign_cred_keys(bus, spawn, template, reason, refusal):
    rp, since = os.getpid(), log_mark(bus)

    def child(ctl):
        c = Conn.to(bus.address)
        kept = c.sub_ok(fill(template, rp))
        return {"kept": kept, "got": _s(c.drain(0.05)) if kept else []}

    ch = spawn(child)
    assert ch.result() == {"kept": False, "got": []}
    rec = refused(bus, since, ch.pid, reason, refusal)
    assert rec["uid"] == NOBODY and rec["pattern"]


def test_root_gets_no_bypass_either(bus, conns):
    since = log_mark(bus)
    c = conns(bus.address)
    assert not c.sub_ok(f"!/cred/{NOBODY}/{NOBODY}/1/x")
    refused(bus, since, os.getpid())


@asroot
def test_group_is_part_of_the_credentials(bus, spawn):
    """A child whose gid is OTHER_GID: its uid's key with gid 65534 is foreign."""
    def child(ctl):
        me = os.getpid()
        wrong = Conn.to(bus.address).sub_ok(f"!/cred/{NOBODY}/{NOBODY}/{me}/x")
        supp_free = Conn.to(bus.address).sub_ok(f"!/cred/{OTHER_GID}/{NOBODY}/{me}/x")
        return [wrong, supp_free]

    since = log_mark(bus)
    ch = spawn(child, gid=OTHER_GID)
    assert ch.result() == [False, True]
    refused(bus, since, ch.pid)


@asroot
def test_supplementary_group_does_not_count(bus, spawn):
    def child(ctl):
        return Conn.to(bus.address).sub_ok(f"!/cred/{OTHER_GID}/{NOBODY}//x")

    since = log_mark(bus)
    ch = spawn(child, groups=(OTHER_GID,))
    assert ch.result() is False
    refused(bus, since, ch.pid)


# Own-credential spellings: accepted, stored canonically, and delivered.
OWN = [
    ("all-empty", "!/cred////own"),
    ("explicit", "!/cred/{cg}/{cu}/{cp}/own"),
    ("empty-uid", "!/cred/{cg}//{cp}/own"),
    ("empty-gid-pid", "!/cred//{cu}//own"),
    ("leading-zeros", "!/cred/0{cg}/00{cu}/000{cp}/own"),
    ("many-zeros", "!/cred/" + "0" * 40 + "{cg}//{cp}/own"),
    ("wildcard-rest", "!/cred////*"),
    ("trailing-slash-rest", "!/cred////"),
]


@asroot
@pytest.mark.parametrize("template", [o[1] for o in OWN], ids=[o[0] for o in OWN])
def test_second_user_subscribes_to_its_own_key(bus, spawn, conns, template):
    rp = os.getpid()
    wild = conns(bus.address)       # root, subscribed to everything
    assert wild.sub_ok("")

    def child(ctl):
        c = Conn.to(bus.address)
        ctl.send({"kept": c.sub_ok(fill(template, rp))})
        ctl.wait()
        return _s(c.collect())

    since = log_mark(bus)
    ch = spawn(child)
    assert ch.recv() == {"kept": True}
    own = f"!/cred/{NOBODY}/{NOBODY}/{ch.pid}/own"
    rec = bus.wait_for_event("subscribe", TIMEOUT, since=since,
                             predicate=lambda r: r.get("pid") == ch.pid)
    assert rec["accepted"] is True
    stored = f"!/cred/{NOBODY}/{NOBODY}/{ch.pid}/" + template.split("/", 5)[5]
    assert rec["pattern"] == stored, "empty fields filled in, numbers canonical"
    pub = conns(bus.address)
    pub.pub(own, b"for you")
    assert pub.whoami()
    ch.send({"go": True})
    assert _pkts(ch.result()) == [msg(own, b"for you")]
    # Root's catch-all subscription does not see a message addressed to the child.
    assert wild.collect() == []


def test_leading_zeros_in_a_key_name_the_same_client(bus, conns):
    me = conns(bus.address)
    g, u, p = me.me.split("/")[2:]
    assert me.sub_ok(f"!/cred/0{g}/00{u}/{p}/x")          # stored as !/cred/G/U/P/x
    pub = conns(bus.address)
    keys = [f"!/cred/{g}/{u}/{p}/x", f"!/cred/0{g}/00{u}/{p}/x", f"!/cred/{g}/{u}/000{p}/x"]
    for k in keys:
        pub.pub(k, b"z")
    assert pub.whoami()
    assert me.collect() == [msg(k, b"z") for k in keys]
    pub.pub(f"!/cred/{g}/{u}/{p}0/x", b"no")                 # another pid entirely
    assert pub.whoami()
    assert me.collect() == []


@asroot
def test_an_empty_field_in_a_key_restricts_nothing(bus, spawn, conns):
    root_all = conns(bus.address)
    assert root_all.sub_ok("")

    def child(ctl):
        c = Conn.to(bus.address)
        ctl.send({"kept": c.sub_ok("")})
        ctl.wait()
        return _s(c.collect())

    ch = spawn(child)
    assert ch.recv() == {"kept": True}
    pub = conns(bus.address)
    pub.pub("!/cred////anyone", b"a")                       # names no one: all who match
    pub.pub("!/cred//0//root-uid", b"b")                    # any gid and pid, uid 0
    pub.pub(f"!/cred/{NOBODY}///nobody-gid", b"c")
    assert pub.whoami()
    ch.send({"go": True})
    assert _pkts(ch.result()) == [msg("!/cred////anyone", b"a"), msg(f"!/cred/{NOBODY}///nobody-gid", b"c")]
    assert root_all.collect() == [msg("!/cred////anyone", b"a"), msg("!/cred//0//root-uid", b"b")]


@asroot
def test_anyone_may_publish_to_a_cred_key(bus, spawn, conns):
    rp = os.getpid()
    owner = conns(bus.address)
    assert owner.sub_ok("!/cred////from/*")

    def child(ctl):
        c = Conn.to(bus.address)
        c.pub(f"!/cred/0/0/{rp}/from/nobody", "hi")
        return c.whoami()

    ch = spawn(child)
    assert ch.result() == f"!/cred/{NOBODY}/{NOBODY}/{ch.pid}"
    assert owner.collect() == [msg(f"!/cred/0/0/{rp}/from/nobody", "hi")]


@pytest.mark.parametrize("pattern,key", [
    ("!/cred////!/cred/0/0/{rp}/x", "!/cred/{cg}/{cu}/{cp}/!/cred/0/0/{rp}/x"),
    ("!/cred/{cg}/{cu}/{cp}/!/cred/1/2/3/!/cred/4/5/6/",
     "!/cred/{cg}/{cu}/{cp}/!/cred/1/2/3/!/cred/4/5/6/y"),
    ("!/cred////!/cred/*/*/*/", "!/cred/{cg}/{cu}/{cp}/!/cred/7/8/9/z"),
    ("!/cred////!/cred////", "!/cred/{cg}/{cu}/{cp}/!/cred////w"),
], ids=["nested-root", "doubly-nested", "nested-star", "nested-empty"])
@asroot
def test_nested_cred_form_accepted_for_own_credentials(bus, spawn, conns, pattern, key):
    rp = os.getpid()

    def child(ctl):
        c = Conn.to(bus.address)
        ctl.send({"kept": c.sub_ok(fill(pattern, rp)), "key": fill(key, rp).decode()})
        ctl.wait()
        return _s(c.collect())

    ch = spawn(child)
    first = ch.recv()
    assert first["kept"] is True
    pub = conns(bus.address)
    pub.pub(first["key"], b"nested")
    assert pub.whoami()
    ch.send({"go": True})
    assert _pkts(ch.result()) == [msg(first["key"], b"nested")]


# -- delivery-time protection ---------------------------------------------------------

# (pattern, the reason it is refused or None) a second user tries in order to
# read root's private keys.
WILDCARDS = [
    ("", None),
    ("*/", None),
    ("*/cred/", None),
    ("*/cred/*/*/*/", None),
    ("*/cred/*/*/*/secret", None),
    ("*/cred/0/0/{rp}/secret", None),
    ("*/cred/0/0/{rp}/", None),
    ("*/*/*/*/*/*", None),
    ("*/*/", None),
    ("!*/", None),
    ("!*/cred/*/*/*/", None),
    ("!*/*/*/*/*/secret", None),
    ("!/", "bang_misuse"),
    ("!/cred/", "cred_malformed"),
    ("!/cred/*/*/*/", "cred_malformed"),
    ("!/cred/*/*/*/secret", "cred_malformed"),
    ("!/cred/0/0/{rp}/", "cred_mismatch"),
    ("!/cred/0/0/{rp}/secret", "cred_mismatch"),
]


@asroot
@pytest.mark.parametrize("template,refusal", WILDCARDS, ids=[repr(w[0]) for w in WILDCARDS])
def test_wildcards_never_deliver_another_users_cred_messages(bus, spawn, conns, template, refusal):
    accepted = refusal is None
    rp = os.getpid()
    owner = conns(bus.address)              # root's rightful subscriber
    assert owner.sub_ok(f"!/cred/0/0/{rp}/secret")
    root_wild = conns(bus.address)          # root's own catch-all
    assert root_wild.sub_ok("")

    def child(ctl):
        c = Conn.to(bus.address)
        kept = c.sub_ok(fill(template, rp))
        ctl.send({"kept": kept})
        ctl.wait()
        return _s(c.collect())

    since = log_mark(bus)
    ch = spawn(child)
    assert ch.recv() == {"kept": accepted}
    cp = ch.pid
    for_root = [f"!/cred/0/0/{rp}/secret",
                f"!/cred/0/0/{rp}/!/cred/{NOBODY}/{NOBODY}/{cp}/secret"]
    for_nobody_else = [f"!/cred/{NOBODY}/{NOBODY}/{rp}/secret",   # same user, other pid
                       f"!/cred/0/{NOBODY}/{cp}/secret",           # other gid
                       f"!/cred/{NOBODY}/0/{cp}/secret",           # other uid
                       f"!/cred/{NOBODY}/{NOBODY}/1/secret"]
    for_child = [f"!/cred/{NOBODY}/{NOBODY}/{cp}/secret"]
    public = [f"x/cred/0/0/{rp}/secret", "pub/x", "pub/x/y/z/w/secret"]
    pub = conns(bus.address)
    for k in for_root + for_nobody_else:
        pub.pub(k, b"TOPSECRET")
    for k in for_child + public:            # published after the secrets
        pub.pub(k, b"control")
    assert pub.whoami()

    assert owner.collect() == [msg(for_root[0], b"TOPSECRET")]
    assert root_wild.collect() == ([msg(k, b"TOPSECRET") for k in for_root] +
                                 [msg(k, b"control") for k in public])
    ch.send({"go": True})
    got = _pkts(ch.result())
    assert not [p for p in got if b"TOPSECRET" in p]
    if accepted:
        pat = fill(template, rp)
        expect = [msg(k, b"control") for k in for_child + public if matches(pat, k.encode())]
        assert expect, "the pattern must be live: some control message should match it"
        assert got == expect
    else:
        assert got == []
        rec = bus.wait_for_event("subscribe", TIMEOUT, since=since,
                                 predicate=lambda r: r.get("pid") == cp)
        assert rec["accepted"] is False
        assert rec["reason"] == refusal


@asroot
def test_same_user_other_process_cannot_read(bus, spawn, conns):
    """Two processes of uid 65534: one's private key is not the other's."""
    def snoop(ctl):
        c = Conn.to(bus.address)
        ok = all(c.sub_ok(p) for p in ("", "*/cred/*/*/*/", "!*/"))
        ctl.send({"kept": ok})
        ctl.wait()
        return _s(c.collect())

    def target(ctl):
        c = Conn.to(bus.address)
        ctl.send({"kept": c.sub_ok("!/cred////mail")})
        ctl.wait()
        return _s(c.collect())

    a, b = spawn(snoop), spawn(target)
    assert a.recv() == {"kept": True} and b.recv() == {"kept": True}
    key = f"!/cred/{NOBODY}/{NOBODY}/{b.pid}/mail"
    pub = conns(bus.address)
    pub.pub(key, b"private")
    pub.pub("pub/sync", b"sync")
    assert pub.whoami()
    a.send({})
    b.send({})
    assert _pkts(a.result()) == [msg("pub/sync", b"sync")]
    assert _pkts(b.result()) == [msg(key, b"private")]


# -- control messages ------------------------------------------------------------------

@asroot
def test_control_messages_are_never_forwarded(bus, spawn, conns):
    rp = os.getpid()
    listener = conns(bus.address)           # root, subscribed to anything a CMSG could match
    for p in ("", "*/cred/*", "*/*", "*", "stats", "echo/*", "*/*/*"):
        assert listener.sub_ok(p)

    def child(ctl):
        c = Conn.to(bus.address)
        assert c.sub_ok("") and c.sub_ok("*/cred/*")
        ctl.send({"ready": True})
        ctl.wait()                          # root has asked whoami by now
        seen = c.collect()
        for pkt in (b"CMSG !/cred/whoami\0!/cred/0/0/1",     # a forged payload
                    b"CMSG foo/bar\0CMSG !/cred/whoami\0!/cred/0/0/1",
                    b"CMSG stats", b"CMSG echo/on", b"CMSG blocking/soft/queue",
                    b"CMSG order/queue", b"CMSG x",
                    b"MSG x\0CMSG !/cred/whoami\0!/cred/0/0/1",
                    b"MSG CMSG !/cred/whoami\0!/cred/0/0/1",
                    WHOAMI):
            c.packet(pkt)
        replies = []
        while sum(p.startswith(WHOAMI_REPLY) for p in replies) < 2:    # ours: the last one
            pkt = c.next_packet(TIMEOUT)
            if not pkt:
                break
            replies.append(pkt)
        return {"seen": _s(seen), "replies": _s(replies)}

    ch = spawn(child)
    assert ch.recv() == {"ready": True}
    assert listener.whoami() == f"!/cred/0/0/{rp}"
    ch.send({"go": True})
    rep = ch.result()
    assert rep["seen"] == [], "root's whoami reply went to someone else"
    who = WHOAMI_REPLY + f"!/cred/{NOBODY}/{NOBODY}/{ch.pid}".encode()
    replies = _pkts(rep["replies"])
    # Its own whoami replies (a forged payload is ignored), the stats reply,
    # and the two MSGs it is subscribed to; nothing else.
    assert len(replies) == 5, replies
    assert replies[0] == who and replies[4] == who
    assert replies[1].startswith(b"CMSG stats\0")
    assert replies[2:4] == [b"MSG x\0CMSG !/cred/whoami\0!/cred/0/0/1",
                            b"MSG CMSG !/cred/whoami\0!/cred/0/0/1"]
    # Root saw the child's two MSGs (as MSGs), no CMSG, no whoami reply.
    seen = listener.collect()
    assert seen == [b"MSG x\0CMSG !/cred/whoami\0!/cred/0/0/1",
                    b"MSG CMSG !/cred/whoami\0!/cred/0/0/1"]


@asroot
def test_stats_reveal_no_keys_patterns_or_payloads(bus, spawn, conns):
    """``CMSG stats`` answers anyone; it shows who is connected and their
    counters (see docs/security.md) but no key, pattern or payload."""
    rp = os.getpid()
    owner = conns(bus.address)
    assert owner.sub_ok("!/cred////marker-pattern")
    pub = conns(bus.address)
    pub.pub(f"!/cred/0/0/{rp}/marker-pattern", b"marker-payload")
    pub.pub("marker-public/x", b"marker-payload")
    assert pub.whoami()
    assert owner.collect() == [msg(f"!/cred/0/0/{rp}/marker-pattern", b"marker-payload")]

    def child(ctl):
        c = Conn.to(bus.address)
        c.packet(b"CMSG stats")
        return c.next_packet(TIMEOUT).decode("latin-1")

    body = spawn(child).result()
    assert body.startswith("CMSG stats\0")
    json.loads(body[len("CMSG stats\0"):])
    assert "marker" not in body


@asroot
def test_publishing_to_the_whoami_key_is_refused(bus, spawn):
    def child(ctl):
        c = Conn.to(bus.address)
        c.pub("!/cred/whoami", "!/cred/0/0/1")
        return c.whoami()

    since = log_mark(bus)
    ch = spawn(child)
    assert ch.result() is None
    r = bus.wait_for_event("client_disconnect", TIMEOUT, since=since,
                           predicate=lambda r: r.get("pid") == ch.pid)
    assert r["reason"] == "bang_misuse", r


# -- the reserved '!' ---------------------------------------------------------------

MISUSE = ["a/!/b", "!", "!/x", "x/!", "/!", "!/", "a/!", "!/!", "a//!//b", "!/cred////a/!/b"]
FINE = ["a!b", "!x", "x!", "a/!x/b", "a/x!/b", "!!", "a/!!/b"]


@pytest.mark.parametrize("verb", ["SUB", "UNSUB", "MSG"])
@pytest.mark.parametrize("key", MISUSE)
def test_bang_misuse_disconnects(bus, conns, verb, key):
    since = log_mark(bus)
    c = conns(bus.address)
    c.packet(verb.encode() + b" " + key.encode() + (b"\0payload" if verb == "MSG" else b""))
    assert c.whoami() is None
    pid = os.getpid()
    # (A connection an earlier test closed may still be logging its "eof".)
    r = bus.wait_for_event("client_disconnect", TIMEOUT, since=since,
                 predicate=lambda r: r.get("pid") == pid and r.get("reason") != "eof")
    assert r["reason"] == "bang_misuse", r
    if verb == "SUB":
        s = bus.wait_for_event("subscribe", TIMEOUT, since=since,
                               predicate=lambda s: s.get("client") == r["client"])
        assert s["accepted"] is False and s["reason"] == "bang_misuse", s


@pytest.mark.parametrize("key", FINE)
def test_bang_next_to_other_bytes_is_ordinary(bus, conns, key):
    c = conns(bus.address)
    assert c.sub_ok(key)
    c.pub(key, b"ok")
    assert c.whoami() is not None
    assert c.collect() == [msg(key, b"ok")]
    c.unsub(key)
    assert c.whoami() is not None


# -- -r and the pidfile --------------------------------------------------------------

def _stale_socket(path: Path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(path))
    s.close()


def _run_sbusd(*args, timeout=15.0):
    """Run sbusd to completion (the launcher, in daemon mode). stderr goes to a
    file: a daemon that started would hold a pipe open."""
    with tempfile.TemporaryFile() as err:
        r = subprocess.run([SBUSD, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=err, timeout=timeout)
        err.seek(0)
        r.stderr = err.read()
    return r


def _snapshot(path: Path):
    st = os.lstat(path)
    content = None
    if stat.S_ISREG(st.st_mode):
        content = path.read_bytes()
    elif stat.S_ISLNK(st.st_mode):
        content = os.readlink(path)
    return (st.st_ino, stat.S_IFMT(st.st_mode), content)


def _make_victim(kind: str, d: Path) -> Path:
    path = d / "s"
    target = d / "target"
    if kind == "regular-file":
        path.write_bytes(b"precious\n")
    elif kind == "empty-file":
        path.write_bytes(b"")
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-to-stale-socket":
        _stale_socket(target)
        path.symlink_to(target)
    elif kind == "symlink-to-file":
        target.write_bytes(b"precious\n")
        path.symlink_to(target)
    elif kind == "dangling-symlink":
        path.symlink_to(target)
    return path


@pytest.mark.parametrize("kind", ["regular-file", "empty-file", "directory", "fifo",
                                  "symlink-to-stale-socket", "symlink-to-file",
                                  "dangling-symlink"])
def test_reuse_never_removes_what_is_not_a_socket(tmp_path, kind):
    path = _make_victim(kind, tmp_path)
    target = tmp_path / "target"
    before = _snapshot(path)
    target_before = _snapshot(target) if os.path.lexists(target) else None
    r = _run_sbusd("-f", "-r", "-a", str(path), "--log-level", "off")
    assert r.returncode != 0
    assert b"not a socket" in r.stderr
    assert _snapshot(path) == before
    if kind == "directory":
        assert (path / "inside").read_bytes() == b"x"
    assert (_snapshot(target) if os.path.lexists(target) else None) == target_before


def test_reuse_replaces_a_stale_socket(start_broker, tmp_path):
    path = tmp_path / "s"
    _stale_socket(path)
    r = _run_sbusd("-f", "-a", str(path), "--log-level", "off")
    assert r.returncode != 0 and stat.S_ISSOCK(os.lstat(path).st_mode)   # not without -r
    b = start_broker("-r", address=str(path))
    assert Conn.to(b.address).whoami() == f"!/cred/0/0/{os.getpid()}"


def _wait_gone(*paths, timeout=10.0):
    """Wait until a stopping daemon has removed its files."""
    wait_until(lambda: not any(os.path.lexists(p) for p in paths), timeout, fail=False)


@pytest.mark.parametrize("target_exists", [False, True], ids=["dangling", "existing"])
def test_pidfile_is_never_followed_through_a_symlink(tmp_path, target_exists):
    target_dir = Path(tempfile.mkdtemp(prefix="sbus-sec-target-", dir="/tmp"))
    try:
        target = target_dir / "target"
        if target_exists:
            target.write_bytes(b"keep me\n")
        link = tmp_path / "sbusd.pid"
        link.symlink_to(target)
        sock = tmp_path / "s"
        r = _run_sbusd("-a", str(sock), "-p", str(link), "--log-file", str(tmp_path / "log"))
        if r.returncode == 0:               # a daemon started after all: stop it
            try:
                os.kill(int(target.read_text()), signal.SIGTERM)
                _wait_gone(sock)
            except (OSError, ValueError):
                pass
        assert r.returncode != 0
        assert b"pidfile" in r.stderr
        assert os.readlink(link) == str(target)
        if target_exists:
            assert target.read_bytes() == b"keep me\n"
        else:
            assert not os.path.lexists(target)
        assert not os.path.lexists(sock), "the failed daemon leaves no socket behind"
    finally:
        shutil.rmtree(target_dir, ignore_errors=True)


def test_pidfile_written_by_the_daemon(tmp_path):
    """Control for the test above: the same command line with a plain path works."""
    pidfile, sock = tmp_path / "sbusd.pid", tmp_path / "s"
    r = _run_sbusd("-a", str(sock), "-p", str(pidfile), "--log-file", str(tmp_path / "log"))
    assert r.returncode == 0, r.stderr
    pid = int(pidfile.read_text())
    try:
        assert stat.S_IMODE(os.lstat(pidfile).st_mode) == 0o644
        assert Conn.to(str(sock)).whoami() == f"!/cred/0/0/{os.getpid()}"
    finally:
        os.kill(pid, signal.SIGTERM)
        _wait_gone(sock, pidfile)
    assert not os.path.lexists(pidfile)
