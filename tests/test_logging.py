"""The broker's structured logs: every event of the schema, from a real run."""
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile

import pytest

from sbus import logschema as schema

from support import SBUSD, Conn, wait_for_record

TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
NESTED = {
    schema.TOTALS: schema.TOTALS_FIELDS,
    schema.DELTA: schema.DELTA_FIELDS,
    schema.COUNTERS: schema.CLIENT_COUNTER_FIELDS,
}


def check_value(event, name, tag, value):
    where = f"{event}.{name}"
    if value is None:
        assert (event, name) in schema.NULLABLE, f"{where} is null"
        return
    if tag == schema.INT:
        assert isinstance(value, int) and not isinstance(value, bool), where
    elif tag == schema.FLOAT:
        assert isinstance(value, (int, float)) and not isinstance(value, bool), where
    elif tag == schema.STR:
        assert isinstance(value, str), where
    elif tag == schema.BOOL:
        assert isinstance(value, bool), where
    elif tag == schema.TIMESTAMP:
        assert TIMESTAMP.match(value), f"{where}={value!r}"
    elif tag == schema.CONFIG:
        assert isinstance(value, dict) and all(
            isinstance(v, (str, int, float, bool)) or v is None for v in value.values()), where
    elif tag == schema.COUNTERS_LIST:
        assert isinstance(value, list), where
        for item in value:
            check_value(event, name + "[]", schema.COUNTERS, item)
    elif tag == schema.USERS_LIST:
        assert isinstance(value, list), where
        for item in value:
            assert set(item) == set(schema.USER_FIELDS), where
            # a budget is null for the exempt uid (sbusd's own)
            assert all(isinstance(item[f], int) or (item[f] is None and f.startswith("max_"))
                       for f in schema.USER_FIELDS), f"{where}={item}"
    else:
        assert isinstance(value, dict), where
        for field in NESTED[tag]:
            assert field in value, f"{where} lacks {field}"
            assert isinstance(value[field], int), f"{where}.{field}"


def check_record(record):
    for name, tag in schema.COMMON_FIELDS:
        assert name in record, f"{record.get('event')} lacks {name}"
        check_value(record["event"], name, tag, record[name])
    assert record["schema"] == schema.SCHEMA_VERSION
    assert record["level"] in schema.LEVELS
    for name, tag in schema.EVENT_FIELDS.get(record["event"], ()):
        assert name in record, f"{record['event']} lacks {name}: {record}"
        check_value(record["event"], name, tag, record[name])


