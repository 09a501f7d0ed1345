"""No local user can exhaust the broker for the others: the budgets.

One uid (a forked child as uid 65534, on a socket opened with -o) is driven
to each of its budgets with real clients: subscription bytes (per connection,
per uid, broker-wide), connections, queued bytes. Each test checks the
refusal, its log record and counters, the uid's usage in ``CMSG stats``, and
that a second uid (root, the test process) still connects, subscribes and
receives everything. The RSS test checks that the broker's memory stays
under the configured subscription total plus the overhead docs/security.md
states, and returns near its baseline once the user's clients leave.
"""
from __future__ import annotations

from sbus import logschema as ls
from sbus._core.budget import cost

from support import NOBODY, Conn, Sbusd, asroot, report_line, status_kib, wait_until

PATTERN = 4000                                  # bytes of each flood pattern
PATTERN_COST = cost(b"p" * PATTERN)             # what one is charged (no '/': one segment)
MIB = 1 << 20
# What the broker may use beyond the subscription bytes it charged: the log
# records' buffers, the receive pages SUB packets touched, malloc's free lists
# (docs/security.md, "What a local user can make the broker spend").
RSS_OVERHEAD_KIB = 8 * 1024


def flood_patterns(address, caps, tag=b"nobody"):
    """One connection per entry of ``caps``, each subscribing to distinct
    PATTERN-byte patterns, 32 at a time, until it holds its cap or the broker
    closes it. Returns how many each holds (full batches), and the
    connections (keep them to keep the patterns)."""
    held, counts = [], []
    for k, cap in enumerate(caps):
        c = Conn.to(address, timeout=30)
        n = 0
        while n < cap:
            # no '/': one segment, so each costs exactly PATTERN_COST
            batch = [b"SUB " + (b"%s-%d-%d-" % (tag, k, n + i)).ljust(PATTERN, b"p")
                     for i in range(32)]
            ok = all(c.packet(p) for p in batch)
            if not ok or c.whoami() is None:
                break
            n += 32
        counts.append(n)
        held.append(c)
    return counts, held


def user_entry(stats: dict, uid: int):
    return next((u for u in stats["users"] if u["uid"] == uid), None)


def root_still_serves(b: Sbusd, patterns=4) -> None:
    """A root client connects, subscribes, and receives every message."""
    sub, pub = b.connect(), b.connect()
    for i in range(patterns):
        assert sub.sub_ok(b"root/%d/" % i + b"r" * 2000)
    for i in range(patterns):
        pub.pub(b"root/%d/" % i + b"r" * 2000, b"m%d" % i)
    pub.sync()
    got = sub.collect()
    assert [p.rsplit(b"\0", 1)[1] for p in got] == [b"m%d" % i for i in range(patterns)]
    sub.close()
    pub.close()


