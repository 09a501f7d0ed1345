"""``sbus``: publish, subscribe and ask the broker from the shell.

    sbus pub KEY [MESSAGE | - | --file PATH | --lines] [--repeat N] [--interval S]
                                    publish MESSAGE (default empty; '-' reads stdin;
                                    --lines: one message per line); exits 1 if the
                                    broker refuses one
    sbus sub [--json | -F TEMPLATE | -v | --raw] [-n N] [-W S] [--no-reconnect] [--strict]
             PATTERN...             print messages as they arrive; with -W, exit 3
                                    if N messages did not come within S seconds;
                                    rides out a broker restart unless --no-reconnect;
                                    warns about (--strict: refuses) patterns of
                                    other buses (sbus.cli.otherbuses), as every
                                    command that takes a pattern does
    sbus whoami                     print this client's credentials
    sbus whoami --prove KEY         prove identities with whoever serves KEY (docs/proof.md)
    sbus top                        a live view of the broker's counters
    sbus bench pair|fanout N|latency
                                    measure this broker's throughput or latency
    sbus stats [--format prometheus] [--no-clients] [-o PATH]
                                    print the broker's counters as JSON, or in the
                                    Prometheus text format
    sbus bridge --nats URL [--export PATTERN] [--import SUBJECT] ...
                                    join this bus to others through NATS
    sbus queue PATTERN [--prefetch K] [--ack-timeout S] [--max-held N]
                                    share the jobs on PATTERN among consumers
    sbus consume [--json | -F TEMPLATE | -v | --raw] [-n N] [--prefetch K] [-W S] PATTERN
                                    print the jobs of the queue on PATTERN, each
                                    acknowledged once written; says when no queue
                                    service answers within 3 s, and gives up
                                    (exit 1) after -W S (default 10; 0: never)
    sbus store --dir DIR --record PATTERN ...
                                    record messages and answer replays (docs/store.md)
    sbus replay PATTERN [--since T] [--until T] [--follow]
    sbus last PATTERN               recorded messages, or each key's last one;
                                    -F '{seq}' shows where --after resumes
    sbus request KEY [PAYLOAD | -] [-W S]
                                    ask whoever serves KEY and print the reply
    sbus serve [-j N] PATTERN -- COMMAND ...
                                    answer requests on PATTERN: COMMAND gets the
                                    body on stdin, its stdout is the reply
    sbus ready store|queue PATTERN|serve PATTERN|upstream [-W S]
                                    wait until the store, the queue service for
                                    PATTERN, an sbus serve PATTERN or a leaf's
                                    link serves: exit 0, or 1 with a hint after
                                    S seconds (default 10)
    sbus fds [--socket PATH] [--timeout S] [--max-fds-per-uid N]
                                    hand fds to the process a !/cred/ address
                                    names (docs/fds.md)

Every command takes ``-a ADDRESS``; the default is ``$SBUS_ADDRESS``, else
``/run/sbus.socket``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import BinaryIO, Iterator, List, Optional

from .. import __version__, argtypes
from ..address import from_environment
from ..atomicfile import write_atomically
from ..client.protocol import MAX_MESSAGE, Message
from ..client.reconnect import Reconnect
from ..client.sync import Client
from ..errors import BusClosedError, PatternRefusedError, SbusError
from ..queue.defaults import CLI_PREFETCH, CLI_WAIT
from . import connecterrors, otherbuses, render

# How long whoami and stats wait for the broker's reply.
REPLY_TIMEOUT = 10.0
# `sbus sub -W` ran out of time before --count messages came.
TIMEOUT_EXIT = 3
# The field `sbus stats` adds, true, to its own connection's entry in the JSON.
OWN_MARK = "asking"


def payloads(args: argparse.Namespace, stdin: BinaryIO) -> Iterator[bytes]:
    """The payloads ``sbus pub`` sends, in order: the argument, stdin, the
    file, or each line of stdin as it comes (--lines); --repeat times."""
    if args.lines:
        for line in stdin:
            yield line[:-1] if line.endswith(b"\n") else line
        return
    if args.file is not None:
        payload = args.file_content
    elif args.message == "-":
        payload = stdin.read()
    else:
        payload = args.message.encode("utf-8", "surrogateescape")
    for _ in range(args.repeat):
        yield payload


def cmd_pub(bus: Client, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    for n, payload in enumerate(payloads(args, stdin)):
        if n and args.interval:
            time.sleep(args.interval)
        bus.publish(args.key, payload)
    # The broker answers in order: a reply means it took the messages, and a
    # hang-up means it refused one (oversized, or a misused '!').
    bus.whoami(timeout=REPLY_TIMEOUT)
    return 0


def sub_renderer(args: argparse.Namespace) -> render.Renderer:
    if args.raw:
        return render.format_raw
    if args.json:
        return render.format_json
    if args.format is not None:
        return render.format_template(args.format)
    if args.verbose:
        return render.format_template(render.VERBOSE)
    return render.format_plain


def given_patterns(args: argparse.Namespace) -> List[str]:
    """Every routing key pattern on a command line: sub's, the one of
    consume, last, replay, serve and queue, store's --record, bridge's --export."""
    found = list(getattr(args, "patterns", None) or ())
    if isinstance(getattr(args, "pattern", None), str):
        found.append(args.pattern)
    for option in ("record", "export"):
        found += getattr(args, option, None) or ()
    return found


def check_patterns(args: argparse.Namespace) -> bool:
    """Warn about each pattern written for another bus; False if --strict
    (sub's) refuses one."""
    ok = True
    strict = getattr(args, "strict", False)
    for pattern in given_patterns(args):
        problem = otherbuses.foreign(pattern)
        if problem is not None:
            if strict:
                _say(f"{problem.text(pattern)} (refused: --strict)")
                ok = False
            else:
                _say(f"warning: {problem.text(pattern)}")
    return ok


def cmd_sub(bus: Client, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    bus.chunks.on_lost = lambda lost: _say(
        f"lost a chunked message on {lost.key.decode('utf-8', 'backslashreplace')!r}: "
        f"{lost.reason} ({lost.received} of {lost.total} bytes came)")
    for pattern in args.patterns:
        bus.subscribe(pattern)
    if args.ready:
        # The broker handles a client's packets in order, so once the reply
        # is back every SUB has been registered.
        bus.whoami(timeout=REPLY_TIMEOUT)
        sys.stderr.write("ready\n")
        sys.stderr.flush()
    render_one = sub_renderer(args)
    seen = 0
    while args.count is None or seen < args.count:
        if deadline is None:
            message = bus.receive()
        else:
            try:
                message = bus.receive(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                # -W ended it: a success only if no --count was left unmet.
                if args.count is None:
                    _say(f"-W {args.timeout:g}: stopped after {args.timeout:g} s "
                         f"({seen} message{'' if seen == 1 else 's'})")
                    return 0
                _say(f"-W {args.timeout:g}: timed out: {seen} of {args.count} messages "
                     f"came within {args.timeout:g} s")
                return TIMEOUT_EXIT
        stdout.write(render_one(message))
        stdout.flush()
        seen += type(message) is Message
    return 0


def cmd_consume(bus: Client, args: argparse.Namespace, stdin: BinaryIO,
                stdout: BinaryIO) -> int:
    from .consume import cmd_consume as run
    return run(bus, args, stdin, stdout, sub_renderer, _say)


def cmd_whoami(bus: Client, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    """This client's credentials; with --prove, a peer's, verified (docs/proof.md);
    with --serve-proofs, each verified peer that proves to this one."""
    if args.serve_proofs is not None:
        from ..client.proof import serve_proofs
        for peer in serve_proofs(bus, args.serve_proofs, args.count, args.timeout):
            stdout.write(str(peer).encode() + b"\n")
            stdout.flush()
        return 0
    who = (bus.prove(args.prove, args.timeout) if args.prove is not None
           else bus.whoami(timeout=REPLY_TIMEOUT))
    stdout.write(str(who).encode() + b"\n")
    return 0


def is_own(client: dict) -> bool:
    """Whether a stats reply's client entry is this process's own connection
    (the one asking: an sbus command makes only one)."""
    return client.get("pid") == os.getpid() and client.get("uid") == os.getuid()


def cmd_stats(bus: Client, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    stats = bus.stats(timeout=REPLY_TIMEOUT)
    if args.no_clients:
        stats.pop("clients", None)
    if args.format == "prometheus":
        from .metrics import to_prometheus
        # The scrape's own connection is no client worth a series.
        stats["clients"] = [c for c in stats.get("clients", ()) if not is_own(c)]
        text = to_prometheus(stats, clients=not args.no_clients).encode()
    else:
        for c in stats.get("clients", ()):
            if is_own(c):
                c[OWN_MARK] = True
        text = json.dumps(stats, indent=2).encode() + b"\n"
    if args.output is None:
        stdout.write(text)
    else:
        try:
            write_atomically(args.output, text)
        except OSError as exc:
            return _fail(f"stats --output {args.output}: {exc.strerror or exc}")
    return 0


def cmd_top(bus: Client, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return _fail("top: needs a terminal (try: sbus stats)")
    from .top import run
    return run(lambda: bus.stats(timeout=REPLY_TIMEOUT), str(from_environment(args.address)),
               args.interval, is_own)


def cmd_bench(args: argparse.Namespace) -> int:
    from . import benchmark
    if args.workload == "fanout" and not args.subscribers:
        return _fail("bench fanout: how many subscribers? (sbus bench fanout N)")
    if args.size < benchmark.SEQ_BYTES:
        return _fail(f"bench: --size must be {benchmark.SEQ_BYTES} or more: each payload "
                     "carries its sequence number")
    return benchmark.main(args, from_environment(args.address), sys.stdout)


def _template(text: str) -> str:
    try:
        return render.check_template(text)
    except (ValueError, IndexError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_shape_options(parser: argparse.ArgumentParser) -> None:
    """How ``sub`` and ``consume`` print a message (``sub_renderer`` reads them)."""
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true",
                       help='one JSON object per line: {"type", "key", "payload"}; a field that '
                            'is not UTF-8 is given as "key_base64"/"payload_base64" instead')
    shape.add_argument("-F", "--format", type=_template, metavar="TEMPLATE",
                       help="one line per message from TEMPLATE, with fields "
                            + ", ".join(f"{{{f}}}" for f in render.FIELDS)
                            + r"; \n and \t are newline and tab")
    shape.add_argument("-v", "--verbose", action="store_true",
                       help=f"key and payload: -F '{render.VERBOSE}' (as mosquitto_sub -v)")
    shape.add_argument("--raw", action="store_true",
                       help="the payload bytes only, nothing between messages (for binary data)")


class _Parser(argparse.ArgumentParser):
    """The top-level parser: a misspelled command gets the likeliest one."""

    command_names: List[str] = []

    def error(self, message: str):
        import difflib
        import re
        m = re.match(r"argument COMMAND: invalid choice: '?(.*?)'? \(choose from", message)
        if m and self.command_names:
            commands = self.command_names
            close = difflib.get_close_matches(m.group(1), commands, n=1, cutoff=0.5)
            message = (f"unknown command {m.group(1)!r}"
                       + (f"; did you mean {close[0]!r}?" if close else "")
                       + f" (commands: {' '.join(commands)}; sbus COMMAND -h for each)")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sbus", description="Talk to an sbus message bus.",
        epilog="ADDRESS is a socket path, /dev/unix/abstract/HEX or /dev/fd/N; "
               "the default is $SBUS_ADDRESS, else /run/sbus.socket.")
    parser.add_argument("-V", "--version", action="version", version=f"sbus {__version__}")
    parser.add_argument("-a", "--address", metavar="ADDRESS", help="the bus to connect to")
    # SUPPRESS: a subcommand without -a must not overwrite the one given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-a", "--address", metavar="ADDRESS", default=argparse.SUPPRESS,
                        help="the bus to connect to")
    common.add_argument("--max-message", metavar="BYTES", type=argtypes.count, default=MAX_MESSAGE,
                        help=f"the largest packet to send or receive, as the broker's "
                             f"--max-message (default {MAX_MESSAGE})")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    pub = commands.add_parser("pub", parents=[common], help="publish a message")
    pub.add_argument("key", metavar="KEY", help="the routing key")
    pub.add_argument("message", metavar="MESSAGE", nargs="?", default="",
                     help="the payload (default empty); '-' reads it from stdin")
    source = pub.add_mutually_exclusive_group()
    source.add_argument("-f", "--file", metavar="PATH", help="the payload is this file's content")
    source.add_argument("-l", "--lines", action="store_true",
                        help="one message per line of stdin, sent as the lines come "
                             "(the newline is not sent)")
    pub.add_argument("--repeat", type=argtypes.count, default=1, metavar="N",
                     help="send the message N times (default 1)")
    pub.add_argument("--interval", type=argtypes.seconds, default=0.0, metavar="SECONDS",
                     help="wait this long between messages")
    pub.set_defaults(run=cmd_pub)

    sub = commands.add_parser("sub", parents=[common],
                              help="print messages matching the patterns as they arrive")
    sub.add_argument("patterns", metavar="PATTERN", nargs="+",
                     help="a routing key pattern; '' matches everything")
    add_shape_options(sub)
    sub.add_argument("-n", "--count", type=argtypes.count, metavar="N",
                     help="exit after N messages (control messages are shown, not counted)")
    sub.add_argument("-W", "--timeout", type=argtypes.seconds, metavar="SECONDS",
                     help=f"exit after SECONDS; the exit status is {TIMEOUT_EXIT} if --count "
                          "messages had not come by then")
    sub.add_argument("--strict", action="store_true",
                     help="refuse a pattern written for another bus (MQTT's '#' and '+', "
                          "NATS's '.' and '>', a '*' followed by more of its segment) "
                          "instead of warning")
    sub.add_argument("--ready", action="store_true",
                     help="print 'ready' on stderr once the broker has registered the patterns")
    sub.add_argument("--no-reconnect", dest="reconnect", action="store_false",
                     help="exit when the broker goes away instead of waiting for it to come "
                          "back (messages published meanwhile are not seen either way)")
    sub.set_defaults(run=cmd_sub)

    whoami = commands.add_parser("whoami", parents=[common],
                                 help="print this client's credentials (!/cred/GID/UID/PID)")
    proving = whoami.add_mutually_exclusive_group()
    proving.add_argument("--prove", metavar="KEY",
                         help="run the spec's identity proof with whoever serves KEY and "
                              "print their verified credentials (docs/proof.md)")
    proving.add_argument("--serve-proofs", metavar="PATTERN",
                         help="answer proofs asked on PATTERN; print each verified peer")
    whoami.add_argument("--timeout", type=float, default=10.0,
                        help="seconds a proof may take (default 10)")
    whoami.add_argument("--count", type=int, default=None,
                        help="with --serve-proofs: exit after this many proofs")
    whoami.set_defaults(run=cmd_whoami)

    stats = commands.add_parser("stats", parents=[common],
                                help="print the broker's counters as JSON or for Prometheus")
    stats.add_argument("--format", choices=("json", "prometheus"), default="json",
                       help="json (default), or the Prometheus text exposition format "
                            "(for node_exporter's textfile collector)")
    stats.add_argument("--no-clients", action="store_true",
                       help="leave out the per-client counters (series)")
    stats.add_argument("-o", "--output", metavar="PATH",
                       help="write to PATH, replaced whole (through a temporary file and a "
                            "rename), instead of stdout: for node_exporter's textfile "
                            "collector")
    stats.set_defaults(run=cmd_stats)
    top = commands.add_parser("top", parents=[common],
                              help="a live view of the broker: totals, rates, busiest clients")
    top.add_argument("-i", "--interval", type=argtypes.seconds, default=1.0, metavar="SECONDS",
                     help="seconds between refreshes (default 1)")
    top.set_defaults(run=cmd_top)

    bench = commands.add_parser(
        "bench", parents=[common],
        help="measure the broker: pair, fanout N (subscribers), latency",
        description="Publishers and subscribers are separate processes of the compiled load "
                    "generator; loss and order are checked (exit 2 if anything was lost or "
                    "reordered). Runs for 2 s unless given --count or --seconds.")
    bench.add_argument("workload", choices=("pair", "fanout", "latency"))
    bench.add_argument("subscribers", nargs="?", type=argtypes.count, metavar="N",
                       help="fanout: the number of subscribers")
    bench.add_argument("-s", "--size", type=argtypes.count, default=64, metavar="BYTES",
                       help="payload size (default 64; 8 or more carries the sequence number)")
    bench.add_argument("-n", "--count", type=argtypes.count, metavar="N",
                       help="messages to publish (latency: round trips to time)")
    bench.add_argument("-d", "--seconds", type=argtypes.seconds, metavar="SECONDS",
                       help="how long to publish (default 2 unless --count)")
    bench.add_argument("-w", "--window", type=argtypes.count, default=256, metavar="N",
                       help="messages in flight toward the slowest subscriber (default 256)")
    bench.add_argument("--runs", type=argtypes.count, default=1, metavar="N",
                       help="repeat the run N times, one line each (default 1)")
    bench.add_argument("--json", action="store_true",
                       help="the load generator's JSON result, one object per run")
    bench.add_argument("--timeout", type=argtypes.seconds, default=300.0, metavar="SECONDS",
                       help="give up on a run after this long (default 300)")
    bench.set_defaults(run=None)

    consume = commands.add_parser(
        "consume", parents=[common], help="print the jobs of an sbus queue, acknowledging each",
        description="Take jobs from the `sbus queue PATTERN` service (docs/queues.md), print "
                    "each as `sbus sub` would, and acknowledge it once it is written.")
    consume.add_argument("pattern", metavar="PATTERN", help="the queue's pattern, as given "
                                                            "to sbus queue")
    add_shape_options(consume)
    consume.add_argument("-n", "--count", type=argtypes.count, metavar="N",
                         help="exit after N jobs")
    consume.add_argument("--prefetch", type=argtypes.argtype(int, low=1),
                         default=CLI_PREFETCH, metavar="K",
                         help=f"jobs held unprinted at once (default {CLI_PREFETCH})")
    consume.add_argument("-W", "--wait", type=argtypes.seconds, default=CLI_WAIT,
                         metavar="SECONDS",
                         help="give up (exit 1) if no queue service for PATTERN answers "
                              f"within SECONDS (default {CLI_WAIT:g}; 0: wait for ever)")
    consume.set_defaults(run=cmd_consume)

    from ..bridge.cli import add_parser as add_bridge_parser
    from ..fdpass.cli import add_parser as add_fds_parser
    from ..queue.cli import add_parser as add_queue_parser
    from ..store.cli import add_parsers as add_store_parsers
    from .access import add_parsers as add_access_parsers
    from .ready import add_parser as add_ready_parser
    from .requests import add_parsers as add_request_parsers
    add_bridge_parser(commands, common)
    add_queue_parser(commands, common)
    add_store_parsers(commands, common)
    add_request_parsers(commands, common)
    add_access_parsers(commands, common)
    add_ready_parser(commands, common)
    add_fds_parser(commands, common)
    for command in commands.choices.values():
        command.set_defaults(parser=command)
    parser.command_names = list(commands.choices)
    return parser


def _stdout_gone(stdout) -> int:
    """Our stdout went away (sbus sub | head): exit quietly, and keep the
    interpreter from complaining when it flushes stdout at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # A command's mistakes get that command's usage, not the top level's.
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "pub" and (args.lines or args.file is not None) and args.message:
        args.parser.error("give MESSAGE, --file or --lines, not two of them")
    if args.command == "bench":     # its processes make their own connections
        return cmd_bench(args)
    if not check_patterns(args):
        return 2
    if args.command == "pub" and args.file is not None:
        try:
            with open(args.file, "rb") as f:
                args.file_content = f.read()
        except OSError as exc:
            return _fail(f"pub --file {args.file}: {exc.strerror or exc}")
    where = from_environment(args.address)
    if hasattr(args, "standalone"):     # a command with its own client or none (bridge, policy)
        try:
            return args.standalone(args, where)
        except BrokenPipeError:
            return _stdout_gone(sys.stdout.buffer)
    stdout = sys.stdout.buffer
    reconnect = None
    if args.command == "sub" and args.reconnect:
        reconnect = Reconnect(
            give_up_after=None, max_delay=1.0,
            on_disconnect=lambda exc: _say(f"{where}: the broker went away; reconnecting"),
            on_reconnect=lambda: _say(f"{where}: reconnected; subscriptions restored"))
    try:
        bus = Client(where, max_message=args.max_message, reconnect=reconnect)
    except OSError as exc:
        return _fail(connecterrors.explain(where, connecterrors.origin(args.address), exc))
    except (SbusError, ValueError) as exc:
        return _fail(str(exc))
    try:
        with bus:
            return args.run(bus, args, sys.stdin.buffer, stdout)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _stdout_gone(stdout)
    except PatternRefusedError as exc:
        return _fail(str(exc))      # names the refused patterns and where it connected
    except BusClosedError:
        return _fail(f"{where}: the broker closed the connection (its log says why)")
    except TimeoutError:
        return _fail(f"{where}: no reply from the broker within {REPLY_TIMEOUT:g} s")
    except OSError as exc:
        return _fail(f"{where}: {exc.strerror or exc}")
    except (SbusError, ValueError) as exc:
        return _fail(explain(args, exc))


def explain(args: argparse.Namespace, exc: Exception) -> str:
    """A failure's message; for a store that did not answer, what to start."""
    from ..client.store import StoreError
    # The client raises its StoreError from the receive that timed out.
    if isinstance(exc, StoreError) and isinstance(exc.__context__, TimeoutError):
        import shlex
        pattern = shlex.quote(getattr(args, "pattern", None) or "PATTERN")
        return (f"{exc}\n  is sbus store running? replay and last ask it: start one "
                f"recording the keys, sbus store --dir DIR --record {pattern} "
                "(docs/store.md), or give its --request-key")
    return str(exc)


def _say(text: str) -> None:
    sys.stderr.write(f"sbus: {text}\n")
    sys.stderr.flush()


def _fail(text: str) -> int:
    _say(text)
    return 1


if __name__ == "__main__":
    sys.exit(main())
