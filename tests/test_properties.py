"""Properties of the compiled core, with hypothesis: the parser and matcher
against the plain-Python oracle in sbus._ref, the '!' and !/cred/ rules, the
pattern index against a linear scan, and the shared-packet send queues
against a model (every pushed packet leaves each queue exactly once, in the
order the queue promises, and the process-wide packet counters balance).
The spec's worked examples are tables in test_matching.py.

``SBUS_FUZZ_EXAMPLES`` sets the number of examples (default a few thousand
for ``make test``; ``make fuzz`` 20000 unless FUZZ_EXAMPLES says more). Every crash ever found goes
into ``CRASH_REGRESSIONS`` below and is replayed in a child process, so a
segfault fails one test instead of killing the run.
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from sbus._core import index as cindex
from sbus._core import protocol as cproto
from sbus._core import sendq as csendq
from sbus._ref import index as rindex
from sbus._ref import protocol as rproto
from sbus.client import MAX_MESSAGE

from support import report_line
from support.budget import EXAMPLES, FUZZ_TIMEOUT
from support.garbage import ATOMS, VERBS

# Tests with a timeout mark of their own keep it.
pytestmark = pytest.mark.timeout(FUZZ_TIMEOUT)
STATEFUL_EXAMPLES = max(30, EXAMPLES // 15)

FUZZ = settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

# Properties that two tests used to check, one on structured and one on
# arbitrary input, draw from both and get both tests' examples.
MERGED = settings(FUZZ, max_examples=2 * EXAMPLES)

_calls = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_examples(request):
    """Say how many inputs each fuzz target saw (shown even under -q)."""
    started = time.monotonic()
    yield
    if not _calls:
        return
    line = ", ".join(f"{k}={v}" for k, v in sorted(_calls.items()))
    report_line(request, f"\n[fuzz] SBUS_FUZZ_EXAMPLES={EXAMPLES}; inputs per target: {line}; "
                       f"{time.monotonic() - started:.1f}s")


# Byte strings built from the tokens that matter to the parser and matcher,
# mixed with arbitrary bytes.
ATOM = st.sampled_from(ATOMS + [b"\0", b"!/cred/1/2/3/", b"!/cred////", b"!/cred/*/",
                                b"99999999999", b"/!", b"!/", b"whoami", b"SUB ", b"MSG "])
token_bytes = st.lists(st.one_of(ATOM, st.binary(max_size=3)), max_size=16).map(b"".join)
any_bytes = st.one_of(token_bytes, st.binary(max_size=40))
no_nul = any_bytes.map(lambda b: b.replace(b"\0", b""))
VERB = st.sampled_from(VERBS + [b"", b"SU", b"MSG \0", b"CMSG \0", b"UNSUB \0"])
# Patterns and keys made of path segments, so that matches are frequent.
SEGMENT = st.sampled_from([b"a", b"b", b"ab", b"", b"*", b"a*", b"*b", b"x!", b"!"])
segment_pattern = (st.lists(SEGMENT, max_size=4).map(b"/".join)
                   | st.sampled_from([b"", b"/", b"*/"]))
segment_key = st.lists(st.sampled_from([b"a", b"b", b"ab", b"", b"ba", b"x!"]),
                       max_size=5).map(b"/".join)


@MERGED
@given(st.one_of(st.tuples(VERB, any_bytes).map(b"".join), st.binary(max_size=64)))
@example(b"")
@example(b"MSG ")
@example(b"CMSG ")
@example(b"MSG \0")
@example(b"UNSUB")
@example(b"SUB \0\0\0")
def test_parse_agrees_with_spec_regexes(packet):
    _calls["parse"] += 1
    assert cproto.parse(packet) == rproto.parse(packet)


@FUZZ
@given(st.sampled_from(["SUB", "UNSUB", "MSG", "CMSG"]), no_nul,
       st.one_of(st.none(), any_bytes))
def test_parse_round_trips(verb, key, payload):
    """Build a packet from (verb, key, payload) and read the same back."""
    _calls["parse_round_trip"] += 1
    if verb == "MSG" and payload is None:
        payload = b""
    packet = verb.encode() + b" " + key + (b"" if payload is None else b"\0" + payload)
    assert cproto.parse(packet) == (verb, key, payload)
    assert rproto.parse(packet) == (verb, key, payload)


@settings(FUZZ, max_examples=max(20, EXAMPLES // 50))
@given(st.sampled_from([b"SUB ", b"UNSUB ", b"MSG ", b"CMSG ", b"X"]),
       st.integers(0, 2 * MAX_MESSAGE), st.sampled_from([b"a", b"\0", b"/", b"*", b"!"]),
       st.booleans())
def test_parse_large_packets(verb, n, fill, nul_at_end):
    _calls["parse_large"] += 1
    packet = verb + fill * n + (b"\0" if nul_at_end else b"")
    assert cproto.parse(packet) == rproto.parse(packet)


@MERGED
@given(any_bytes | segment_pattern, any_bytes | segment_key)
@example(b"*b", b"b")
@example(b"a/*/c/", b"a/b/c/d/e")
@example(b"/", b"")
@example(b"*/", b"/")
def test_matches_agrees_with_reference(pattern, key):
    _calls["matches"] += 1
    got = cproto.matches(pattern, key)
    assert got == rproto.matches(pattern, key)
    if pattern == b"":
        assert got
    elif b"*" not in pattern and not pattern.endswith(b"/"):
        assert got == (pattern == key)


@settings(FUZZ, max_examples=max(20, EXAMPLES // 50))
@given(st.lists(st.sampled_from([b"*", b"/", b"a", b"*/", b"a*", b"!"]), max_size=40),
       st.integers(0, 4000), st.sampled_from([b"a", b"/", b"a/", b"ab/"]))
def test_matches_long_inputs(parts, reps, unit):
    """Long and star-heavy patterns: no crash, no blow-up, same answer."""
    _calls["matches_long"] += 1
    pattern = b"".join(parts) * (1 + reps // 100)
    key = unit * reps
    assert cproto.matches(pattern, key) == rproto.matches(pattern, key)
    assert cproto.matches(key, key)      # a star-free pattern matches itself


cred_key = st.one_of(
    st.tuples(st.just(b"!/cred/"), st.lists(st.sampled_from(
        [b"0", b"1", b"4294967295", b"4294967296", b"007", b"", b"*", b"/", b"x", b"99999999999999999999999"]),
        max_size=8).map(b"/".join), any_bytes).map(b"".join),
    st.lists(st.sampled_from([b"!", b"/", b"a", b"!/cred/", b"1", b"*", b"0/"]),
             max_size=10).map(b"".join),
    any_bytes)


@MERGED
@given(cred_key, st.booleans())
@example(b"!/cred/4294967295/4294967295/4294967295/", False)
@example(b"!/cred/" + b"9" * 40 + b"/0/0/", False)
@example(b"!/cred/1/2/3/!/cred/*/*/*/x", True)
def test_check_key_and_cred_form_agree_with_reference(key, is_pattern):
    _calls["check_key"] += 1
    assert cproto.check_key(key, is_pattern) == rproto.check_key(key, is_pattern)
    form = cproto.cred_form(key)
    assert form == rproto.cred_form(key)
    if form is not None:
        assert key[:form[3]].startswith(b"!/cred/") and key[form[3] - 1:form[3]] == b"/"


# ---- the pattern index against a linear scan --------------------------------

index_segment = st.sampled_from([b"a", b"b", b"ab", b"", b"*", b"a*", b"*b", b"x!", b"!",
                                 b"\xff", b"\0"])
index_pattern = st.one_of(
    st.lists(index_segment, max_size=4).map(b"/".join),
    st.sampled_from([b"", b"/", b"*/", b"*", b"a/"]),
    st.binary(max_size=6))
index_key = st.lists(st.sampled_from([b"a", b"b", b"ab", b"", b"ba", b"x!", b"\xff", b"\0"]),
                     max_size=5).map(b"/".join)


def _trie_path(pattern):
    """The trie steps a pattern descends (see sbus/_core/index.pxd), written
    independently: one step per segment that is literal or exactly '*',
    stopping at a segment that mixes '*' with other bytes or at a trailing '/'."""
    if not pattern:
        return ()
    steps = []
    segments = pattern.split(b"/")
    for i, seg in enumerate(segments):
        if i == len(segments) - 1 and seg == b"" and i > 0:
            break                   # the trailing '/'
        if seg != b"*" and b"*" in seg:
            break
        steps.append(b"*" if seg == b"*" else (b"=" + seg))
    return tuple(steps)


class IndexMachine(RuleBasedStateMachine):
    """Random add/remove/match sequences, including SUB/UNSUB bursts."""
    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.c = cindex.PatternIndex()
        self.r = rindex.LinearIndex()
        self.live = {}          # compiled handle -> (reference handle, pattern)

    def _add(self, owner, pattern):
        ch = self.c.add(owner, pattern)
        self.live[ch] = (self.r.add(owner, pattern), pattern)
        return ch

    def _remove(self, ch):
        rh, _ = self.live.pop(ch)
        self.c.remove(ch)
        self.r.remove(rh)

    @rule(target=handles, owner=st.integers(0, 9), pattern=index_pattern)
    def add(self, owner, pattern):
        return self._add(owner, pattern)

    @rule(h=consumes(handles))
    def remove(self, h):
        if h in self.live:      # a burst may have removed it already
            self._remove(h)

    @rule(owner=st.integers(0, 9), patterns=st.lists(index_pattern, min_size=1, max_size=50),
          keep=st.integers(0, 50), key=index_key)
    def burst(self, owner, patterns, keep, key):
        new = [self._add(owner, p) for p in patterns]
        assert self.c.match(key) == self.r.match(key)
        for h in new[keep:]:
            self._remove(h)

    @rule(key=index_key)
    def match(self, key):
        _calls["index_match"] += 1
        assert self.c.match(key) == self.r.match(key)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def match_stored(self, data):
        """A key built from a stored pattern, so matches actually happen."""
        _, pattern = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        key = pattern.replace(b"*", data.draw(st.sampled_from([b"", b"q", b"qq"])))
        if key.endswith(b"/"):
            key += data.draw(st.sampled_from([b"", b"z", b"z/y"]))
        assert self.c.match(key) == self.r.match(key)
        assert self.c.count_matches(key) >= len(self.c.match(key))

    @invariant()
    def same_size(self):
        assert len(self.c) == len(self.r) == len(self.live)
        paths = [_trie_path(p) for _, p in self.live.values()]
        # The root keeps exactly the patterns with nothing to descend by.
        assert self.c.root_count == sum(1 for path in paths if not path)
        # One literal node per distinct path prefix ending in a literal step:
        # nodes no live pattern needs are freed.
        literal = {path[:i + 1] for path in paths for i, step in enumerate(path) if step != b"*"}
        assert self.c.node_count == len(literal)

    def teardown(self):
        for ch in list(self.live):
            self._remove(ch)
        assert len(self.c) == 0 and self.c.node_count == 0 and self.c.root_count == 0
        assert self.c.match(b"a") == []


IndexMachine.TestCase.settings = settings(
    FUZZ, max_examples=STATEFUL_EXAMPLES, stateful_step_count=40)
test_pattern_index_against_linear_scan = pytest.mark.timeout(FUZZ_TIMEOUT)(IndexMachine.TestCase)


# ---- send queues against a model --------------------------------------------

packet_data = st.one_of(st.binary(max_size=30),
                        st.tuples(st.integers(0, 300000), st.sampled_from([b"x", b"y"]))
                        .map(lambda t: t[1] * t[0]))


class SendQueueMachine(RuleBasedStateMachine):
    """Push to any subset of queues, pop in any order, clear: every packet
    leaves each queue that got it exactly once, in the order the queue
    promises, and the process-wide counters balance."""

    @initialize(nq=st.integers(1, 4))
    def start(self, nq):
        self.before = csendq.packet_counters()
        self.sim = csendq.SendQueueSim(nq)
        self.nq = nq
        self.seq = 0
        self.data = {}                        # seq -> bytes
        self.queues = [[] for _ in range(nq)]   # seqs, push order
        self.pushed = [[] for _ in range(nq)]
        self.gone = [[] for _ in range(nq)]     # popped or cleared

    def refs(self, seq):
        return sum(seq in q for q in self.queues)

    @rule(data=packet_data, which=st.lists(st.integers(0, 3), unique=True, max_size=4) | st.none())
    def push(self, data, which):
        queues = list(range(self.nq)) if which is None else [q for q in which if q < self.nq]
        self.sim.push(data, None if which is None else queues)
        self.data[self.seq] = data
        for q in queues:
            self.queues[q].append(self.seq)
            self.pushed[q].append(self.seq)
        self.seq += 1

    @rule(q=st.integers(0, 3), order=st.sampled_from(["queue", "stack", "random"]),
          n=st.integers(0, 100))
    def pop(self, q, order, n):
        _calls["sendq_pop"] += 1
        q %= self.nq
        if order == "random" and n == 0:
            n = 1       # n=0 in random order crashes: see CRASH_REGRESSIONS
        got = self.sim.pop(q, order, n)
        live = self.queues[q]
        n = min(n, 64)
        if order == "queue":
            want = live[:n]
        elif order == "stack":
            want = live[::-1][:n]
        else:
            want = sorted(live, key=lambda s: (self.refs(s) != 1, -len(self.data[s]), s))[:n]
        assert got == [self.data[s] for s in want]
        for s in want:
            live.remove(s)
            self.gone[q].append(s)

    @rule(q=st.integers(0, 3))
    def clear(self, q):
        q %= self.nq
        assert self.sim.clear(q) == len(self.queues[q])
        self.gone[q].extend(self.queues[q])
        self.queues[q] = []

    @invariant()
    def counters_balance(self):
        if not hasattr(self, "sim"):
            return
        for q in range(self.nq):
            assert self.sim.queued(q) == (len(self.queues[q]),
                                          sum(len(self.data[s]) for s in self.queues[q]))
        held = {s for q in self.queues for s in q}
        now = csendq.packet_counters()
        assert now["live"] - self.before["live"] == len(held)
        assert now["bytes"] - self.before["bytes"] == sum(len(self.data[s]) for s in held)
        assert now["allocated"] - now["freed"] == now["live"]

    def teardown(self):
        if not hasattr(self, "sim"):
            return
        for q in range(self.nq):
            self.clear(q)
            assert sorted(self.gone[q]) == sorted(self.pushed[q])   # each exactly once
        after = csendq.packet_counters()
        assert after["live"] == self.before["live"] and after["bytes"] == self.before["bytes"]
        del self.sim
        assert csendq.packet_counters()["live"] == self.before["live"]


SendQueueMachine.TestCase.settings = settings(
    FUZZ, max_examples=STATEFUL_EXAMPLES, stateful_step_count=60)
test_send_queues_against_model = pytest.mark.timeout(FUZZ_TIMEOUT)(SendQueueMachine.TestCase)


def test_dropping_a_queue_sim_with_packets_releases_them():
    before = csendq.packet_counters()
    sim = csendq.SendQueueSim(3)
    for i in range(1000):
        sim.push(b"%d" % i * (i % 50), [i % 3] if i % 4 else None)
    sim.pop(0, "random", 7)
    sim.pop(1, "stack", 64)
    del sim
    after = csendq.packet_counters()
    assert (after["live"], after["bytes"]) == (before["live"], before["bytes"])


# ---- crash regressions ---------------------------------------------------------
#
# Every input that ever crashed the compiled code, replayed in a child process
# (a segfault there fails the test instead of killing pytest). A known, still
# unfixed crash is marked xfail(strict=True): fixing it turns the test green
# and makes the xfail fail, as a reminder to drop the mark.

CRASH_REGRESSIONS = [
    pytest.param(
        "s = SendQueueSim(1); s.push(b'x'); s.pop(0, 'random', 0)",
        id="sendq-random-pop-zero"),
    pytest.param("s = SendQueueSim(2); s.pop(0, 'random', 64); s.pop(1, 'stack', 0); "
                 "s.pop(0, 'queue', 0)", id="sendq-pop-empty"),
    pytest.param("for p in (b'', b'MSG', b'CMSG ', b'UNSUB \\0', b'\\0' * 100000): parse(p)",
                 id="parse-edges"),
    pytest.param("matches(b'*/' * 50000, b'a/' * 50000); matches(b'', b''); "
                 "matches(b'/', b''); matches(b'*', b'/' * 1000)", id="matches-edges"),
    pytest.param("check_key(b'!/cred/' * 20000, True); check_key(b'!/cred/1/2/3/' * 20000); "
                 "cred_form(b'!/cred/' + b'9' * 100000 + b'/0/0/')", id="cred-edges"),
    pytest.param("i = PatternIndex(); hs = [i.add(n, b'%d/x' % n) for n in range(5000)]; "
                 "[i.remove(h) for h in hs]; i.match(b'')", id="index-churn"),
]


@pytest.mark.parametrize("code", CRASH_REGRESSIONS)
def test_crash_regressions(code):
    prelude = ("from sbus._core.sendq import SendQueueSim, packet_counters\n"
               "from sbus._core.protocol import parse, matches, check_key, cred_form\n"
               "from sbus._core.index import PatternIndex\n")
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", prelude + code],
                       capture_output=True, timeout=120)
    assert r.returncode == 0, f"rc={r.returncode} stderr={r.stderr.decode(errors='replace')[-2000:]}"


