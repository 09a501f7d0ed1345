"""Hostile input: fuzzing the compiled core, and a live broker under garbage.

Part 1 drives the compiled functions directly with hypothesis: the parser and
matcher against the plain-Python oracle in sbus._ref, the '!' and !/cred/
rules, the pattern index against a linear scan, and the shared-packet send
queues against a model (every pushed packet leaves each queue exactly once,
in the order the queue promises, and the process-wide packet counters
balance). ``SBUS_FUZZ_EXAMPLES`` sets the number of examples (default a few
thousand for ``make test``; ``make fuzz`` uses 200000). Every crash ever found
goes into ``CRASH_REGRESSIONS`` below and is replayed in a child process, so a
segfault fails one test instead of killing the run.

Part 2 is a live fuzz over real sockets on both backends: hostile client
processes send random verbs, missing NULs, huge patterns, SUB/UNSUB bursts,
'!' in every position, invalid and foreign !/cred/ forms, oversized packets,
empty packets and half-closed sockets while a well-behaved publisher and
subscriber pair checks that every message of theirs (public and !/cred/
private) arrives once and in order. ``SBUS_FUZZ_SECONDS`` sets how long the
hostile clients run per backend (default 6, or 30 when SBUS_FUZZ_EXAMPLES is
raised above the default). The module doubles as the hostile worker script:
``python test_fuzz.py hostile ...``.

Part 3 checks the limits against memory abuse: --max-subscriptions,
--max-pattern and their defaults.
"""
from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter

