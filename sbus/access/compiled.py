"""One client's policy, compiled at connect time (as dbus-broker does).

``Policy.compile_for(uid, gid, groups, user)`` keeps the rules that name the
client, substitutes its ``%u``/``%uid``/``%gid`` and returns an ``Access``:

- ``may_publish(key) -> Decision``: the first publish entry whose pattern
  matches the key decides, else the default.
- ``may_subscribe(pattern) -> Decision``: allowed only if every key the pattern
  can match is one the client may read; else refused, naming the rule that
  denies some key and such a key (docs/policy.md says why not narrowed).

Clients with the same identity share one ``Access`` (``compile_for`` keeps
them), so a connection holds a reference, not a copy.

The contract for the C core
---------------------------
Subscriptions are decided at ``SUB`` time, in Python (``may_subscribe``: a
slow path, like the ``!/cred/`` check it runs after). On the message path the
core needs only publish decisions, and ``Access.to_bytes()`` gives them as one
flat little-endian blob, already filtered to this client and substituted,
which the core copies into a C struct once per identity:

    header  (12 bytes)  u8 version (1), u8 flags, u16 0,
                        u32 count, u32 default_rule
    entry   (8 bytes + pattern), count times, in decision order:
                        u8 flags, u8 0, u16 pattern_length, u32 rule,
                        pattern_length bytes of pattern (no NUL, no padding)

    flags: 1 allow, 2 disconnect (a denied publish closes the connection
    rather than dropping silently). Header flags are the default's, used when
    no entry matches; ``default_rule`` is the rule number the log gives for a
    default decision (0: the file's ``default``). ``rule`` counts from 1 in
    file order; several entries may share one (a rule with a list of patterns).

    To decide a publish of KEY: put a key's ``!/cred/G/U/P/`` numbers in the
    canonical form (no leading zeros), as the delivery rule reads them; then
    the first entry whose pattern matches KEY (the spec's matcher, the
    index's) decides; none: the header. An empty table (count 0) means one
    decision for every key: the core can keep just the header.

Patterns in the table are those of publish rules only, in file order; an
entry that matches every key ends the table (nothing after it is reached).

At connect the core calls ``policy.compile_for(uid, gid, groups, user)``,
looking up the user name only if ``policy.uses_user_name`` and the
supplementary groups (``SO_PEERGROUPS``) only if ``policy.uses_groups``, and
keeps the ``Access`` and its C table per identity (``compile_for`` returns
the same object for the same identity). At ``SUB``, after the ``!/cred/``
check, it calls ``access.may_subscribe(stored_pattern)`` and refuses the
subscription unless ``.allowed``; ``.rule`` and ``.key`` are for the log.
"""
from __future__ import annotations

import re
import struct
from typing import List, NamedTuple, Optional, Sequence, Tuple

from ..client.chunks import SUFFIX as CHUNK_SUFFIX
from ..queue.wire import PUT_SUFFIX
from .keysets import KeySet, TooComplex, find_key, meet, within
from .model import DISCONNECT, PUBLISH, SUBSCRIBE, Policy, Rule, Template

# Derived keys the policy judges as the key they carry messages of.
_DERIVED = (CHUNK_SUFFIX, PUT_SUFFIX.encode())
HEADER = struct.Struct("<BBHII")
ENTRY = struct.Struct("<BBHI")
VERSION = 1
F_ALLOW = 1
F_DISCONNECT = 2
# Bytes a user name may not bring into a pattern: they would change what it
# matches ('/', '*') or make keys the broker reads specially ('!').
_UNSAFE_NAME = re.compile(r"[/*!\x00]")
_HOLE = "\x00"      # stands for an unusable %u until the rule's kind decides
_CRED = re.compile(rb"!/cred/([0-9]*)/([0-9]*)/([0-9]*)/")


class Entry(NamedTuple):
    """One pattern of one rule, for one client: substituted, in file order."""

    verbs: int
    allow: bool
    action: str
    pattern: bytes
    rule: Rule


class Decision(NamedTuple):
    """What a policy says about one publish or one subscription.

    ``rule`` is the deciding rule (None: the default). ``action`` is what a
    denied publish gets ("drop" or "disconnect"). ``pattern`` is the deciding
    entry's pattern as substituted. For a refused subscription, ``key`` is a
    key the pattern matches and the client may not read; for an allowed one,
    ``rules`` are the allow rules its keys fall under. ``why`` says it in words.
    """

    allowed: bool
    rule: Optional[Rule]
    action: Optional[str] = None
    pattern: Optional[bytes] = None
    key: Optional[bytes] = None
    rules: Tuple[Rule, ...] = ()
    why: str = ""


