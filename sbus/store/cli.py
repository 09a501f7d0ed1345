"""``sbus store`` (the service), ``sbus replay`` and ``sbus last``: options and mains."""
from __future__ import annotations

import argparse
import datetime
import decimal
import json
import re
import sys
import time
from typing import BinaryIO

from .. import argtypes
from ..cli import render
from ..runner import add_log_options
from . import wire

DEFAULT_FSYNC = "100"       # milliseconds between fdatasync(2)s
DEFAULT_SEGMENT_BYTES = 64 << 20
DEFAULT_STATS_INTERVAL = 10.0
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def fsync_policy(text: str) -> str:
    """always, never, or N / Nms (milliseconds between syncs)."""
    if text in ("always", "never"):
        return text
    m = re.fullmatch(r"(\d+)(ms)?", text)
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"--fsync: always, never or N (milliseconds): {text!r}")
    return m.group(1)


def duration(text: str) -> float:
    """Seconds, with an optional unit: 90, 90s, 15m, 2h, 7d."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration (90, 15m, 2h, 7d): {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def point_in_time(text: str) -> decimal.Decimal:
    """Seconds since the epoch, an ISO 8601 time (local unless it says), or
    a duration ago (10m, 2h), exactly: a record's time as ``{unix}`` prints
    it finds that record (a float would miss it by up to 240 ns)."""
    try:
        seconds = decimal.Decimal(text)
        if seconds.is_finite():
            return seconds
    except decimal.InvalidOperation:
        pass
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text)
    if m:
        return (decimal.Decimal(time.time_ns()).scaleb(-9)
                - decimal.Decimal(m.group(1)) * _UNITS[m.group(2)])
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time (seconds since the epoch, ISO 8601, or 10m/2h ago): {text!r}") from None
    since_epoch = (when if when.tzinfo else when.astimezone()) - _EPOCH
    return (decimal.Decimal(since_epoch.days * 86400 + since_epoch.seconds)
            + decimal.Decimal(since_epoch.microseconds).scaleb(-6))


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def _template(text: str) -> str:
    try:
        return render.check_template(text, render.STORE_FIELDS)
    except (ValueError, IndexError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _output_options(p: argparse.ArgumentParser) -> None:
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="one JSON object per line, as sbus sub")
    shape.add_argument("-F", "--format", type=_template, metavar="TEMPLATE",
                       help="one line per message from TEMPLATE, as sbus sub, and {seq}: the "
                            "record's sequence number (for --after); {time} and {unix} are "
                            "when the store received it")
    shape.add_argument("-v", "--verbose", action="store_true",
                       help=f"key and payload: -F '{render.VERBOSE}'")
    shape.add_argument("--raw", action="store_true", help="the payload bytes only")
    p.add_argument("--request-key", metavar="KEY", default=wire.REQUEST_KEY.decode(),
                   help=f"the store's request key (default {wire.REQUEST_KEY.decode()})")


def add_parsers(commands, common: argparse.ArgumentParser) -> None:
    """Add ``store``, ``replay`` and ``last`` to the ``sbus`` subcommands."""
    p = commands.add_parser(
        "store", parents=[common], help="record messages and answer replays (a service)",
        description="Record every message matching a --record pattern in DIR, and answer "
                    "replay, last-value and stats requests (docs/store.md).")
    p.add_argument("--dir", metavar="DIR", help="where the segment files live (required)")
    p.add_argument("--record", metavar="PATTERN", action="append", default=[],
                   help="record messages whose key matches PATTERN (repeatable); keys "
                        "starting with '!' are never recorded")
    p.add_argument("--fsync", type=fsync_policy, default=DEFAULT_FSYNC, metavar="POLICY",
                   help="always (after every batch), never, or N: every N milliseconds "
                        f"(default {DEFAULT_FSYNC}); docs/store.md gives each one's loss window")
    p.add_argument("--max-bytes", type=argtypes.count, metavar="BYTES",
                   help="remove the oldest segments while the log is larger (default: no limit)")
    p.add_argument("--max-age", type=duration, metavar="DURATION",
                   help="remove segments whose newest record is older (90s, 15m, 2h, 7d)")
    p.add_argument("--segment-bytes", type=argtypes.count, default=DEFAULT_SEGMENT_BYTES,
                   metavar="BYTES", help=f"start a new segment past this size "
                                         f"(default {DEFAULT_SEGMENT_BYTES})")
    p.add_argument("--request-key", metavar="KEY", default=wire.REQUEST_KEY.decode(),
                   help=f"where requests are sent (default {wire.REQUEST_KEY.decode()})")
    p.add_argument("--flood", choices=("discard", "block"), default="discard",
                   help="when the store falls behind by more than the broker queues for a "
                        "client: the broker discards (and the store counts the gap), or "
                        "blocks the publishers (no loss; the bus waits for the store) "
                        "(default discard)")
    p.add_argument("--stats-interval", type=argtypes.seconds, default=DEFAULT_STATS_INTERVAL,
                   metavar="SECONDS", help="seconds between store_stats log records "
                                           f"(default {DEFAULT_STATS_INTERVAL:g}; 0: none)")
    p.add_argument("--policy", metavar="FILE",
                   help="answer a replay or last request only if the asker may read every "
                        "key its pattern matches under this access policy (sbusd's; "
                        "docs/policy.md); reloaded on SIGUSR1")
    p.add_argument("--stats", action="store_true",
                   help="do not run a store: print the running store's counters as JSON")
    add_log_options(p)
    p.set_defaults(standalone=main)

    r = commands.add_parser(
        "replay", parents=[common], help="print recorded messages (from sbus store)",
        description="Print the messages sbus store recorded whose keys match PATTERN, in the "
                    "order it recorded them; with --follow, go on with new ones.")
    r.add_argument("pattern", metavar="PATTERN")
    r.add_argument("--since", type=point_in_time, metavar="TIME",
                   help="from this time on: seconds since the epoch, ISO 8601, or 10m/2h ago")
    r.add_argument("--until", type=point_in_time, metavar="TIME", help="up to this time")
    r.add_argument("--after", type=argtypes.count, metavar="SEQ",
                   help="only records with a greater sequence number")
    r.add_argument("--follow", action="store_true",
                   help="then go on with messages as they are recorded (no gap, no repeat)")
    _output_options(r)
    r.set_defaults(run=cmd_replay)

    la = commands.add_parser("last", parents=[common],
                             help="print the last recorded message of each matching key")
    la.add_argument("pattern", metavar="PATTERN")
    _output_options(la)
    la.set_defaults(run=cmd_last)


def _renderer(args: argparse.Namespace, clock, seq=None):
    if args.raw:
        return render.format_raw
    if args.json:
        return render.format_json
    if args.format is not None:
        return render.format_template(args.format, clock, seq)
    if args.verbose:
        return render.format_template(render.VERBOSE, clock)
    return render.format_plain


def _say_gap(gap) -> None:
    lost = "an unknown number of" if gap.lost < 0 else str(gap.lost)
    sys.stderr.write(f"sbus: gap in the log: {lost} messages lost ({gap.reason})\n")
    sys.stderr.flush()


def cmd_replay(bus, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    from ..client.store import from_ns, replay
    with replay(bus, args.pattern, args.since, args.until, args.after, follow=args.follow,
                request_key=args.request_key, on_gap=_say_gap) as it:
        render_one = _renderer(args, lambda: from_ns(it.time_ns), lambda: it.seq)
        for message in it:
            stdout.write(render_one(message))
            if args.follow:
                stdout.flush()
    stdout.flush()
    return 0


def cmd_last(bus, args: argparse.Namespace, stdin: BinaryIO, stdout: BinaryIO) -> int:
    from ..client.store import Replay, from_ns
    with Replay(bus, "last", args.pattern, request_key=args.request_key) as it:
        render_one = _renderer(args, lambda: from_ns(it.time_ns), lambda: it.seq)
        for message in it:
            stdout.write(render_one(message))
    stdout.flush()
    return 0


def main(args: argparse.Namespace, address: str) -> int:
    """Run the store until SIGTERM/SIGINT (or print its stats with --stats)."""
    if args.stats:
        from ..client.store import StoreError, store_stats
        from ..client.sync import Client
        from ..errors import SbusError
        try:
            with Client(address, max_message=args.max_message) as bus:
                counters = store_stats(bus, request_key=args.request_key)
        except (StoreError, SbusError, OSError) as exc:
            sys.stderr.write(f"sbus store: {exc}\n")
            return 1
        sys.stdout.write(json.dumps(counters, indent=2) + "\n")
        return 0
    if not args.dir or not args.record:
        sys.stderr.write("sbus store: needs --dir DIR and at least one --record PATTERN\n")
        return 2
    from ..runner import STOPPED, Runner, configure_log
    from .service import Settings, Store
    settings = Settings(
        address=address, directory=args.dir,
        patterns=[p.encode("utf-8", "surrogateescape") for p in args.record],
        fsync=args.fsync, segment_bytes=args.segment_bytes, max_bytes=args.max_bytes,
        max_age_s=args.max_age, request_key=args.request_key.encode("utf-8", "surrogateescape"),
        stats_interval=args.stats_interval, max_message=args.max_message, flood=args.flood,
        policy=args.policy)
    from ..access import PolicyError
    stream, logger = configure_log(args)
    try:
        store = Store(settings, logger)
    except PolicyError as exc:
        sys.stderr.write(f"sbus store: {exc}\n")
        return 1
    except OSError as exc:
        sys.stderr.write(f"sbus store: {args.dir}: {exc.strerror or exc}\n")
        return 1
    reason = STOPPED
    with Runner(stream, store.reload_policy) as runner:
        try:
            # A write in progress finishes first: the loop looks between batches.
            reason = store.run(runner.between_turns, wake=runner.fileno())
        except OSError as exc:
            reason = f"error: {exc}"
            sys.stderr.write(f"sbus store: {address}: {exc.strerror or exc}\n")
            return 1
        finally:
            store.stop(reason)
    return 0
