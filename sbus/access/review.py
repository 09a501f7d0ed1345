"""What ``sbus policy check`` says about a valid policy: rules that name no
one, patterns that match no key, and rules no key ever reaches because earlier
rules decide every key they match (shadowed).

A shadowed rule is reported only when that holds for every client it names:
the earlier rules name everyone, or the same uids or gids; ``%u``, ``%uid``
and ``%gid`` are compared as placeholders, so ``user/%uid/x/`` is shadowed by
``user/%uid/`` and by ``user/*/``, whatever the uid.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

from .keysets import KeySet, TooComplex, find_key, meet
from .model import PUBLISH, SUBSCRIBE, VERBS, Policy, Rule, Template

# Placeholders for the tokens: bytes no operator writes in a pattern, so two
# patterns compare equal only where they would for every client.
_PLACEHOLDER = {"%u": "\x01u\x01", "%uid": "\x01U\x01", "%gid": "\x01G\x01"}


class Finding(NamedTuple):
    line: int
    rule: int
    text: str


def _placeheld(template: Template) -> bytes:
    return "".join(part if i % 2 == 0 else _PLACEHOLDER[part]
                   for i, part in enumerate(template.parts)).encode("utf-8", "surrogateescape")


def _covers(earlier: Rule, rule: Rule) -> bool:
    """Whether ``earlier`` names every client ``rule`` names."""
    if earlier.uids is None and earlier.gids is None:
        return True
    if rule.uids is not None and earlier.uids is not None:
        return rule.uids <= earlier.uids
    if rule.gids is not None and earlier.gids is not None:
        return rule.gids <= earlier.gids
    return False


class _Earlier:
    """The patterns of earlier rules for one verb, bucketed by their first
    segment so a rule is compared with the ones that can overlap it, not
    with the whole file."""

    def __init__(self) -> None:
        self.exact: Dict[bytes, List[Tuple[Rule, KeySet]]] = {}
        self.wide: List[Tuple[Rule, KeySet]] = []

    def add(self, rule: Rule, keys: KeySet) -> None:
        if keys.segs and not keys.segs[0][1]:
            self.exact.setdefault(keys.segs[0][0], []).append((rule, keys))
        else:
            self.wide.append((rule, keys))

    def near(self, keys: KeySet) -> List[Tuple[Rule, KeySet]]:
        if keys.segs and not keys.segs[0][1]:
            first = keys.segs[0][0]
            found = list(self.exact.get(first, ()))
        else:
            lit = keys.segs[0][0] if keys.segs else b""
            found = [x for lit_, xs in self.exact.items() if lit_.startswith(lit) for x in xs]
            first = None
        found += [(r, k) for r, k in self.wide
                  if first is None or not k.segs or first.startswith(k.segs[0][0])]
        return found


def review(policy: Policy) -> List[Finding]:
    """Findings about ``policy``, by line."""
    findings = [Finding(line, 0, text) for line, text in policy.warnings]
    earlier = {PUBLISH: _Earlier(), SUBSCRIBE: _Earlier()}
    for rule in policy.rules:
        if rule.uids is not None and not rule.uids or rule.gids is not None and not rule.gids:
            continue    # names no one: already a warning
        unreached = []
        dead = 0
        for template in rule.patterns:
            keys = KeySet(_placeheld(template))
            if keys.dead:
                findings.append(Finding(rule.line, rule.number, (
                    f"rule {rule.number}: pattern {template.text!r} matches no key: '*' "
                    f"takes the rest of its segment, so nothing can follow it there")))
                dead += 1
                continue
            for verb, bit in VERBS.items():
                if not rule.verbs & bit:
                    continue
                before = [(r, k) for r, k in earlier[bit].near(keys) if _covers(r, rule)]
                deciders = _deciders(keys, before)
                if deciders is not None:
                    unreached.append((template.text, verb, deciders))
                earlier[bit].add(rule, keys)
        whole = unreached and \
            len(unreached) + dead * bin(rule.verbs).count("1") == \
            len(rule.patterns) * bin(rule.verbs).count("1")
        for text, verb, deciders in unreached[:1] if whole else unreached:
            numbers = ", ".join(str(n) for n in deciders)
            by = f"rule {numbers} decides" if len(deciders) == 1 else f"rules {numbers} decide"
            what = f"rule {rule.number} is" if whole else \
                f"rule {rule.number}: {verb} {text!r} is"
            findings.append(Finding(rule.line, rule.number, f"{what} never reached: {by} "
                                                            f"every key it matches first"))
    return sorted(findings, key=lambda f: (f.line, f.rule))


def _deciders(keys: KeySet, before: List[Tuple[Rule, KeySet]]) -> Optional[List[int]]:
    """The numbers of the earlier rules that decide every key of ``keys``, or
    None if some key reaches the rule."""
    outside = [k for _, k in before]
    try:
        if find_key([keys], outside) is not None:
            return None
    except TooComplex:
        return None
    # Name the rules that matter: those whose keys meet this pattern.
    return sorted({r.number for r, k in before if meet([keys, k])})
