"""The access policy enforced by sbusd (``--policy``, docs/policy.md), across
a real uid boundary: the test process runs as root, the second user is a
forked child of uid 65534 (tests/support/seconduser.py).

Covered: the system-bus example for uid 65534 under every pattern form it may
send; a denied publish reaching no one, counted and logged; a refused
subscription; %u and %uid namespaces; default deny and allow; the disconnect
action; a reload with a good file (what it takes from clients already
subscribed), a bad file, under load; the policy through a live upgrade; a
bad file at start; no --policy, no change. And the C table the broker walks,
held to the Python decisions it is compiled from.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sbus._core.acl import Table, memo_hits
from sbus.access import parse
from sbus.access.compiled import canonical_key

from support import NOBODY, SBUSD, Conn, Sbusd, Started, asroot, wait_until

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "system-bus-policy.toml"
TIMEOUT = 10.0

# docs/policy.md's table for uid 65534 under the example.
MAY_SUBSCRIBE = ["user/65534/", "user/65534/*/x", "power/", "power/*", "a*b"]
MAY_NOT_SUBSCRIBE = ["", "*/", "*", "user/", "user/*/", "power", "user/65534", "*/65534/",
                     "user/6553*/", "!/cred/65534/65534//"]
MAY_PUBLISH = ["user/65534/anything", "user/65534/a/b"]
MAY_NOT_PUBLISH = ["power/off", "user/1000/x", "user/65534", "x", "", "user/0/x",
                   "!/cred/0/0/1/x"]


def msg(key, payload=b"") -> bytes:
    key = key.encode() if isinstance(key, str) else key
    return b"MSG " + key + b"\0" + payload


@pytest.fixture
def policy_bus(tmp_path):
    """Factory: ``policy_bus(text_or_path, *args)`` is sbusd -f -o --policy
    FILE (a copy of the text or the file, so a test may rewrite it) on a
    socket the second user reaches, with a pidfile; the copy is ``bus.policy``."""
    started = Started()

    def start(policy=None, *args):
        d = started.public_dir()
        extra = []
        path = None
        if policy is not None:
            path = tmp_path / f"policy{len(started)}.toml"
            path.write_text(policy.read_text() if isinstance(policy, Path) else policy)
            extra = ["--policy", str(path)]
        pidfile = tmp_path / f"sbusd{len(started)}.pid"
        b = Sbusd.foreground(tmp_path, "-o", "-p", str(pidfile), "--stats-interval", "0",
                             *extra, *args, address=d / "sbus.socket")
        b.policy = path
        b.pidfile = pidfile
        return started.add(b)

    yield start
    started.end()


def try_subscribe(address, patterns):
    """In the child: each pattern on a fresh connection; {pattern: kept}."""
    out = {}
    for p in patterns:
        with Conn.to(address) as c:
            out[p] = c.sub_ok(p)
    return out


# ---- the C table is the compiled decisions ------------------------------------

def test_c_table_decides_as_the_compiled_policy():
    """Every publish decision the broker's table makes is the one
    Access.may_publish makes, over keys made of the rules' own segments."""
    policy = parse(EXAMPLE.read_text() + """
[[rule]]
uid = 65534
deny = "publish"
pattern = ["user/65534/secret/", "log-*", "*/x"]
on_deny = "disconnect"

[[rule]]
gid = 100
allow = "publish"
pattern = ["log-a", "a/*/c"]
""", "p.toml")
    rng = random.Random(36)
    segs = ["user", "65534", "0", "secret", "log-a", "log-", "power", "x", "a", "c", "", "*"]
    keys = ["/".join(rng.choice(segs) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    keys += ["user/65534/", "user/65534", "", "power/off", "!/cred/0/0/1/x"]
    for uid, gid, groups in ((0, 0, ()), (NOBODY, NOBODY, ()), (NOBODY, NOBODY, (100,)),
                             (1000, 100, ())):
        access = policy.compile_for(uid, gid, groups)
        table = Table(access)
        assert table.nbytes <= 1024
        for key in keys:
            want = access.may_publish(key.encode())
            allowed, disconnect, rule = table.decide(canonical_key(key.encode()))
            assert allowed == want.allowed, (uid, key)
            assert rule == (want.rule.number if want.rule else 0), (uid, key)
            assert disconnect == (want.action == "disconnect"), (uid, key)


def test_c_trie_decides_as_the_compiled_policy():
    """A table longer than a few entries is decided through its segment trie:
    the first matching entry still decides, over random rules and keys
    (segments literal, '*', 'x*', trailing '/', the empty pattern)."""
    rng = random.Random(3636)
    segs = ["a", "b", "ab", "*", "a*", "%uid", ""]
    rules = ['default = "deny"']
    for _rule in range(80):
        pattern = "/".join(rng.choice(segs) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.3:
            pattern += "/"
        verb = rng.choice(["allow", "deny"])
        rules += ["[[rule]]", f'{verb} = "publish"', f'pattern = "{pattern}"']
        if verb == "deny" and rng.random() < 0.5:
            rules.append('on_deny = "disconnect"')
    policy = parse("\n".join(rules) + "\n", "random.toml")
    keysegs = ["a", "b", "ab", "abc", "", "7", "x"]
    keys = ["/".join(rng.choice(keysegs) for _ in range(rng.randint(1, 4))) for _ in range(4000)]
    for uid in (0, 7):
        access = policy.compile_for(uid, uid)
        table = Table(access)
        assert len(access.table) > 8       # the trie, not the linear walk
        # Keys repeat and share the table's few remembered decisions: hits,
        # misses and evictions must all decide as the walk does.
        for key in keys + keys[::-1]:
            want = access.may_publish(key.encode())
            allowed, disconnect, rule = table.decide(key.encode())
            assert (allowed, rule) == (want.allowed, want.rule.number if want.rule else 0), \
                (uid, key)
            assert disconnect == (want.action == "disconnect"), (uid, key)


def test_a_remembered_decision_is_taken_only_for_the_same_key():
    """A connection remembers its last publish decision and compares the
    next key word by word (acl.pxd same_short): a key differing in any one
    byte, or in length, must not take it, whatever the length; a key too
    long to remember, or nothing remembered, never does."""
    rng = random.Random(3637)
    assert not memo_hits(None, b"") and not memo_hits(None, b"a")
    for n in range(41):
        key = bytes(rng.randrange(1, 256) for _ in range(n))
        assert memo_hits(key, bytes(key)) == (n <= 32), n
        assert not memo_hits(key, key + b"x") and not memo_hits(key + b"x", key), n
        for i in range(n):
            for flip in (1, 0x80):
                other = key[:i] + bytes([key[i] ^ flip]) + key[i + 1:]
                assert not memo_hits(key, other), (n, i, flip)


# ---- the system-bus example ------------------------------------------------------

@asroot
def test_system_bus_subscriptions_for_nobody(policy_bus, spawn):
    """Every pattern docs/policy.md lists for uid 65534: the allowed ones are
    kept, the others refused (the connection closed, the refusal logged)."""
    bus = policy_bus(EXAMPLE)
    got = spawn(lambda ctl: try_subscribe(bus.address, MAY_SUBSCRIBE + MAY_NOT_SUBSCRIBE)
                ).result()
    assert {p for p, kept in got.items() if kept} == set(MAY_SUBSCRIBE), got
    refused = bus.events("subscribe")
    refused = [r for r in refused if r["accepted"] is False]
    assert {r["reason"] for r in refused} == {"policy_denied"}
    assert len(refused) == len(MAY_NOT_SUBSCRIBE)
    gone = [r for r in bus.events("client_disconnect") if r["reason"] == "policy_refused"]
    assert len(gone) == len(MAY_NOT_SUBSCRIBE)
    assert any("the default is deny" in r["detail"] for r in gone), gone
    with bus.connect() as root:
        totals = root.stats()["totals"]
    assert totals["policy_subs_refused"] == len(MAY_NOT_SUBSCRIBE)


@asroot
def test_system_bus_publishes_of_nobody_reach_only_where_allowed(policy_bus, spawn):
    """A denied publish is delivered to no one (root holds the empty
    pattern), is counted for the connection and in total, and logged with
    the uid, the key and the rule; the publisher stays connected (drop)."""
    bus = policy_bus(EXAMPLE)
    with bus.connect() as root:
        assert root.sub_ok("")

        def child(ctl):
            with Conn.to(bus.address) as c:
                for key in MAY_NOT_PUBLISH + MAY_PUBLISH:
                    c.packet(msg(key, b"from nobody"))
                c.sync()
                mine = [e for e in c.stats()["clients"] if e["pid"] == os.getpid()]
                return mine[0]["denied"]

        denied = spawn(child).result()
        got = root.collect()
        assert sorted(p.split(b"\0")[0] for p in got) == sorted(msg(k) [:-1] for k in MAY_PUBLISH)
        assert denied == len(MAY_NOT_PUBLISH)
        totals = root.stats()["totals"]
    assert totals["denied"] == len(MAY_NOT_PUBLISH)
    records = bus.events("publish_denied")
    assert sorted(r["key"] for r in records) == sorted(MAY_NOT_PUBLISH)
    assert {(r["uid"], r["rule"], r["action"]) for r in records} == {(NOBODY, 0, "drop")}
    assert not [r for r in bus.events("client_disconnect") if r["uid"] == NOBODY
                and r["reason"] != "eof"]


@asroot
def test_denials_are_logged_at_most_ten_a_second(policy_bus, spawn):
    """A flood of denied publishes is counted in full; the log takes at most
    PUBLISH_DENIED_PER_S records a second, and a record after a quiet second
    says how many were left out."""
    bus = policy_bus(EXAMPLE)

    def child(ctl):
        with Conn.to(bus.address) as c:
            for i in range(200):
                c.packet(msg(f"power/{i}"))
            c.sync()
            time.sleep(1.1)
            c.packet(msg("power/later"))
            c.sync()
        return True

    started = time.monotonic()
    assert spawn(child).result() is True
    with bus.connect() as root:
        assert root.stats()["totals"]["denied"] == 201
    records = bus.events("publish_denied")
    assert len(records) <= 10 * (1 + int(time.monotonic() - started)), len(records)
    assert records[-1]["key"] == "power/later"
    # Every denial is a record or counted in a later one's suppressed.
    assert len(records) + sum(r["suppressed"] for r in records) == 201


@asroot
def test_nobody_reads_only_what_it_may_under_every_pattern_it_may_hold(policy_bus, spawn):
    """The wildcard leaks: uid 65534 holds every pattern it may, root
    publishes everywhere; only its own namespace and power/ arrive."""
    bus = policy_bus(EXAMPLE)
    keys = ["power/off", "power", "user/0/secret", "user/65534/mine", "user/65534",
            "x", "auth/token", "user/65534x/a", "!/cred/65534/65534/0/x", "a*b"]

    def child(ctl):
        c = Conn.to(bus.address)
        for p in MAY_SUBSCRIBE:
            assert c.sub_ok(p), p
        ctl.send("subscribed")
        ctl.wait()
        return [p.decode("latin-1") for p in c.collect()]

    kid = spawn(child)
    assert kid.recv() == "subscribed"
    with bus.connect() as root:
        for key in keys:
            root.packet(msg(key))
        root.sync()
        kid.send("go")
        got = kid.result()
    assert sorted(p.split("\0")[0] for p in got) == sorted(
        ["MSG power/off", "MSG user/65534/mine"])


@asroot
def test_uid_and_user_name_namespaces(policy_bus, spawn):
    """%u and %uid: one rule each gives every user a namespace of their own."""
    bus = policy_bus("""
default = "deny"
[[rule]]
allow = ["publish", "subscribe"]
pattern = ["home/%u/", "id/%uid/"]
""")
    with bus.connect() as root:
        assert root.whoami()

        def child(ctl):
            kept = try_subscribe(bus.address, ["home/nobody/", "id/65534/", "home/root/",
                                               "id/0/", "home/"])
            with Conn.to(bus.address) as c:
                assert c.sub_ok("home/nobody/")
                for key in ("home/nobody/a", "id/65534/b", "home/root/c", "id/0/d"):
                    c.packet(msg(key))
                return kept, [p.decode() for p in c.collect()]

        kept, got = spawn(child).result()
    assert kept == {"home/nobody/": True, "id/65534/": True, "home/root/": False,
                    "id/0/": False, "home/": False}
    assert got == ["MSG home/nobody/a\0"]
    assert sorted(r["key"] for r in bus.events("publish_denied")) == ["home/root/c", "id/0/d"]


@asroot
def test_default_allow_with_a_disconnecting_deny(policy_bus, spawn):
    """default allow: what no rule names is allowed (as without a policy);
    a deny rule with on_deny = "disconnect" closes the publisher, with the
    rule in the reason, and its message reaches no one."""
    bus = policy_bus("""
default = "allow"
[[rule]]
uid = 65534
deny = ["publish", "subscribe"]
pattern = "billing/"
on_deny = "disconnect"
""")
    with bus.connect() as root:
        assert root.sub_ok("")

        def child(ctl):
            c = Conn.to(bus.address)
            assert c.sub_ok("other/")
            c.packet(msg("other/ok"))
            c.whoami()      # its echo is in c.got: a close takes the batch it is read in
            c.packet(msg("billing/forged"))
            c.packet(msg("other/after"))
            return [p.decode() for p in c.got + c.until_closed()]

        assert spawn(child).result() == [msg("other/ok").decode()]
        got = root.collect()
    assert [p.split(b"\0")[0] for p in got] == [b"MSG other/ok"]
    disc = bus.wait_for_event("client_disconnect", TIMEOUT,
                              predicate=lambda r: r["reason"] == "policy_denied")
    assert disc["uid"] == NOBODY and "rule 1" in disc["detail"], disc
    assert disc["counters"]["denied"] == 1


@asroot
def test_without_policy_nothing_changes(policy_bus, spawn):
    """No --policy: uid 65534 may subscribe to everything public and publish
    power/off, and the counters stay at zero."""
    bus = policy_bus(None)
    with bus.connect() as root:
        assert root.sub_ok("")

        def child(ctl):
            kept = try_subscribe(bus.address, ["", "*/", "power/"])
            with Conn.to(bus.address) as c:
                c.packet(msg("power/off"))
                c.sync()
            return kept

        assert spawn(child).result() == {"": True, "*/": True, "power/": True}
        assert [p.split(b"\0")[0] for p in root.collect()] == [b"MSG power/off"]
        totals = root.stats()["totals"]
    assert totals["denied"] == 0 and totals["policy_subs_refused"] == 0
    assert not bus.events("publish_denied")


def test_a_bad_file_stops_sbusd_at_start(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('default = "deny"\n\n[[rule]]\nallow = "publsh"\npattern = "a/"\n')
    proc = subprocess.run([SBUSD, "-f", "-a", str(tmp_path / "s"), "--policy", str(bad)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert f"{bad}:4: " in proc.stderr and "publsh" in proc.stderr, proc.stderr
    assert not (tmp_path / "s").exists()


# ---- reloading -----------------------------------------------------------------------

def reload(bus) -> subprocess.CompletedProcess:
    return subprocess.run([SBUSD, "--reload", "-p", str(bus.pidfile)], capture_output=True,
                          text=True, timeout=60)


@asroot
def test_reload_applies_at_once_to_clients_already_subscribed(policy_bus, spawn):
    """From default allow to the system-bus example: a client holding a
    pattern the new policy refuses is closed (policy_revoked), one whose
    patterns are all allowed stays, and publish decisions change with the
    next message."""
    bus = policy_bus('default = "allow"\n')

    def child(ctl):
        wide = Conn.to(bus.address)
        narrow = Conn.to(bus.address)
        assert wide.sub_ok("") and narrow.sub_ok("user/65534/")
        ctl.send("subscribed")
        ctl.wait()
        narrow.packet(msg("power/off"))
        narrow.packet(msg("user/65534/still"))
        return {"wide": [p.decode() for p in wide.until_closed()],
                "narrow": narrow.whoami() is not None}

    kid = spawn(child)
    assert kid.recv() == "subscribed"
    with bus.connect() as root:
        assert root.sub_ok("")
        bus.policy.write_text(EXAMPLE.read_text())
        proc = reload(bus)
        assert proc.returncode == 0, proc.stderr
        assert "enforces" in proc.stdout and "1 connections revoked" in proc.stdout
        kid.send("go")
        got = kid.result()
        assert got == {"wide": [], "narrow": True}
        assert [p.split(b"\0")[0] for p in root.collect()] == [b"MSG user/65534/still"]
    (revoked,) = [r for r in bus.events("client_disconnect") if r["reason"] == "policy_revoked"]
    assert revoked["uid"] == NOBODY and "''" in revoked["detail"]
    loaded = bus.events("policy_loaded")
    assert [r["reload"] for r in loaded] == [False, True] and loaded[1]["revoked"] == 1


# Two keys of each length the per-connection memo compares differently
# (bytes, 4-byte words, two to four 8-byte words): policy(0) denies uid
# 65534 the first of each pair, policy(1) the second.
SAME_LENGTH = [("k/a", "k/b"), ("svc/on", "svc/no"), ("user/65534/n/first", "user/65534/n/other"),
               ("power/room-7/lights/dim-to-11", "power/room-7/lights/dim-to-12")]


def policy(which):
    return 'default = "allow"\n' + "".join(
        f'\n[[rule]]\nuid = 65534\ndeny = "publish"\npattern = "{pair[which]}"\n'
        for pair in SAME_LENGTH)


@asroot
def test_reload_flips_the_decision_for_the_key_a_connection_repeats(policy_bus, spawn):
    """Each publish of a connection is decided from the table it holds now:
    a key published before a reload that flips its decision is decided
    afresh after it, both ways, and one uid's decision never reaches
    another connection publishing the same key (root, allowed throughout),
    nor a key of the same length from the same connection."""
    bus = policy_bus(policy(0))
    keys = [k for pair in SAME_LENGTH for k in pair]
    # Each phase starts with the key the last one ended with: what the
    # connection remembers from before the reload is that key's old decision.
    sent = keys[::-1] + keys + [k for k in keys for _ in range(3)]

    def child(ctl):
        with Conn.to(bus.address) as c:
            while (phase := ctl.wait(60)) is not None:
                for key in sent:
                    c.packet(msg(key, f"nobody {phase}".encode()))
                c.sync()
                ctl.send("published")
            mine = [e for e in c.stats()["clients"] if e["pid"] == os.getpid()]
            return mine[0]["denied"]

    kid = spawn(child)
    with bus.connect() as root, bus.connect() as observer:
        assert observer.sub_ok("")
        for phase, which in enumerate([0, 1, 0]):
            if phase:
                bus.policy.write_text(policy(which))
                proc = reload(bus)
                assert proc.returncode == 0, proc.stderr
            kid.send(phase)
            assert kid.recv() == "published"
            for key in keys:
                root.packet(msg(key, f"root {phase}".encode()))
            root.sync()
            got = [p[4:].split(b"\0") for p in observer.collect()]
            allowed = {pair[1 - which] for pair in SAME_LENGTH}
            assert sorted(k.decode() for k, payload in got if payload == f"nobody {phase}".encode()) == \
                sorted(k for k in sent if k in allowed)
            assert sorted(k.decode() for k, payload in got if payload == f"root {phase}".encode()) == \
                sorted(keys)
            assert len(got) == 5 * len(SAME_LENGTH) + len(keys)
        kid.send(None)
        assert kid.result() == 3 * 5 * len(SAME_LENGTH)


@asroot
def test_a_bad_file_at_reload_keeps_the_policy_in_force(policy_bus, spawn):
    bus = policy_bus(EXAMPLE)
    bus.policy.write_text('default = "allow"\nsurprise = 1\n')
    proc = reload(bus)
    assert proc.returncode == 1
    assert "keeps its policy" in proc.stderr and f"{bus.policy}:2: " in proc.stderr, proc.stderr
    (refused,) = bus.events("policy_refused")
    assert refused["path"] == str(bus.policy) and "surprise" in refused["reason"]
    # SIGUSR1 alone does the same, and stops nothing.
    os.kill(bus.pid, signal.SIGUSR1)
    wait_until(lambda: len(bus.events("policy_refused")) == 2, TIMEOUT)
    assert spawn(lambda ctl: try_subscribe(bus.address, ["", "power/"])).result() == {
        "": False, "power/": True}
    assert bus.proc.poll() is None


@asroot
def test_reload_under_load_loses_and_misdelivers_nothing(policy_bus, spawn):
    """A publisher streams user/65534/<n> to a reader of user/65534/ while
    the policy is reloaded again and again (it allows both throughout): every
    message arrives, in order, once, and nothing else does."""
    text = EXAMPLE.read_text()
    bus = policy_bus(EXAMPLE)
    count = 3000

    def reader(ctl):
        c = Conn.to(bus.address)
        assert c.sub_ok("user/65534/")
        ctl.send("ready")
        got = []
        while len(got) < count:
            p = c.next_packet(TIMEOUT)
            assert p, f"EOF or silence after {len(got)}"
            got.append(p)
        return [p.split(b"\0")[0].decode() for p in got]

    def writer(ctl):
        with Conn.to(bus.address) as c:
            for i in range(count):
                c.packet(msg(f"user/65534/{i}"))
                c.packet(msg(f"power/{i}"))
            c.sync()
        return True

    r = spawn(reader)
    assert r.recv() == "ready"
    stop = threading.Event()

    def reloader():
        n = 0
        while not stop.is_set():
            bus.policy.write_text(text + f"\n# reload {n}\n")
            os.kill(bus.pid, signal.SIGUSR1)
            n += 1
            time.sleep(0.005)

    t = threading.Thread(target=reloader)
    t.start()
    try:
        assert spawn(writer).result() is True
        got = r.result(timeout=60)
    finally:
        stop.set()
        t.join()
    assert got == [f"MSG user/65534/{i}" for i in range(count)]
    assert len(bus.events("policy_loaded")) > 2
    assert bus.proc.poll() is None


# ---- the live upgrade --------------------------------------------------------------

def upgrade(bus) -> subprocess.CompletedProcess:
    return subprocess.run([SBUSD, "--upgrade", "-p", str(bus.pidfile)], capture_output=True,
                          text=True, timeout=120)


@asroot
def test_policy_survives_a_live_upgrade_and_a_bad_file_refuses_it(policy_bus, spawn):
    """The new process reads the file as it is now and compiles each restored
    connection's identity: a client kept across the upgrade is still denied
    power/; a file that does not load fails the upgrade with its reason, and
    the old process serves on with its policy. The policy's counters come
    across."""
    bus = policy_bus(EXAMPLE)

    def child(ctl):
        c = Conn.to(bus.address)
        assert c.sub_ok("user/65534/")
        c.packet(msg("power/early"))
        c.sync()
        ctl.send("ready")
        ctl.wait()
        c.packet(msg("power/off"))
        c.packet(msg("user/65534/after"))
        got = [p.decode() for p in c.collect()]
        mine = [e for e in c.stats()["clients"] if e["pid"] == os.getpid()]
        kept = try_subscribe(bus.address, ["", "power/"])
        return got, kept, mine[0]["denied"]

    kid = spawn(child)
    assert kid.recv() == "ready"
    bus.policy.write_text("default = deny\n")
    proc = upgrade(bus)
    assert proc.returncode == 1, proc.stdout
    assert "policy" in proc.stderr and f"{bus.policy}:1" in proc.stderr, proc.stderr
    assert int(bus.pidfile.read_text()) == bus.pid
    bus.policy.write_text(EXAMPLE.read_text())
    old = bus.pid
    proc = upgrade(bus)
    assert proc.returncode == 0, proc.stderr
    new = int(bus.pidfile.read_text())
    try:
        assert new != old
        wait_until(lambda: bus.events("upgrade_done"), TIMEOUT)
        with Conn.to(bus.address) as root:
            assert root.sub_ok("")
            kid.send("go")
            got, kept, denied = kid.result()
            assert [p.split(b"\0")[0] for p in root.collect()] == [b"MSG user/65534/after"]
            stats = root.stats()
            totals = stats["totals"]
        assert got == ["MSG user/65534/after\0"]
        # The counters came across: one denial before the upgrades, one after;
        # per uid too (kept's refused '' came after).
        assert denied == 2 and totals["denied"] == 2
        assert stats["policy_uids"] == [{"uid": NOBODY, "denied": 2, "subs_refused": 1}]
        assert kept == {"": False, "power/": True}
        loaded = bus.events("policy_loaded")
        assert [r["reload"] for r in loaded] == [False, False]
    finally:
        os.kill(new, signal.SIGTERM)
        wait_until(lambda: not Path(f"/proc/{new}").exists(), TIMEOUT)


def test_top_shows_the_policys_denials():
    """sbus top adds a policy line once the broker reports a denial."""
    from sbus.cli.top import View
    view = View("/run/sbus")
    quiet = {"totals": {"denied": 0, "policy_subs_refused": 0}, "clients": []}
    view.update(quiet, 0.0)
    assert not [t for t, _ in view.lines(200, 40) if t.startswith("policy:")]
    view.update({"totals": {"denied": 30, "policy_subs_refused": 2}, "clients": []}, 2.0)
    (line,) = [t for t, _ in view.lines(200, 40) if t.startswith("policy:")]
    assert line == "policy: denied 15/s  total 30  subscriptions refused 2"
