"""``sbus policy``: check an access policy file, and explain its decisions
(docs/policy.md). Neither talks to a broker.

    sbus policy check FILE [--strict]
    sbus policy explain FILE --user USER [--gid GID] [--groups G,...]
                        publish KEY | subscribe PATTERN
"""
from __future__ import annotations

import argparse
import grp
import os
import pwd
import sys
from typing import List, Optional, Tuple

from ..access import Decision, PolicyError, load
from ..access.review import review
from . import otherbuses

# explain: the policy denies it (0: allows it; 1: the file or the user is bad).
DENIED_EXIT = 3


def add_parsers(commands, common: argparse.ArgumentParser) -> None:
    """``sbus policy ...`` on the sbus command's subparsers. ``common`` is
    not used: these commands talk to no broker."""
    policy = commands.add_parser(
        "policy", help="check an access policy file, or explain what it decides",
        description="Check or explain an access policy file (docs/policy.md). sbusd does "
                    "not enforce policies yet.")
    verbs = policy.add_subparsers(dest="policy_command", metavar="COMMAND", required=True)

    check = verbs.add_parser(
        "check", help="validate FILE; report rules that are never reached",
        description="Validate FILE: exit 1 with FILE:LINE: reason if it does not parse or "
                    "validate. Also warns about rules that are never reached (earlier rules "
                    "decide every key they match), patterns that match no key or are "
                    "written for another bus, and names this host does not know.")
    check.add_argument("file", metavar="FILE")
    check.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    check.set_defaults(standalone=cmd_check)

    explain = verbs.add_parser(
        "explain", help="which rule decides a publish or a subscription, and why",
        description="Say whether USER may publish KEY or subscribe to PATTERN under FILE, "
                    f"which rule decides and why. Exits 0 if allowed, {DENIED_EXIT} if "
                    "denied, 1 on a bad file or user.")
    explain.add_argument("file", metavar="FILE")
    explain.add_argument("--user", required=True, metavar="USER",
                         help="a user name or uid (a uid need not exist on this host)")
    explain.add_argument("--gid", metavar="GROUP",
                         help="the client's gid or group name (default: the user's)")
    explain.add_argument("--groups", metavar="G,...",
                         help="its supplementary groups, comma-separated (default: the "
                              "user's, from the group database)")
    explain.add_argument("verb", choices=("publish", "subscribe"))
    explain.add_argument("key", metavar="KEY|PATTERN")
    explain.set_defaults(standalone=cmd_explain)


def _load(path: str):
    try:
        return load(path)
    except PolicyError as exc:
        _say(str(exc))
        return None


def cmd_check(args: argparse.Namespace, where: object = None) -> int:
    policy = _load(args.file)
    if policy is None:
        return 1
    findings = [(f.line, f.text) for f in review(policy)]
    for rule in policy.rules:
        for template in rule.patterns:
            problem = otherbuses.foreign(template.text)
            if problem is not None and "never matches" not in problem.why:
                findings.append((rule.line, f"rule {rule.number}: {problem.text(template.text)}"))
    findings.sort(key=lambda f: f[0])
    for line, text in findings:
        print(f"{args.file}:{line}: warning: {text}")
    default = "allow" if policy.default_allow else "deny"
    count = len(policy.rules)
    print(f"{args.file}: valid: {count} rule{'' if count == 1 else 's'}, default {default}"
          + (f"; {len(findings)} warning{'' if len(findings) == 1 else 's'}" if findings else ""))
    return 1 if findings and args.strict else 0


def identity(user: str, gid: Optional[str], groups: Optional[str]) \
        -> Tuple[int, int, List[int], Optional[str]]:
    """(uid, gid, supplementary gids, user name) for ``--user``, ``--gid`` and
    ``--groups``; raises ValueError naming what is unknown."""
    entry = None
    if user.isdigit():
        uid = int(user)
        try:
            entry = pwd.getpwuid(uid)
        except KeyError:
            pass
    else:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise ValueError(f"no user named {user!r} on this host (give a uid)") from None
        uid = entry.pw_uid
    name = entry.pw_name if entry else None
    if gid is not None:
        the_gid = _group(gid)
    elif entry is not None:
        the_gid = entry.pw_gid
    else:
        raise ValueError(f"uid {uid} is not in the user database: give --gid")
    if groups is not None:
        extra = [_group(g) for g in groups.split(",") if g]
    elif name is not None:
        extra = [g for g in os.getgrouplist(name, the_gid) if g != the_gid]
    else:
        extra = []
    return uid, the_gid, extra, name


def _group(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"no group named {text!r} on this host") from None


def cmd_explain(args: argparse.Namespace, where: object = None) -> int:
    policy = _load(args.file)
    if policy is None:
        return 1
    try:
        uid, gid, groups, name = identity(args.user, args.gid, args.groups)
    except ValueError as exc:
        _say(f"policy explain: {exc}")
        return 1
    access = policy.compile_for(uid, gid, groups, name)
    arg = os.fsencode(args.key)
    decision = access.may_publish(arg) if args.verb == "publish" else access.may_subscribe(arg)
    who = (f"{name} " if name else "") + f"(uid {uid}, gid {gid}" + \
        (f", groups {','.join(str(g) for g in groups)}" if groups else "") + ")"
    print(f"{_verdict(args.verb, decision)}: {args.verb} {args.key!r} by {who}")
    print(f"  {decision.why}")
    shown = [decision.rule] if decision.rule is not None else list(decision.rules)
    for rule in shown:
        print(f"  {rule.describe()}")
    if decision.rule is None and not decision.rules:
        default = "allow" if policy.default_allow else "deny"
        print(f'  the default: default = "{default}"'
              + (f', on_deny = "{policy.default_action}"'
                 if not policy.default_allow and args.verb == "publish" else ""))
    return 0 if decision.allowed else DENIED_EXIT


def _verdict(verb: str, decision: Decision) -> str:
    if decision.allowed:
        return "allowed"
    if verb == "subscribe":
        return "refused"
    return "denied (the connection is closed)" if decision.action == "disconnect" \
        else "denied (dropped)"


def _say(text: str) -> None:
    sys.stderr.write(f"sbus: {text}\n")
    sys.stderr.flush()
