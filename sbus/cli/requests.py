"""``sbus request`` and ``sbus serve``: requests and replies from the shell (docs/requests.md)."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import BinaryIO

from .. import argtypes
from ..client.requests import CONCURRENCY, REQUEST_TIMEOUT, IncomingRequest

# `sbus request` had no reply within -W seconds (as `sbus sub -W`).
TIMEOUT_EXIT = 3
# The environment variable telling a served COMMAND which key the request came on.
KEY_VARIABLE = "SBUS_REQUEST_KEY"
# Bytes of a failing COMMAND's stderr quoted in the error reply.
STDERR_QUOTED = 400


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
                    f"${KEY_VARIABLE} holds the request's key.")
    serve.add_argument("pattern", metavar="PATTERN", help="the routing key pattern to serve")
    serve.add_argument("-j", "--jobs", type=argtypes.argtype(int, low=1), default=CONCURRENCY,
                       metavar="N",
                       help=f"requests answered at once, at most (default {CONCURRENCY})")
    serve.add_argument("command", metavar="-- COMMAND", nargs=argparse.REMAINDER,
                       help="the command and its arguments, after --")
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


def serve_main(args: argparse.Namespace, address: str) -> int:
    """Serve until SIGTERM/SIGINT or the broker goes away."""
    from ..aio import Client
    from ..client.protocol import pack_subscribe
    from ..errors import MessageRefusedError, SbusError
    from ..runner import sd_notify
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        args.parser.error("give the command to run after --")
    try:
        pack_subscribe(args.pattern)
    except MessageRefusedError as exc:
        sys.stderr.write(f"sbus serve: PATTERN {args.pattern!r}: {exc}\n")
        return 2

    async def handle(request: IncomingRequest) -> bytes:
        return await run_command(command, request)

    async def run() -> int:
        loop = asyncio.get_running_loop()
        try:
            bus = Client(address, max_message=args.max_message)
        except OSError as exc:
            sys.stderr.write(f"sbus serve: {address}: {exc.strerror or exc}\n")
            return 1
        serving = asyncio.ensure_future(bus.serve(args.pattern, handle, args.jobs))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, serving.cancel)
        try:
            # serve() sends its SUB at its first step; a whoami answered
            # after it means the broker has it: then systemd hears READY=1.
            await asyncio.sleep(0)
            if not serving.done():
                await bus.whoami()
                sd_notify("READY=1")
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
