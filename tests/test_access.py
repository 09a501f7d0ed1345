"""The access policy (sbus.access, docs/policy.md): the file model and its
errors, substitution, first-match combination, subscribe decisions held to
the spec's matcher by brute force, the compiled table, and the `sbus policy`
commands. Not yet enforced by sbusd; these test the model the core will use."""
from __future__ import annotations

import functools
import itertools
import os
import subprocess
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbus._ref.protocol import matches
from sbus.access import PolicyError, keysets, load, parse
from sbus.access.compiled import canonical_key, from_bytes
from sbus.access.keysets import KeySet, TooComplex, find_key, meet, within
from sbus.access.review import review

from support import ROOT, SBUS

EXAMPLE = ROOT / "docs" / "examples" / "system-bus-policy.toml"

# Small alphabets, so brute force over every short key is exhaustive enough:
# patterns use 'a', 'b', '/', '*'; keys add 'x', a byte no pattern holds
# (find_key's "something else").
PATTERN_BYTES = [b"a", b"b", b"/", b"*"]
KEY_BYTES = [b"a", b"b", b"/", b"x"]
KEYS = [b"".join(t) for n in range(7) for t in itertools.product(KEY_BYTES, repeat=n)]
SHORT = [b"".join(t) for n in range(4) for t in itertools.product(PATTERN_BYTES, repeat=n)]
# Half from the short ones, where the edge cases are dense.
patterns = st.one_of(st.sampled_from(SHORT),
                     st.lists(st.sampled_from(PATTERN_BYTES), max_size=5).map(b"".join))


@functools.lru_cache(maxsize=None)
def keys_of(pattern: bytes) -> frozenset:
    """The keys of KEYS the spec's matcher says ``pattern`` matches."""
    return frozenset(k for k in KEYS if matches(pattern, k))


def policy(text: str, path: str = "p.toml"):
    return parse(textwrap.dedent(text), path)


def first_match(rules, default_allow, key):
    """The oracle: (allow, rule index) of the first (allow, pattern) whose
    pattern matches ``key`` by the spec's matcher, else the default."""
    for i, (allow, pattern) in enumerate(rules):
        if matches(pattern, key):
            return allow, i
    return default_allow, None


# ---- patterns as key sets ----------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(pattern=patterns, key=st.lists(st.sampled_from(KEY_BYTES + [b"*"]), max_size=8).map(b"".join))
def test_keyset_matches_as_the_spec(pattern, key):
    assert KeySet(pattern).matches(key) == matches(pattern, key)


@settings(max_examples=300, deadline=None)
@given(a=patterns, b=patterns)
def test_meet_and_within_against_brute_force(a, b):
    ka, kb = KeySet(a), KeySet(b)
    if keys_of(a) & keys_of(b):
        assert meet([ka, kb])
    elif meet([ka, kb]):
        # Only keys longer than brute force tries: find_key must show one.
        key = find_key([ka, kb])
        assert key is not None and matches(a, key) and matches(b, key)
    if within(ka, kb):
        assert keys_of(a) <= keys_of(b)
    else:
        key = find_key([ka], [kb])      # the key in a and not in b
        assert key is not None and matches(a, key) and not matches(b, key)


def test_find_key_on_every_pair_of_short_patterns():
    # Exhaustive where hypothesis would rarely draw the one pair that needs
    # a literal followed by something else ('ax' in 'a*' but not in 'a').
    for a in SHORT:
        for b in SHORT:
            key = find_key([KeySet(a)], [KeySet(b)])
            if key is None:
                assert keys_of(a) <= keys_of(b), (a, b)
            else:
                assert matches(a, key) and not matches(b, key), (a, b)


@settings(max_examples=400, deadline=None)
@given(inside=st.lists(patterns, min_size=1, max_size=2),
       outside=st.lists(patterns, max_size=4))
def test_find_key_is_sound_and_complete(inside, outside):
    key = find_key([KeySet(p) for p in inside], [KeySet(p) for p in outside])
    brute = frozenset.intersection(*map(keys_of, inside)).difference(*map(keys_of, outside))
    if key is None:
        assert not brute
    else:
        assert all(matches(p, key) for p in inside)
        assert not any(matches(p, key) for p in outside)


