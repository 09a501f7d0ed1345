"""``sbus consume``: print a queue's jobs, and say so when no queue service answers.

A consumer keeps saying hello until the service for its pattern welcomes it,
which may be never (no ``sbus queue`` runs, or one runs for another pattern).
The consumer library waits without a word, as a program's consumer should
(the service may start later); a person at a shell wants to be told. So,
from a connection of its own, the command asks the service for its state
(docs/queues.md, "State") until it answers: if none has within
``NOTICE_AFTER`` seconds it says so on stderr, with the command that starts
one, and keeps waiting; once one answers it says that too.
"""
from __future__ import annotations

import argparse
import shlex
import threading
from typing import BinaryIO, Callable

from ..client.private import PrivateInbox
from ..client.protocol import Message
from ..errors import SbusError
from ..queue import wire

# Seconds without an answer from the queue service before the command says so.
NOTICE_AFTER = 3.0
# Seconds between state requests while none is answered.
ASK_EVERY = 1.0


class ServiceWatch:
    """Ask the queue service for ``pattern`` its state until it answers,
    telling ``say`` after NOTICE_AFTER seconds of silence and when it answers."""

    def __init__(self, client, pattern: str, say: Callable[[str], None],
                 notice_after: float = NOTICE_AFTER) -> None:
        self.address = client.address
        self.max_message = client.max_message
        self.pattern = pattern
        self.say = say
        self.notice_after = notice_after
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sbus-consume-watch", daemon=True)

    def __enter__(self) -> "ServiceWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(ASK_EVERY)

    def _run(self) -> None:
        from ..client.sync import Client
        try:
            with Client(self.address, max_message=self.max_message) as bus:
                inbox = PrivateInbox(bus.whoami(timeout=10.0), "queue")
                bus.subscribe(inbox.pattern)
                request = wire.pack_state_request(inbox.prefix, self.pattern)
                waited, told = 0.0, False
                while not self.stop.is_set():
                    bus.publish(wire.STATE_KEY, request)
                    if self._answered(bus, inbox):
                        if told:
                            self.say(f"the queue service for {self.pattern!r} answered; "
                                     "taking its jobs")
                        return
                    waited += ASK_EVERY
                    if not told and waited >= self.notice_after and not self.stop.is_set():
                        told = True
                        self.say(
                            f"no queue service for {self.pattern!r} answered within "
                            f"{self.notice_after:g} s (asked on {wire.STATE_KEY}); start one "
                            f"with: sbus queue {shlex.quote(self.pattern)}  (the pattern must be "
                            "the same, byte for byte); still waiting for it (Ctrl-C stops)")
        except (OSError, SbusError):
            pass    # the consumer's own connection reports a broker that went away

    def _answered(self, bus, inbox: PrivateInbox) -> bool:
        """Whether a state answer came within ASK_EVERY (or the watch was stopped)."""
        deadline = ASK_EVERY
        while deadline > 0 and not self.stop.is_set():
            step = min(deadline, 0.2)
            deadline -= step
            try:
                message = bus.receive(timeout=step)
            except TimeoutError:
                continue
            if type(message) is Message and inbox.suffix_of(message.key) == wire.STATE.encode():
                return True
        return False


def cmd_consume(bus, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO,
                renderer, say: Callable[[str], None]) -> int:
    from ..client.consume import consume
    render_one = renderer(args)
    if args.count == 0:
        return 0
    with ServiceWatch(bus, args.pattern, say):
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

