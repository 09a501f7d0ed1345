"""The services under the access policy (docs/policy.md, "Services"), across
a real uid boundary: the test runs as root and forks a child of uid 65534
(tests/support/seconduser.py).

``sbus store --policy`` answers a replay or a last-value request, and
``sbus queue --policy`` hands jobs, only to an asker the policy lets read
every key of the pattern, judged by the identity in its reply key; a reload
(SIGUSR1) ends what the new policy refuses. A leaf sbusd applies its own
policy to its own clients, whatever its upstream allows.
"""
from __future__ import annotations

import os
import shutil
import signal

import pytest

from sbus.access.askers import Askers, identities

from support import NOBODY, Conn, Sbusd, asroot, make_public_dir, wait_until
from support.queuesvc import QueueService
from support.store import StoreProcess

# The system bus of docs/policy.md, and what the services need: private keys
# (the broker's !/cred/ rule keeps each client to its own), and the requests.
POLICY = """\
default = "deny"

[[rule]]
uid = 0
allow = ["publish", "subscribe"]
pattern = ""

[[rule]]
allow = ["publish", "subscribe"]
pattern = "user/%uid/"

[[rule]]
allow = "subscribe"
pattern = "power/"

[[rule]]
allow = ["publish", "subscribe"]
pattern = "!/cred/"             # docs/policy.md: the one rule private replies need

[[rule]]
allow = "publish"
pattern = ["sbus/store/request", "sbus/queue/"]
"""
# The same, with no namespaces: what a reload takes away.
NO_NAMESPACES = POLICY.replace('pattern = "user/%uid/"', 'pattern = "nobody/"')
KEYS = ["power/off", "user/0/secret", "user/65534/mine", "auth/token"]


@pytest.fixture
def bus(tmp_path):
    d = make_public_dir()
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    b = Sbusd.foreground(tmp_path, "-o", "--policy", str(policy), "--stats-interval", "0",
                         address=d / "sbus.socket")
    b.policy = policy
    yield b
    StoreProcess.stop_all()
    b.stop()
    shutil.rmtree(d, ignore_errors=True)


def publish(address, keys):
    with Conn.to(address) as root:
        for key in keys:
            root.packet(b"MSG " + key.encode() + b"\0" + key.encode())
        root.sync()


def store(tmp_path, bus, *args):
    return StoreProcess(tmp_path, bus.address, tmp_path / "log", [""], "--stats-interval", "0",
                        "--policy", str(bus.policy), *args).ready()


def ask_store(address, asks):
    """In the child: each (op, pattern) asked of the store; the keys answered,
    or the error."""
    from sbus import Client
    from sbus.client.store import Replay, StoreError
    out = []
    with Client(address) as c:
        for op, pattern in asks:
            try:
                with Replay(c, op, pattern) as it:
                    out.append(sorted(m.key.decode() for m in it))
            except StoreError as e:
                out.append(f"refused: {e}")
    return out


def test_identities_are_every_credentials_form_of_the_reply_key():
    assert identities(b"!/cred/100/1000/42/store/ab/answer") == [(1000, 100)]
    assert identities(b"!/cred/0/0/7/!/cred/100/1000/42/queue/x/") == [(0, 0), (1000, 100)]
    for nobody in (b"user/1/x", b"!/cred////x", b"!/cred/a/1/2/x", b"!/cred/1/99999999999/2/x"):
        assert identities(nobody) == [], nobody