@asroot
def test_subscription_budgets_per_connection_and_per_uid(open_broker, spawn):
    per_conn, per_user = 1 * MIB, 2 * MIB
    b = open_broker("--sub-max-bytes", str(per_conn), "--user-sub-max-bytes", str(per_user))
    fit_conn, fit_user = per_conn // PATTERN_COST, per_user // PATTERN_COST     # 127, 255

    def child(ctl):
        # One connection past its own budget; then three that together pass the uid's.
        counts, held = flood_patterns(b.address, [4096, 96, 96, 96])
        ctl.send({"counts": counts})
        ctl.wait()
        return counts

    kid = spawn(child)
    counts = kid.recv(timeout=60)["counts"]
    # A connection holds what fits and is closed by the SUB past it; the
    # closed one's patterns went with it, so the uid's budget is reached only
    # by the ones it holds together.
    assert counts == [fit_conn // 32 * 32, 96, 96, (fit_user - 192) // 32 * 32], counts
    refused = [r for r in b.records() if r.get("event") == ls.SUBSCRIBE and not r["accepted"]]
    assert [r["reason"] for r in refused] == [ls.REFUSE_SUB_BUDGET_CONNECTION,
                                              ls.REFUSE_SUB_BUDGET_USER]
    assert all(r["uid"] == NOBODY for r in refused)
    gone = b.events(ls.CLIENT_DISCONNECT)
    assert [r["reason"] for r in gone] == [ls.DISCONNECT_SUB_BUDGET] * 2
    assert f"over --sub-max-bytes {per_conn}" in gone[0]["detail"]
    assert f"over --user-sub-max-bytes {per_user}" in gone[1]["detail"]

    # The uid's usage against its budget; root is untouched, and exempt.
    root_still_serves(b)
    with b.connect() as s:
        stats = s.stats()
    assert stats["totals"]["budget_subs_refused"] == 2
    assert user_entry(stats, NOBODY) == {
        "uid": NOBODY, "connections": 2, "max_connections": 1024,
        "sub_bytes": 192 * PATTERN_COST, "max_sub_bytes": per_user, "queued_bytes": 0,
        "max_queued_bytes": 64 * MIB}
    assert user_entry(stats, 0)["max_sub_bytes"] is None     # sbusd's own uid
    kid.send({"done": True})
    kid.result()


@asroot
def test_uid_at_its_budget_leaves_the_total_to_others(open_broker, spawn):
    per_user, total = 2 * MIB, 3 * MIB
    b = open_broker("--user-sub-max-bytes", str(per_user), "--total-sub-max-bytes", str(total))

    def child(ctl):
        _, held = flood_patterns(b.address, [96, 96, 96])   # the third passes the uid's budget
        ctl.send({"held": True})
        ctl.wait()
        return True

    kid = spawn(child)
    kid.recv(timeout=60)
    with b.connect() as s:
        nobody = user_entry(s.stats(), NOBODY)
    assert nobody["connections"] == 2 and nobody["max_sub_bytes"] == per_user
    assert nobody["sub_bytes"] == 192 * PATTERN_COST
    # Root still subscribes (and receives) within what the total leaves ...
    root_still_serves(b, patterns=8)
    # ... and is itself refused only at the broker-wide total.
    root = b.connect()
    n = 0
    while root.sub_ok((b"root/%d/" % n).ljust(PATTERN, b"r")):
        n += 1
        assert n < 1000
    rec = b.wait_for_event(ls.SUBSCRIBE, predicate=lambda r: r["uid"] == 0 and not r["accepted"])
    assert rec["reason"] == ls.REFUSE_SUB_BUDGET_TOTAL
    assert n * PATTERN_COST + nobody["sub_bytes"] <= total
    kid.send({"done": True})
    kid.result()


@asroot
def test_connection_budget_per_uid(open_broker, spawn):
    b = open_broker("--user-max-connections", "3")

    def child(ctl):
        mine = [Conn.to(b.address) for _ in range(3)]
        whos = [c.whoami() for c in mine]
        extra = Conn.to(b.address)          # the kernel accepts; the broker closes it
        refused = extra.whoami() is None
        ctl.send({"whos": whos, "refused": refused})
        ctl.wait()
        mine[0].close()                     # room for one more, once the broker saw it go

        def admitted():
            with Conn.to(b.address) as again:
                return again.whoami()
        return {"again": wait_until(admitted, 5, "a connection in the room made")}

    kid = spawn(child)
    report = kid.recv()
    assert all(w and w.startswith(f"!/cred/{NOBODY}/{NOBODY}/") for w in report["whos"])
    assert report["refused"]
    rec = b.wait_for_event(ls.CLIENT_DISCONNECT,
                           predicate=lambda r: r["reason"] == ls.DISCONNECT_CONNECTION_BUDGET)
    assert rec["uid"] == NOBODY and "--user-max-connections 3" in rec["detail"]
    # Root gets in as often as it likes, and is served.
    roots = [b.connect() for _ in range(10)]
    for r in roots:
        r.sync()
    root_still_serves(b)
    with b.connect() as s:
        stats = s.stats()
    assert stats["totals"]["budget_conns_refused"] == 1
    assert user_entry(stats, NOBODY) == {
        "uid": NOBODY, "connections": 3, "max_connections": 3, "sub_bytes": 0,
        "max_sub_bytes": 64 * MIB, "queued_bytes": 0, "max_queued_bytes": 64 * MIB}
    kid.send({"done": True})
    assert kid.result()["again"].startswith(f"!/cred/{NOBODY}/")


@asroot
def test_queued_bytes_budget_per_uid(open_broker, spawn):
    budget = 1 * MIB
    b = open_broker("--user-queue-max-bytes", str(budget))

    def child(ctl):
        # Two subscribers that never read: their queues grow until the uid's budget.
        lazy = [Conn.to(b.address) for _ in range(2)]
        for c in lazy:
            assert c.sub_ok(b"flood/*")
        ctl.send({"subscribed": True})
        ctl.wait()
        return True

    kid = spawn(child)
    kid.recv()
    reader = b.connect(timeout=30)
    assert reader.sub_ok(b"flood/*")
    pub = b.connect(timeout=30)
    n, payload = 600, b"x" * 10000              # 6 MB each way: past the uid's budget
    for i in range(n):
        pub.pub(b"flood/%d" % i, payload)
    pub.sync()
    got = []
    while len(got) < n:
        p = reader.next_packet(10)
        assert p, f"root received {len(got)} of {n}"
        got.append(p)
    assert [p.split(b"\0", 1)[0] for p in got] == [b"MSG flood/%d" % i for i in range(n)]
    with b.connect() as s:
        stats = s.stats()
    nobody = user_entry(stats, NOBODY)
    assert nobody["max_queued_bytes"] == budget and 0 < nobody["queued_bytes"] <= budget
    lazies = [c for c in stats["clients"] if c["uid"] == NOBODY]
    assert all(c["drops_hard"] > 0 for c in lazies), lazies       # their hard mode: discard
    assert sum(c["queued_bytes"] for c in lazies) == nobody["queued_bytes"]
    rootc = [c for c in stats["clients"] if c["uid"] == 0 and c["msgs_out"]]
    assert all(c["drops_hard"] == c["drops_soft"] == 0 for c in rootc)
    flood = b.wait_for_event(ls.FLOOD, predicate=lambda r: r["uid"] == NOBODY, timeout=10)
    assert flood["drops_hard"] > 0
    kid.send({"done": True})
    kid.result()
    wait_until(lambda: user_entry(b.stats(), NOBODY) is None, 10, "the uid's account to go")


@asroot
def test_rss_stays_under_the_budgets_and_returns(open_broker, spawn, request):
    per_conn, per_user, total = 4 * MIB, 16 * MIB, 24 * MIB
    b = open_broker("--sub-max-bytes", str(per_conn), "--user-sub-max-bytes", str(per_user),
                    "--total-sub-max-bytes", str(total))
    warm = [b.connect() for _ in range(4)]       # the broker's own steady state first
    for c in warm:
        c.sync()
    for c in warm:
        c.close()
    wait_until(lambda: b.stats()["totals"]["clients"] == 1, 5)
    base = status_kib(b.pid, "VmRSS")

    def child(ctl):
        counts, held = flood_patterns(b.address, [448] * 6)   # more than the uid may hold
        ctl.send({"counts": counts})
        ctl.wait()
        return counts

    kid = spawn(child)
    kid.recv(timeout=120)
    # Root takes what the total leaves, in connections within their own budget.
    counts, held = flood_patterns(b.address, [64] * 30, tag=b"root")
    assert counts[-1] < 64          # the total was reached
    last = [r for r in b.events(ls.SUBSCRIBE) if r["uid"] == 0 and not r["accepted"]]
    assert last[-1]["reason"] == ls.REFUSE_SUB_BUDGET_TOTAL
    with b.connect() as s:
        stats = s.stats()
    charged = stats["totals"]["sub_bytes"]
    peak = status_kib(b.pid, "VmRSS")
    assert total - 64 * PATTERN_COST <= charged <= total
    assert user_entry(stats, NOBODY)["sub_bytes"] <= per_user
    assert peak - base <= total // 1024 + RSS_OVERHEAD_KIB, (base, peak, charged)
    kid.send({"done": True})
    kid.result()
    for c in held:
        c.close()
    root_still_serves(b)
    wait_until(lambda: b.stats()["totals"]["sub_bytes"] == 0, 10, "the patterns to go")
    end = wait_until(lambda: (lambda r: r - base <= 4096 and r)(status_kib(b.pid, "VmRSS")),
                     10, "RSS to come back near its baseline", fail=False)
    end = status_kib(b.pid, "VmRSS")
    report_line(request, f"budgets RSS: base {base} kB, under {charged >> 10} KiB of patterns "
                         f"{peak} kB, after {end} kB")
    assert end - base <= 4096, (base, peak, end)
