"""Producers' batches of ``sbus queue`` (docs/queues.md, "Producers' batches"):
many jobs in one packet on ``KEY/.sbus-jobs``, taken apart by the service,
with real sbusd, service and consumer processes; a raw-socket producer
written from the docs; the access policy judging a batch as its jobs' key."""
from __future__ import annotations

import random
import shutil
import signal
import subprocess
import textwrap
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hyp

from sbus import Client
from sbus import logschema as ls
from sbus._core.jobs import pack_puts
from sbus.access import parse
from sbus.client.consume import job_packets
from sbus.queue import wire

from support import TESTS, Conn, Sbusd, asroot, make_public_dir, wait_until
from support.queuesvc import QueueService, wait_state

PUTS = wire.PUT_SUFFIX.encode()
TIMEOUT = 20.0
PATTERN = "jobs/"


@settings(max_examples=300, deadline=None)
@given(hyp.lists(hyp.binary(max_size=300), max_size=40), hyp.integers(1, 400))
def test_batches_are_packed_as_their_plain_python_twin_and_parse_back(payloads, limit):
    packets = pack_puts(b"jobs/k", b"jobs/k" + PUTS, payloads, limit)
    assert packets == wire.pack_puts_py(b"jobs/k", payloads, limit)
    got = []
    for key, payload in packets:
        if key == b"jobs/k" + PUTS:
            assert len(payload) <= limit
            got += wire.parse_puts_py(payload)
        else:
            assert key == b"jobs/k" and len(b"%d " % len(payload)) + len(payload) > limit
            got.append(payload)
    assert got == payloads


def test_job_packets_fit_the_brokers_packet():
    packets = job_packets("jobs/k", [b"x" * 100] * 1000, max_message=4096)
    assert all(k == b"jobs/k" + PUTS for k, _ in packets)
    assert all(len(b"MSG jobs/k/.sbus-jobs\0") + len(p) <= 4096 for _, p in packets)
    assert len(packets) > 20


def test_produced_jobs_go_to_exactly_one_consumer_each_in_order(bus, queues, consumers):
    q = queues(bus.address)
    consumers.start(16, "ack")
    wait_state(q, lambda s: len(s["consumers"]) == 1, "a consumer")
    with Client(bus.address) as pub:
        assert pub.produce("jobs/a", [b"job-%d" % i for i in range(300)]) == 1
        pub.publish("jobs/b", "plain")      # a packet per job still works, in order
        pub.produce(b"jobs/c", [b"job-%d" % i for i in range(300, 600)])
        pub.whoami(timeout=TIMEOUT)
    s = wait_state(q, lambda s: s["acked"] == 601, "601 acks")
    got = consumers.printed(601)
    assert [j["payload"] for j in got] == (
        [f"job-{i}" for i in range(300)] + ["plain"] + [f"job-{i}" for i in range(300, 600)])
    assert [j["key"] for j in got] == ["jobs/a"] * 300 + ["jobs/b"] + ["jobs/c"] * 300
    assert (s["received"], s["delivered"], s["bad_requests"]) == (601, 601, 0)


def test_the_asyncio_client_produces(bus, queues, consumers):
    import asyncio

    from sbus.aio import Client as AsyncClient

    async def main():
        async with AsyncClient(bus.address) as pub:
            await pub.produce("jobs/x", [b"one", b"two"])
            await pub.whoami()

    q = queues(bus.address)
    consumers.start(4, "ack")
    wait_state(q, lambda s: len(s["consumers"]) == 1, "a consumer")
    asyncio.run(main())
    wait_state(q, lambda s: s["acked"] == 2, "2 acks")
    assert [j["payload"] for j in consumers.printed(2)] == ["one", "two"]


def test_produced_jobs_of_a_consumer_killed_go_to_another(bus, queues, consumers):
    q = queues(bus.address, PATTERN, "--lease", "1")
    holder = consumers.start(5, "hold")
    wait_state(q, lambda s: len(s["consumers"]) == 1, "the holder")
    with Client(bus.address) as pub:
        pub.produce("jobs/k", [b"job-%d" % i for i in range(5)])
        pub.whoami(timeout=TIMEOUT)
    wait_until(lambda: consumers.counts()[holder] == 5, TIMEOUT, "the holder's 5 jobs")
    consumers.procs[holder].send_signal(signal.SIGKILL)
    worker = consumers.start(5, "ack")
    wait_until(lambda: consumers.counts()[worker] == 5, TIMEOUT, "the holder's jobs again")
    assert Counter(j["payload"] for j in consumers.jobs[worker]) == Counter(
        f"job-{i}" for i in range(5))
    assert {j["deliveries"] for j in consumers.jobs[worker]} == {2}
    s = wait_state(q, lambda s: s["acked"] == 5, "5 acks")
    assert (s["redelivered"], s["consumers_lost"]) == (5, 1)