def _message_key(key: bytes) -> bytes:
    """The key (or pattern) a derived one carries messages of: ``K`` for
    ``K/.sbus-chunk``, ``K/.sbus-jobs`` and ``K/.sbus-jobs/.sbus-chunk``."""
    for suffix in _DERIVED:
        if key.endswith(suffix) and len(key) > len(suffix):
            key = key[:-len(suffix)]
    return key


def canonical_key(key: bytes) -> bytes:
    """``key`` with the numbers of a leading ``!/cred/G/U/P/`` form without
    leading zeros: the broker delivers both spellings to the same client, so
    the policy must judge them alike. A chunk's key is judged as its
    message's (docs/chunks.md): ``K/.sbus-chunk`` as ``K``; and a producer's
    batch of jobs as its jobs' (docs/queues.md): ``K/.sbus-jobs`` as ``K``."""
    key = _message_key(key)
    m = _CRED.match(key)
    if m is None:
        return key
    fields = [str(int(g)).encode() if g else b"" for g in m.groups()]
    return b"!/cred/" + b"/".join(fields) + b"/" + key[m.end():]


def _substitute(template: Template, values: dict, allow: bool) -> Optional[bytes]:
    """The template with this client's values, or None if the entry is
    dropped. A token without a usable value (a uid without a user name, a
    name holding '/', '*' or '!') drops an allow entry (it allows nothing
    then) and widens a deny entry to '*' for that segment (it denies at
    least what any value would have)."""
    out = []
    for i, part in enumerate(template.parts):
        if i % 2 == 0:
            out.append(part)
        else:
            value = values.get(part)
            if value is None:
                if allow:
                    return None
                value = _HOLE
            out.append(value)
    text = "".join(out)
    if _HOLE in text:
        text = "/".join("*" if _HOLE in seg else seg for seg in text.split("/"))
    return text.encode("utf-8", "surrogateescape")


