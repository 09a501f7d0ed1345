"""``sbus request`` and ``sbus serve``: requests and replies from the shell (docs/requests.md)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
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


class ServeState:
    """What ``sbus serve`` answers a state request with (docs/requests.md,
    "Is it serving?"), and its counts."""

    def __init__(self, pattern: str, command: list, jobs: int) -> None:
        self.pattern = pattern.encode("utf-8", "surrogateescape")
        self.fields = {"service": "serve", "pattern": pattern, "pid": os.getpid(),
                       "command": command, "jobs": jobs}
        self.running = self.answered = self.failed = 0

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
        if pattern != self.pattern:
            return None
        state = dict(self.fields, running=self.running, answered=self.answered,
                     failed=self.failed)
        return inbox + STATE, json.dumps(state).encode()


def serve_main(args: argparse.Namespace, address: str) -> int:
    """Serve until SIGTERM/SIGINT or the broker goes away."""
    from ..aio import Client
    from ..client.protocol import pack_subscribe
    from ..client.requests import serve_async
    from ..errors import MessageRefusedError, SbusError
    from ..runner import configure_log, ready
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        args.parser.error("give the command to run after --")
    try:
        pack_subscribe(args.pattern)
    except MessageRefusedError as exc:
        sys.stderr.write(f"sbus serve: PATTERN {args.pattern!r}: {exc}\n")
        return 2
    stream, logger = configure_log(args)
    state = ServeState(args.pattern, command, args.jobs)

    async def handle(request: IncomingRequest) -> bytes:
        state.running += 1
        try:
            out = await run_command(command, request)
        except RuntimeError:
            state.failed += 1
            raise
        finally:
            state.running -= 1
        state.answered += 1
        return out

    async def run() -> int:
        loop = asyncio.get_running_loop()
        try:
            bus = Client(address, max_message=args.max_message)
        except OSError as exc:
            sys.stderr.write(f"sbus serve: {address}: {exc.strerror or exc}\n")
            return 1

        async def others(message: Message) -> None:
            found = state.answer(message)
            if found is not None:
                await bus.publish(*found)

        serving = asyncio.ensure_future(serve_async(bus, args.pattern, handle, args.jobs,
                                                    others))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, serving.cancel)
        loop.add_signal_handler(signal.SIGHUP, reopen, stream)
        try:
            # serve() sends its SUB at its first step; the state key's SUB
            # goes after it, so a state answer means the pattern's is in
            # place too; a whoami answered after both means the broker has
            # them: then the log and systemd hear it is ready.
            await asyncio.sleep(0)
            if not serving.done():
                await bus.subscribe(STATE_KEY)
                await bus.whoami()
                ready(logger, "serve", pattern=args.pattern)
            await serving
        except asyncio.CancelledError:
            return 0
        except (OSError, SbusError) as exc:
            sys.stderr.write(f"sbus serve: {address}: {exc}\n")
            return 1
        finally:
            bus.close()
        return 0

    return asyncio.run(run())


def reopen(stream) -> None:
    try:
        stream.reopen()
    except OSError:
        pass    # it goes on where it was: a log file is no reason to stop