DEFAULT_EXAMPLES = 2000
EXAMPLES = int(os.environ.get("SBUS_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
LIVE_SECONDS = float(os.environ.get(
    "SBUS_FUZZ_SECONDS", 6 if EXAMPLES <= DEFAULT_EXAMPLES else 30))
SO_SNDBUFFORCE = 32
MAX_MESSAGE = 409600


# =============================================================================
# The hostile worker (runs in its own process; imports nothing from pytest)
# =============================================================================

WHOAMI = b"CMSG !/cred/whoami"

# Keys and patterns the steady pair uses; hostile packets never carry them,
# so anything the steady subscriber receives must be the steady publisher's.
STEADY = b"steady"

BAD_CRED = [
    b"!/cred/", b"!/cred/1", b"!/cred/1/2", b"!/cred/1/2/3", b"!/cred/x/y/z/",
    b"!/cred/*/*/*/", b"!/cred/*/2/3/k", b"!/cred/+1/2/3/k", b"!/cred/ 1/2/3/k",
    b"!/cred/99999999999/0/0/k", b"!/cred/4294967296/0/0/", b"!/cred/whoami",
    b"!/cred/-1/0/0/k", b"!/cred/0x1/0/0/k", b"!/cred/1/2/3/!/cred/", b"!/cred/1/2/3/!/cred/1/2",
    b"!/cred/1/2/3/!", b"!/cred/1/2/3/!/x", b"!/cred////!/cred/*/*/", b"!/cred//////",
    b"!/cred/\xff/0/0/", b"!/cred/1\x002/3/4/",
]
CONTROLS = [
    b"CMSG blocking/soft/queue", b"CMSG blocking/soft/discard", b"CMSG blocking/soft/error",
    b"CMSG blocking/soft/block", b"CMSG blocking/hard/discard", b"CMSG blocking/hard/block",
    b"CMSG blocking/hard/error", b"CMSG order/queue", b"CMSG order/stack",
    b"CMSG order/random", b"CMSG echo/off", b"CMSG echo/on", b"CMSG stats", WHOAMI,
    b"CMSG blocking/soft/", b"CMSG blocking/", b"CMSG order/", b"CMSG ", b"CMSG \0",
    b"CMSG blocking/soft/queue\0tail\0more", b"CMSG !/cred/whoami\0x",
    b"CMSG !/cred/1/2/3/k\0x", b"CMSG stats/\0", b"CMSG echo", b"CMSG \xff\xfe",
]
VERBS = [b"SUB ", b"UNSUB ", b"MSG ", b"CMSG ", b"SUB", b"UNSUB", b"MSG", b"CMSG", b"sub ",
         b"msg ", b"PUB ", b"SUBSCRIBE ", b" SUB ", b"SUB\0", b"MSG\0", b"\0", b"S", b"UNSU",
         b"SUB  ", b"MSG\t", b"XMSG ", b"\xffSUB "]
ATOMS = [b"a", b"b", b"/", b"*", b"!", b"!/cred/", b"0", b"1", b"//", b"**", b"\xff", b" ",
         b"4294967295", b"4294967296", b"a*", b"*/", b"x!", b"!x", b"\n"]


def _rand_key(rng: random.Random, maxlen=12) -> bytes:
    return b"".join(rng.choice(ATOMS) for _ in range(rng.randrange(maxlen + 1)))


def _bang_everywhere(rng: random.Random) -> bytes:
    base = rng.choice([b"a/b/c", b"x", b"", b"/", b"aa/bb/", b"!/cred////k", b"*/*/"])
    pos = rng.randrange(len(base) + 1)
    return base[:pos] + b"!" + base[pos:]


class Hostile:
    """One process's worth of hostile clients, driven round-robin."""

    def __init__(self, address, seed, nclients, victim_cred):
        self.address = address
        self.rng = random.Random(seed)
        self.socks = [None] * nclients
        self.victim_cred = victim_cred        # b"!/cred/G/U/P/" of the steady subscriber
        self.own = (os.getgid(), os.getuid(), os.getpid())
        self.stats = Counter()
        self.leaks = []
        self.actions = [
            (self.random_verb, 6), (self.msg_without_nul, 3), (self.huge_pattern, 2),
            (self.sub_unsub_burst, 3), (self.bang_everywhere, 5), (self.bad_cred, 4),
            (self.foreign_cred, 2), (self.oversized, 1), (self.half_close, 2),
            (self.empty_packet, 1), (self.garbage, 4), (self.valid_traffic, 8),
            (self.control, 4), (self.abrupt_close, 2), (self.drain, 6),
            (self.sub_everything, 2), (self.unsub_unknown, 2),
        ]
        self.weights = [w for _, w in self.actions]
        # The first half of the clients mostly behave, so they live long enough
        # to pile up subscriptions, queues and flood modes before they go.
        fatal = {"random_verb", "msg_without_nul", "huge_pattern", "bang_everywhere",
                 "bad_cred", "foreign_cred", "oversized", "half_close", "empty_packet",
                 "garbage", "abrupt_close"}
        self.calm_weights = [w / 50 if f.__name__ in fatal else w for f, w in self.actions]

    # -- plumbing ----------------------------------------------------------

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5)
        s.connect(self.address)
        try:        # room for oversized packets (root may force it)
            s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 4 << 20)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setblocking(False)
        self.stats["connects"] += 1
        return s

    def send(self, s, packet):
        """Send without blocking; a full socket just drops the attempt."""
        if STEADY in packet:
            packet = packet.replace(STEADY, b"xteady")
        try:
            s.send(packet)
            self.stats["packets"] += 1
        except BlockingIOError:
            self.stats["would_block"] += 1

    def check_packet(self, packet):
        """A !/cred/ message must name our own credentials, never another's
        (an empty field names no one)."""
        if not packet.startswith(b"MSG !/cred/"):
            return
        m = re.match(rb"MSG !/cred/(\d*)/(\d*)/(\d*)/", packet)
        if m is None or any(g and int(g) != own for g, own in zip(m.groups(), self.own)):
            self.leaks.append(packet[:80].decode("latin-1"))

    def drain(self, s):
        for _ in range(256):
            try:
                packet = s.recv(1 << 20)
            except BlockingIOError:
                return
            if packet == b"":
                raise ConnectionResetError("eof")
            self.stats["received"] += 1
            self.check_packet(packet)

    # -- actions -----------------------------------------------------------

    def random_verb(self, s):
        rng = self.rng
        packet = rng.choice(VERBS) + _rand_key(rng)
        if rng.random() < 0.5:
            packet += b"\0" + rng.randbytes(rng.randrange(20))
        self.send(s, packet)

    def msg_without_nul(self, s):
        self.send(s, b"MSG " + _rand_key(self.rng).replace(b"\0", b""))

    def huge_pattern(self, s):
        n = self.rng.choice([4095, 4096, 4097, 5000, 65536, 300000])
        verb = self.rng.choice([b"SUB ", b"UNSUB ", b"SUB !/cred////"])
        self.send(s, verb + b"p" * n)

    def sub_unsub_burst(self, s):
        rng = self.rng
        patterns = [_rand_key(rng, 6).replace(b"!", b"") for _ in range(rng.randrange(1, 60))]
        for p in patterns:
            self.send(s, b"SUB " + p)
        rng.shuffle(patterns)
        for p in patterns[: rng.randrange(len(patterns) + 1)]:
            self.send(s, b"UNSUB " + p)

    def bang_everywhere(self, s):
        verb = self.rng.choice([b"SUB ", b"UNSUB ", b"MSG ", b"CMSG "])
        packet = verb + _bang_everywhere(self.rng)
        if verb == b"MSG ":
            packet += b"\0x"
        self.send(s, packet)

    def bad_cred(self, s):
        verb = self.rng.choice([b"SUB ", b"UNSUB ", b"MSG "])
        packet = verb + self.rng.choice(BAD_CRED)
        if verb == b"MSG ":
            packet += b"\0payload"
        self.send(s, packet)

    def foreign_cred(self, s):
        """Subscribe to the steady subscriber's private keys (refused)."""
        rest = self.rng.choice([b"", b"x", b"*", b"xteady/"])
        self.send(s, b"SUB " + self.victim_cred + rest)

    def oversized(self, s):
        n = self.rng.choice([MAX_MESSAGE + 1, MAX_MESSAGE + 2, 2 * MAX_MESSAGE, 1 << 20])
        verb = self.rng.choice([b"MSG k\0", b"SUB ", b"CMSG k\0", b"GARBAGE"])
        self.send(s, verb + b"\0" * (n - len(verb)))

    def half_close(self, s):
        how = self.rng.choice([socket.SHUT_WR, socket.SHUT_RD, socket.SHUT_RDWR])
        self.send(s, b"SUB half/closed")
        self.send(s, b"MSG half/closed\0x")
        s.shutdown(how)
        if how != socket.SHUT_WR:
            raise ConnectionResetError("half-closed for reading")
        # Write side closed: the broker sees EOF, we keep reading until it closes.
        s.settimeout(5)
        try:
            while s.recv(1 << 20):
                pass
        except OSError:
            pass
        raise ConnectionResetError("half-closed for writing")

    def empty_packet(self, s):
        self.send(s, b"")

    def garbage(self, s):
        self.send(s, self.rng.randbytes(self.rng.randrange(1, 200)))

    def valid_traffic(self, s):
        rng = self.rng
        for _ in range(rng.randrange(1, 20)):
            key = rng.choice([b"fuzz/a", b"fuzz/b/c", b"x", b"", b"a/b", b"!/cred////anyone",
                              b"!/cred/0/0/1/init-only"])   # pid 1 is no client here
            if rng.random() < 0.3:
                key = _rand_key(rng, 4).replace(b"!", b"")
            self.send(s, b"MSG " + key + b"\0" + rng.randbytes(rng.randrange(200)))
        if rng.random() < 0.05:
            self.send(s, b"MSG fuzz/big\0" + b"B" * rng.randrange(100000, 400000))

    def control(self, s):
        self.send(s, self.rng.choice(CONTROLS))

    def abrupt_close(self, s):
        for i in range(self.rng.randrange(50)):
            self.send(s, b"MSG fuzz/a\0%d" % i)
        raise ConnectionResetError("closed mid-burst")

    def sub_everything(self, s):
        self.send(s, b"SUB " + self.rng.choice([b"", b"*", b"*/", b"!/cred////", b"fuzz/"]))

    def unsub_unknown(self, s):
        self.send(s, b"UNSUB " + _rand_key(self.rng).replace(b"!", b"x"))

    # -- the loop ------------------------------------------------------------

    def run(self, seconds):
        deadline = time.monotonic() + seconds
        rng = self.rng
        while time.monotonic() < deadline:
            i = rng.randrange(len(self.socks))
            try:
                if self.socks[i] is None:
                    self.socks[i] = self.connect()
                s = self.socks[i]
                weights = self.calm_weights if i < len(self.socks) // 2 else self.weights
                action = rng.choices(self.actions, weights)[0][0]
                self.stats["action:" + action.__name__] += 1
                action(s)
                if rng.random() < 0.3:
                    self.drain(s)
            except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError,
                    socket.timeout, OSError) as e:
                self.stats["disconnects"] += 1
                self.stats["disconnect:" + type(e).__name__] += 1
                if self.socks[i] is not None:
                    self.socks[i].close()
                    self.socks[i] = None
            time.sleep(0.0005)
        for s in self.socks:
            if s is not None:
                try:
                    self.drain(s)
                except OSError:
                    pass
                s.close()
        return {"pid": os.getpid(), "stats": dict(self.stats), "leaks": self.leaks[:20],
                "nleaks": len(self.leaks)}


