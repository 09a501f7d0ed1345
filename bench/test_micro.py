"""Micro-benchmarks of the pattern index and the send queue (pytest-benchmark).

    .venv/bin/python -m pytest bench/test_micro.py --benchmark-only

Run by bench/run.py as part of `make bench`; not part of `make test`.  They go
through the Python-visible wrappers (PatternIndex, SendQueueSim), so every
figure includes one Python call, about what `test_index_match_empty` costs.
Where one call does several operations, `extra_info["ops"]` says how many and
run.py reports the time per operation.
"""
import pytest

index = pytest.importorskip("sbus._core.index")
sendq = pytest.importorskip("sbus._core.sendq")
protocol = pytest.importorskip("sbus._core.protocol")

SIZES = (10, 1_000, 100_000)


def patterns(shape, n):
    """n distinct patterns of which exactly one matches KEYS[shape].

    literal: every pattern has its own literal first segment: the index looks
             at one bucket whatever n is.
    shared:  all share the key's first segment ("app"), as when every client
             lives under one namespace: one bucket holds them all.
    wild:    all start with "*/": no first segment to narrow the search.
    """
    if shape == "literal":
        return [f"s{k}/node/*".encode() for k in range(n)]
    if shape == "shared":
        return [f"app/n{k}/{'*' if k % 2 else 'cpu'}".encode() for k in range(n)]
    if shape == "wild":
        return [f"*/n{k}/cpu".encode() for k in range(n)]
    raise ValueError(shape)


KEYS = {"literal": lambda n: f"s{n // 2}/node/cpu".encode(),
        "shared": lambda n: f"app/n{n // 2}/cpu".encode(),
        "wild": lambda n: f"x/n{n // 2}/cpu".encode()}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("shape", ["literal", "shared", "wild"])
def test_index_match(benchmark, shape, n):
    idx = index.PatternIndex()
    for owner, pat in enumerate(patterns(shape, n)):
        idx.add(owner, pat)
    key = KEYS[shape](n)
    assert idx.count_matches(key) == 1
    benchmark.extra_info.update(patterns=n, shape=shape)
    benchmark(idx.count_matches, key)


def test_index_match_empty(benchmark):
    """The floor: one Python call into an empty index."""
    idx = index.PatternIndex()
    benchmark(idx.count_matches, b"app/n1/cpu")


def test_index_add_remove(benchmark):
    """Subscribe and unsubscribe one pattern in an index of 100,000."""
    idx = index.PatternIndex()
    for owner, pat in enumerate(patterns("literal", 100_000)):
        idx.add(owner, pat)

    def churn():
        idx.remove(idx.add(7, b"churn/*/x"))

    benchmark(churn)


def test_pattern_matches(benchmark):
    """One pattern against one key, the unit of every bucket scan."""
    assert protocol.matches(b"app/*/cpu/", b"app/n7/cpu/load")
    benchmark(protocol.matches, b"app/*/cpu/", b"app/n7/cpu/load")


PACKET = b"MSG bench/k\0" + b"x" * 64


def test_sendq_push_pop(benchmark):
    """One packet queued to one client and sent: the path of a client that cannot keep up."""
    q = sendq.SendQueueSim(1)

    def one():
        q.push(PACKET)
        q.pop(0)

    benchmark(one)


@pytest.mark.parametrize("order", ["queue", "stack", "random"])
def test_sendq_burst(benchmark, order):
    """64 packets queued, then sent in one batch (one sendmmsg's worth)."""
    q = sendq.SendQueueSim(1)

    def burst():
        for _ in range(64):
            q.push(PACKET)
        assert len(q.pop(0, order, 64)) == 64

    benchmark.extra_info["ops"] = 64
    benchmark(burst)


def test_sendq_fanout(benchmark):
    """One packet shared by 64 queues (stored once), then sent from each."""
    q = sendq.SendQueueSim(64)

    def fan():
        q.push(PACKET)
        for i in range(64):
            q.pop(i)

    benchmark.extra_info["ops"] = 64
    benchmark(fan)