def test_a_producer_written_from_the_docs(bus, queues, consumers):
    """Raw packets, as a C program would send them: records ``SIZE PAYLOAD``
    on KEY/.sbus-jobs. A malformed record ends its batch (the records before
    it are jobs; the rest is a bad request), a record too large to deliver
    is dropped and counted as oversize, a batch whose key is outside the
    pattern is a bad request, and the service stays."""
    q = queues(bus.address)
    with Conn.to(bus.address, sndbuf=1 << 21) as c:
        c.packet(b"MSG jobs/a/.sbus-jobs\0" + b"3 one7 two two0 5 three")
        c.packet(b"MSG jobs/b/.sbus-jobs\0" + b"4 four9 nine")      # 9: past the end
        c.packet(b"MSG jobs/c/.sbus-jobs\0" + b"1 x12 " + b"z" * 12)
        c.packet(b"MSG jobs/c/.sbus-jobs\0" + b"x 1")
        c.packet(b"MSG jobs/.sbus-jobs\0" + b"3 out")   # its key, jobs, is not under jobs/
        c.packet(b"MSG jobs/d\0" + b"1 plain")          # no suffix: one job, as ever
        c.sync()
    limit = 409600 - len(b"MSG \0") - wire.DELIVERY_OVERHEAD
    with Conn.to(bus.address, sndbuf=1 << 21) as c:
        c.packet(b"MSG jobs/e/.sbus-jobs\0" + b"%d " % (limit - 5) + b"y" * (limit - 5) + b"1 z")
        c.sync()
    s = wait_state(q, lambda s: s["received"] == 9, "9 jobs")
    assert (s["bad_requests"], s["oversize"]) == (3, 1)
    drop = q.wait_for_event(ls.QUEUE_DROP)
    assert (drop["reason"], drop["key"]) == ("oversize", "jobs/e")
    consumers.start(16, "ack")
    s = wait_state(q, lambda s: s["acked"] == 9, "9 acks")
    assert [(j["key"], j["payload"][:10]) for j in consumers.printed(9)] == [
        ("jobs/a", "one"), ("jobs/a", "two two"), ("jobs/a", ""), ("jobs/a", "three"),
        ("jobs/b", "four"), ("jobs/c", "x"), ("jobs/c", "z" * 10), ("jobs/d", "1 plain"),
        ("jobs/e", "z")]
    assert q.proc.poll() is None


def test_a_pattern_not_ending_in_a_slash_takes_batches_on_its_twin(bus, queues, consumers):
    q = queues(bus.address, "work/*")
    consumers.start(16, "ack", "work/*")
    wait_state(q, lambda s: len(s["consumers"]) == 1, "a consumer")
    with Client(bus.address) as pub:
        pub.produce("work/a", [b"1", b"2"])
        pub.produce("work/a/b", [b"not ours"])       # work/* does not match work/a/b
        pub.publish("work/c", "3")
        pub.whoami(timeout=TIMEOUT)
    wait_state(q, lambda s: s["acked"] == 3, "3 acks")
    assert [(j["key"], j["payload"]) for j in consumers.printed(3)] == [
        ("work/a", "1"), ("work/a", "2"), ("work/c", "3")]
    assert q.state()["bad_requests"] == 0


# -- under an enforced access policy --------------------------------------------------------

POLICY = """\
default = "deny"

[[rule]]
uid = 0
allow = ["publish", "subscribe"]
pattern = ""

[[rule]]
allow = "publish"
pattern = ["work/a", "sbus/queue/", "!/cred/"]
"""


def test_a_policy_judges_a_batch_as_its_jobs_key():
    a = parse(POLICY, "p.toml").compile_for(65534, 65534)
    assert a.may_publish(b"work/a/.sbus-jobs").allowed
    assert not a.may_publish(b"work/b/.sbus-jobs").allowed
    assert not a.may_publish(b"work/a/x/.sbus-jobs").allowed
    root = parse(textwrap.dedent("""\
        default = "deny"
        [[rule]]
        allow = "subscribe"
        pattern = "work/*"
        """), "p.toml").compile_for(0, 0)
    assert root.may_subscribe(b"work/*/.sbus-jobs").allowed
    assert not root.may_subscribe(b"work/a/.sbus-jobs/").allowed