@pytest.mark.parametrize("inside, outside, exists", [
    ([b""], [b"*", b"*/"], False),          # every key: one segment or more than one
    ([b""], [b"*/"], True),                  # '' also matches keys without '/'
    ([b"*/"], [b"/"], True),                 # 'a/x' is under '*/' but not under '/'
    ([b"a/"], [b"a/*", b"a/*/"], False),
    ([b"a/"], [b"a/*/"], True),              # 'a/x': one segment after 'a/'
    ([b"a/*/c"], [b"a/b/"], True),
    ([b"a*b"], [], False),                   # '*' swallows the 'b': no key at all
    ([b"ab*"], [b"a*"], False),
    ([b"a*"], [b"ab*"], True),
    ([b"a*"], [b"a"], True),                 # 'ax'
    ([b"a*/"], [b"a/", b"/"], True),         # 'ax/'
    ([b""], [], True),
])
def test_find_key_leak_cases(inside, outside, exists):
    assert (find_key([KeySet(p) for p in inside], [KeySet(p) for p in outside]) is not None) \
        == exists


# ---- the file ----------------------------------------------------------------

def test_the_model():
    p = policy('''
        default = "deny"
        on_deny = "disconnect"

        [[rule]]
        uid = [0, 5]
        allow = ["publish", "subscribe"]
        pattern = ""

        [[rule]]
        gid = 100
        deny = "publish"
        pattern = ["a/", "b/*"]
        on_deny = "disconnect"
        ''')
    assert not p.default_allow and p.default_action == "disconnect"
    r1, r2 = p.rules
    assert (r1.number, r1.line, r1.allow, r1.verbs, r1.uids) == (1, 5, True, 3, {0, 5})
    assert (r2.number, r2.line, r2.allow, r2.verbs, r2.gids) == (2, 10, False, 1, {100})
    assert [t.text for t in r2.patterns] == ["a/", "b/*"] and r2.action == "disconnect"
    assert r2.describe() == ("rule 2 (line 10): deny publish 'a/', 'b/*' to gid 100 "
                             "(on_deny: disconnect)")


@pytest.mark.parametrize("text, line, reason", [
    ('default = "deny"\n[[rule]]\nallow = \n', 3, "Invalid value"),
    ('default = "deny"\nrules = []\n', 2, "unknown setting 'rules'"),
    ('[[rule]]\nallow = "publish"\npattern = ""\n', 1, "no default"),
    ('default = "maybe"\n', 1, 'default must be "allow" or "deny"'),
    ('default = "deny"\non_deny = "kill"\n', 2, "on_deny must be"),
    ('default = "deny"\nrule = "x"\n', 2, "array of tables"),
    ('default = "deny"\n\n[[rule]]\nallow = "publish"\npattern = ""\n\n[[rule]]\nallow = "publish"\n'
     'patern = "a/"\n', 9, "rule 2: unknown key 'patern'"),
    ('default = "deny"\n[[rule]]\nallow = "publish"\ndeny = "subscribe"\npattern = ""\n', 2,
     "rule 1: say either allow"),
    ('default = "deny"\n[[rule]]\npattern = ""\n', 2, "rule 1: say either allow"),
    ('default = "deny"\n[[rule]]\npattern = ""\nallow = ["publsh"]\n', 4, "'publsh' is no verb"),
    ('default = "deny"\n[[rule]]\nallow = ["publish", "publish"]\npattern = ""\n', 3, "twice"),
    ('default = "deny"\n[[rule]]\nallow = []\npattern = ""\n', 3, "must list"),
    ('default = "deny"\n[[rule]]\nallow = "publish"\n', 2, "no pattern"),
    ('default = "deny"\n[[rule]]\nallow = "publish"\npattern = 3\n', 4, "string or a list"),
    ('default = "deny"\n[[rule]]\nallow = "publish"\npattern = "a\\u0000"\n', 4, "NUL"),
    ('default = "deny"\n[[rule]]\nallow = "publish"\npattern = "user/%x/"\n', 4,
     "'%' at offset 5 starts no token"),
    ('default = "deny"\n[[rule]]\nallow = "publish"\npattern = ""\non_deny = "drop"\n', 5,
     "on_deny is for deny rules"),
    ('default = "deny"\n[[rule]]\ndeny = "subscribe"\npattern = ""\non_deny = "drop"\n', 5,
     "on_deny is for deny rules"),
    ('default = "deny"\n[[rule]]\nuid = 0\ngid = 0\nallow = "publish"\npattern = ""\n', 4,
     "one of user, group, uid, gid, not uid and gid"),
    ('default = "deny"\n[[rule]]\nuid = "root"\nallow = "publish"\npattern = ""\n', 3,
     "uid must be a number"),
    ('default = "deny"\n[[rule]]\nuid = 4294967296\nallow = "publish"\npattern = ""\n', 3,
     "out of range"),
    ('default = "deny"\n[[rule]]\nuser = 0\nallow = "publish"\npattern = ""\n', 3,
     "user must be a name"),
])
def test_errors_carry_file_line_and_reason(text, line, reason):
    with pytest.raises(PolicyError) as info:
        parse(text, "site.toml")
    assert (info.value.path, info.value.line) == ("site.toml", line)
    assert reason in info.value.reason
    assert str(info.value).startswith(f"site.toml:{line}: ")