def hostile_main(argv):
    address, seed, seconds, nclients, victim = argv
    report = Hostile(address, int(seed), int(nclients), victim.encode()).run(float(seconds))
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "hostile":
    sys.exit(hostile_main(sys.argv[2:]))


# =============================================================================
# Part 1: hypothesis against the compiled core
# =============================================================================

import pytest  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes,  # noqa: E402
                                 initialize, invariant, precondition, rule)

from sbus._core import index as cindex  # noqa: E402
from sbus._core import protocol as cproto  # noqa: E402
from sbus._core import sendq as csendq  # noqa: E402
from sbus._ref import index as rindex  # noqa: E402
from sbus._ref import protocol as rproto  # noqa: E402

from steady import SteadyPair
from conftest import BACKENDS, SBUSD, fd_count, report_line  # noqa: E402

# A timeout that grows with the example count (make fuzz runs for an hour);
# tests with a timeout mark of their own keep it.
FUZZ_TIMEOUT = max(300, int(EXAMPLES * 0.05))
pytestmark = pytest.mark.timeout(FUZZ_TIMEOUT)
STATEFUL_EXAMPLES = max(30, EXAMPLES // 15)

FUZZ = settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

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
VERB = st.sampled_from(VERBS + [b"", b"MSG \0", b"CMSG \0", b"UNSUB \0"])


@FUZZ
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


@FUZZ
@given(any_bytes, any_bytes)
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
    any_bytes)


