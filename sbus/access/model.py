"""The policy file: TOML, read and validated into an ordered list of rules.

::

    default = "deny"                  # what no rule decides: "allow" or "deny"
    on_deny = "drop"                  # a publish the default denies: "drop" or "disconnect"

    [[rule]]
    uid = 0                           # who: user, group, uid or gid (one value or a
                                      # list); no such key: everyone
    allow = ["publish", "subscribe"]  # or deny = [...]
    pattern = ""                      # spec syntax; a list of patterns is allowed

    [[rule]]
    allow = ["publish", "subscribe"]
    pattern = "user/%uid/"            # %u user name, %uid, %gid, %% a '%'

The first rule, in file order, that names the client, covers the verb and
matches the key decides (docs/policy.md says why). Errors (``PolicyError``)
carry the file, the line and the reason.
"""
from __future__ import annotations

import grp
import pwd
import re
import sys
from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from ..errors import SbusError

if sys.version_info >= (3, 11):
    import tomllib
else:   # pragma: no cover - exercised on 3.9 and 3.10 only
    import tomli as tomllib

PUBLISH = 1
SUBSCRIBE = 2
VERBS = {"publish": PUBLISH, "subscribe": SUBSCRIBE}
DROP = "drop"
DISCONNECT = "disconnect"
ACTIONS = (DROP, DISCONNECT)
SELECTORS = ("user", "group", "uid", "gid")
TOP_KEYS = ("default", "on_deny", "rule")
RULE_KEYS = ("allow", "deny", "pattern", "on_deny") + SELECTORS
_RULE_KEYS = frozenset(RULE_KEYS)
MAX_ID = 0xFFFFFFFF
# Substitution tokens, longest first so '%uid' is not read as '%u' + 'id'.
TOKENS = ("%uid", "%gid", "%u", "%%")
_TOKEN = re.compile(r"%uid|%gid|%u|%%|%")