def test_load_refuses_unreadable_and_non_utf8_files(tmp_path):
    with pytest.raises(PolicyError, match="No such file"):
        load(str(tmp_path / "missing.toml"))
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'default = "deny"\n# caf\xe9\n')
    with pytest.raises(PolicyError) as info:
        load(str(bad))
    assert info.value.line == 2 and "UTF-8" in info.value.reason


def test_unknown_names_name_no_one_and_are_warned_about():
    p = policy('''
        default = "allow"
        [[rule]]
        user = "no-such-user-sbus"
        deny = "publish"
        pattern = ""
        ''')
    assert p.rules[0].uids == frozenset()
    assert p.compile_for(1234, 1234).may_publish(b"x").allowed
    assert p.warnings and "no user named 'no-such-user-sbus'" in p.warnings[0][1]


# ---- substitution ------------------------------------------------------------

SUBST = '''
    default = "deny"
    [[rule]]
    allow = ["publish", "subscribe"]
    pattern = ["user/%uid/", "group/%gid/", "home/%u/", "pct/100%%/%u-x"]
    [[rule]]
    deny = "publish"
    pattern = "shared/%u/secret"
    [[rule]]
    allow = "publish"
    pattern = "shared/"
    '''


def test_substitution_of_user_uid_and_gid():
    p = policy(SUBST)
    assert p.uses_user_name and not p.uses_groups
    a = p.compile_for(1000, 100, (), "alice")
    assert [e.pattern for e in a.entries] == [
        b"user/1000/", b"group/100/", b"home/alice/", b"pct/100%/alice-x",
        b"shared/alice/secret", b"shared/"]
    assert a.may_publish(b"user/1000/x").allowed
    assert not a.may_publish(b"user/1001/x").allowed
    assert a.may_publish(b"home/alice/x").allowed
    assert a.may_publish(b"pct/100%/alice-x").allowed
    assert not a.may_publish(b"shared/alice/secret").allowed
    assert a.may_publish(b"shared/bob/secret").allowed


@pytest.mark.parametrize("user", [None, "", "a/b", "a*", "!"])
def test_an_unusable_user_name_opens_nothing_and_widens_denies(user):
    a = policy(SUBST).compile_for(1000, 100, (), user)
    # The %u allows are gone; the %u deny covers the whole segment.
    assert b"home/" not in b"".join(e.pattern for e in a.entries)
    assert [e.pattern for e in a.entries if not e.allow] == [b"shared/*/secret"]
    assert not a.may_publish(b"shared/anyone/secret").allowed
    assert not a.may_publish(b"home/a/b/x").allowed
    assert a.may_publish(b"user/1000/x").allowed


# ---- combination: the first match decides ------------------------------------

def test_first_match_in_file_order():
    early_deny = policy('''
        default = "allow"
        [[rule]]
        deny = "publish"
        pattern = "a/b/"
        on_deny = "disconnect"
        [[rule]]
        allow = "publish"
        pattern = "a/"
        ''').compile_for(1, 1)
    d = early_deny.may_publish(b"a/b/c")
    assert (d.allowed, d.rule.number, d.action) == (False, 1, "disconnect")
    assert early_deny.may_publish(b"a/c").rule.number == 2
    late_deny = policy('''
        default = "allow"
        [[rule]]
        allow = "publish"
        pattern = "a/"
        [[rule]]
        deny = "publish"
        pattern = "a/b/"
        ''').compile_for(1, 1)
    assert late_deny.may_publish(b"a/b/c").allowed      # rule 1 came first


