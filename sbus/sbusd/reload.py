"""sbusd's access policy: loaded at start, reloaded on SIGUSR1 between two
turns of the loop, and ``sbusd --reload -p PIDFILE``, which sends SIGUSR1
and waits for the outcome the broker writes beside the pidfile (as
``--upgrade`` does, docs/policy.md).

A file that does not load is refused: at start sbusd exits 1 with
``FILE:LINE: reason``; at a reload the policy in force stays, and the refusal
is logged (``policy_refused``) and is the reason ``--reload`` prints.
"""
from __future__ import annotations

import os
import signal
from typing import Optional

from .. import logschema as schema

STATUS_SUFFIX = ".reload"       # beside the pidfile: the last reload's outcome
REQUEST_TIMEOUT = 30.0


def load(path: str):
    """The Policy in path; PolicyError (``FILE:LINE: reason``) if it does not load."""
    from ..access import load as load_policy
    return load_policy(path)


def status_path(pidfile: str) -> str:
    return pidfile + STATUS_SUFFIX


def write_status(pidfile: Optional[str], **outcome) -> None:
    from .lifecycle import write_outcome
    write_outcome(pidfile, STATUS_SUFFIX, outcome)


def enforce(broker, policy, log, *, reload: bool) -> dict:
    """Have broker enforce policy now (between turns), and log it."""
    identities, revoked = broker.set_policy(policy)
    fields = {"path": policy.path, "rules": len(policy.rules),
              "default": "allow" if policy.default_allow else "deny", "reload": reload,
              "identities": identities, "revoked": revoked}
    log.info(schema.POLICY_LOADED, **fields)
    return fields


def act(cfg, broker, log) -> bool:
    """SIGUSR1, between two turns: load cfg.policy again and enforce it, or
    keep the one in force and say why. True when the new one is in force."""
    from ..access import PolicyError
    if not cfg.policy:
        reason = "sbusd runs without --policy: there is no file to reload"
        log.warning(schema.POLICY_REFUSED, path=None, reason=reason)
        write_status(cfg.pidfile, result="failed", pid=os.getpid(), reason=reason)
        return False
    try:
        policy = load(cfg.policy)
    except PolicyError as e:
        log.error(schema.POLICY_REFUSED, path=cfg.policy, reason=str(e))
        write_status(cfg.pidfile, result="failed", pid=os.getpid(), reason=str(e))
        return False
    fields = enforce(broker, policy, log, reload=True)
    write_status(cfg.pidfile, result="done", pid=os.getpid(), **fields)
    return True


def request(pidfile: Optional[str], timeout: float = REQUEST_TIMEOUT) -> int:
    """``sbusd --reload -p PIDFILE``: 0 once the sbusd the pidfile names
    enforces its policy file as it is now; 1 with the reason when it refused
    the file (the old policy stays), or on a timeout."""
    from .lifecycle import signal_and_wait

    def judge(pid: int, outcome: dict):
        if outcome.get("pid") != pid:
            return None
        if outcome.get("result") == "done":
            return 0, (f"sbusd: pid {pid} enforces {outcome.get('path')} "
                       f"({outcome.get('rules')} rules; {outcome.get('revoked')} "
                       f"connections revoked)")
        return 1, f"pid {pid} keeps its policy: {outcome.get('reason')}"

    return signal_and_wait("reload", pidfile, STATUS_SUFFIX, signal.SIGUSR1, judge, "exited",
                           timeout)