@FUZZ
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

index_segment = st.sampled_from([b"a", b"b", b"ab", b"", b"*", b"a*", b"*b", b"x!", b"\xff", b"\0"])
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


# =============================================================================
# Part 2: live fuzz against a real broker
# =============================================================================

def _known_reasons():
    """The schema's disconnect reasons (sbus.logschema is the source of truth;
    plain Python, so a rebuild of the compiled core mid-run cannot break it)."""
    from sbus import logschema
    return set(logschema.DISCONNECT_REASONS)


def sync(sock):
    """Round-trip through the broker; returns packets that arrived meanwhile."""
    sock.send(WHOAMI)
    other = []
    while True:
        packet = sock.recv(1 << 20)
        if packet.startswith(WHOAMI + b"\0"):
            return packet[len(WHOAMI) + 1:], other
        if packet == b"":
            raise ConnectionResetError("eof while syncing")
        other.append(packet)


def assert_disconnected(sock, timeout=5.0):
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(1 << 20)
            if data == b"":
                return
    except (ConnectionResetError, BrokenPipeError):
        return


RATE = 1000     # steady messages per second during the live fuzz
WARN_REASONS_WITH_DETAIL = {"protocol_error", "bang_misuse", "cred_refused", "limit",
                            "oversize", "flood_error", "error"}