def test_rules_apply_to_their_verbs_and_clients_only():
    p = policy('''
        default = "deny"
        on_deny = "disconnect"
        [[rule]]
        uid = 7
        allow = "publish"
        pattern = "svc/"
        [[rule]]
        group = "root"
        allow = "subscribe"
        pattern = "svc/"
        [[rule]]
        gid = 50
        allow = ["publish", "subscribe"]
        pattern = "team/"
        ''')
    svc = p.compile_for(7, 7)
    assert svc.may_publish(b"svc/x").allowed and not svc.may_subscribe(b"svc/").allowed
    reader = p.compile_for(8, 0)            # gid 0 is group root
    assert reader.may_subscribe(b"svc/").allowed and not reader.may_publish(b"svc/x").allowed
    d = reader.may_publish(b"svc/x")
    assert (d.rule, d.action) == (None, "disconnect")   # the default's action
    member = p.compile_for(9, 9, groups=(50,))          # a supplementary group counts
    assert member.may_publish(b"team/x").allowed and member.may_subscribe(b"team/").allowed
    assert not p.compile_for(9, 9).may_publish(b"team/x").allowed
    assert p.compile_for(9, 9, (50,)) is member         # one table per identity
    assert p.uses_groups and not p.uses_user_name


@settings(max_examples=300, deadline=None)
@given(rules=st.lists(st.tuples(st.booleans(), patterns), max_size=5),
       default=st.booleans(), key=st.sampled_from(KEYS))
def test_publish_is_the_first_match_against_brute_force(rules, default, key):
    a = _policy_of(rules, default).compile_for(1, 1)
    want_allow, want_rule = first_match(rules, default, key)
    d = a.may_publish(key)
    assert d.allowed == want_allow
    assert (d.rule.number - 1 if d.rule else None) == want_rule
    assert a.may_read(key) == d         # the same rules cover both verbs here
    # The C table says the same.
    (dallow, _, drule), entries = from_bytes(a.to_bytes())
    for allow, _, pattern, number in entries:
        if matches(pattern, key):
            assert (allow, number) == (d.allowed, d.rule.number)
            break
    else:
        assert dallow == d.allowed and drule == (d.rule.number if d.rule else 0)


def _policy_of(rules, default_allow):
    """A policy of one everyone rule per (allow, pattern), for both verbs."""
    text = [f'default = "{"allow" if default_allow else "deny"}"']
    for allow, pattern in rules:
        text.append(f'[[rule]]\n{"allow" if allow else "deny"} = ["publish", "subscribe"]\n'
                    f'pattern = "{pattern.decode()}"')
    return parse("\n".join(text))


# ---- subscribe: refused unless every key it matches is readable ---------------

@settings(max_examples=500, deadline=None)
@given(rules=st.lists(st.tuples(st.booleans(), patterns), max_size=5),
       default=st.booleans(), wanted=patterns)
def test_subscribe_decision_against_brute_force(rules, default, wanted):
    a = _policy_of(rules, default).compile_for(1, 1)
    d = a.may_subscribe(wanted)
    if d.allowed:
        # No leak: every key the pattern matches is readable.
        for key in keys_of(wanted):
            assert first_match(rules, default, key)[0], key
    else:
        # The refusal names a real key, matched by the pattern and denied by
        # the rule it names (None: the default).
        assert d.key is not None and matches(wanted, d.key)
        allow, index = first_match(rules, default, d.key)
        assert not allow
        assert (d.rule.number - 1 if d.rule else None) == index


@pytest.mark.parametrize("wanted", [b"", b"*/", b"*", b"/", b"a/", b"*/*/", b"!*/", b"*/cred/"])
def test_wildcard_leak_cases_are_refused(wanted):
    a = policy('''
        default = "allow"
        [[rule]]
        deny = "subscribe"
        pattern = "a/secret/"
        [[rule]]
        deny = "subscribe"
        pattern = "!/cred/"
        ''').compile_for(1, 1)
    d = a.may_subscribe(wanted)
    if any(matches(wanted, k) for k in (b"a/secret/x", b"!/cred/1/1/1/x")):
        assert not d.allowed and d.rule is not None and matches(wanted, d.key)
    else:
        assert d.allowed


