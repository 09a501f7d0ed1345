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
import sys
import time
from typing import Optional

from .. import logschema as schema
from ..atomicfile import write_atomically

STATUS_SUFFIX = ".reload"       # beside the pidfile: the last reload's outcome
REQUEST_TIMEOUT = 30.0


def load(path: str):
    """The Policy in path; PolicyError (``FILE:LINE: reason``) if it does not load."""
    from ..access import load as load_policy
    return load_policy(path)


def status_path(pidfile: str) -> str:
    return pidfile + STATUS_SUFFIX


def write_status(pidfile: Optional[str], **outcome) -> None:
    import json
    if pidfile:
        try:
            write_atomically(status_path(pidfile), (json.dumps(outcome) + "\n").encode())
        except OSError:
            pass        # the log says it too


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
    import json

    from .upgrade import alive, read_pid

    def fail(text: str) -> int:
        print(f"sbusd --reload: {text}", file=sys.stderr)
        return 1

    if not pidfile:
        return fail("give the running sbusd's pidfile with -p")
    pid = read_pid(pidfile)
    if pid is None:
        return fail(f"no pid in {pidfile}")
    if not alive(pid):
        return fail(f"pid {pid} (from {pidfile}) is not running")
    status = status_path(pidfile)
    try:
        os.unlink(status)       # so the outcome we read is this reload's
    except FileNotFoundError:
        pass
    except OSError as e:
        return fail(f"{status}: {e.strerror}")
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(status) as f:
                outcome = json.load(f)
        except (OSError, ValueError):
            outcome = {}
        if outcome.get("pid") == pid:
            if outcome.get("result") == "done":
                print(f"sbusd: pid {pid} enforces {outcome.get('path')} "
                      f"({outcome.get('rules')} rules; {outcome.get('revoked')} "
                      f"connections revoked)")
                return 0
            return fail(f"pid {pid} keeps its policy: {outcome.get('reason')}")
        if not alive(pid):
            return fail(f"pid {pid} exited")
        time.sleep(0.02)
    return fail(f"no outcome within {timeout:g} s")