@pytest.mark.timeout(max(300, int(LIVE_SECONDS * 10)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_live_fuzz_broker_survives_and_steady_pair_loses_nothing(start_broker, backend, request):
    nproc, per_proc = 3, 10
    b = start_broker("--block-timeout", "1", "--queue-max-bytes", str(2 << 20),
                     "--total-max-bytes", str(96 << 20), "--stats-interval", "0",
                     backend=backend, log_level="info")
    known = _known_reasons()
    pair = SteadyPair(b)
    fds_before = fd_count(b.pid())
    workers = [subprocess.Popen(
        [sys.executable, __file__, "hostile", b.address, str(1000 * i + os.getpid() % 1000),
         str(LIVE_SECONDS), str(per_proc), pair.cred_prefix.decode()],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(nproc)]
    try:
        # The steady pair talks throughout the hostile run, about RATE a second.
        started = time.monotonic()
        while any(w.poll() is None for w in workers):
            due = int((time.monotonic() - started) * RATE) - pair.sent
            if due <= 0 or pair.publish(min(due, 50)) == 0:
                time.sleep(0.002)
            assert not pair.errors, pair.errors
            assert b.proc.poll() is None, f"broker died: {b.stderr_text()[-3000:]}"
        while pair.sent < 3000:         # at least a few thousand messages
            if pair.publish(200) == 0:
                time.sleep(0.002)
    finally:
        reports = []
        for w in workers:
            try:
                out, err = w.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                w.kill()
                out, err = w.communicate()
            assert w.returncode == 0, err.decode(errors="replace")[-3000:]
            reports.append(json.loads(out))
    assert pair.finish(), f"steady pair: sent {pair.sent}, received {pair.received}, {pair.errors}"
    assert b.proc.poll() is None, f"broker died: {b.stderr_text()[-3000:]}"

    # Nobody saw someone else's private messages.
    assert sum(r["nleaks"] for r in reports) == 0, [r["leaks"] for r in reports]

    # Every hostile connection is logged as closed, with a known reason.
    hostile_pids = {r["pid"] for r in reports}
    connects = sum(r["stats"].get("connects", 0) for r in reports)
    deadline = time.monotonic() + 30
    while True:
        recs = b.records()
        mine = [r for r in recs if r.get("event") == "client_disconnect" and r["pid"] in hostile_pids]
        if len(mine) >= connects or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    opened = [r for r in recs if r.get("event") == "client_connect" and r["pid"] in hostile_pids]
    assert len(opened) == connects, (len(opened), connects)
    assert len(mine) == connects, f"{connects} hostile connections, {len(mine)} disconnects logged"
    assert {r["client"] for r in mine} == {r["client"] for r in opened}
    all_disconnects = [r for r in recs if r.get("event") == "client_disconnect"]
    bad = [r for r in all_disconnects if r["reason"] not in known]
    assert not bad, bad[:5]
    missing_detail = [r for r in mine if r["reason"] in WARN_REASONS_WITH_DETAIL and not r["detail"]]
    assert not missing_detail, missing_detail[:5]
    reasons = Counter(r["reason"] for r in mine)
    # The garbage reached every rule it aims at.
    for reason in ("eof", "protocol_error", "bang_misuse", "cred_refused", "limit", "oversize"):
        assert reasons[reason] > 0, (reason, reasons)

    # The broker is healthy: no traceback, no descriptor kept, still serving.
    assert "Traceback" not in b.stderr_text(), b.stderr_text()[-3000:]
    assert fd_count(b.pid()) == fds_before
    fresh = b.connect()
    fresh.send(b"SUB after/fuzz")
    cred, _ = sync(fresh)
    assert cred.startswith(b"!/cred/")
    pair.pub.send(b"MSG after/fuzz\0ok")
    assert fresh.recv(100) == b"MSG after/fuzz\0ok"
    pair.close()
    stats = Counter()
    for r in reports:
        stats.update(r["stats"])
    report_line(request, f"\n[live fuzz {backend}] {LIVE_SECONDS:g}s, {nproc}x{per_proc} hostile "
                       f"clients: {connects} connections, {stats['packets']} packets sent, "
                       f"{stats['disconnects']} disconnects seen; steady pair {pair.received} "
                       f"messages in order; broker reasons {dict(reasons)}")


BANG_BASES = [b"a/b/c", b"x/", b"", b"!/cred////k/", b"!/cred/1/2/3/k", b"*/*"]


def _bang_cases():
    for base in BANG_BASES:
        for i in range(len(base) + 1):
            yield base[:i] + b"!" + base[i:]


def test_bang_in_every_position_follows_the_oracle(broker):
    """'!' inserted at every position of a few keys, as SUB, UNSUB and MSG:
    the broker keeps the client exactly when the plain-Python oracle says the
    key is fine, and otherwise disconnects it with the matching reason."""
    kept, dropped = [], 0
    for key in _bang_cases():
        for verb in (b"SUB ", b"UNSUB ", b"MSG "):
            verdict = rproto.check_key(key, verb != b"MSG ")
            if verb == b"MSG ":
                want = None if verdict == "ok" else "bang_misuse"
            elif verb == b"SUB ":
                want = {"ok": None, "bang_misuse": "bang_misuse",
                        "cred_malformed": "cred_refused"}[verdict]
                form = rproto.cred_form(key)
                if form is not None and form[:3] != (None, None, None) and verdict == "ok":
                    want = "cred_refused"       # someone else's credentials
            else:   # UNSUB: a reserved '!' is fatal as in SUB, unless the pattern's
                # !/cred/ form already rules it out (malformed, or someone else's
                # credentials): such a pattern was never stored, so it is not found
                form = rproto.cred_form(key)
                ruled_out = key.startswith(b"!/cred/") and (form is None or form[:3] != (None, None, None))
                want = "bang_misuse" if verdict == "bang_misuse" and not ruled_out else None
            s = broker.connect()
            s.send(verb + key + (b"\0x" if verb == b"MSG " else b""))
            if want is None:
                sync(s)         # still connected; closed at the end
                kept.append(s)
                continue
            assert_disconnected(s)
            s.close()
            dropped += 1
            # Kept clients stay open, so disconnects arrive one by one, in order.
            deadline = time.monotonic() + 10
            while len(broker.events("client_disconnect")) < dropped and time.monotonic() < deadline:
                time.sleep(0.01)
            got = broker.events("client_disconnect")[dropped - 1]["reason"]
            assert got == want, (verb, key, got, want)
    assert len(broker.events("client_disconnect")) == dropped
    assert len(kept) > 20 and dropped > 20, (len(kept), dropped)
    for s in kept:
        s.close()


# =============================================================================
# Part 3: limits against memory abuse
# =============================================================================

def _limit_disconnect(b, predicate=lambda r: True):
    return b.wait_for_event("client_disconnect", timeout=10,
                            predicate=lambda r: r["reason"] == "limit" and predicate(r))


def test_max_subscriptions_flag(start_broker, backend):
    b = start_broker("--max-subscriptions", "10", backend=backend)
    s, other = b.connect(), b.connect()
    for i in range(10):
        s.send(b"SUB k/%d" % i)
    for i in range(5):                  # unsubscribing frees room
        s.send(b"UNSUB k/%d" % i)
        s.send(b"SUB k/%d" % i)
    sync(s)
    for i in range(10):
        other.send(b"SUB k/%d" % i)     # the limit is per client
    sync(other)
    s.send(b"SUB k/10")
    assert_disconnected(s)
    rec = _limit_disconnect(b)
    assert "10" in rec["detail"]
    assert rec["counters"]["subscriptions"] == 10
    refused = b.wait_for_event("subscribe", predicate=lambda r: r["accepted"] is False)
    assert refused["reason"] == "too_many_subscriptions"
    sync(other)                         # the other client is untouched
    assert [r["client"] for r in b.events("client_disconnect")] == [rec["client"]]


def test_max_pattern_flag(start_broker, backend):
    b = start_broker("--max-pattern", "100", backend=backend)
    s = b.connect()
    s.send(b"SUB " + b"p" * 100)
    s.send(b"SUB !/cred////" + b"q" * 90)       # 100 bytes as sent
    sync(s)
    s.send(b"SUB " + b"p" * 101)
    assert_disconnected(s)
    rec = _limit_disconnect(b)
    assert "100" in rec["detail"]
    assert rec["counters"]["subscriptions"] == 2


def test_default_limits_are_in_help():
    out = subprocess.run([SBUSD, "--help"], capture_output=True, text=True, timeout=30).stdout
    assert re.search(r"--max-subscriptions N.*\(default 65536\)", out), out
    assert re.search(r"--max-pattern BYTES.*\(default 4096\)", out), out


def test_default_pattern_limit_is_4096_bytes(broker):
    s = broker.connect()
    pub = broker.connect()
    s.send(b"SUB " + b"p" * 4096)
    sync(s)
    pub.send(b"MSG " + b"p" * 4096 + b"\0long")
    assert s.recv(10000) == b"MSG " + b"p" * 4096 + b"\0long"
    s.send(b"SUB " + b"p" * 4097)
    assert_disconnected(s)
    rec = _limit_disconnect(broker)
    assert "4096" in rec["detail"]


def test_default_subscription_limit_is_65536(start_broker):
    b = start_broker(log_level="warning")
    s = b.connect(timeout=60)
    s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)
    for i in range(65536):
        s.send(b"SUB s/%d" % i)
    sync(s)
    s.send(b"SUB s/one-too-many")
    assert_disconnected(s, timeout=30)
    rec = _limit_disconnect(b)
    assert "65536" in rec["detail"] and rec["counters"]["subscriptions"] == 65536