def test_a_pattern_too_tangled_to_prove_is_refused(monkeypatch):
    a = policy('''
        default = "deny"
        [[rule]]
        allow = "subscribe"
        pattern = ["a/", "b/"]
        ''').compile_for(1, 1)
    assert a.may_subscribe(b"a/").allowed and not a.may_subscribe(b"").allowed
    outside = [KeySet(b"a/"), KeySet(b"b/")]
    assert find_key([KeySet(b"*/")], outside) is not None
    with pytest.raises(TooComplex):
        find_key([KeySet(b"*/")], outside, budget=1)
    monkeypatch.setattr(keysets, "BUDGET", 1)
    d = a.may_subscribe(b"*/")
    assert (d.allowed, d.rule) == (False, None) and "refused to be safe" in d.why
    assert a.may_subscribe(b"a/x/").allowed     # one allow holds it: no walk needed


def test_credential_keys_are_judged_in_canonical_form():
    assert canonical_key(b"!/cred/007/00/0/x") == b"!/cred/7/0/0/x"
    assert canonical_key(b"!/cred///0012/x") == b"!/cred///12/x"
    assert canonical_key(b"!/cred/0/x") == b"!/cred/0/x"        # not a form: as written
    a = policy('''
        default = "allow"
        [[rule]]
        deny = "publish"
        pattern = "!/cred/0/0/"
        ''').compile_for(5, 5)
    assert not a.may_publish(b"!/cred/000/0/1/x").allowed


# ---- the system-bus example ----------------------------------------------------

def test_example_for_root():
    root = load(str(EXAMPLE)).compile_for(0, 0, (), "root")
    for key in (b"", b"power/off", b"user/1000/x", b"anything", b"!/cred/1/2/3/x"):
        assert root.may_publish(key).allowed
    for pattern in (b"", b"*/", b"power/", b"user/"):
        assert root.may_subscribe(pattern).allowed
    assert root.nbytes == 12 and from_bytes(root.to_bytes()) == ((True, False, 1), [])


NOBODY_PUBLISH = {
    b"user/65534/x": True, b"user/65534/a/b": True, b"user/65534/": True,
    b"user/65534": False, b"user/1000/x": False, b"power/off": False, b"power": False,
    b"x": False, b"": False, b"!/cred/0/0/1/x": False,
}
NOBODY_SUBSCRIBE = {
    b"user/65534/": True, b"user/65534/*/x": True, b"power/": True, b"power/*": True,
    b"power/off": True, b"a*b": True,
    b"": False, b"*/": False, b"*": False, b"user/": False, b"user/*/": False,
    b"power": False, b"user/65534": False, b"!/cred/65534/65534/1/": False,
}


def test_example_for_nobody():
    nobody = load(str(EXAMPLE)).compile_for(65534, 65534, (), "nobody")
    for key, allowed in NOBODY_PUBLISH.items():
        assert nobody.may_publish(key).allowed == allowed, key
    for pattern, allowed in NOBODY_SUBSCRIBE.items():
        assert nobody.may_subscribe(pattern).allowed == allowed, pattern
    assert nobody.nbytes <= 1024


@settings(max_examples=400, deadline=None)
@given(wanted=st.lists(st.sampled_from([b"user", b"power", b"65534", b"1000", b"a", b"/", b"*"]),
                       max_size=6).map(b"".join))
def test_example_leaks_nothing_to_nobody_under_any_pattern(wanted):
    nobody = load(str(EXAMPLE)).compile_for(65534, 65534, (), "nobody")
    if nobody.may_subscribe(wanted).allowed:
        words = [b"user", b"power", b"65534", b"1000", b"a", b"x"]
        for parts in itertools.product(words + [b"/"], repeat=4):
            key = b"".join(parts)
            if matches(wanted, key):
                assert key.startswith((b"user/65534/", b"power/")), (wanted, key)


def test_a_policy_of_many_rules_stays_small_per_client():
    rules = "\n".join(f'[[rule]]\nuid = {1000 + i}\nallow = ["publish", "subscribe"]\n'
                      f'pattern = "user/{i}/"' for i in range(2000))
    p = parse('default = "deny"\n' + rules + '\n[[rule]]\nallow = "subscribe"\npattern = "pub/"\n')
    a = p.compile_for(1500, 1500)
    assert [e.pattern for e in a.entries] == [b"user/500/", b"pub/"]
    assert a.nbytes < 1024


# ---- review (sbus policy check) ------------------------------------------------

