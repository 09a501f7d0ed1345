"""`sbus stats --format prometheus`, read back with prometheus_client's own parser."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sbus import logschema
from sbus.cli.metrics import CLIENT, COUNTER, TOTALS, to_prometheus

from support import NOBODY, SBUS, Conn, Sbusd, asroot, make_public_dir

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "system-bus-policy.toml"

TIMEOUT = 10.0


def scrape(address, *flags) -> dict:
    proc = subprocess.run([SBUS, "stats", "-a", address, "--format", "prometheus", *flags],
                          capture_output=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr.decode()
    families = list(text_string_to_metric_families(proc.stdout.decode()))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family is split"
    return {f.name: f for f in families}


def samples(family, **labels):
    return [s for s in family.samples
            if all(s.labels.get(k) == str(v) for k, v in labels.items())]


def value(family, **labels) -> float:
    (s,) = samples(family, **labels)
    return s.value


def test_prometheus_totals_and_per_client_series(start_broker):
    b = start_broker()
    sub, pub = b.connect(), b.connect()
    sub.sub("m/*")
    sub.send(b"CMSG blocking/soft/discard")
    sub.sync()
    for i in range(5):
        pub.pub(f"m/{i}", b"x" * 10)
    pub.sync()
    sub.whoami()                                    # the deliveries are made
    m = scrape(b.address)
    # Counters are typed as such; the parser names a counter's family without
    # its _total, which every sample carries.
    counters = [f for f in m.values() if f.type == "counter"]
    assert {f.name for f in counters} >= {
        "sbus_messages_received", "sbus_connects", "sbus_budget_connections_refused",
        "sbus_budget_subscriptions_refused", "sbus_client_messages_delivered"}
    for family in counters:
        assert {s.name for s in family.samples} == {family.name + "_total"}, family
    assert value(m["sbus_budget_subscriptions_refused"]) == 0
    assert m["sbus_subscription_bytes"].type == "gauge"
    assert m["sbus_messages_received"].type == "counter"
    assert value(m["sbus_messages_received"]) == 5
    assert value(m["sbus_messages_delivered"]) == 5
    assert value(m["sbus_received_bytes"]) == 5 * len(b"MSG m/0\0" + b"x" * 10)
    assert m["sbus_clients"].type == "gauge"
    assert value(m["sbus_clients"]) == 3           # sub, pub and the scraper
    assert value(m["sbus_subscriptions"]) == 1
    assert {s.labels["kind"] for s in m["sbus_dropped_messages"].samples} == {
        "soft", "hard", "disconnect"}
    assert value(m["sbus_broker_info"], backend="epoll") == 1
    assert m["sbus_uptime_seconds"].samples[0].value >= 0
    for family in m.values():
        assert family.documentation, f"{family.name} has no HELP"
    # Per client: labelled by client id, pid and uid.
    got = m["sbus_client_messages_delivered"]
    ours = samples(got, pid=os.getpid(), uid=os.getuid())
    assert {s.labels["client"] for s in got.samples} == {"1", "2"}
    assert sorted(s.value for s in ours) == [0, 5]      # pub and sub
    assert len(got.samples) == 2        # the scraper's own connection is left out
    assert value(m["sbus_client_messages_received"], client=2) == 5
    assert value(m["sbus_client_subscriptions"], client=1) == 1
    assert value(m["sbus_client_info"], client=1, soft="discard", hard="discard") == 1


def test_prometheus_without_clients(start_broker):
    b = start_broker()
    c = b.connect()
    c.sync()
    m = scrape(b.address, "--no-clients")
    assert not [name for name in m if name.startswith("sbus_client_")]
    assert value(m["sbus_clients"]) == 2
    proc = subprocess.run([SBUS, "stats", "-a", b.address, "--no-clients"],
                          capture_output=True, timeout=TIMEOUT)
    assert b'"clients": [' not in proc.stdout and b'"totals"' in proc.stdout


def test_budget_use_per_uid_and_new_totals_are_exported_when_present():
    """The stats reply grows (per-uid budgets, more totals): every number is
    still exported, a null budget (none) is left out."""
    stats = {
        "uptime_s": 1.5, "backend": "select",
        "totals": {"clients": 1, "msgs_in": 2, "drops_soft": 0, "sub_bytes": 300,
                   "a_later_field": 7},
        "clients": [], "clients_omitted": 4,
        "users": [{"uid": 0, "connections": 1, "max_connections": None, "sub_bytes": 300},
                  {"uid": 1000, "connections": 2, "max_connections": 64, "sub_bytes": 0}],
    }
    m = {f.name: f for f in text_string_to_metric_families(to_prometheus(stats))}
    assert value(m["sbus_subscription_bytes"]) == 300
    assert value(m["sbus_a_later_field"]) == 7
    assert value(m["sbus_clients_omitted"]) == 4
    assert value(m["sbus_user_connections"], uid=1000) == 2
    assert [s.labels["uid"] for s in m["sbus_user_max_connections"].samples] == ["1000"]


@pytest.mark.parametrize("bad", ['a"b', "back\\slash", "new\nline"])
def test_label_values_are_escaped(bad):
    stats = {"totals": {}, "backend": bad}
    (family,) = [f for f in text_string_to_metric_families(to_prometheus(stats))
                 if f.name == "sbus_broker_info"]
    assert family.samples[0].labels["backend"] == bad


def test_every_field_the_broker_reports_has_its_name_and_type():
    """No counter of the schema falls back to an untyped gauge: each is named
    and typed in the table, and a counter's name ends in _total."""
    def values(fields):
        return [f for f in fields if f not in ("client", "pid", "uid", "gid")
                and f not in logschema.DROP_KINDS]

    assert not [f for f in values(logschema.TOTALS_FIELDS) if f not in TOTALS]
    assert not [f for f in values(logschema.CLIENT_COUNTER_FIELDS) if f not in CLIENT]
    for name, kind, _ in [*TOTALS.values(), *CLIENT.values()]:
        assert name.endswith("_total") == (kind == COUNTER), name