def test_every_identity_must_read_the_whole_pattern(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(POLICY)
    askers = Askers(str(path))
    mine = b"!/cred/65534/65534/9/store/ab/answer"
    assert askers.refusal(mine, b"user/65534/") is None
    assert askers.refusal(mine, b"power/*") is None
    refusal = askers.refusal(mine, b"")
    assert refusal.uid == NOBODY and refusal.rule == 0 and "the default is deny" in refusal.why
    assert askers.refusal(mine, b"user/0/").uid == NOBODY
    # Behind a leaf run by root: the client below must be allowed too.
    nested = b"!/cred/0/0/7/!/cred/65534/65534/9/store/ab/answer"
    assert askers.refusal(nested, b"user/0/").uid == NOBODY
    assert askers.refusal(b"!/cred/0/0/7/store/ab/answer", b"user/0/") is None
    assert askers.refusal(b"!/cred////store", b"power/").uid is None


@asroot
def test_store_replays_and_answers_last_only_what_the_asker_may_read(tmp_path, bus, spawn):
    """uid 65534 gets the records of patterns it may hold, and a refusal naming
    the policy for any pattern with a key it may not read; root gets all."""
    s = store(tmp_path, bus)
    publish(bus.address, KEYS)
    asks = [("replay", "user/65534/"), ("replay", "power/"), ("replay", ""),
            ("replay", "user/"), ("replay", "user/0/"), ("replay", "*/"),
            ("last", "user/65534/"), ("last", ""), ("last", "auth/")]
    got = spawn(lambda ctl: ask_store(bus.address, asks)).result()
    assert got[0] == ["user/65534/mine"] and got[1] == ["power/off"]
    assert got[6] == ["user/65534/mine"]
    for i in (2, 3, 4, 5, 7, 8):
        assert got[i].startswith("refused: ") and "policy: uid 65534" in got[i], (asks[i], got[i])
    assert ask_store(bus.address, [("replay", ""), ("last", "")]) == [sorted(KEYS)] * 2
    refused = [r for r in s.events("store_request_refused") if "policy" in r["error"]]
    assert len(refused) == 6
    assert {r["reply"].split("/")[3] for r in refused} == {str(NOBODY)}


@asroot
def test_store_reload_ends_a_follower_the_new_policy_refuses(tmp_path, bus, spawn):
    """A follower of user/65534/ gets its records until SIGUSR1 loads a policy
    without namespaces; then an error answer ends it, and a new request is refused."""
    s = store(tmp_path, bus)

    def child(ctl):
        from sbus import Client
        from sbus.client.store import StoreError, replay
        got = []
        with Client(bus.address) as c:
            try:
                with replay(c, "user/65534/", follow=True) as it:
                    for m in it:
                        got.append(m.key.decode())
                        if len(got) == 1:
                            ctl.send("following")
            except StoreError as e:
                return {"got": got, "error": str(e),
                        "again": ask_store(bus.address, [("replay", "user/65534/")])}
        return {"got": got, "error": None}

    kid = spawn(child)
    publish(bus.address, ["user/65534/one"])
    assert kid.recv() == "following"
    bus.policy.write_text(NO_NAMESPACES)
    s.proc.send_signal(signal.SIGUSR1)
    loaded = s.wait_for_event("policy_loaded")
    assert loaded["reload"] is True and loaded["revoked"] == 1
    publish(bus.address, ["user/65534/two"])
    out = kid.result()
    assert out["got"] == ["user/65534/one"]
    assert "policy: uid 65534" in out["error"]
    assert out["again"][0].startswith("refused: ")
    # A file that does not load leaves the policy in force.
    bus.policy.write_text("default = maybe\n")
    s.proc.send_signal(signal.SIGUSR1)
    assert "policy.toml:1" in s.wait_for_event("policy_refused")["reason"]


def test_a_bad_policy_stops_the_services_and_sigusr1_without_one_is_harmless(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('default = "deny"\n[[rule]]\nallow = "publsh"\npattern = ""\n')
    b = Sbusd.foreground(tmp_path, address=tmp_path / "sbus.socket")
    try:
        s = StoreProcess(tmp_path, b.address, tmp_path / "log", [""], "--policy", str(bad))
        assert s.proc.wait(20) == 1
        assert "bad.toml:3: rule 1: 'publsh' is no verb" in s.stderr_text()
        q = QueueService(tmp_path, b.address, "jobs/", "--policy", str(bad))
        assert q.proc.wait(20) == 1
        assert "sbus queue: " in q.stderr_text() and "bad.toml:3:" in q.stderr_text()
        # Without --policy, a reload (systemctl reload) is refused and logged.
        s = StoreProcess(tmp_path, b.address, tmp_path / "log", [""]).ready()
        q = QueueService.start(tmp_path, b.address, "jobs/")
        for service in (s, q):
            service.proc.send_signal(signal.SIGUSR1)
            assert "without --policy" in service.wait_for_event("policy_refused")["reason"]
            assert service.proc.poll() is None
            assert service.stop() == 0
    finally:
        b.stop()


def consume_one(address, pattern):
    """In the child: the first job of the queue on pattern, or the refusal."""
    from sbus import Client
    from sbus.errors import ServiceRefusedError
    with Client(address) as c:
        try:
            for job in c.consume(pattern):
                job.ack()
                return f"job {job.key.decode()}"
        except ServiceRefusedError as e:
            return f"refused: {e}"


@asroot
def test_queue_hands_jobs_only_to_consumers_that_may_read_them(tmp_path, bus, spawn):
    """uid 65534 is refused the jobs of user/0/ (told why, none delivered to
    it) and served those of user/65534/; root then gets the job it was refused."""
    theirs = QueueService.start(tmp_path, bus.address, "user/0/", "--policy", str(bus.policy))
    mine = QueueService.start(tmp_path, bus.address, "user/65534/",
                              "--policy", str(bus.policy))
    publish(bus.address, ["user/0/secret", "user/65534/mine"])
    assert spawn(lambda ctl: consume_one(bus.address, "user/65534/")).result() == \
        "job user/65534/mine"
    refused = spawn(lambda ctl: consume_one(bus.address, "user/0/")).result()
    assert refused.startswith("refused: ") and "policy: uid 65534" in refused, refused
    state = theirs.state()
    assert state["delivered"] == 0 and state["held"] == 1 and state["policy_refused"] >= 1
    [record] = theirs.events("queue_consumer_refused")
    assert (record["uid"], record["rule"]) == (NOBODY, 0)
    assert consume_one(bus.address, "user/0/") == "job user/0/secret"
    assert mine.state()["acked"] == 1
    for q in (theirs, mine):
        q.stop()


@asroot
def test_queue_reload_revokes_a_consumer_and_its_jobs_go_back(tmp_path, bus, spawn):
    q = QueueService.start(tmp_path, bus.address, "user/65534/", "--policy", str(bus.policy))

    def child(ctl):
        from sbus import Client
        from sbus.errors import ServiceRefusedError
        got = []
        with Client(bus.address) as c:
            try:
                for job in c.consume("user/65534/", prefetch=1):
                    got.append(job.key.decode())    # held, never acked
                    ctl.send("holding")
            except ServiceRefusedError as e:
                return {"got": got, "error": str(e)}
        return {"got": got, "error": None}

    kid = spawn(child)
    publish(bus.address, ["user/65534/held"])
    assert kid.recv() == "holding"
    bus.policy.write_text(NO_NAMESPACES)
    q.proc.send_signal(signal.SIGUSR1)
    assert q.wait_for_event("policy_loaded")["revoked"] == 1
    out = kid.result()
    assert out["got"] == ["user/65534/held"] and "policy: uid 65534" in out["error"]
    leave = q.wait_for_event("queue_consumer_leave")
    assert (leave["reason"], leave["requeued"]) == ("policy", 1)
    assert consume_one(bus.address, "user/65534/") == "job user/65534/held"
    q.stop()


@asroot
def test_a_leaf_applies_its_own_policy_to_its_clients(tmp_path, spawn):
    """An upstream without a policy, a leaf with the system-bus policy: uid
    65534 on the leaf is refused '' and user/, reads only its namespace and
    power/ of what comes down, and what the leaf denies it never goes up."""
    from sbus import Client
    d = make_public_dir()
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    up = Sbusd.foreground(tmp_path, "-o", "--stats-interval", "0", address=d / "up.socket")
    leaf = Sbusd.foreground(tmp_path, "-o", "--upstream", str(d / "up.socket"), "--policy",
                            str(policy), "--stats-interval", "0", address=d / "leaf.socket")
    try:
        leaf.wait_for_event("upstream_connected", timeout=10)
        watcher = Client(up.address)
        watcher.subscribe("")
        watcher.whoami()

        def child(ctl):
            out = {}
            for p in ("", "*/", "user/", "power", "user/0/", "!/cred/0/0/1/"):
                with Conn.to(leaf.address) as c:
                    out[p] = c.sub_ok(p)
            with Client(leaf.address) as c:
                c.subscribe("user/65534/")
                c.subscribe("power/")
                c.whoami()
                for key in ("power/off", "user/0/forged", "user/65534/up"):
                    c.publish(key, b"from nobody")
                ctl.send("subscribed")
                got = []
                while True:
                    m = c.receive(timeout=10)
                    if m.key == b"user/65534/end":
                        break
                    got.append(m.key.decode())
            out["got"] = sorted(got)
            return out

        kid = spawn(child)
        assert kid.recv() == "subscribed"
        # Up and down through the link: what the child published went up in
        # order, so once its last key is here, anything forged before it would be.
        went_up = []
        while "user/65534/up" not in went_up:
            went_up.append(watcher.receive(timeout=10).key.decode())
        assert went_up == ["user/65534/up"], went_up
        # The link's subscriptions upstream follow the leaf's SUBs a moment later.
        wait_until(lambda: max(e["subscriptions"] for e in up.stats()["clients"]
                               if e["pid"] not in (os.getpid(), kid.pid)) >= 3,
                   timeout=10, what="the link's subscriptions upstream")
        publish(up.address, KEYS + ["user/65534/end"])
        out = kid.result()
        assert not any(out[p] for p in ("", "*/", "user/", "power", "user/0/", "!/cred/0/0/1/")), out
        assert out["got"] == ["power/off", "user/65534/mine", "user/65534/up"], out  # echo: its own
        denied = leaf.events("publish_denied")
        assert sorted(r["key"] for r in denied) == ["power/off", "user/0/forged"]
        watcher.close()
    finally:
        leaf.stop()
        up.stop()
        shutil.rmtree(d, ignore_errors=True)
