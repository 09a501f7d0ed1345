"""``sbus request`` and ``sbus serve``: requests and replies from the shell (docs/requests.md)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import BinaryIO, Optional, Tuple

from .. import argtypes
from ..client.protocol import Message
from ..client.requests import CONCURRENCY, REQUEST_TIMEOUT, IncomingRequest
from ..runner import add_log_options

# `sbus request` had no reply within -W seconds (as `sbus sub -W`).
TIMEOUT_EXIT = 3
# The environment variable telling a served COMMAND which key the request came on.
KEY_VARIABLE = "SBUS_REQUEST_KEY"
# Bytes of a failing COMMAND's stderr quoted in the error reply.
STDERR_QUOTED = 400
# Where `sbus serve` answers state requests ("<inbox> <pattern>", as the
# queue's: sbus.queue.wire), to the inbox + STATE; `sbus ready serve` asks.
STATE_KEY = "sbus/serve/state"
STATE = "state"


def add_parsers(commands, common: argparse.ArgumentParser) -> None:
    """Add ``request`` and ``serve`` to the ``sbus`` subcommands."""
    request = commands.add_parser(
        "request", parents=[common], help="ask whoever serves KEY and print the reply",
        description="Publish a request on KEY (docs/requests.md) and print the reply's body. "
                    f"Exit {TIMEOUT_EXIT} if no reply came within the timeout, 1 if the "
                    "server's handler failed (its error on stderr).")
    request.add_argument("key", metavar="KEY", help="the routing key the server listens on")
    request.add_argument("payload", metavar="PAYLOAD", nargs="?", default="",
                         help="the request's body (default empty); '-' reads it from stdin")
    request.add_argument("-W", "--timeout", type=argtypes.positive_seconds,
                         default=REQUEST_TIMEOUT, metavar="SECONDS",
                         help=f"how long to wait for the reply (default {REQUEST_TIMEOUT:g})")
    request.set_defaults(run=cmd_request)

    serve = commands.add_parser(
        "serve", parents=[common], help="answer requests on PATTERN with a command",
        description="Answer every request on PATTERN (docs/requests.md) by running COMMAND "
                    "with the request's body on stdin; its stdout is the reply. A COMMAND "
                    "that exits non-zero, or writes to stderr and nothing to stdout, sends "
                    "an error reply quoting its stderr (an empty stdout and stderr is an "
                    "empty reply). "
                    f"${KEY_VARIABLE} holds the request's key. Once its subscription is in "
                    "place it logs service_ready and sends READY=1 under systemd; `sbus ready "
                    "serve PATTERN` waits for that.")
    serve.add_argument("pattern", metavar="PATTERN", help="the routing key pattern to serve")
    serve.add_argument("-j", "--jobs", type=argtypes.argtype(int, low=1), default=CONCURRENCY,
                       metavar="N",
                       help=f"requests answered at once, at most (default {CONCURRENCY})")
    serve.add_argument("command", metavar="-- COMMAND", nargs=argparse.REMAINDER,
                       help="the command and its arguments, after --")
    add_log_options(serve)
    serve.set_defaults(standalone=serve_main)


def cmd_request(bus, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    from ..errors import HandlerError, RequestTimeoutError
    payload = stdin.read() if args.payload == "-" else args.payload.encode(
        "utf-8", "surrogateescape")
    try:
        reply = bus.request(args.key, payload, args.timeout)
    except RequestTimeoutError as exc:
        sys.stderr.write(f"sbus request: {exc}\n  is anything serving {args.key!r}? start a "
                         "server (sbus serve PATTERN -- COMMAND, or a client's serve()), or "
                         "wait longer with -W SECONDS\n")
        return TIMEOUT_EXIT
    except HandlerError as exc:
        sys.stderr.write(f"sbus request: the server failed: {exc}\n")
        return 1
    stdout.write(reply if reply.endswith(b"\n") or not reply else reply + b"\n")
    stdout.flush()
    return 0


async def run_command(command: list, request: IncomingRequest) -> bytes:
    """COMMAND's stdout for one request; RuntimeError (an error reply) if it
    exits non-zero, or writes to stderr and nothing to stdout: a command that
    only complained has not answered (bc given no final newline says
    "syntax error" and exits 0), and an empty reply would pass for success."""
    env = dict(os.environ, **{KEY_VARIABLE: request.key.decode("utf-8", "surrogateescape")})
    proc = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await proc.communicate(request.payload)
    detail = err[-STDERR_QUOTED:].decode("utf-8", "replace").strip()
    if proc.returncode != 0:
        raise RuntimeError(f"{command[0]} exited with status {proc.returncode}"
                           + (f": {detail}" if detail else ""))
    if not out and detail:
        raise RuntimeError(f"{command[0]} wrote nothing to stdout, only to stderr: {detail}")
    return out


class Server:
    """``sbus serve``, run as every asyncio service is (sbus.runner.run_async):
    its state (what a state request is answered with, docs/requests.md, "Is
    it serving?") and its counts."""

    def __init__(self, args: argparse.Namespace, address: str, command: list, logger) -> None:
        self.address, self.max_message = address, args.max_message
        self.pattern, self.jobs, self.command = args.pattern, args.jobs, command
        self.logger = logger
        self.fields = {"service": "serve", "pattern": args.pattern, "pid": os.getpid(),
                       "command": command, "jobs": args.jobs}
        self.running = self.answered = self.failed = 0

    async def handle(self, request: IncomingRequest) -> bytes:
        self.running += 1
        try:
            out = await run_command(self.command, request)
        except RuntimeError:
            self.failed += 1
            raise
        finally:
            self.running -= 1
        self.answered += 1
        return out

    def answer(self, message: Message) -> Optional[Tuple[str, bytes]]:
        """(reply key, JSON) for a state request naming our pattern; None for
        anything else (another server's pattern, a payload off the convention)."""
        from ..queue.wire import WireError, parse_state_request
        if message.key != STATE_KEY.encode():
            return None
        try:
            inbox, pattern = parse_state_request(message.payload)
        except WireError:
            return None
        if pattern != self.pattern.encode("utf-8", "surrogateescape"):
            return None
        state = dict(self.fields, running=self.running, answered=self.answered,
                     failed=self.failed)
        return inbox + STATE, json.dumps(state).encode()

    async def run(self, stop: asyncio.Event) -> str:
        """Serve until ``stop`` is set (SIGTERM, SIGINT) or the broker closes
        the connection; the reason. OSError (BusClosedError too) if the
        broker is not there or fails us."""
        from ..aio import Client
        from ..client.requests import serve_async
        from ..runner import STOPPED, ready
        bus = Client(self.address, max_message=self.max_message)

        async def others(message: Message) -> None:
            found = self.answer(message)
            if found is not None:
                await bus.publish(*found)

        serving = asyncio.ensure_future(serve_async(bus, self.pattern, self.handle, self.jobs,
                                                    others))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            # serve_async sends its SUB at its first step; the state key's
            # SUB goes after it, so a state answer means the pattern's is in
            # place too; a whoami answered after both means the broker has
            # them: then the log and systemd hear it is ready.
            await asyncio.sleep(0)
            if not serving.done():
                await bus.subscribe(STATE_KEY)
                await bus.whoami()
                ready(self.logger, "serve", pattern=self.pattern)
            await asyncio.wait((serving, stopping), return_when=asyncio.FIRST_COMPLETED)
            if not serving.done():
                return STOPPED
            serving.result()    # its error, if it failed
            return "the broker closed the connection"
        finally:
            stopping.cancel()
            serving.cancel()
            bus.close()

    def stopped(self, reason: str) -> None:
        pass    # it logs its readiness only (docs/requests.md)


def serve_main(args: argparse.Namespace, address: str) -> int:
    """Serve until SIGTERM/SIGINT or the broker goes away."""
    from ..client.protocol import pack_subscribe
    from ..errors import MessageRefusedError
    from ..runner import run_async
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        args.parser.error("give the command to run after --")
    try:
        pack_subscribe(args.pattern)
    except MessageRefusedError as exc:
        sys.stderr.write(f"sbus serve: PATTERN {args.pattern!r}: {exc}\n")
        return 2
    return run_async("serve", address, args,
                     lambda logger: Server(args, address, command, logger))
