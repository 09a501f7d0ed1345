"""``sbus ready``: wait until a service serves, for scripts and units.

    sbus ready store [--request-key KEY] [-W S]   the store answers on its request key
    sbus ready queue PATTERN [-W S]               the queue service for PATTERN answers
    sbus ready serve PATTERN [-W S]               an ``sbus serve PATTERN`` answers
    sbus ready upstream [-W S]                    this leaf's link has its subscriptions
                                                  in place on the upstream

Each asks the service what it already answers (the store's ``op=stats``, the
queue's and ``sbus serve``'s state requests, the broker's ``CMSG stats``) until it does: exit 0,
quietly, once it does; after ``-W`` seconds (default 10; 0: for ever) exit 1
with what to start. A service also says it is ready itself, once: a
``service_ready`` record in its log and READY=1 under systemd (``Type=notify``).
"""
from __future__ import annotations

import argparse
import shlex
import time
from typing import BinaryIO, Callable, Optional, Tuple

from .. import argtypes

WAIT = 10.0         # seconds, as consume's and replay's waits
ASK_EVERY = 1.0     # seconds a question waits for its answer before it is asked again
NOT_READY = 1       # the exit status after -W


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    ready = commands.add_parser(
        "ready", parents=[common], help="wait until a service serves (exit 0), or say why not",
        description="Wait until a service serves: the store answers on its request key, the "
                    "queue service for PATTERN answers, an sbus serve PATTERN has its "
                    "subscription in place, or this leaf broker's link has its "
                    f"subscriptions in place upstream. Exit 0 once it does, {NOT_READY} with a "
                    "hint if it did not within -W seconds.")
    ready.add_argument("service", choices=tuple(CHECKS), help="what to wait for")
    ready.add_argument("pattern", metavar="PATTERN", nargs="?",
                       help="queue, serve: the pattern, as given to sbus queue or sbus serve")
    ready.add_argument("--request-key", metavar="KEY", default=None,
                       help="store: its --request-key (default sbus/store/request)")
    ready.add_argument("-W", "--wait", type=argtypes.seconds, default=WAIT, metavar="SECONDS",
                       help=f"give up after SECONDS (default {WAIT:g}; 0: wait for ever)")
    ready.set_defaults(run=cmd_ready)


def cmd_ready(bus, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    if (args.service in ("queue", "serve")) != (args.pattern is not None):
        args.parser.error("queue and serve take their PATTERN; store and upstream take none")
    check = CHECKS[args.service](bus, args)
    deadline = None if args.wait == 0 else time.monotonic() + args.wait
    while True:
        asked = time.monotonic()
        done, why = check()
        if done:
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            say(f"sbus ready: {args.service} not ready within {args.wait:g} s: {why}")
            return NOT_READY
        time.sleep(max(0.0, ASK_EVERY - (time.monotonic() - asked)))


Check = Callable[[], Tuple[bool, str]]


def store_check(bus, args: argparse.Namespace) -> Check:
    from ..client.store import StoreError, store_stats
    from ..store import wire
    key = args.request_key or wire.REQUEST_KEY.decode()
    extra = f" --request-key {shlex.quote(key)}" if args.request_key else ""

    def check() -> Tuple[bool, str]:
        try:
            store_stats(bus, request_key=key, timeout=ASK_EVERY)
            return True, ""
        except (StoreError, TimeoutError):
            return False, (f"no answer on {key!r}\n  is sbus store running? start one: sbus "
                           f"store --dir DIR --record PATTERN{extra} (docs/store.md), or wait "
                           "longer with -W SECONDS")
    return check


def queue_check(bus, args: argparse.Namespace) -> Check:
    from ..queue import wire
    return state_check(bus, args.pattern, wire.STATE_KEY, "queue", (
        f"no queue service for {args.pattern!r} answered (asked on {wire.STATE_KEY})\n"
        f"  is sbus queue running? start one with: sbus queue {shlex.quote(args.pattern)} "
        "(the pattern must be the same, byte for byte), or wait longer with -W SECONDS"))


def serve_check(bus, args: argparse.Namespace) -> Check:
    from .requests import STATE_KEY
    return state_check(bus, args.pattern, STATE_KEY, "serve", (
        f"no sbus serve for {args.pattern!r} answered (asked on {STATE_KEY})\n"
        f"  is it running? start one with: sbus serve {shlex.quote(args.pattern)} -- COMMAND "
        "(the pattern must be the same, byte for byte), or wait longer with -W SECONDS"))


def state_check(bus, pattern: str, state_key: str, kind: str, why: str) -> Check:
    """Whether a service answers the state request for ``pattern`` on
    ``state_key`` (the queue's, sbus serve's: docs/queues.md, "State")."""
    from .consume import wait_for_service

    def check() -> Tuple[bool, str]:
        # One question, one second (-W 0 there would mean for ever).
        if wait_for_service(bus, pattern, ASK_EVERY / 2, say, notice_after=float("inf"),
                            state_key=state_key, kind=kind):
            return True, ""
        return False, why
    return check


def upstream_check(bus, args: argparse.Namespace) -> Check:
    def check() -> Tuple[bool, str]:
        state: Optional[dict] = bus.stats(timeout=10.0).get("upstream")
        if state is None:
            return False, ("this broker has no upstream\n  sbus ready upstream is for a "
                           "leaf broker (sbusd --upstream ADDRESS, docs/hierarchy.md)")
        if state.get("state") == "up" and state.get("subscribed"):
            return True, ""
        reason = f" ({state['reason']})" if state.get("reason") else ""
        return False, (f"its link to {state.get('address')} is {state.get('state')}{reason}\n"
                       "  is the upstream sbusd running? the leaf reconnects by itself; wait "
                       "longer with -W SECONDS")
    return check


CHECKS = {"store": store_check, "queue": queue_check, "serve": serve_check,
          "upstream": upstream_check}


def say(text: str) -> None:
    import sys
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
