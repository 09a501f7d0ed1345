"""The access policy in a service (``sbus store``, ``sbus queue``): may the
client behind a reply key read what it asks for (docs/policy.md, "Services").

A service never sees its askers' sockets. It learns who asks from the
private key its answers go to, ``!/cred/GID/UID/PID/...``: the broker hands a
message on that key only to a client with those credentials, so whoever
wrote the key, only that client reads the answer. Behind a leaf broker or a
bridge the key holds one such form per hop (``!/cred/G/U/P/!/cred/g/u/p/...``),
and each hop hands it on to its own client of those credentials alone; every
form names a client the answer passes through, so every one must be allowed.

The decision is the broker's own SUB decision, ``Access.may_subscribe``: a
service answers PATTERN to a client only if every key PATTERN can match is
one the client may read. A replay, a last-value answer or a queue's jobs are
a subscription by other means, and are refused as one would be: never
narrowed, and with the reason. Deciding once per request (per consumer for a
queue) keeps the per-record and per-job paths free of any check.
"""
from __future__ import annotations

import os
import pwd
import re
from typing import Dict, List, NamedTuple, Optional, Tuple

from .compiled import Access
from .model import MAX_ID, Policy, load

# Decisions remembered (a queue consumer says hello every third of its
# lease); past this many, forgotten all at once.
MAX_REMEMBERED = 4096
# One credentials form; the numbers as the broker writes them (no sign, no
# spaces). A reply key that starts with none names nobody the service can judge.
_FORM = re.compile(rb"!/cred/([0-9]{1,10})/([0-9]{1,10})/([0-9]{1,10})/")


class Refusal(NamedTuple):
    """Why a service refuses: the client (uid, gid) that may not read some key
    of the pattern (None when the reply key names no client), the deciding
    rule's number (0: the default) and the reason in words."""

    uid: Optional[int]
    gid: Optional[int]
    rule: int
    why: str

    def __str__(self) -> str:
        return self.why


def identities(reply: bytes) -> List[Tuple[int, int]]:
    """(uid, gid) of every ``!/cred/GID/UID/PID/`` form a reply key starts
    with, outermost first; [] when it starts with none."""
    out = []
    pos = 0
    while True:
        m = _FORM.match(reply, pos)
        if m is None:
            return out
        gid, uid = int(m.group(1)), int(m.group(2))
        if gid > MAX_ID or uid > MAX_ID:
            return []
        out.append((uid, gid))
        pos = m.end()


class Askers:
    """A service's ``--policy FILE``: loaded at start, ``reload()`` on SIGUSR1.

    ``refusal(reply, pattern)`` is the one question the services ask: None
    when every client the reply key names may read every key ``pattern`` can
    match, else a :class:`Refusal`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.policy: Policy = load(path)     # PolicyError: the service does not start
        self._access: Dict[Tuple[int, int], Access] = {}
        self._decided: Dict[tuple, Optional[Refusal]] = {}

    def reload(self) -> Policy:
        """Read the file again; the new policy decides from now on. A file
        that does not load raises PolicyError and the policy in force stays."""
        policy = load(self.path)
        self.policy, self._access, self._decided = policy, {}, {}
        return policy

    def access(self, uid: int, gid: int) -> Access:
        """The compiled policy of a client, as sbusd compiles it at connect.
        The user name and supplementary groups, which sbusd takes from the
        socket, come from the user database here (``getgrouplist``), and
        only when some rule needs them."""
        found = self._access.get((uid, gid))
        if found is None:
            policy = self.policy
            user: Optional[str] = None
            groups: Tuple[int, ...] = ()
            if policy.uses_user_name or policy.uses_groups:
                try:
                    user = pwd.getpwuid(uid).pw_name
                except KeyError:
                    pass
            if policy.uses_groups and user is not None:
                try:
                    groups = tuple(os.getgrouplist(user, gid))
                except OSError:
                    pass
            found = self._access[(uid, gid)] = policy.compile_for(uid, gid, groups, user)
        return found

    def refusal(self, reply: bytes, pattern: bytes) -> Optional[Refusal]:
        """None if the service may answer ``pattern`` on ``reply``; else why not."""
        ids = identities(reply)
        known = (tuple(ids), pattern)
        if known in self._decided:
            return self._decided[known]
        if len(self._decided) >= MAX_REMEMBERED:
            self._decided.clear()
        refusal = self._decided[known] = self._decide(ids, pattern)
        return refusal

    def _decide(self, ids: List[Tuple[int, int]], pattern: bytes) -> Optional[Refusal]:
        if not ids:
            return Refusal(None, None, 0, "the reply key names no client "
                                          "(!/cred/GID/UID/PID/...), so the policy cannot "
                                          "say who would read the answer")
        shown = pattern.decode("utf-8", "backslashreplace")
        for uid, gid in ids:
            decision = self.access(uid, gid).may_subscribe(pattern)
            if not decision.allowed:
                rule = decision.rule.number if decision.rule else 0
                return Refusal(uid, gid, rule,
                               f"policy: uid {uid} may not read every key of {shown!r}: "
                               f"{decision.why}")
        return None

    @property
    def fields(self) -> dict:
        """What ``policy_loaded`` says of the policy in force."""
        return {"path": self.path, "rules": len(self.policy.rules),
                "default": "allow" if self.policy.default_allow else "deny"}


def reload(askers: Optional[Askers], log, revoke) -> bool:
    """SIGUSR1 in a service, between two turns: load the file again and
    ``revoke()`` what the new policy no longer allows (it returns how many
    sessions or consumers it ended), or keep the policy in force and say
    why. The same records as sbusd's reload; True once the new one decides."""
    from .. import logschema as schema
    from .model import PolicyError
    if askers is None:
        log.warning(schema.POLICY_REFUSED, path=None,
                    reason="this service runs without --policy: there is no file to reload")
        return False
    try:
        askers.reload()
    except PolicyError as e:
        log.error(schema.POLICY_REFUSED, path=askers.path, reason=str(e))
        return False
    log.info(schema.POLICY_LOADED, reload=True, identities=0, revoked=revoke(),
             **askers.fields)
    return True
