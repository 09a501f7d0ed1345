"""``sbus``: publish, subscribe and ask the broker from the shell.

    sbus pub KEY [MESSAGE | -]      publish MESSAGE (default empty; '-' reads stdin);
                                    exits 1 if the broker refuses it
    sbus sub [--json] [--count N] [--no-reconnect] PATTERN...
                                    print messages as they arrive; rides out a
                                    broker restart unless --no-reconnect
    sbus whoami                     print this client's credentials
    sbus stats                      print the broker's counters as JSON
    sbus bridge --nats URL [--export PATTERN] [--import SUBJECT] ...
                                    join this bus to others through NATS

Every command takes ``-a ADDRESS``; the default is ``$SBUS_ADDRESS``, else
``/run/sbus.socket``.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from typing import BinaryIO, Dict, List, Optional, Union

from . import __version__
from .address import from_environment
from .client import MAX_MESSAGE, Client, ControlMessage, Message
from .reconnect import Reconnect
from .errors import BusClosedError, SbusError

# How long whoami and stats wait for the broker's reply.
REPLY_TIMEOUT = 10.0


def _json_field(out: Dict[str, str], name: str, raw: bytes) -> None:
    """``name`` as text if ``raw`` is UTF-8, else ``name_base64``: JSON cannot carry bytes."""
    try:
        out[name] = raw.decode("utf-8")
    except UnicodeDecodeError:
        out[name + "_base64"] = base64.b64encode(raw).decode("ascii")


def format_json(message: Union[Message, ControlMessage]) -> bytes:
    """One JSON line: ``{"type": "msg"|"cmsg", "key": ..., "payload": ...}``."""
    out = {"type": "msg" if type(message) is Message else "cmsg"}
    _json_field(out, "key", message.key)
    _json_field(out, "payload", message.payload)
    return json.dumps(out, ensure_ascii=False).encode("utf-8") + b"\n"


def format_plain(message: Union[Message, ControlMessage]) -> bytes:
    """``KEY<TAB>PAYLOAD`` as raw bytes; a control message is prefixed with ``CMSG ``."""
    prefix = b"" if type(message) is Message else b"CMSG "
    return b"%s%s\t%s\n" % (prefix, message.key, message.payload)


def cmd_pub(bus: Client, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    if args.message == "-":
        payload: Union[str, bytes] = stdin.read()
    else:
        payload = args.message
    bus.publish(args.key, payload)
    # The broker answers in order: a reply means it took the message, and a
    # hang-up means it refused it (oversized, or a misused '!').
    bus.whoami(timeout=REPLY_TIMEOUT)
    return 0


def cmd_sub(bus: Client, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    for pattern in args.patterns:
        bus.subscribe(pattern)
    if args.ready:
        # The broker handles a client's packets in order, so once the reply
        # is back every SUB has been registered.
        bus.whoami(timeout=REPLY_TIMEOUT)
        sys.stderr.write("ready\n")
        sys.stderr.flush()
    render = format_json if args.json else format_plain
    seen = 0
    while args.count is None or seen < args.count:
        message = bus.receive()
        stdout.write(render(message))
        stdout.flush()
        seen += type(message) is Message
    return 0


def cmd_whoami(bus: Client, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    stdout.write(str(bus.whoami(timeout=REPLY_TIMEOUT)).encode() + b"\n")
    return 0


def cmd_stats(bus: Client, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    stats = bus.stats(timeout=REPLY_TIMEOUT)
    stdout.write(json.dumps(stats, indent=2).encode() + b"\n")
    return 0


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    if n < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sbus", description="Talk to an sbus message bus.",
        epilog="ADDRESS is a socket path, /dev/unix/abstract/HEX or /dev/fd/N; "
               "the default is $SBUS_ADDRESS, else /run/sbus.socket.")
    parser.add_argument("-V", "--version", action="version", version=f"sbus {__version__}")
    parser.add_argument("-a", "--address", metavar="ADDRESS", help="the bus to connect to")
    # SUPPRESS: a subcommand without -a must not overwrite the one given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-a", "--address", metavar="ADDRESS", default=argparse.SUPPRESS,
                        help="the bus to connect to")
    common.add_argument("--max-message", metavar="BYTES", type=_count, default=MAX_MESSAGE,
                        help=f"the largest packet to send or receive, as the broker's "
                             f"--max-message (default {MAX_MESSAGE})")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    pub = commands.add_parser("pub", parents=[common], help="publish a message")
    pub.add_argument("key", metavar="KEY", help="the routing key")
    pub.add_argument("message", metavar="MESSAGE", nargs="?", default="",
                     help="the payload (default empty); '-' reads it from stdin")
    pub.set_defaults(run=cmd_pub)

    sub = commands.add_parser("sub", parents=[common],
                              help="print messages matching the patterns as they arrive")
    sub.add_argument("patterns", metavar="PATTERN", nargs="+",
                     help="a routing key pattern; '' matches everything")
    sub.add_argument("--json", action="store_true",
                     help='one JSON object per line: {"type", "key", "payload"}; a field that '
                          'is not UTF-8 is given as "key_base64"/"payload_base64" instead')
    sub.add_argument("-n", "--count", type=_count, metavar="N",
                     help="exit after N messages (control messages are shown, not counted)")
    sub.add_argument("--ready", action="store_true",
                     help="print 'ready' on stderr once the broker has registered the patterns")
    sub.add_argument("--no-reconnect", dest="reconnect", action="store_false",
                     help="exit when the broker goes away instead of waiting for it to come "
                          "back (messages published meanwhile are not seen either way)")
    sub.set_defaults(run=cmd_sub)

    whoami = commands.add_parser("whoami", parents=[common],
                                 help="print this client's credentials (!/cred/GID/UID/PID)")
    whoami.set_defaults(run=cmd_whoami)

    stats = commands.add_parser("stats", parents=[common],
                                help="print the broker's counters as JSON")
    stats.set_defaults(run=cmd_stats)

    from .bridge.cli import add_parser as add_bridge_parser
    add_bridge_parser(commands, common)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    where = from_environment(args.address)
    if hasattr(args, "standalone"):     # a long-running command with its own client (bridge)
        return args.standalone(args, where)
    stdout = sys.stdout.buffer
    reconnect = None
    if args.command == "sub" and args.reconnect:
        reconnect = Reconnect(
            give_up_after=None, max_delay=1.0,
            on_disconnect=lambda exc: _say(f"{where}: the broker went away; reconnecting"),
            on_reconnect=lambda: _say(f"{where}: reconnected; subscriptions restored"))
    try:
        with Client(where, max_message=args.max_message, reconnect=reconnect) as bus:
            return args.run(bus, args, sys.stdin.buffer, stdout)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Our stdout went away (sbus sub | head): exit quietly, and keep the
        # interpreter from complaining when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return 0
    except BusClosedError:
        return _fail(f"{where}: the broker closed the connection (its log says why)")
    except TimeoutError:
        return _fail(f"{where}: no reply from the broker within {REPLY_TIMEOUT:g} s")
    except OSError as exc:
        return _fail(f"{where}: {exc.strerror or exc}")
    except (SbusError, ValueError) as exc:
        return _fail(str(exc))


def _say(text: str) -> None:
    sys.stderr.write(f"sbus: {text}\n")
    sys.stderr.flush()


def _fail(text: str) -> int:
    _say(text)
    return 1


if __name__ == "__main__":
    sys.exit(main())
