"""``sbus queue``: its options (nothing heavy imported) and its main."""
from __future__ import annotations

import argparse
import sys

from .. import argtypes
from ..runner import add_log_options
from .defaults import ACK_TIMEOUT, LEASE, MAX_HELD, PREFETCH, STATS_INTERVAL


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """Add ``queue`` to the ``sbus`` subcommands."""
    p = commands.add_parser(
        "queue", parents=[common], help="share the jobs on PATTERN among consumers",
        description="Give every message matching PATTERN to exactly one consumer (sbus "
                    "consume), at least once, fairly, on the consumer's private key "
                    "(docs/queues.md).")
    p.add_argument("pattern", metavar="PATTERN", help="the jobs' routing key pattern")
    p.add_argument("--prefetch", metavar="K", type=argtypes.argtype(int, low=1), default=PREFETCH,
                   help=f"the most unacknowledged jobs one consumer holds (default {PREFETCH})")
    p.add_argument("--ack-timeout", metavar="SECONDS", type=argtypes.positive_seconds,
                   default=ACK_TIMEOUT,
                   help=f"a consumer holding a job unacknowledged this long is dropped and its "
                        f"jobs go to others (default {ACK_TIMEOUT:g})")
    p.add_argument("--lease", metavar="SECONDS", type=argtypes.positive_seconds, default=LEASE,
                   help=f"a consumer not heard from this long is dropped and its jobs go to "
                        f"others (default {LEASE:g})")
    p.add_argument("--max-held", metavar="N", type=argtypes.count, default=MAX_HELD,
                   help=f"jobs waiting for a consumer before the oldest is dropped "
                        f"(default {MAX_HELD})")
    p.add_argument("--stats-interval", metavar="SECONDS", type=argtypes.seconds,
                   default=STATS_INTERVAL,
                   help=f"seconds between queue_stats records, written when something "
                        f"changed (default {STATS_INTERVAL:g}; 0: none)")
    p.add_argument("--policy", metavar="FILE",
                   help="hand jobs only to consumers that may read every key PATTERN matches "
                        "under this access policy (sbusd's; docs/policy.md); reloaded on "
                        "SIGUSR1")
    add_log_options(p)
    p.set_defaults(standalone=main)


def main(args: argparse.Namespace, address: str) -> int:
    """Run the service until SIGTERM/SIGINT; 0, or 1 with a message on stderr."""
    from ..client.protocol import pack_subscribe
    from ..errors import MessageRefusedError
    from ..runner import run_async
    from .service import QueueService, Settings
    try:
        pack_subscribe(args.pattern)
    except MessageRefusedError as exc:
        sys.stderr.write(f"sbus queue: PATTERN {args.pattern!r}: {exc}\n")
        return 2
    askers = None
    if args.policy:
        from ..access import PolicyError
        from ..access.askers import Askers
        try:
            askers = Askers(args.policy)
        except PolicyError as exc:
            sys.stderr.write(f"sbus queue: {exc}\n")
            return 1
    settings = Settings(address=address, pattern=args.pattern, prefetch=args.prefetch,
                        ack_timeout=args.ack_timeout, lease=args.lease,
                        max_held=args.max_held, stats_interval=args.stats_interval,
                        max_message=args.max_message, askers=askers)
    return run_async("queue", address, args, lambda logger: QueueService(settings, logger))