def test_stats_json_marks_the_asking_connection(start_broker):
    b = start_broker()
    c = b.connect()
    c.sync()
    proc = subprocess.run([SBUS, "stats", "-a", b.address], capture_output=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr.decode()
    clients = json.loads(proc.stdout)["clients"]
    assert [x.get("asking", False) for x in clients] == [False, True]


@asroot
def test_policy_denials_per_uid_outlive_the_connection(tmp_path, spawn):
    """uid 65534's denied publishes and refused SUB under the system-bus
    example are counters labelled with its uid, still there once it has
    gone; root, denied nothing, has no series."""
    d = make_public_dir()
    b = Sbusd.foreground(tmp_path, "-o", "--policy", str(EXAMPLE), address=d / "sbus.socket")
    try:
        def child(ctl):
            with Conn.to(b.address) as c:
                for key in ("power/off", "user/0/x", "x", "user/65534/ok"):
                    c.packet(b"MSG " + key.encode() + b"\0")
                c.sync()
            with Conn.to(b.address) as c:
                return c.sub_ok("")

        assert spawn(child).result() is False
        m = scrape(b.address)
        assert m["sbus_user_policy_denied"].type == "counter"
        assert [s.name for s in m["sbus_user_policy_denied"].samples] == [
            "sbus_user_policy_denied_total"]
        assert value(m["sbus_user_policy_denied"], uid=NOBODY) == 3
        assert value(m["sbus_user_policy_subscriptions_refused"], uid=NOBODY) == 1
        assert not samples(m["sbus_user_policy_denied"], uid=0)
        assert value(m["sbus_policy_denied"]) == 3
    finally:
        b.stop()
        shutil.rmtree(d, ignore_errors=True)
