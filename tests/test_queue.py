"""``sbus queue`` and its consumers, with real sbusd, service and consumer processes."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hyp

from sbus import Client
from sbus import logschema as ls
from sbus._core.inflight import Held, InFlight
from sbus._core.jobs import Acks, jobs_from, pack_jobs, parse_jobs, parse_tags
from sbus.aio import Client as AsyncClient
from sbus.client.consume import consume
from sbus.client.private import PrivateInbox
from sbus.client.protocol import Credentials
from sbus.queue import state as st
from sbus.queue import wire

from support import SBUS, TESTS, Conn, QueueService, asroot, wait_until
from support.queuesvc import wait_state

TIMEOUT = 20.0
PATTERN = "jobs/"


def publish(address, keys_payloads):
    with Client(address) as pub:
        for key, payload in keys_payloads:
            pub.publish(key, payload)
        pub.whoami(timeout=TIMEOUT)     # the broker has taken them all


def jobs(n, start=0):
    return [(f"jobs/{i % 3}", f"job-{i}") for i in range(start, start + n)]


def test_jobs_go_round_the_consumers_within_their_prefetch(bus, queues, consumers):
    q = queues(bus.address, PATTERN, "--prefetch", "3")
    for _ in range(3):
        consumers.start(50, "hold")     # asks for 50: the service grants 3
    wait_state(q, lambda s: len(s["consumers"]) == 3, "three consumers")
    publish(bus.address, jobs(11))
    s = wait_state(q, lambda s: s["in_flight"] == 9 and s["held"] == 2, "9 in flight, 2 held")
    assert sorted(c["in_flight"] for c in s["consumers"]) == [3, 3, 3]
    assert all(c["prefetch"] == 3 for c in s["consumers"])
    wait_until(lambda: sum(consumers.counts()) == 9, TIMEOUT, "9 jobs printed")
    assert consumers.counts() == [3, 3, 3]
    payloads = [j["payload"] for j in consumers.all()]
    assert sorted(payloads) == sorted(f"job-{i}" for i in range(9))
    assert {j["deliveries"] for j in consumers.all()} == {1}
    assert q.state()["held"] == 2      # nobody has credit: the rest wait
    assert (s["received"], s["delivered"], s["dropped"]) == (11, 9, 0)


def test_each_job_goes_to_exactly_one_consumer(bus, queues, consumers):
    q = queues(bus.address)
    for _ in range(4):
        consumers.start(16, "ack")
    wait_state(q, lambda s: len(s["consumers"]) == 4, "four consumers")
    publish(bus.address, jobs(400))
    wait_until(lambda: len(consumers.all()) >= 400, TIMEOUT, "400 jobs printed")
    s = wait_state(q, lambda s: s["acked"] == 400, "400 acks")
    got = Counter(j["payload"] for j in consumers.all())
    assert got == Counter(f"job-{i}" for i in range(400))
    assert all(n > 0 for n in consumers.counts()), consumers.counts()
    assert (s["held"], s["in_flight"], s["redelivered"], s["delivered"]) == (0, 0, 0, 400)


def test_a_consumer_killed_mid_stream_loses_no_job(bus, queues, consumers):
    q = queues(bus.address, PATTERN, "--lease", "1")
    holder = consumers.start(5, "hold")
    wait_state(q, lambda s: len(s["consumers"]) == 1, "the holder")
    publish(bus.address, jobs(5))
    wait_until(lambda: consumers.counts()[holder] == 5, TIMEOUT, "the holder's 5 jobs")
    worker = consumers.start(4, "ack")
    wait_state(q, lambda s: len(s["consumers"]) == 2, "the worker")
    publish(bus.address, jobs(45, start=5))
    wait_until(lambda: consumers.counts()[worker] == 45, TIMEOUT, "the worker's 45 jobs")
    held_by_holder = {j["payload"] for j in consumers.jobs[holder]}
    consumers.procs[holder].send_signal(signal.SIGKILL)
    wait_until(lambda: consumers.counts()[worker] == 50, TIMEOUT, "the holder's jobs again")
    again = [j for j in consumers.jobs[worker] if j["deliveries"] > 1]
    assert {j["payload"] for j in again} == held_by_holder
    assert {j["deliveries"] for j in again} == {2}
    done = Counter(j["payload"] for j in consumers.jobs[worker])
    assert done == Counter(f"job-{i}" for i in range(50))
    s = wait_state(q, lambda s: s["acked"] == 50, "50 acks")
    assert (s["redelivered"], s["consumers_lost"], s["in_flight"], s["held"]) == (5, 1, 0, 0)
    left = q.wait_for_event(ls.QUEUE_CONSUMER_LEAVE)
    assert (left["reason"], left["requeued"], left["acked"]) == (st.LEFT_LEASE, 5, 0)


def test_without_a_consumer_jobs_are_held_then_the_oldest_dropped(bus, queues, consumers):
    q = queues(bus.address, PATTERN, "--max-held", "5")
    publish(bus.address, jobs(8))
    s = wait_state(q, lambda s: s["received"] == 8, "8 jobs received")
    assert (s["held"], s["dropped"], s["delivered"]) == (5, 3, 0)
    q.wait_for_event(ls.QUEUE_DROP, TIMEOUT, lambda r: r["dropped"] == 3)
    drops = q.events(ls.QUEUE_DROP)
    assert sum(r["count"] for r in drops) == 3
    assert {r["reason"] for r in drops} == {"full"}
    assert drops[-1]["dropped"] == 3 and drops[-1]["level"] == "warning"
    consumers.start(16, "ack")
    wait_until(lambda: len(consumers.all()) == 5, TIMEOUT, "the 5 held jobs")
    assert [j["payload"] for j in consumers.all()] == [f"job-{i}" for i in range(3, 8)]


def test_a_job_too_large_to_deliver_is_dropped_on_arrival(bus, queues, consumers):
    q = queues(bus.address)
    limit = 409600 - len("MSG jobs/big\0")
    publish(bus.address, [("jobs/big", "x" * limit), ("jobs/fits", "y" * (limit - 300))])
    s = wait_state(q, lambda s: s["received"] + s["oversize"] == 2, "both jobs")
    assert (s["oversize"], s["received"], s["held"]) == (1, 1, 1)
    drop = q.wait_for_event(ls.QUEUE_DROP)
    assert (drop["reason"], drop["key"], drop["size"]) == ("oversize", "jobs/big", limit)
    consumers.start(1, "ack")
    wait_until(lambda: len(consumers.all()) == 1, TIMEOUT, "the job that fits")
    assert consumers.all()[0]["key"] == "jobs/fits"
    assert q.proc.poll() is None


def test_a_job_held_past_the_ack_timeout_goes_to_another_consumer(bus, queues, consumers):
    q = queues(bus.address, PATTERN, "--ack-timeout", "1", "--prefetch", "1")
    stuck = consumers.start(1, "hold")
    wait_state(q, lambda s: len(s["consumers"]) == 1, "the stuck consumer")
    publish(bus.address, jobs(1))
    wait_until(lambda: consumers.counts()[stuck] == 1, TIMEOUT, "the stuck consumer's job")
    worker = consumers.start(1, "ack")
    wait_until(lambda: consumers.counts()[worker] == 1, TIMEOUT, "the job again")
    assert consumers.jobs[worker][0]["payload"] == "job-0"
    assert consumers.jobs[worker][0]["deliveries"] == 2
    left = q.wait_for_event(ls.QUEUE_CONSUMER_LEAVE)
    assert (left["reason"], left["requeued"]) == (st.LEFT_ACK_TIMEOUT, 1)


def test_nack_gives_a_job_out_again_and_reject_drops_it(bus, queues):
    q = queues(bus.address)
    with Client(bus.address) as c:
        jobs_in = c.consume(PATTERN, prefetch=1)     # the method: consume(c, ...)
        publish(bus.address, [("jobs/a", "one"), ("jobs/b", "two")])
        first = next(jobs_in)
        assert (first.key, first.payload, first.deliveries) == (b"jobs/a", b"one", 1)
        first.nack()
        again = next(jobs_in)
        assert (again.key, again.deliveries, again.redelivered) == (b"jobs/a", 2, True)
        again.nack(requeue=False)
        second = next(jobs_in)
        assert (second.payload, second.deliveries) == (b"two", 1)
        second.ack()
        with pytest.raises(RuntimeError):
            second.ack()
        s = wait_state(q, lambda s: s["acked"] == 1, "one ack")
        assert (s["nacked"], s["rejected"], s["redelivered"], s["in_flight"]) == (1, 1, 1, 0)
        jobs_in.close()
    left = q.wait_for_event(ls.QUEUE_CONSUMER_LEAVE)
    assert left["reason"] == st.LEFT_BYE


def test_closing_the_generator_hands_prefetched_jobs_to_others(bus, queues, consumers):
    q = queues(bus.address)
    with Client(bus.address) as c:
        jobs_in = consume(c, PATTERN, prefetch=4)
        publish(bus.address, jobs(4))
        next(jobs_in).ack()
        wait_state(q, lambda s: s["in_flight"] == 3, "3 prefetched")
        jobs_in.close()
    s = wait_state(q, lambda s: s["held"] == 3, "3 handed back")
    assert (s["in_flight"], len(s["consumers"])) == (0, 0)
    consumers.start(16, "ack")
    wait_until(lambda: len(consumers.all()) == 3, TIMEOUT, "the 3 handed back")
    assert {j["deliveries"] for j in consumers.all()} == {2}


def test_leaving_a_for_loop_mid_batch_hands_the_rest_of_the_batch_to_others(bus, queues, consumers):
    """The jobs of a batch come out of the consumer's list (jobs.Feed), not
    its plan: a ``break`` after the first still says bye, the first acked
    and the other three, delivered in the same batch, handed back."""
    q = queues(bus.address)
    publish(bus.address, jobs(4))
    wait_state(q, lambda s: s["held"] == 4, "4 held")
    with Client(bus.address) as c:
        for job in consume(c, PATTERN, prefetch=4):
            assert wait_state(q, lambda s: s["in_flight"] == 4, "4 in one go")["delivered"] == 4
            job.ack()
            break
        left = q.wait_for_event(ls.QUEUE_CONSUMER_LEAVE, timeout=10)
    assert (left["reason"], left["requeued"], left["acked"]) == (st.LEFT_BYE, 3, 1)
    consumers.start(16, "ack")
    wait_until(lambda: len(consumers.all()) == 3, TIMEOUT, "the 3 handed back")
    assert {j["deliveries"] for j in consumers.all()} == {2}


def test_a_consumer_leaving_with_deliveries_unread_is_heard_saying_bye(bus, queues):
    """A client that closes with deliveries unread loses what the broker has
    not read of it yet: the consumer makes sure its last acks and its bye
    were read before it lets its client close. The lease is long, so only
    the bye can end the consumer in time."""
    q = queues(bus.address, PATTERN, "--lease", "60")
    with Client(bus.address) as c:
        jobs_in = consume(c, PATTERN, prefetch=4)
        publish(bus.address, jobs(1))
        first = next(jobs_in)
        publish(bus.address, jobs(1, start=1))
        wait_state(q, lambda s: s["in_flight"] == 2, "a second delivery, unread")
        first.ack()
        jobs_in.close()
    left = q.wait_for_event(ls.QUEUE_CONSUMER_LEAVE, timeout=10)
    assert (left["reason"], left["requeued"], left["acked"]) == (st.LEFT_BYE, 1, 1)


def test_the_asyncio_consumer(bus, queues):
    queues(bus.address)

    async def run():
        async with AsyncClient(bus.address) as c:
            got = []
            publish(bus.address, jobs(3))
            async for job in c.consume(PATTERN, prefetch=2):     # consume(c, ...): a Consumer
                got.append(job.payload)
                await job.ack()
                if len(got) == 3:
                    break
            return got

    assert asyncio.run(asyncio.wait_for(run(), TIMEOUT)) == [b"job-0", b"job-1", b"job-2"]


def test_the_asyncio_consumer_acks_and_says_bye_when_the_loop_is_left_by_break(bus, queues):
    """``await job.ack(); break`` and then leaving the client's ``async with``:
    the held ack and the bye go out. The lease is long, so only the bye can
    end the consumer in time, and a lost ack would show as acked 0."""
    q = queues(bus.address, PATTERN, "--lease", "60")

    async def run():
        async with AsyncClient(bus.address) as c:
            publish(bus.address, jobs(2))
            async for job in c.consume(PATTERN, prefetch=2):
                await job.ack()
                break

    asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    left = q.wait_for_event(ls.QUEUE_CONSUMER_LEAVE, timeout=10)
    assert (left["reason"], left["acked"]) == (st.LEFT_BYE, 1)
    assert wait_state(q, lambda s: s["acked"] == 1 and s["in_flight"] == 0, "the ack")


def test_the_asyncio_consumer_says_bye_when_the_loop_ends_in_an_exception(bus, queues):
    q = queues(bus.address, PATTERN, "--lease", "60")

    async def run():
        async with AsyncClient(bus.address) as c:
            publish(bus.address, jobs(1))
            async for job in c.consume(PATTERN, prefetch=2):
                await job.ack()
                raise LookupError("the handler failed")

    with pytest.raises(LookupError):
        asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    left = q.wait_for_event(ls.QUEUE_CONSUMER_LEAVE, timeout=10)
    assert (left["reason"], left["acked"]) == (st.LEFT_BYE, 1)


def test_a_held_ack_goes_out_while_the_consumer_works_on(bus, queues):
    """Acks wait to go out together, but a timer sends them: a consumer busy
    with the next job of its batch holds back neither credit nor the ack timeout."""
    q = queues(bus.address)
    publish(bus.address, jobs(3))
    with Client(bus.address) as c:
        jobs_in = c.consume(PATTERN, prefetch=6)    # half of it, 3 acks, would go at once
        next(jobs_in).ack()
        second = next(jobs_in)  # taken from the batch already received: no wait, no flush
        s = wait_state(q, lambda s: s["acked"] == 1, "the held ack")
        assert s["in_flight"] == 2
        second.ack()            # while the renewer still watches after the first
        next(jobs_in)
        s = wait_state(q, lambda s: s["acked"] == 2, "the second held ack")
        assert s["in_flight"] == 1
        jobs_in.close()

    async def run():
        async with AsyncClient(bus.address) as c:
            publish(bus.address, jobs(2, start=3))
            jobs_in = c.consume(PATTERN, prefetch=4)
            await (await jobs_in.__anext__()).ack()
            await jobs_in.__anext__()
            await asyncio.get_running_loop().run_in_executor(
                None, wait_state, q, lambda s: s["acked"] == 3, "the held ack")
            await jobs_in.aclose()

    asyncio.run(asyncio.wait_for(run(), TIMEOUT))


def test_sbus_consume_prints_and_acknowledges(bus, queues):
    q = queues(bus.address)
    publish(bus.address, [("jobs/x", "hello"), ("jobs/y", "world")])
    wait_state(q, lambda s: s["held"] == 2, "2 held")
    r = subprocess.run([SBUS, "-a", bus.address, "consume", "--json", "-n", "2", PATTERN],
                       capture_output=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert [json.loads(line) for line in r.stdout.splitlines()] == [
        {"type": "msg", "key": "jobs/x", "payload": "hello"},
        {"type": "msg", "key": "jobs/y", "payload": "world"}]
    s = wait_state(q, lambda s: s["acked"] == 2, "2 acks")
    assert (s["held"], s["in_flight"]) == (0, 0)


def test_bad_requests_are_counted_and_the_service_stays(bus, queues):
    q = queues(bus.address)
    control = q.start_record["control"]
    publish(bus.address, [
        (wire.HELLO_KEY, "x"), (wire.HELLO_KEY, "1 public/inbox/ jobs/"),
        (wire.HELLO_KEY, "99999999999999999999 !/cred/1/2/3/q/ jobs/"),
        (wire.STATE_KEY, "not/private jobs/"), (control, "dance 1"), (control, "ack"),
        (control, "ack nosuchtoken 5"), ("sbus/queue/other", "?")])
    s = wait_state(q, lambda s: s["bad_requests"] == 6, "6 bad requests")
    assert (s["late_acks"], s["received"], len(s["consumers"])) == (1, 0, 0)
    assert q.proc.poll() is None


def test_the_service_rides_out_a_broker_restart(start_broker, queues):
    first = start_broker()
    q = queues(first.address)
    first.stop()
    q.wait_for_event(ls.QUEUE_BUS_LOST, TIMEOUT)
    start_broker("-r", address=first.address)
    q.wait_for_event(ls.QUEUE_BUS_BACK, TIMEOUT)
    publish(first.address, jobs(3))
    with Client(first.address) as c:
        jobs_in = consume(c, PATTERN)
        got = []
        for job in jobs_in:
            got.append(job.payload)
            job.ack()
            if len(got) == 3:
                break
    assert got == [b"job-0", b"job-1", b"job-2"]
    assert wait_state(q, lambda s: s["acked"] == 3, "3 acks")["received"] == 3


def test_state_is_logged(bus, queues):
    q = queues(bus.address, PATTERN, "--stats-interval", "0.2")
    publish(bus.address, jobs(2))
    rec = q.wait_for_event(ls.QUEUE_STATS, TIMEOUT, lambda r: r["held"] == 2)
    assert (rec["in_flight"], rec["received"], rec["consumers"]) == (0, 2, [])
    q.stop()
    stop = q.wait_for_event(ls.QUEUE_STOP)
    assert (stop["reason"], stop["held"], stop["received"]) == ("signal", 2, 2)


@asroot
def test_an_eavesdropper_sees_public_jobs_but_no_delivery(open_broker, queues, spawn):
    broker = open_broker()
    q = queues(broker.address)

    def child(ctl):
        held = {}
        for pattern in ("", "!/", "!/cred/", "*/"):
            c = Conn.to(broker.address)
            if c.sub_ok(pattern):
                held[pattern] = c
        ctl.send({"held": sorted(held)})
        ctl.wait()
        return {p: [[k.decode(), v.decode()] for k, v in
                    (pkt[4:].split(b"\0", 1) for pkt in c.collect()
                     if pkt.startswith(b"MSG "))]
                for p, c in held.items()}

    eavesdropper = spawn(child)
    assert eavesdropper.recv() == {"held": ["", "*/"]}
    with Client(broker.address) as c:
        jobs_in = consume(c, PATTERN, prefetch=2)
        publish(broker.address, jobs(6))
        for _ in range(6):
            next(jobs_in).ack()
        wait_state(q, lambda s: s["acked"] == 6, "6 acks")
        jobs_in.close()
    eavesdropper.send({"go": True})
    seen = eavesdropper.result()
    for pattern, got in seen.items():
        keys = [k for k, _ in got]
        assert [(k, v) for k, v in got if k.startswith("jobs/")] == jobs(6), pattern
        assert not [k for k in keys if k.startswith("!")], pattern
        assert set(keys) <= {k for k, _ in jobs(6)} | {wire.HELLO_KEY, wire.STATE_KEY}, pattern


def test_a_consumer_that_says_batch_gets_its_share_in_one_packet(bus, queues):
    """Written from docs/queues.md "Batches" with a raw client: the jobs given
    out at one go arrive as one ``jobs`` packet, each record a delivery of its own."""
    q = queues(bus.address)
    publish(bus.address, jobs(5))
    wait_state(q, lambda s: s["held"] == 5, "5 held")
    with Client(bus.address) as c:
        inbox = PrivateInbox(c.whoami(timeout=TIMEOUT), "queue")
        c.subscribe(inbox.pattern)
        c.publish(wire.HELLO_KEY, wire.pack_hello(4, inbox.prefix, PATTERN, batch=True))

        def next_packet(suffix):
            while True:
                m = c.receive(timeout=TIMEOUT)
                if inbox.suffix_of(m.key) == suffix:
                    return m.payload

        welcome = wire.parse_welcome(next_packet(b"welcome"))
        first = wire.parse_jobs_py(next_packet(b"jobs"))
        assert [(d, k, p) for _, d, k, p in first] == [
            (1, k.encode(), p.encode()) for k, p in jobs(4)]
        tags = [t for t, _, _, _ in first]
        assert tags == list(range(tags[0], tags[0] + 4))
        c.publish(welcome.control, wire.pack_control(wire.NACK, welcome.token, tags[1], tags[3]))
        again = wire.parse_jobs_py(next_packet(b"jobs"))
        # the two handed back, from the front of the queue, with the credit they freed
        assert [(d, p) for _, d, _, p in again] == [(2, b"job-1"), (2, b"job-3")]
        c.publish(welcome.control, wire.pack_control(wire.ACK, welcome.token, tags[0], tags[2]))
        rest = wire.parse_jobs_py(next_packet(b"jobs"))
        assert [(d, p) for _, d, _, p in rest] == [(1, b"job-4")]
        done = [t for t, _, _, _ in again + rest]
        c.publish(welcome.control, wire.pack_control(wire.ACK, welcome.token, *done))
        s = wait_state(q, lambda s: s["acked"] == 5, "5 acks")
        assert (s["delivered"], s["redelivered"], s["nacked"], s["in_flight"]) == (7, 2, 2, 0)


# -- the pieces, without processes ------------------------------------------------------

def test_dispatch_goes_round_the_consumers_one_each_in_turn():
    q = st.Queue(prefetch=3, ack_timeout=10.0, lease=5.0, max_held=100)
    a, _ = q.join("!/cred/1/2/3/q/a/", 1, 0.0)
    b, _ = q.join("!/cred/1/2/3/q/b/", 3, 0.0)
    c, _ = q.join("!/cred/1/2/3/q/c/", 2, 0.0)
    for i in range(5):
        q.add(b"k", b"%d" % i)
    given = {d[0].inbox[-2]: [job[1] for job in d[2]] for d in q.dispatch(0.0)}
    # a, b, c, then b, c (a has no credit left)
    assert given == {"a": [b"0"], "b": [b"1", b"3"], "c": [b"2", b"4"]}
    q.add(b"k", b"5")
    q.add(b"k", b"6")
    # b is next in turn (c took the last job); c has no credit left, a none
    assert [(d[0] is b, [job[1] for job in d[2]]) for d in q.dispatch(0.0)] == [(True, [b"5"])]
    assert (len(q.held), a.credit, b.credit, c.credit) == (1, 0, 0, 0)
    q.settle(c, [next(iter(c.in_flight))], wire.NACK)     # b"2" goes back, in front of b"6"
    (d,) = q.dispatch(1.0)
    assert (d[0] is c, d[2]) == (True, [(b"k", b"2", 2)])
    assert q.counts["redelivered"] == 1 and [job[1] for job in q.held] == [b"6"]


def test_a_consumer_is_overdue_once_its_oldest_job_passes_the_ack_timeout():
    q = st.Queue(prefetch=4, ack_timeout=10.0, lease=100.0, max_held=100)
    c, _ = q.join("!/cred/1/2/3/q/a/", 4, 0.0)
    q.add(b"k", b"0")
    q.dispatch(0.0)
    q.add(b"k", b"1")
    q.dispatch(5.0)
    assert not c.overdue(9.9) and c.overdue(10.0)
    q.settle(c, [next(iter(c.in_flight))], wire.ACK)      # the first: the second is due at 15
    assert not c.overdue(14.9) and c.overdue(15.0)
    assert [(reason, requeued) for _, reason, requeued in q.expire(15.0)] == [
        (st.LEFT_ACK_TIMEOUT, 1)]


@settings(max_examples=300, deadline=None)
@given(args=hyp.one_of(
    hyp.lists(hyp.integers(0, 10 ** 18 - 1)).map(lambda tags: " ".join(map(str, tags)).encode()),
    hyp.binary(max_size=60),
    hyp.lists(hyp.sampled_from([b"1", b"23", b" ", b"", b"x", b"-1", b"9" * 18, b"9" * 19,
                                b"\xd9\xa1", b"007"])).map(b" ".join)))
def test_tags_are_parsed_as_their_plain_python_twin(args):
    """The service's C reading of ack, nack and reject tags agrees with the
    plain-Python one on well-formed and malformed arguments alike."""
    try:
        expected = wire.parse_tags_py(args)
    except wire.WireError:
        with pytest.raises(wire.WireError):
            parse_tags(args)
    else:
        assert parse_tags(args) == expected


_TAG_ARGS = hyp.one_of(
    hyp.lists(hyp.integers(0, 300)).map(lambda tags: " ".join(map(str, tags)).encode()),
    hyp.lists(hyp.sampled_from([b"1", b"2", b" ", b"", b"x", b"-1", b"9" * 19, b"007"])).map(
        b" ".join))


@settings(max_examples=300, deadline=None)
@given(steps=hyp.lists(hyp.one_of(
    hyp.tuples(hyp.just("add"), hyp.integers(0, 5), hyp.integers(0, 70)),
    hyp.tuples(hyp.just("settle"), _TAG_ARGS),
    hyp.tuples(hyp.just("drop"), _TAG_ARGS),
    hyp.tuples(hyp.just("pop"), hyp.lists(hyp.integers(0, 300), max_size=10)),
    hyp.tuples(hyp.just("clear"))), max_size=40))
def test_jobs_in_flight_are_kept_as_a_dict_of_tags_keeps_them(steps):
    """The C record of a consumer's jobs in flight against the dict it
    replaced: the same jobs, in tag order, settled by the same tags (those
    not in flight skipped, malformed arguments settling nothing)."""
    flight, model, tag = InFlight(), {}, 1
    for step in steps:
        if step[0] == "add":
            tag += step[1]          # tags only grow, with gaps (other consumers')
            jobs = [(b"k", b"%d" % (tag + i)) for i in range(step[2])]
            flight.add(tag, jobs)
            model.update(zip(range(tag, tag + len(jobs)), jobs))
            tag += len(jobs)
        elif step[0] in ("settle", "drop"):
            settle = flight.settle if step[0] == "settle" else flight.drop
            try:
                tags = wire.parse_tags_py(step[1])
            except wire.WireError:
                with pytest.raises(wire.WireError):
                    settle(step[1])
                continue
            expected = [model.pop(t) for t in tags if t in model]
            if step[0] == "drop":
                expected = len(expected)
            assert settle(step[1]) == (expected, len(tags))
        elif step[0] == "pop":
            expected = [model.pop(t) for t in step[1] if t in model]
            assert flight.pop_tags(step[1]) == expected
        else:
            assert flight.clear() == list(model.values())
            model.clear()
        assert (len(flight), bool(flight)) == (len(model), bool(model))
        assert list(flight) == list(model) and flight.values() == list(model.values())
        assert flight.oldest == next(iter(model), None)
    flight.add(tag, [(b"k", b"last")])
    with pytest.raises(ValueError):     # a tag given out already
        flight.add(tag, [(b"k", b"again")])


@given(tags=hyp.lists(hyp.integers(1, 10 ** 18 - 1), min_size=1, max_size=50))
def test_held_acks_go_out_as_the_convention_writes_them(tags):
    acks = Acks(60.0, 1000)
    for tag in tags:
        acks.add("!/cred/1/2/3/queue/s/ctl", "t0k", tag)
    key, payload = acks.take()
    assert key == "!/cred/1/2/3/queue/s/ctl"
    assert payload == wire.pack_control(wire.ACK, "t0k", *tags)
    assert wire.parse_control(payload) == (wire.ACK, "t0k", " ".join(map(str, tags)).encode())


@settings(max_examples=300, deadline=None)
@given(steps=hyp.lists(hyp.one_of(
    hyp.tuples(hyp.just("append"), hyp.integers(0, 100)),
    hyp.tuples(hyp.just("requeue"), hyp.integers(0, 100)),
    hyp.tuples(hyp.just("take"), hyp.integers(0, 120)),
    hyp.tuples(hyp.just("deal"), hyp.integers(0, 120), hyp.integers(1, 5))), max_size=40))
def test_held_jobs_are_kept_as_the_deque_they_replaced_kept_them(steps):
    """The C ring of held jobs against a deque: the same jobs in the same
    order, handed back in front, taken from the front, dealt round in turn."""
    import collections
    held, model, n = Held(), collections.deque(), 0
    for step in steps:
        if step[0] in ("append", "requeue"):
            jobs = [(b"k", b"%d" % i) for i in range(n, n + step[1])]
            n += step[1]
            if step[0] == "append":
                for job in jobs:
                    held.append(job)
                model.extend(jobs)
            else:
                held.requeue(jobs)
                model.extendleft(reversed(jobs))
        elif step[0] == "take":
            expected = [model.popleft() for _ in range(min(step[1], len(model)))]
            assert held.take(step[1]) == expected
        else:
            taken = [model.popleft() for _ in range(min(step[1], len(model)))]
            hands = [[(b"k", b"before")] for _ in range(step[2])]
            held.deal(step[1], hands)
            assert hands == [[(b"k", b"before")] + taken[i::step[2]] for i in range(step[2])]
        assert (len(held), bool(held), list(held)) == (len(model), bool(model), list(model))


def test_jobs_batches_count_the_tags_width_as_it_grows():
    entries = [(b"k", b"p")] * 12 + [(b"k", b"q", 3)]
    for first in (1, 5, 99_995, 10 ** 17 - 3):
        tags = list(range(first, first + len(entries)))
        assert pack_jobs(first, entries, 1 << 20) == wire.pack_jobs_py(tags, entries, 1 << 20)


@settings(max_examples=200, deadline=None)
@given(jobs=hyp.lists(hyp.tuples(hyp.binary().filter(lambda k: b"\0" not in k), hyp.binary(),
                                 hyp.integers(0, 10 ** 6)), max_size=20),
       first=hyp.integers(1, 10 ** 17), limit=hyp.integers(1, 400))
def test_jobs_batches_are_packed_and_parsed_as_their_plain_python_twins(jobs, first, limit):
    entries = [(k, p) if n == 0 else (k, p, n) for k, p, n in jobs]
    tags = list(range(first, first + len(entries)))
    packed = pack_jobs(first, entries, limit)
    assert packed == wire.pack_jobs_py(tags, entries, limit)
    assert all(len(p) <= limit or len(parse_jobs(p)) == 1 for p in packed)
    records = [r for p in packed for r in parse_jobs(p)]
    assert records == [r for p in packed for r in wire.parse_jobs_py(p)]
    made = [j for p in packed for j in jobs_from(p, None)]
    assert [(j.tag, j.deliveries, j.key, j.payload, j.settled) for j in made] == [
        (*r, False) for r in records]
    assert records == [(t, n or 1, k, p) for t, (k, p, n) in zip(tags, jobs)]


def test_a_job_is_settled_once_through_its_settle():
    settled = []
    (job,) = jobs_from(b"18 7 2 jobs/a\0payload", lambda verb, tag: settled.append((verb, tag)))
    assert (job.key, job.payload, job.deliveries, job.tag, job.redelivered) == (
        b"jobs/a", b"payload", 2, 7, True)
    job.nack(requeue=False)
    with pytest.raises(RuntimeError):
        job.ack()
    assert (settled, job.settled) == ([(wire.REJECT, 7)], True)


def test_acks_are_held_together_per_token_up_to_their_limit():
    acks = Acks(10.0, 3)
    assert (acks.take(), acks.due, acks.started) == (None, None, 0)
    assert acks.add("ctl", "t1", 5) is True     # the first since the last went out
    assert acks.due is not None and acks.add("ctl", "t1", 6) is None
    # another token: what was held for the first goes out before
    assert acks.add("ctl", "t2", 7) == ("ctl", b"ack t1 5 6")
    assert (acks.take(), acks.due, acks.started) == (("ctl", b"ack t2 7"), None, 2)
    assert [acks.add("ctl", "t2", tag) for tag in (8, 9, 10, 11)] == [
        True, None, ("ctl", b"ack t2 8 9 10"), True]     # the third held: all go
    assert Acks(10.0, 1).add("ctl", "t", 1) == ("ctl", b"ack t 1")


def test_a_malformed_jobs_batch_is_refused_by_both_parsers():
    for bad in (b"x", b"5 1 1 k", b"9 1 1 k\0p", b"3 1 1\0", b"6 1 x k\0p", b"6 1 1 kp",
                b"25 7 1 jobs/resize\0img-1.png2"):
        with pytest.raises(ValueError):
            parse_jobs(bad)
        with pytest.raises(ValueError):
            wire.parse_jobs_py(bad)
        with pytest.raises(ValueError):
            jobs_from(bad, None)


def test_inbox_keys():
    creds = Credentials.parse("!/cred/1/2/3")
    box = PrivateInbox(creds, "queue", "abc")
    assert (box.pattern, box.key("job")) == ("!/cred/1/2/3/queue/abc/", "!/cred/1/2/3/queue/abc/job")
    assert box.suffix_of(b"!/cred/1/2/3/queue/abc/welcome") == b"welcome"
    assert box.suffix_of(b"!/cred/1/2/3/queue/abd/welcome") is None
    assert PrivateInbox(creds, "queue").prefix != PrivateInbox(creds, "queue").prefix
    with pytest.raises(ValueError):
        PrivateInbox(creds, "a/b")


def test_wire_round_trips():
    assert wire.parse_hello(wire.pack_hello(4, "!/cred/1/2/3/q/x/", "a b/*/")) == (
        4, "!/cred/1/2/3/q/x/", b"a b/*/", False)
    assert wire.pack_hello(4, "!/cred/1/2/3/q/x/", "batch", batch=True) == (
        b"4 batch !/cred/1/2/3/q/x/ batch")
    assert wire.parse_hello(b"4 batch !/cred/1/2/3/q/x/ batch") == (
        4, "!/cred/1/2/3/q/x/", b"batch", True)
    packed = wire.pack_job(7, 2, b"k e\ny", b"pay\0load")
    assert packed == b"7 2 k e\ny\0pay\0load"
    assert wire.parse_job(packed) == (7, 2, b"k e\ny", b"pay\0load")
    assert wire.parse_welcome(wire.pack_welcome("t0k", 2.5, "!/cred/1/2/3/queue/s/ctl")) == (
        "t0k", 2.5, "!/cred/1/2/3/queue/s/ctl")
    assert wire.parse_control(b"ack t 1 2 3") == ("ack", "t", b"1 2 3")
    assert wire.parse_control(b"bye t") == ("bye", "t", b"")
    for bad in (b"", b"1 !/cred/1/2/3/", b"x !/cred/1/2/3/q/ p", b"1 pub/lic/ p"):
        with pytest.raises(wire.WireError):
            wire.parse_hello(bad)


def test_queue_log_fields_keep_the_broker_schemas_types():
    broker = ls.all_fields()
    for event, fields in ls.QUEUE_EVENT_FIELDS.items():
        for name, tag in fields:
            assert broker.get(name, tag) == tag, (event, name)
    assert not set(ls.QUEUE_EVENT_FIELDS) & set(ls.EVENT_FIELDS)


def test_every_logged_queue_field_is_in_the_schema(bus, queues, consumers):
    q = queues(bus.address, PATTERN, "--max-held", "1", "--stats-interval", "0.2",
               "--lease", "1")
    publish(bus.address, jobs(2))
    consumers.start(1, "hold")
    wait_until(lambda: len(consumers.all()) == 1, TIMEOUT, "a job")
    consumers.procs[0].kill()
    q.wait_for_event(ls.QUEUE_CONSUMER_LEAVE, TIMEOUT)
    q.wait_for_event(ls.QUEUE_STATS, TIMEOUT, lambda r: r["consumers_lost"] == 1)
    q.stop()
    common = {name for name, _ in ls.COMMON_FIELDS}
    seen = set()
    for r in q.records():
        if r["event"] in ls.QUEUE_EVENT_FIELDS:
            seen.add(r["event"])
            assert set(r) - common == {n for n, _ in ls.QUEUE_EVENT_FIELDS[r["event"]]}, r
    assert seen >= {ls.QUEUE_START, ls.QUEUE_STOP, ls.QUEUE_DROP, ls.QUEUE_STATS,
                    ls.QUEUE_CONSUMER_JOIN, ls.QUEUE_CONSUMER_LEAVE}


@pytest.mark.spark
@pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas")
def test_the_analytics_job_reads_a_log_with_queue_records(spark, bus, queues, consumers,
                                                          tmp_path):
    from sbus.analytics import event_counts, line_summary, parse, read_events, read_lines

    q = queues(bus.address, PATTERN, "--max-held", "1", "--stats-interval", "0.2",
               "--lease", "1")
    publish(bus.address, jobs(2))
    consumers.start(1, "hold")
    wait_until(lambda: len(consumers.all()) == 1, TIMEOUT, "a job")
    consumers.procs[0].kill()
    q.wait_for_event(ls.QUEUE_STATS, TIMEOUT, lambda r: r["consumers_lost"] == 1)
    q.stop()
    both = tmp_path / "both.log"
    both.write_text(bus.log_path.read_text() + q.log_path.read_text())
    lines = [line for line in both.read_text().splitlines() if line]
    summary = line_summary(parse(read_lines(spark, [str(both)])))
    assert (summary["lines"], summary["malformed"]) == (len(lines), 0)
    counted = {r["event"]: r["records"] for r in event_counts(read_events(spark, [str(both)]))
               .collect()}
    assert counted == Counter(json.loads(line)["event"] for line in lines)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_a_c_consumer_written_from_the_docs(bus, queues, tmp_path):
    exe = tmp_path / "queue_consumer"
    built = subprocess.run(["gcc", "-std=c99", "-D_DEFAULT_SOURCE", "-O2", "-Wall", "-Wextra",
                            "-Werror", "-o", str(exe), str(TESTS / "c" / "queue_consumer.c")],
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert built.returncode == 0, built.stderr
    q = queues(bus.address)
    publish(bus.address, [("jobs/a", "one"), ("jobs/b", "two two"), ("jobs/c", "three")])
    run = subprocess.run([str(exe), bus.address, PATTERN, "3"], capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "jobs/a one 1\njobs/b two two 1\njobs/c three 1\n"
    s = wait_state(q, lambda s: s["acked"] == 3, "3 acks")
    assert (s["in_flight"], s["consumers"], s["late_acks"]) == (0, [], 0)
    assert q.wait_for_event(ls.QUEUE_CONSUMER_LEAVE)["reason"] == st.LEFT_BYE


def test_sighup_reopens_the_log_and_sigterm_stops_with_the_counts(bus, queues):
    """logrotate's way: the log renamed, SIGHUP, and the next record goes to
    a new file at the old path; SIGTERM then stops the service cleanly."""
    q = queues(bus.address, PATTERN)
    rotated = q.log_path.with_suffix(".log.1")
    q.log_path.rename(rotated)
    os.kill(q.pid, signal.SIGHUP)
    # Acted on between turns: a record of the turn the signal came in may
    # still go to the old file; once the new one exists, every record does.
    wait_until(q.log_path.exists, 10, "the log reopened")
    publish(bus.address, [("jobs/a", b"1")])
    with Client(bus.address) as c:
        c.publish(wire.HELLO_KEY, b"not a hello")     # a bad request: logged at debug
        c.whoami(timeout=10)
    wait_until(lambda: q.events("queue_bad_request"), 10, "a record in the new log")
    assert q.stop() == 0
    (stop,) = q.events("queue_stop")
    assert (stop["reason"], stop["received"], stop["held"]) == ("signal", 1, 1)
    assert not any('"queue_bad_request"' in line for line in rotated.read_text().splitlines())


def test_the_queue_says_it_is_ready_and_sbus_ready_waits_for_it(bus, tmp_path, monkeypatch):
    """Issue 38: READY=1 (systemd's Type=notify) and one service_ready record
    once its subscriptions are in place; ``sbus ready queue PATTERN`` returns
    then, and gives up with a hint when no service for PATTERN runs."""
    from support.systemd import Notify
    r = subprocess.run([SBUS, "-a", bus.address, "ready", "queue", "jobs/", "-W", "1"],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.splitlines() == [
        "sbus ready: queue not ready within 1 s: no queue service for 'jobs/' answered "
        "(asked on sbus/queue/state)",
        "  is sbus queue running? start one with: sbus queue jobs/ (the pattern must be the "
        "same, byte for byte), or wait longer with -W SECONDS"]

    notify = Notify(tmp_path, abstract=True)
    monkeypatch.setenv("NOTIFY_SOCKET", notify.env)
    service = None
    try:
        waiter = subprocess.Popen([SBUS, "-a", bus.address, "ready", "queue", "jobs/", "-W",
                                   "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        service = QueueService(tmp_path, bus.address, "jobs/")
        out, err = waiter.communicate(timeout=90)
        assert (waiter.returncode, out, err) == (0, b"", b"")
        assert notify.recv(timeout=30) == ("READY=1", service.pid)
        said = service.wait_for_event("service_ready")
        assert (said["service"], said["pid"], said["pattern"]) == ("queue", service.pid, "jobs/")
        assert notify.pending() is None, "once"
        # Another pattern's service is not this one's.
        r = subprocess.run([SBUS, "-a", bus.address, "ready", "queue", "other/", "-W", "1"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1
    finally:
        notify.close()
        if service is not None:
            service.stop()