class Access:
    """One identity's compiled policy; made by ``Policy.compile_for``."""

    def __init__(self, policy: Policy, uid: int, gid: int, groups: Sequence[int],
                 user: Optional[str]) -> None:
        self.policy = policy
        self.uid, self.gid, self.groups, self.user = uid, gid, tuple(groups), user
        values = {"%uid": str(uid), "%gid": str(gid)}
        if user and not _UNSAFE_NAME.search(user):
            values["%u"] = user
        entries: List[Entry] = []
        for rule in policy.rules_for(uid, (gid, *groups)):
            for template in rule.patterns:
                pattern = _substitute(template, values, rule.allow)
                if pattern is not None:
                    entries.append(Entry(rule.verbs, rule.allow, rule.action, pattern, rule))
        self.entries: Tuple[Entry, ...] = tuple(entries)
        self._publish = self._table(PUBLISH)
        self._subscribe = self._table(SUBSCRIBE)
        self.default = Decision(policy.default_allow, None,
                                None if policy.default_allow else policy.default_action,
                                why="no rule decides it: the default")
        # The C view: publish entries until one that matches every key,
        # which then stands in for the default.
        table: List[Entry] = []
        self.publish_default = self.default
        for entry, keys in self._publish:
            if keys.dead:
                continue
            if entry.pattern == b"":
                self.publish_default = self._decided(entry)
                break
            table.append(entry)
        self.table: Tuple[Entry, ...] = tuple(table)

    def _table(self, verb: int) -> List[Tuple[Entry, KeySet]]:
        return [(e, KeySet(e.pattern)) for e in self.entries if e.verbs & verb]

    def __repr__(self) -> str:
        return (f"<Access uid={self.uid} gid={self.gid} entries={len(self.entries)} "
                f"bytes={self.nbytes}>")

    @staticmethod
    def _decided(entry: Entry, key: Optional[bytes] = None) -> Decision:
        verb = "allows" if entry.allow else "denies"
        return Decision(entry.allow, entry.rule, None if entry.allow else entry.action,
                        entry.pattern, key,
                        why=f"{entry.pattern.decode('utf-8', 'replace')!r} of "
                            f"rule {entry.rule.number} matches first, and it {verb}")

    def may_publish(self, key: bytes) -> Decision:
        """Whether this client may publish ``key``, and which rule says so."""
        key = canonical_key(key)
        for entry, keys in self._publish:
            if keys.matches(key):
                return self._decided(entry)
        return self.default

    def may_read(self, key: bytes) -> Decision:
        """Whether a message with ``key`` may reach this client: the subscribe
        rules, as for publish. (``may_subscribe`` holds every key of a pattern
        to this.)"""
        key = canonical_key(key)
        for entry, keys in self._subscribe:
            if keys.matches(key):
                return self._decided(entry)
        return self.default

    def may_subscribe(self, pattern: bytes) -> Decision:
        """Whether this client may hold ``pattern``: only if every key it can
        match is one the client may read (``may_read``). Refused otherwise,
        with the rule that denies some key (None: the default) and such a key.

        Rules are walked in file order; the keys an earlier allow takes are
        out of reach of a later deny. A deny refuses if some key of the
        pattern is in it and in no earlier allow; an allow that holds the
        whole pattern settles it. A pattern too tangled to prove safe within
        ``keysets.BUDGET`` steps is refused: refusing is never a leak.
        A chunk twin ``P/.sbus-chunk`` is judged as ``P``, whose messages its
        chunks carry (docs/chunks.md), and so is a queue's twin
        ``P/.sbus-jobs``, whose jobs its batches carry (docs/queues.md)."""
        pattern = _message_key(pattern)
        wanted = KeySet(pattern)
        if wanted.dead:
            return Decision(True, None, why="the pattern matches no key ('*' takes the rest "
                                            "of its segment), so it can leak nothing")
        earlier: List[KeySet] = []
        met: List[Rule] = []
        try:
            for entry, keys in self._subscribe:
                if entry.allow:
                    if within(wanted, keys):
                        met.append(entry.rule)
                        return Decision(True, entry.rule, pattern=entry.pattern,
                                        rules=tuple(dict.fromkeys(met)),
                                        why=f"every key it matches is under "
                                            f"{entry.pattern.decode('utf-8', 'replace')!r}"
                                            f" of rule {entry.rule.number}, which allows")
                    if meet([wanted, keys]):
                        met.append(entry.rule)
                        earlier.append(keys)
                    continue
                key = find_key([wanted, keys], earlier)
                if key is not None:
                    d = self._decided(entry, key)
                    return d._replace(action=None, why=(
                        f"it matches {_show(key)}, which rule {entry.rule.number} denies "
                        f"({entry.pattern.decode('utf-8', 'replace')!r}) before any rule "
                        f"allows it"))
            if not self.policy.default_allow:
                key = find_key([wanted], earlier)
                if key is not None:
                    return Decision(False, None, key=key,
                                    why=f"it matches {_show(key)}, which no rule allows, "
                                        f"and the default is deny")
        except TooComplex as exc:
            return Decision(False, None, why=f"too many rules to prove every key it matches "
                                             f"readable ({exc}); refused to be safe")
        if met:
            numbers = ", ".join(str(r.number) for r in dict.fromkeys(met))
            why = f"every key it matches is allowed (rules {numbers}" + \
                  (", and the default" if self.policy.default_allow else "") + ")"
        else:
            why = "no rule names a key it matches, and the default is allow"
        return Decision(True, None, rules=tuple(dict.fromkeys(met)), why=why)

    def to_bytes(self) -> bytes:
        """The publish table as the C core reads it (the module docstring)."""
        default = self.publish_default
        out = [HEADER.pack(VERSION, _flags(default.allowed, default.action), 0,
                           len(self.table), default.rule.number if default.rule else 0)]
        for entry in self.table:
            out.append(ENTRY.pack(_flags(entry.allow, None if entry.allow else entry.action),
                                  0, len(entry.pattern), entry.rule.number))
            out.append(entry.pattern)
        return b"".join(out)

    @property
    def nbytes(self) -> int:
        """What one identity's C table costs (shared by its connections)."""
        return HEADER.size + sum(ENTRY.size + len(e.pattern) for e in self.table)


def _flags(allow: bool, action: Optional[str]) -> int:
    return (F_ALLOW if allow else 0) | (F_DISCONNECT if action == DISCONNECT else 0)


def _show(key: bytes) -> str:
    return repr(key.decode("utf-8", "backslashreplace"))


def from_bytes(blob: bytes) -> Tuple[Tuple[bool, bool, int], List[Tuple[bool, bool, bytes, int]]]:
    """The blob read back: ((allow, disconnect, rule) of the default,
    [(allow, disconnect, pattern, rule), ...]). The tests use it to hold
    ``to_bytes`` to the contract; the C side reads the same layout."""
    version, flags, _, count, rule = HEADER.unpack_from(blob, 0)
    if version != VERSION:
        raise ValueError(f"access table version {version}, not {VERSION}")
    pos = HEADER.size
    entries = []
    for _ in range(count):
        eflags, _, length, number = ENTRY.unpack_from(blob, pos)
        pos += ENTRY.size
        entries.append((bool(eflags & F_ALLOW), bool(eflags & F_DISCONNECT),
                        blob[pos:pos + length], number))
        pos += length
    if pos != len(blob):
        raise ValueError("trailing bytes after the access table")
    return (bool(flags & F_ALLOW), bool(flags & F_DISCONNECT), rule), entries
