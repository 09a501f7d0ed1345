"""``sbus consume``: print a queue's jobs, and say so when no queue service answers.

A consumer keeps saying hello until the service for its pattern welcomes it,
which may be never (no ``sbus queue`` runs, or one runs for another pattern).
The consumer library waits without a word, as a program's consumer should
(the service may start later); a person at a shell, or a script, wants to be
told. So, before it consumes, the command asks the service for its state
(docs/queues.md, "State") from a connection of its own until it answers: if
none has within ``NOTICE_AFTER`` seconds it says so on stderr, with the
command that starts one, and keeps waiting; after ``-W`` seconds (default
``sbus.queue.defaults.CLI_WAIT``; 0: for ever) it gives up with exit status
1 and the same hint.
"""
from __future__ import annotations

import argparse
import shlex
import time
from typing import BinaryIO, Callable

from ..client.private import PrivateInbox
from ..client.protocol import Message
from ..queue import wire

# Seconds without an answer from the queue service before the command says so.
NOTICE_AFTER = 3.0

# Seconds between state requests while none is answered.
ASK_EVERY = 1.0


def wait_for_service(client, pattern: str, wait: float, say: Callable[[str], None],
                     notice_after: float = NOTICE_AFTER, state_key: str = wire.STATE_KEY,
                     kind: str = "queue") -> bool:
    """Ask the queue service for ``pattern`` its state, from a connection of
    our own, until it answers (True) or ``wait`` seconds passed (False; 0:
    never); tell ``say`` after ``notice_after`` seconds of silence, and when
    it answers after that. ``sbus serve`` answers the same state request on
    its own ``state_key`` (``sbus ready serve``, with its ``kind`` of inbox)."""
    from ..client.sync import Client
    forever = wait == 0
    with Client(client.address, max_message=client.max_message) as bus:
        inbox = PrivateInbox(bus.whoami(timeout=10.0), kind)
        bus.subscribe(inbox.pattern)
        request = wire.pack_state_request(inbox.prefix, pattern)
        started, told = time.monotonic(), False
        while True:
            bus.publish(state_key, request)
            if answered(bus, inbox):
                if told:
                    say(f"the queue service for {pattern!r} answered; taking its jobs")
                return True
            waited = time.monotonic() - started
            if not forever and waited >= wait:
                return False
            if not told and waited >= notice_after:
                told = True
                until = "Ctrl-C stops" if forever else f"gives up after {wait:g} s, -W"
                say(f"no queue service for {pattern!r} answered within {notice_after:g} s "
                    f"(asked on {wire.STATE_KEY}); start one with: sbus queue "
                    f"{shlex.quote(pattern)}  (the pattern must be the same, byte for byte); "
                    f"still waiting for it ({until})")


def answered(bus, inbox: PrivateInbox) -> bool:
    """Whether a state answer came within ASK_EVERY."""
    deadline = time.monotonic() + ASK_EVERY
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            message = bus.receive(timeout=left)
        except TimeoutError:
            return False
        if type(message) is Message and inbox.suffix_of(message.key) == wire.STATE.encode():
            return True


def cmd_consume(bus, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO,
                renderer, say: Callable[[str], None]) -> int:
    from ..client.consume import consume
    render_one = renderer(args)
    if args.count == 0:
        return 0
    if not wait_for_service(bus, args.pattern, args.wait, say):
        say(f"no queue service for {args.pattern!r} answered within {args.wait:g} s "
            f"(asked on {wire.STATE_KEY})\n  is sbus queue running? start one with: sbus queue "
            f"{shlex.quote(args.pattern)} (the pattern must be the same, byte for byte), "
            "or wait longer with -W SECONDS (0: for ever)")
        return 1
    jobs = consume(bus, args.pattern, args.prefetch)
    try:
        for seen, job in enumerate(jobs, 1):
            stdout.write(render_one(Message(job.key, job.payload)))
            stdout.flush()
            job.ack()
            if seen == args.count:
                break
    finally:
        jobs.close()    # says bye: jobs prefetched and not printed go to other consumers
    return 0

