"""The flood decision and !/cred/ normalisation as tables, without a broker.

These call the very C functions the broker uses (through small def wrappers),
so each row is one delivery or one SUB pattern the broker would see.
"""
import pytest

from sbus._core.policy import FloodAction as A
from sbus._core.policy import decide, still_blocking
from sbus._core.protocol import PatternRefusal as R
from sbus._core.protocol import normalise

# soft, hard, blocking, reply, over -> action
FLOOD_TABLE = [
    # within the limits, only the soft mode speaks
    ("queue", "discard", False, False, False, A.FLOOD_QUEUE),
    ("discard", "discard", False, False, False, A.FLOOD_DROP_SOFT),
    ("error", "discard", False, False, False, A.FLOOD_CLOSE_SOFT),
    ("block", "discard", False, False, False, A.FLOOD_QUEUE_BLOCK),
    ("block", "discard", True, False, False, A.FLOOD_QUEUE_BLOCK),
    # a control reply is always queued while it fits, whatever the soft mode
    ("discard", "discard", False, True, False, A.FLOOD_QUEUE),
    ("error", "error", False, True, False, A.FLOOD_QUEUE),
    ("block", "discard", False, True, False, A.FLOOD_QUEUE),
    # the soft mode acts before any limit is looked at
    ("discard", "error", False, False, True, A.FLOOD_DROP_SOFT),
    ("error", "discard", False, False, True, A.FLOOD_CLOSE_SOFT),
    # over a limit, the hard mode speaks
    ("queue", "discard", False, False, True, A.FLOOD_DROP_HARD),
    ("queue", "error", False, False, True, A.FLOOD_CLOSE_HARD),
    ("queue", "block", False, False, True, A.FLOOD_QUEUE_BLOCK),
    ("block", "discard", False, False, True, A.FLOOD_DROP_HARD),
    ("block", "error", False, False, True, A.FLOOD_CLOSE_HARD),
    # ... and for a reply too: only the hard limit can refuse it
    ("discard", "discard", False, True, True, A.FLOOD_DROP_HARD),
    ("error", "error", False, True, True, A.FLOOD_CLOSE_HARD),
    ("queue", "block", False, True, True, A.FLOOD_QUEUE_BLOCK),
    # a connection that already holds the bus in a block mode queues the
    # rest of the batch beyond the limit instead of losing it
    ("block", "discard", True, False, True, A.FLOOD_QUEUE_BLOCK),
    ("queue", "block", True, False, True, A.FLOOD_QUEUE_BLOCK),
    ("block", "error", True, True, True, A.FLOOD_QUEUE_BLOCK),
    # holding the bus is no licence without a block mode
    ("queue", "discard", True, False, True, A.FLOOD_DROP_HARD),
    ("queue", "error", True, False, True, A.FLOOD_CLOSE_HARD),
]


@pytest.mark.parametrize("soft,hard,blocking,reply,over,action", FLOOD_TABLE)
def test_flood_decision(soft, hard, blocking, reply, over, action):
    assert decide(soft, hard, blocking, reply, over) is action


def test_flood_table_covers_every_action():
    assert {row[-1] for row in FLOOD_TABLE} == set(A)


# soft, hard, queued msgs, queued bytes (limits: 100 bytes, 10 msgs) -> still holds the bus
BLOCK_TABLE = [
    ("block", "discard", 1, 5, True),       # soft block: until the queue is empty
    ("block", "discard", 0, 0, False),
    ("queue", "block", 9, 99, False),       # hard block: while at a limit
    ("queue", "block", 10, 5, True),
    ("queue", "block", 3, 100, True),
    ("block", "block", 1, 1, True),
    ("queue", "discard", 50, 5000, False),  # no block mode: never holds it
    ("discard", "error", 50, 5000, False),
]


@pytest.mark.parametrize("soft,hard,msgs,nbytes,holds", BLOCK_TABLE)
def test_still_blocking(soft, hard, msgs, nbytes, holds):
    assert still_blocking(soft, hard, msgs, nbytes, 100, 10) is holds


GID, UID, PID = 100, 1000, 4242
OWN = b"!/cred/100/1000/4242/"

# pattern -> (refusal, stored form)
NORMALISE_TABLE = [
    (b"a/b", R.PATTERN_OK, b"a/b"),
    (b"", R.PATTERN_OK, b""),
    (b"a!b/c!", R.PATTERN_OK, b"a!b/c!"),                   # '!' inside a segment is plain
    (OWN + b"x", R.PATTERN_OK, OWN + b"x"),
    (b"!/cred////x", R.PATTERN_OK, OWN + b"x"),             # empty fields: its own
    (b"!/cred////", R.PATTERN_OK, OWN),
    (b"!/cred/0100/01000/004242/x", R.PATTERN_OK, OWN + b"x"),  # leading zeros dropped
    (b"!/cred//1000//*/", R.PATTERN_OK, OWN + b"*/"),
    (b"!/cred////!/cred/*/*/*/x", R.PATTERN_OK, OWN + b"!/cred/*/*/*/x"),
    (b"!/cred/101///x", R.PATTERN_CRED_MISMATCH, None),
    (b"!/cred//0///", R.PATTERN_CRED_MISMATCH, None),
    (b"!/cred///4243/", R.PATTERN_CRED_MISMATCH, None),
    (b"!/cred/abc///x", R.PATTERN_CRED_MALFORMED, None),
    (b"!/cred/100/1000", R.PATTERN_CRED_MALFORMED, None),   # truncated
    (b"!/cred/*///x", R.PATTERN_CRED_MALFORMED, None),      # '*' only in nested forms
    (b"!/cred/4294967296///", R.PATTERN_CRED_MALFORMED, None),
    (b"!/cred////!/cred/x/", R.PATTERN_NESTED_CRED_MALFORMED, None),
    (b"!", R.PATTERN_BANG_MISUSE, None),
    (b"a/!/b", R.PATTERN_BANG_MISUSE, None),
    (b"!/cred////a/!", R.PATTERN_BANG_MISUSE, None),
]


@pytest.mark.parametrize("pattern,refusal,stored", NORMALISE_TABLE)
def test_normalise(pattern, refusal, stored):
    assert normalise(pattern, GID, UID, PID) == (refusal, stored)


def test_normalise_refuses_what_does_not_fit():
    assert normalise(b"abcdefghij", GID, UID, PID, cap=10) == (R.PATTERN_OK, b"abcdefghij")
    assert normalise(b"abcdefghijk", GID, UID, PID, cap=10) == (R.PATTERN_TOO_LONG, None)
    # the canonical prefix counts: it may be longer than what was written
    assert normalise(b"!/cred////x", GID, UID, PID, cap=len(OWN)) == (R.PATTERN_TOO_LONG, None)


def test_normalise_table_covers_every_refusal():
    assert {row[1] for row in NORMALISE_TABLE} | {R.PATTERN_TOO_LONG} == set(R)