def _produce(address):
    with Client(address) as c:
        c.produce("work/a", [b"a1", b"a2"])
        c.produce("work/b", [b"b1"])    # denied: nobody may publish work/b
        c.produce("work/a", [b"a3"])
        c.whoami()
        return "sent"


@asroot
def test_a_producer_under_a_policy_batches_what_it_may_publish(tmp_path, spawn):
    """uid 65534 may publish work/a only: its batches there are jobs, its batch
    on work/b is denied as a publish on work/b would be; the service, on a
    pattern not ending in '/', holds its twin subscription under the policy."""
    d = make_public_dir()
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    b = Sbusd.foreground(tmp_path, "-o", "--policy", str(policy), "--stats-interval", "0",
                         address=d / "sbus.socket")
    try:
        q = QueueService.start(tmp_path, b.address, "work/*", "--policy", str(policy))
        assert spawn(lambda ctl: _produce(b.address)).result(60) == "sent"
        wait_state(q, lambda s: s["received"] == 3, "3 jobs")
        with Client(b.address) as c:
            got = []
            for job in c.consume("work/*"):
                got.append((job.key, job.payload))
                job.ack()
                if len(got) == 3:
                    break
        assert got == [(b"work/a", b"a1"), (b"work/a", b"a2"), (b"work/a", b"a3")]
        [denied] = b.events("publish_denied")
        assert denied["key"] == "work/b/.sbus-jobs"
        assert not [r for r in b.events("subscribe") if r["accepted"] is False]
        assert q.proc.poll() is None
        q.stop()
    finally:
        b.stop()
        shutil.rmtree(d, ignore_errors=True)


def _gcc(tmp_path, name):
    exe = tmp_path / name
    built = subprocess.run(["gcc", "-std=c99", "-D_DEFAULT_SOURCE", "-O2", "-Wall", "-Wextra",
                            "-Werror", "-o", str(exe), str(TESTS / "c" / f"{name}.c")],
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert built.returncode == 0, built.stderr
    return str(exe)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_a_c_producer_written_from_the_docs(bus, queues, tmp_path):
    """Its batch goes to the C consumer of test_queue.py, which knows nothing
    of batches (a ``job`` packet per job), as to any consumer."""
    q = queues(bus.address)
    run = subprocess.run([_gcc(tmp_path, "queue_producer"), bus.address, "jobs/c", "one",
                          "two two", "", "three"], capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    s = wait_state(q, lambda s: s["received"] == 4, "4 jobs")
    assert s["bad_requests"] == 0
    run = subprocess.run([_gcc(tmp_path, "queue_consumer"), bus.address, PATTERN, "4"],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "jobs/c one 1\njobs/c two two 1\njobs/c  1\njobs/c three 1\n"
    wait_state(q, lambda s: s["acked"] == 4 and s["in_flight"] == 0, "4 acks")


def _leading_records(payload: bytes):
    """(jobs, malformed): the records before the first that does not follow
    the convention, as the service takes them, and whether one did not."""
    jobs, at = 0, 0
    while at < len(payload):
        space = payload.find(b" ", at)
        size = payload[at:space]
        if space < 0 or not size.isdigit() or len(size) > 18 or space + 1 + int(size) > len(payload):
            return jobs, True
        jobs, at = jobs + 1, space + 1 + int(size)
    return jobs, False


def test_random_batches_are_taken_as_far_as_they_follow_the_convention(bus, queues):
    rng = random.Random(39)
    pieces = [b"3 abc", b"0 ", b"1 \0", b"12 ", b"x", b" ", b"5 ab", b"007 1234567",
              b"9" * 19 + b" ", b"2 \xff\xfe", b"\0\0"]
    payloads = [b"".join(rng.choice(pieces) for _ in range(rng.randrange(8)))
                for _ in range(200)]
    expected = [_leading_records(p) for p in payloads]
    q = queues(bus.address, PATTERN, "--max-held", "10000")
    with Client(bus.address) as pub:
        pub.publish_many([("jobs/r/.sbus-jobs", p) for p in payloads])
        pub.whoami(timeout=TIMEOUT)
    jobs = sum(n for n, _ in expected)
    bad = sum(1 for _, malformed in expected if malformed)
    s = wait_state(q, lambda s: s["received"] == jobs and s["bad_requests"] == bad,
                   f"{jobs} jobs and {bad} bad requests")
    assert s["held"] == jobs and q.proc.poll() is None