def as_other_user(path, action):
    """Connect from a child running as uid 65534; True if it was served."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = b"0"
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = Conn.to(path)
            action(s)
            ok = b"1"
        except Exception:
            pass
        os.write(w, ok)
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        return f.read() == b"1"


@pytest.fixture
def open_dir():
    """A directory uid 65534 can traverse (pytest's tmp_path parents are 0700)."""
    path = tempfile.mkdtemp(prefix="sbus-log-")
    os.chmod(path, 0o755)
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_every_event_type_appears_with_its_documented_fields(tmp_path, open_dir):
    sock = str(open_dir / "bus.socket")
    log = tmp_path / "sbusd.log"
    policy = tmp_path / "policy.toml"       # for publish_denied: power/ only, the rest as without
    policy.write_text('default = "allow"\n[[rule]]\ndeny = "publish"\npattern = "power/"\n')
    proc = subprocess.Popen(
        [SBUSD, "-f", "-go", "-a", sock, "-u", "0", "--log-file", str(log), "--log-level", "debug",
         "--stats-interval", "0.2", "--log-messages", "1", "--max-message", "4096",
         "--max-subscriptions", "3", "--policy", str(policy)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read()
    try:
        pub, sub, slow = Conn.to(sock), Conn.to(sock), Conn.to(sock)
        sub.send(b"SUB news/")
        slow.send(b"CMSG blocking/soft/discard")
        slow.send(b"SUB news/")
        sub.send(b"UNSUB news/")
        sub.send(b"UNSUB never")
        sub.send(b"SUB news/")
        for s in (sub, slow):
            s.sync()
        for i in range(3000):                           # slow never reads: soft discards
            pub.send(b"MSG news/today\0" + b"x" * 1000)
            if i % 500 == 0:
                pub.sync()
        bad_cases = [
            (b"HELLO", "protocol_error"),
            (b"SUB !/cred/1/2/3/x", "cred_refused"),
            (b"SUB a/!/b", "bang_misuse"),
            (b"MSG k\0" + b"y" * 5000, "oversize"),
        ]
        for packet, _ in bad_cases:
            c = Conn.to(sock, sndbuf=1 << 20)
            c.send(packet)
            c.until_closed()
        limit = Conn.to(sock)
        for p in (b"SUB a", b"SUB b", b"SUB c", b"SUB d"):
            limit.send(p)
        limit.until_closed()
        error = Conn.to(sock)
        error.send(b"CMSG blocking/soft/error")
        error.send(b"SUB flood")
        error.sync()
        for _ in range(2000):
            pub.send(b"MSG flood\0" + b"z" * 1000)
        pub.sync()
        error.until_closed()
        pub.send(b"MSG power/off\0")
        pub.sync()
        assert not as_other_user(sock, Conn.sync)             # -u 0: uid 65534 is refused
        eof = Conn.to(sock)
        eof.sync()
        eof.close()
        wait_for_record(log, "client_disconnect", lambda r: r["reason"] == "eof")
        wait_for_record(log, "flood", lambda r: r["drops_soft"] > 0)
        wait_for_record(log, "stats")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for record in records:
        check_record(record)
    seen = {r["event"] for r in records}
    for event in schema.EVENT_FIELDS:
        assert event in seen, f"no {event} record in {sorted(seen)}"
    reasons = {r["reason"] for r in records if r["event"] == "client_disconnect"}
    for reason in ("eof", "protocol_error", "cred_refused", "bang_misuse", "oversize",
                   "limit", "flood_error", "user_refused", "shutdown"):
        assert reason in reasons, f"no disconnect with reason {reason}: {reasons}"
    assert all(r["reason"] in schema.DISCONNECT_REASONS
               for r in records if r["event"] == "client_disconnect")
    subs = [r for r in records if r["event"] == "subscribe"]
    assert any(r["accepted"] for r in subs)
    refused = [r for r in subs if not r["accepted"]]
    assert {r["reason"] for r in refused} == {"cred_mismatch", "bang_misuse", "too_many_subscriptions"}
    unsubs = [r for r in records if r["event"] == "unsubscribe"]
    assert {(r["pattern"], r["accepted"]) for r in unsubs} == {("news/", True), ("never", False)}
    flood = [r for r in records if r["event"] == "flood"]
    assert sum(r["drops_soft"] for r in flood) > 0        # how many: the socket buffers decide
    # One flood summary per client per interval, not one per message.
    per_client = {}
    for r in flood:
        per_client.setdefault(r["client"], []).append(r)
    assert all(len(v) <= 5 for v in per_client.values()), per_client     # intervals: wall-clock
    messages = [r for r in records if r["event"] == "message"]
    # Every message is sampled: the 3000 on news/today and the 2000 on flood.
    assert len(messages) == 5000 and messages[0]["sample_rate"] == 1.0
    assert {r["fanout"] for r in messages if r["key"] == "news/today"} == {2}    # sub and slow
    stop = records[-1]
    assert stop["event"] == "broker_stop" and stop["reason"] == "SIGTERM"
    assert stop["totals"]["msgs_in"] == len(messages)
    start = records[0]
    assert start["event"] == "broker_start" and start["config"]["max_message"] == 4096


def test_stats_records_carry_totals_deltas_and_clients(start_broker):
    b = start_broker("--stats-interval", "0.1")
    pub, sub = b.connect(), b.connect()
    sub.send(b"SUB k")
    sub.sync()
    for _ in range(10):
        pub.send(b"MSG k\0abc")
    for _ in range(10):
        sub.recv(100)
    b.wait_for_event("stats", predicate=lambda r: r["totals"]["msgs_in"] == 10)
    stats = [r for r in b.events("stats")]
    assert sum(r["delta"]["msgs_in"] for r in stats) == stats[-1]["totals"]["msgs_in"] == 10
    assert sum(r["delta"]["msgs_out"] for r in stats) == stats[-1]["totals"]["msgs_out"]
    latest = {}     # a client is listed when it is new or changed: keep its last entry
    for r in stats:
        latest.update((c["client"], c) for c in r["clients"])
    assert sorted(c["msgs_in"] for c in latest.values()) == [0, 10]
    assert sorted(c["subscriptions"] for c in latest.values()) == [0, 1]


def test_stats_records_list_a_client_when_it_connects_or_changes(start_broker):
    b = start_broker("--stats-interval", "0.1")
    idle, busy = b.connect(), b.connect()
    idle.sync()
    busy.sync()

    def next_stats(after, predicate=lambda r: True):
        return b.wait_for_event("stats", predicate=lambda r: r["timestamp"] > after["timestamp"] and predicate(r))

    synced = b.records()[-1]
    quiet = next_stats(synced, lambda r: not r["clients"])     # nothing changed: nobody listed
    assert quiet["totals"]["clients"] == 2
    listed = {c["client"] for r in b.events("stats") if r["timestamp"] <= quiet["timestamp"]
              for c in r["clients"]}
    assert len(listed) == 2                                     # each was listed when it came
    busy.send(b"MSG k\0abc")
    rec = next_stats(quiet, lambda r: r["clients"])
    assert [c["msgs_in"] for c in rec["clients"]] == [1]        # only the one that changed
    busy.send(b"CMSG order/stack")                              # a mode is a change too
    rec = next_stats(rec, lambda r: r["clients"])
    assert [(c["msgs_in"], c["order"]) for c in rec["clients"]] == [(1, "stack")]



def test_log_level_filters_and_off_writes_nothing(start_broker):
    b = start_broker(log_level="warning")
    c = b.connect()
    c.send(b"NOPE")
    c.until_closed()
    b.wait_for_event("client_disconnect")
    b.stop()
    assert {r["level"] for r in b.records()} <= {"warning", "error"}
    off = start_broker(log_level="off")
    c = off.connect()
    c.sync()
    off.stop()
    assert off.records() == []


def test_console_format_is_for_people_and_json_is_the_default_off_a_terminal(tmp_path):
    sock = str(tmp_path / "bus.socket")
    for extra, is_json in ((["--log-format", "console"], False), ([], True)):
        proc = subprocess.Popen([SBUSD, "-f", "-r", "-a", sock, *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.read()
        c = Conn.to(sock)
        c.sync()
        c.close()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
        lines = [ln for ln in err.decode().splitlines() if ln.strip()]
        assert any("client_connect" in ln for ln in lines)
        parsed = []
        for line in lines:
            try:
                parsed.append(json.loads(line))
            except ValueError:
                pass
        assert (len(parsed) == len(lines)) is is_json, lines


def test_sampled_message_records_follow_the_rate(start_broker):
    b = start_broker("--log-messages", "0.1")
    pub, sub = b.connect(), b.connect()
    sub.send(b"SUB s/")
    sub.sync()
    n = 4000
    for i in range(n):
        pub.send(b"MSG s/%d\0p" % (i % 7))
        if i % 500 == 0:
            pub.sync()
    pub.sync()
    b.stop()
    sampled = b.events("message")
    # 10% of 4000, with wide margins: the draw is seeded from an address ASLR picks.
    assert 200 <= len(sampled) <= 600
    assert all(r["sample_rate"] == 0.1 and r["fanout"] == 1 and r["key"].startswith("s/")
               for r in sampled)