class PolicyError(SbusError, ValueError):
    """A policy file that does not parse or validate. ``str()`` is
    ``FILE:LINE: reason`` (``FILE: reason`` when no line is known)."""

    def __init__(self, path: str, line: Optional[int], reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        where = path if line is None else f"{path}:{line}"
        super().__init__(f"{where}: {reason}")

    def __reduce__(self) -> tuple:
        return type(self), (self.path, self.line, self.reason)


class Template(NamedTuple):
    """A rule's pattern as written, split at its substitution tokens:
    ``parts`` alternates literal text and tokens (``%u``, ``%uid``, ``%gid``)."""

    text: str
    parts: Tuple[str, ...]

    @property
    def tokens(self) -> FrozenSet[str]:
        return frozenset(self.parts[1::2])


class Rule(NamedTuple):
    """One ``[[rule]]``. ``number`` counts from 1 in file order; ``uids`` and
    ``gids`` are the clients it names (names resolved when the file was read;
    None: everyone)."""

    number: int
    line: int
    allow: bool
    verbs: int
    patterns: Tuple[Template, ...]
    who: Optional[str]
    names: Tuple[object, ...]
    uids: Optional[FrozenSet[int]]
    gids: Optional[FrozenSet[int]]
    action: str

    def describe(self) -> str:
        """``rule 3 (line 12): deny publish 'power/' to uid 0``, as an operator wrote it."""
        verbs = " and ".join(v for v, bit in VERBS.items() if self.verbs & bit)
        pats = ", ".join(repr(t.text) for t in self.patterns)
        if self.who is None:
            who = "everyone"
        else:
            who = f"{self.who} " + ", ".join(str(n) for n in self.names)
        tail = f" (on_deny: {DISCONNECT})" if not self.allow and self.verbs & PUBLISH and \
            self.action == DISCONNECT else ""
        return (f"rule {self.number} (line {self.line}): {'allow' if self.allow else 'deny'} "
                f"{verbs} {pats} to {who}{tail}")


class Policy:
    """A validated policy file. ``rules`` in file order; ``warnings`` are
    ``(line, text)`` pairs about rules that name no one (unknown user or group
    names). ``compile_for`` (sbus.access.compiled) turns it into one client's table."""

    def __init__(self, path: str, default_allow: bool, default_action: str,
                 rules: Sequence[Rule], warnings: Sequence[Tuple[int, str]]) -> None:
        self.path = path
        self.default_allow = default_allow
        self.default_action = default_action
        self.rules = tuple(rules)
        self.warnings = tuple(warnings)
        # Who each rule names, indexed, so one client's compile reads only
        # its own rules and the everyone rules, not the whole file.
        self._everyone: List[int] = []
        self._by_uid: Dict[int, List[int]] = {}
        self._by_gid: Dict[int, List[int]] = {}
        for i, rule in enumerate(self.rules):
            if rule.uids is not None:
                for uid in rule.uids:
                    self._by_uid.setdefault(uid, []).append(i)
            elif rule.gids is not None:
                for gid in rule.gids:
                    self._by_gid.setdefault(gid, []).append(i)
            else:
                self._everyone.append(i)
        self._compiled: Dict[tuple, object] = {}
        # What compile_for needs to know about a client beyond its uid and
        # gid: a connect need not look up a name (NSS can block) or the
        # supplementary groups when no rule uses them.
        self.uses_user_name = any("%u" in t.tokens for r in self.rules for t in r.patterns)
        self.uses_groups = bool(self._by_gid)

    def rules_for(self, uid: int, gids: Iterable[int]) -> List[Rule]:
        """The rules that name this client, in file order."""
        picked = set(self._everyone)
        picked.update(self._by_uid.get(uid, ()))
        for gid in set(gids):
            picked.update(self._by_gid.get(gid, ()))
        return [self.rules[i] for i in sorted(picked)]

    def compile_for(self, uid: int, gid: int, groups: Iterable[int] = (),
                    user: Optional[str] = None):
        """The compiled table (``sbus.access.compiled.Access``) of a client
        with these credentials. ``groups``: its supplementary gids (for
        ``group``/``gid`` rules); ``user``: its user name, for ``%u`` (None
        if the uid has none). Clients with the same identity share one
        table, so a connection costs a reference."""
        key = (uid, gid, tuple(sorted(set(groups))), user)
        access = self._compiled.get(key)
        if access is None:
            from .compiled import Access
            access = self._compiled[key] = Access(self, uid, gid, key[2], user)
        return access


def _lines(text: str) -> List[str]:
    return text.split("\n")


_HEADER = re.compile(r"^\s*\[\[\s*(?:rule|\"rule\"|'rule')\s*\]\]")
_TABLE = re.compile(r"^\s*\[")


def _rule_lines(lines: Sequence[str]) -> List[int]:
    """The 1-based line of each ``[[rule]]`` header, in order."""
    return [n for n, line in enumerate(lines, 1) if _HEADER.match(line)]


def _key_line(lines: Sequence[str], start: int, key: str) -> Optional[int]:
    """The line of ``key = ...`` in the table whose header is on line
    ``start`` (0: the top level, before the first table), or None."""
    pattern = re.compile(rf"^\s*(?:{re.escape(key)}|\"{re.escape(key)}\")\s*=")
    for n in range(start + 1, len(lines) + 1):
        line = lines[n - 1]
        if _TABLE.match(line):
            break
        if pattern.match(line):
            return n
    return None


_TOML_AT = re.compile(r"\s*\(at line (\d+), column \d+\)$")


def parse(text: str, path: str = "<policy>") -> Policy:
    """The Policy ``text`` describes; raises PolicyError."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        m = _TOML_AT.search(message)
        if m:
            raise PolicyError(path, int(m.group(1)), message[:m.start()]) from None
        last = len(_lines(text.rstrip("\n"))) or 1
        raise PolicyError(path, last if "end of document" in message else None,
                          message.replace(" (at end of document)", " (at the end of the file)")) \
            from None
    lines = _lines(text)
    headers = _rule_lines(lines)

    def top_error(key: Optional[str], reason: str) -> PolicyError:
        return PolicyError(path, _key_line(lines, 0, key) if key else None, reason)

    for key in doc:
        if key not in TOP_KEYS:
            raise top_error(key, f"unknown setting {key!r} (expected one of: "
                                 f"{', '.join(TOP_KEYS)}; each rule is a [[rule]] table)")
    if "default" not in doc:
        raise PolicyError(path, 1, 'no default: say default = "allow" or default = "deny" '
                                   "(what no rule decides)")
    default = doc["default"]
    if default not in ("allow", "deny"):
        raise top_error("default", f'default must be "allow" or "deny", not {default!r}')
    on_deny = doc.get("on_deny", DROP)
    if on_deny not in ACTIONS:
        raise top_error("on_deny", f'on_deny must be "drop" or "disconnect", not {on_deny!r}')
    raw_rules = doc.get("rule", [])
    if not isinstance(raw_rules, list) or not all(isinstance(r, dict) for r in raw_rules):
        raise top_error("rule", "rule must be an array of tables: write each rule under "
                                "its own [[rule]] header")
    rules = []
    warnings: List[Tuple[int, str]] = []
    for i, raw in enumerate(raw_rules):
        header = headers[i] if i < len(headers) else (_key_line(lines, 0, "rule") or 1)
        rules.append(_rule(raw, i + 1, header, lines, path, warnings))
    return Policy(path, default == "allow", on_deny, rules, warnings)


def load(path: str) -> Policy:
    """The Policy in the file at ``path``; raises PolicyError (OSError as one
    too: a file that cannot be read is refused the same way)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise PolicyError(path, None, exc.strerror or str(exc)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise PolicyError(path, line, "not UTF-8 (TOML files are)") from None
    return parse(text, path)


def _rule(raw: dict, number: int, header: int, lines: Sequence[str], path: str,
          warnings: List[Tuple[int, str]]) -> Rule:
    def error(key: Optional[str], reason: str) -> PolicyError:
        line = _key_line(lines, header, key) if key else None
        return PolicyError(path, line or header, f"rule {number}: {reason}")

    for key in raw:
        if key not in _RULE_KEYS:
            raise error(key, f"unknown key {key!r} (expected: {', '.join(RULE_KEYS)})")
    if ("allow" in raw) == ("deny" in raw):
        raise error(None, 'say either allow = [...] or deny = [...], with "publish" '
                          'and/or "subscribe"')
    verb_key = "allow" if "allow" in raw else "deny"
    verbs_raw = raw[verb_key]
    if isinstance(verbs_raw, str):
        verbs_raw = [verbs_raw]
    if not isinstance(verbs_raw, list) or not verbs_raw:
        raise error(verb_key, f'{verb_key} must list "publish" and/or "subscribe"')
    verbs = 0
    for verb in verbs_raw:
        if verb not in VERBS:
            raise error(verb_key, f'{verb!r} is no verb: "publish" or "subscribe"')
        if verbs & VERBS[verb]:
            raise error(verb_key, f"{verb!r} twice")
        verbs |= VERBS[verb]
    allow = verb_key == "allow"

    if "pattern" not in raw:
        raise error(None, "no pattern: say pattern = \"...\" (\"\" is every key)")
    pats_raw = raw["pattern"]
    if isinstance(pats_raw, str):
        pats_raw = [pats_raw]
    if not isinstance(pats_raw, list) or not pats_raw or \
            not all(isinstance(p, str) for p in pats_raw):
        raise error("pattern", "pattern must be a string or a list of strings")
    templates = []
    for text in pats_raw:
        template, problem = _template(text)
        if problem:
            raise error("pattern", f"pattern {text!r}: {problem}")
        templates.append(template)

    action = raw.get("on_deny")
    if action is not None:
        if allow or not verbs & PUBLISH:
            raise error("on_deny", "on_deny is for deny rules that cover publish: it says "
                                   "what a denied publish gets")
        if action not in ACTIONS:
            raise error("on_deny", f'on_deny must be "drop" or "disconnect", not {action!r}')
    action = action or DROP

    chosen = [k for k in SELECTORS if k in raw]
    if len(chosen) > 1:
        raise error(chosen[1], f"name clients by one of user, group, uid, gid, not "
                               f"{' and '.join(chosen)} (write two rules)")
    who = chosen[0] if chosen else None
    names: Tuple[object, ...] = ()
    uids = gids = None
    if who is not None:
        value = raw[who]
        values = value if isinstance(value, list) else [value]
        numeric = who in ("uid", "gid")
        kind = int if numeric else str
        if not values or not all(type(v) is kind for v in values):
            what = "a number" if numeric else "a name"
            raise error(who, f"{who} must be {what} or a list of them")
        if numeric:
            for v in values:
                if not 0 <= v <= MAX_ID:
                    raise error(who, f"{who} {v} is out of range (0 to {MAX_ID})")
            ids = frozenset(values)
        else:
            ids = frozenset(_resolve(who, v, number, header, warnings) for v in values)
            ids = frozenset(i for i in ids if i is not None)
        names = tuple(values)
        if who in ("user", "uid"):
            uids = ids
        else:
            gids = ids
    return Rule(number, header, allow, verbs, tuple(templates), who, names, uids, gids, action)


def _resolve(who: str, name: str, number: int, line: int,
             warnings: List[Tuple[int, str]]) -> Optional[int]:
    try:
        if who == "user":
            return pwd.getpwnam(name).pw_uid
        return grp.getgrnam(name).gr_gid
    except KeyError:
        warnings.append((line, f"rule {number}: no {who} named {name!r} on this host; "
                               f"the rule does not name it (until a reload finds it)"))
        return None


def _template(text: str) -> Tuple[Template, Optional[str]]:
    """The pattern split at its tokens, and what is wrong with it (None)."""
    if "%" not in text and "\x00" not in text:
        return Template(text, (text,)), None
    if "\x00" in text:
        return Template(text, (text,)), "a pattern cannot hold a NUL byte"
    parts: List[str] = []
    literal = []
    pos = 0
    for m in _TOKEN.finditer(text):
        literal.append(text[pos:m.start()])
        token = m.group()
        if token == "%":
            return Template(text, (text,)), \
                f"'%' at offset {m.start()} starts no token (%u, %uid, %gid; %% for a '%')"
        if token == "%%":
            literal.append("%")
        else:
            parts.append("".join(literal))
            parts.append(token)
            literal = []
        pos = m.end()
    literal.append(text[pos:])
    parts.append("".join(literal))
    return Template(text, tuple(parts)), None