def test_review_reports_shadowed_and_dead_rules():
    p = policy('''
        default = "allow"
        [[rule]]
        deny = "publish"
        pattern = "a/"
        [[rule]]
        deny = "publish"
        pattern = ["a/b/", "c/"]
        [[rule]]
        allow = ["publish", "subscribe"]
        pattern = "user/%uid/"
        [[rule]]
        uid = 5
        deny = ["publish", "subscribe"]
        pattern = "user/%uid/x"
        [[rule]]
        uid = 6
        allow = "subscribe"
        pattern = ["*", "*/"]
        [[rule]]
        deny = "subscribe"
        pattern = ["", "q*r"]
        ''')
    texts = [f.text for f in review(p)]
    assert "rule 2: publish 'a/b/' is never reached: rule 1 decides every key it matches first" \
        in texts
    assert "rule 4 is never reached: rule 3 decides every key it matches first" in texts
    assert any(t.startswith("rule 6: pattern 'q*r' matches no key") for t in texts)
    # Rule 5 names uid 6 only, so rule 6 is still reached by everyone else.
    assert not any(t.startswith("rule 6: subscribe ''") or t.startswith("rule 6 is")
                   for t in texts)
    assert len(texts) == 3


# ---- the sbus command ----------------------------------------------------------

def sbus(*args):
    return subprocess.run([SBUS, "policy", *args], capture_output=True, text=True, timeout=60)


def test_check_accepts_the_example():
    r = sbus("check", str(EXAMPLE))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{EXAMPLE}: valid: 3 rules, default deny\n"


def test_check_refuses_a_bad_file_with_its_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('default = "deny"\n\n[[rule]]\nallow = "publish"\npattern = ""\n'
                   'uid = "root"\n')
    r = sbus("check", str(bad))
    assert r.returncode == 1
    assert r.stderr == f"sbus: {bad}:6: rule 1: uid must be a number or a list of them\n"


def test_check_warns_about_shadowed_rules_and_strict_fails(tmp_path):
    f = tmp_path / "shadow.toml"
    f.write_text('default = "allow"\n[[rule]]\ndeny = "publish"\npattern = ""\n'
                 '[[rule]]\nallow = "publish"\npattern = "a/#"\n')
    r = sbus("check", str(f))
    assert r.returncode == 0
    assert f"{f}:5: warning: rule 2 is never reached: rule 1 decides every key it matches " \
           "first\n" in r.stdout
    assert "is MQTT's" in r.stdout and "; 2 warnings" in r.stdout
    assert sbus("check", "--strict", str(f)).returncode == 1


def test_explain_publish_and_subscribe():
    r = sbus("explain", str(EXAMPLE), "--user", "65534", "--gid", "65534", "publish", "power/off")
    assert r.returncode == 3
    assert "denied (dropped): publish 'power/off'" in r.stdout
    assert 'the default: default = "deny", on_deny = "drop"' in r.stdout
    r = sbus("explain", str(EXAMPLE), "--user", "65534", "--gid", "65534", "--groups", "",
             "subscribe", "user/65534/")
    assert r.returncode == 0
    assert r.stdout.splitlines()[1:] == [
        "  every key it matches is under 'user/65534/' of rule 2, which allows",
        "  rule 2 (line 16): allow publish and subscribe 'user/%uid/' to everyone"]
    r = sbus("explain", str(EXAMPLE), "--user", "65534", "--gid", "65534", "subscribe", "")
    assert r.returncode == 3 and r.stdout.startswith("refused: subscribe ''")
    assert "which no rule allows, and the default is deny" in r.stdout
    r = sbus("explain", str(EXAMPLE), "--user", "0", "subscribe", "")
    assert r.returncode == 0 and "rule 1 (line 11)" in r.stdout


def test_explain_needs_a_gid_for_an_unknown_uid():
    r = sbus("explain", str(EXAMPLE), "--user", "4000000000", "publish", "x")
    assert r.returncode == 1 and "give --gid" in r.stderr


def test_explain_into_a_closed_pipe_exits_quietly():
    # As `sbus policy explain ... | head -c0`: the reader is gone before we write.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([SBUS, "policy", "explain", str(EXAMPLE), "--user", "0", "publish",
                            "power/off"], stdout=write_end, stderr=subprocess.PIPE, text=True,
                           timeout=60)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (0, "")


def test_the_docs_show_the_example_file_as_shipped():
    shipped = EXAMPLE.read_text()
    body = shipped[shipped.index('default = "deny"'):]
    assert f"```toml\n{body}```" in (ROOT / "docs" / "policy.md").read_text()
