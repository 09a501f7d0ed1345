"""Routing-key matching, parsing and the '!' rules, as tables: the compiled
code and the plain-Python oracle in sbus._ref against the spec's examples.
The properties over random input are in test_properties.py."""
import pytest

from sbus._core import index as cindex
from sbus._core import protocol as cproto
from sbus._ref import protocol as rproto

# (pattern, key, expected) -- the spec's own examples first, then edge cases of
# '*', a trailing '/' and the empty pattern.
CASES = [
    (b"a/*/c/", b"a/b/c/", True),
    (b"a/*/c/", b"a/b/c/d/e", True),
    (b"a/*/c/", b"a/b/c", False),
    (b"a/*/c/", b"a/c/d", False),
    (b"", b"anything/at/all", True),
    (b"", b"", True),
    (b"a/*", b"a/", True),
    (b"a/*/c", b"a//c", True),
    (b"*b", b"b", False),          # '*' has already consumed the 'b'
    (b"*b", b"ab", False),
    (b"*", b"abc", True),
    (b"*", b"a/b", False),
    (b"*/", b"a/b", True),
    (b"a/", b"a/", True),
    (b"a/", b"a", False),
    (b"a", b"a/b", False),
    (b"a/b", b"a/b", True),
    (b"a/b", b"a/bc", False),
    (b"a/*/c", b"a/b/c/d", False),
    (b"/", b"/x", True),
    (b"*/*/", b"x/y/z", True),
    (b"a*", b"abc", True),
    (b"a*c", b"abc", False),
]


@pytest.mark.parametrize("pattern,key,expected", CASES)
def test_compiled_matcher_follows_spec(pattern, key, expected):
    assert cproto.matches(pattern, key) is expected


@pytest.mark.parametrize("pattern,key,expected", CASES)
def test_reference_matcher_follows_spec(pattern, key, expected):
    assert rproto.matches(pattern, key) is expected


def test_index_stores_patterns_where_their_literal_path_stops():
    idx = cindex.PatternIndex()
    idx.add(1, b"news/sport")
    idx.add(2, b"news/*")
    idx.add(3, b"weather")
    idx.add(4, b"")
    idx.add(5, b"n*/sport")
    idx.add(6, b"*")
    idx.add(7, b"*/sport/")
    assert idx.root_count == 2            # "" and "n*/sport": nothing to descend by
    assert idx.node_count == 4            # news, news/sport, weather, (*)/sport
    assert idx.match(b"news/sport") == [1, 2, 4, 5]
    assert idx.match(b"weather") == [3, 4, 6]
    assert idx.match(b"x/sport/y") == [4, 7]


def test_index_reports_each_owner_once_and_duplicates_are_stored_twice():
    idx = cindex.PatternIndex()
    h1 = idx.add(1, b"a/b")
    h2 = idx.add(1, b"a/b")
    idx.add(1, b"a/*")
    assert idx.match(b"a/b") == [1]
    assert idx.count_matches(b"a/b") == 3
    idx.remove(h1)
    assert idx.match(b"a/b") == [1] and len(idx) == 2
    idx.remove(h2)
    assert idx.count_matches(b"a/b") == 1


def test_nodes_no_pattern_needs_are_freed():
    idx = cindex.PatternIndex()
    handles = [idx.add(i, b"seg%d/x" % i) for i in range(1000)]
    handles += [idx.add(i, b"*/*/w%d/" % i) for i in range(1000)]
    assert idx.node_count == 3000
    for h in handles:
        idx.remove(h)
    assert idx.node_count == 0 and idx.root_count == 0 and len(idx) == 0


PACKETS = [
    b"SUB a/b", b"SUB a/b\0ignored\0tail", b"SUB ", b"UNSUB x", b"UNSUB x\0y",
    b"MSG k\0payload", b"MSG k\0", b"MSG \0", b"MSG k\0pay\0load", b"MSG nonul",
    b"CMSG k", b"CMSG k\0", b"CMSG k\0p", b"CMSG ", b"", b"SUB", b"MSG", b"sub x",
    b"SUBx", b"XMSG k\0p", b" SUB a", b"MSG k\0\n\nmulti\nline",
]


@pytest.mark.parametrize("packet", PACKETS)
def test_parser_agrees_with_spec_regexes(packet):
    assert cproto.parse(packet) == rproto.parse(packet)


BANG = [
    (b"a!b", "ok"), (b"!x", "ok"), (b"x!", "ok"), (b"a/b!", "ok"), (b"!!", "ok"),
    (b"!", "bang_misuse"), (b"!/x", "bang_misuse"), (b"a/!/b", "bang_misuse"),
    (b"x/!", "bang_misuse"), (b"a/!", "bang_misuse"),
    (b"!/cred/1/2/3/x", "ok"), (b"!/cred///3/x", "ok"), (b"!/cred////", "ok"),
    (b"!/cred/1/2/3/!/cred/4/5/6/x", "ok"),
    (b"!/cred/1/2/3/!/x", "bang_misuse"),
    (b"!/cred/1/2/3", "cred_malformed"), (b"!/cred/1/2", "cred_malformed"),
    (b"!/cred/", "cred_malformed"), (b"!/cred/*/2/3/x", "cred_malformed"),
    (b"!/cred/+1/2/3/x", "cred_malformed"), (b"!/cred/ 1/2/3/x", "cred_malformed"),
    (b"!/cred/99999999999/2/3/x", "cred_malformed"), (b"!/cred/whoami", "cred_malformed"),
]


@pytest.mark.parametrize("key,expected", BANG)
def test_bang_rules(key, expected):
    assert cproto.check_key(key) == expected
    assert rproto.check_key(key) == expected


def test_cred_form_parses_fields():
    assert cproto.cred_form(b"!/cred/100/1000/1111/rest") == (100, 1000, 1111, 21)
    assert cproto.cred_form(b"!/cred////rest") == (None, None, None, 10)
    assert cproto.cred_form(b"!/cred/007/0/0/") == (7, 0, 0, 15)
    assert cproto.cred_form(b"!/cred/4294967296/0/0/") is None
    assert cproto.cred_form(b"!/cred/4294967295/0/0/") == (4294967295, 0, 0, 22)
