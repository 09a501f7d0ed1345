"""``sbus bridge``: its options (no NATS import) and its main."""
from __future__ import annotations

import argparse
import sys

from .. import argtypes
from ..runner import add_log_options
from . import mapping
from .defaults import DEFAULT_MAX_PENDING, DEFAULT_STATS_INTERVAL, DEFAULT_STATS_KEY, DROP_NEWEST, DROP_OLDEST


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """Add ``bridge`` to the ``sbus`` subcommands."""
    p = commands.add_parser(
        "bridge", parents=[common], help="join this bus to others through NATS",
        description="Forward local messages matching --export patterns to NATS, and NATS "
                    "messages on --import subjects to the local bus (docs/bridge.md).")
    p.add_argument("--nats", metavar="URL", action="append", default=[], required=True,
                   help="a NATS server (nats://host:4222); repeat for a cluster's seeds")
    p.add_argument("--export", metavar="PATTERN", action="append", default=[],
                   help="send local messages whose key matches PATTERN to NATS (repeatable); "
                        "'!' keys never leave")
    p.add_argument("--import", dest="imports", metavar="SUBJECT", action="append", default=[],
                   help="publish NATS messages on SUBJECT (wildcards * and >) locally "
                        "(repeatable)")
    p.add_argument("--subject-prefix", metavar="PREFIX", default=mapping.DEFAULT_PREFIX,
                   help=f"the first subject token(s) of mapped keys "
                        f"(default {mapping.DEFAULT_PREFIX})")
    p.add_argument("--max-pending", metavar="BYTES", type=argtypes.count, default=DEFAULT_MAX_PENDING,
                   help=f"bytes held for NATS while it is slow or away "
                        f"(default {DEFAULT_MAX_PENDING})")
    p.add_argument("--drop", choices=(DROP_OLDEST, DROP_NEWEST), default=DROP_OLDEST,
                   help="which end of the pending buffer loses when it is full "
                        "(default oldest)")
    p.add_argument("--stats-key", metavar="KEY", default=DEFAULT_STATS_KEY,
                   help=f"local key the counters are published on ('' for none; "
                        f"default {DEFAULT_STATS_KEY})")
    p.add_argument("--stats-interval", metavar="SECONDS", type=argtypes.positive_seconds,
                   default=DEFAULT_STATS_INTERVAL,
                   help=f"seconds between counter reports (default {DEFAULT_STATS_INTERVAL:g})")
    p.add_argument("--reconnect-wait", metavar="SECONDS", type=argtypes.positive_seconds, default=1.0,
                   help="first wait before a NATS server is tried again; doubles up to 5 s "
                        "(default 1)")
    p.add_argument("--local-flood", choices=("discard", "block"), default=None,
                   help="when the bridge falls behind the local bus: the broker discards "
                        "(and counts) what overflows its queue, or blocks the publishers "
                        "(default: the broker's default, discard)")
    p.add_argument("--name", default="sbus-bridge", help="the client name NATS shows")
    p.add_argument("--private", action="store_true",
                   help="carry private keys between bridged hosts: take the local broker's "
                        "link place, answer whoami under this host's identity, use the "
                        "private subjects PREFIX-private.HOST.> (needs --host-id)")
    p.add_argument("--host-id", metavar="N", type=_host_id, default=None,
                   help="this host's id among the bridged hosts (0 to 4294967295), as the "
                        "NATS permissions name it; with --private")
    p.add_argument("--no-fast-path", dest="fast_path", action="store_false",
                   help="meet nats-py through its public API only (the reference path, "
                        "as with an untested nats-py release; slower, same results)")
    p.add_argument("--no-frames", dest="frames", action="store_false",
                   help="a packet per message on the local bus, as any client's (by default "
                        "the bridge asks its broker for frames: many packets in one)")
    auth = p.add_argument_group("NATS authentication and TLS (as nats-py takes them)")
    auth.add_argument("--creds", metavar="FILE", help="a user credentials file (JWT and NKey)")
    auth.add_argument("--token", help="an authentication token")
    auth.add_argument("--user", help="user name")
    auth.add_argument("--password", help="password for --user")
    auth.add_argument("--tls-ca", metavar="FILE", help="CA certificates to verify the server")
    auth.add_argument("--tls-cert", metavar="FILE", help="client certificate")
    auth.add_argument("--tls-key", metavar="FILE", help="client certificate's key")
    add_log_options(p)
    p.set_defaults(standalone=main)


def _host_id(text: str) -> int:
    try:
        return mapping.parse_host_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def settings_of(args: argparse.Namespace, address: str):
    from .forward import Settings
    return Settings(
        address=address, servers=args.nats, exports=args.export, imports=args.imports,
        subject_prefix=args.subject_prefix, max_pending=args.max_pending, drop=args.drop,
        max_message=args.max_message, stats_key=args.stats_key,
        stats_interval=args.stats_interval, reconnect_wait=args.reconnect_wait, name=args.name,
        local_flood=args.local_flood, fast_path=args.fast_path, frames=args.frames,
        private=args.private, host_id=args.host_id,
        creds=args.creds, token=args.token, user=args.user, password=args.password,
        tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)


def main(args: argparse.Namespace, address: str) -> int:
    """Run the bridge until SIGTERM/SIGINT; 0, or 1 with a message on stderr."""
    from ..runner import run_async
    from .forward import Bridge, SettingsError, check
    settings = settings_of(args, address)
    try:
        check(settings)
        import nats  # noqa: F401  (fail early and clearly without the extra)
    except SettingsError as exc:
        sys.stderr.write(f"sbus bridge: {exc}\n")
        return 2
    except ImportError:
        sys.stderr.write("sbus bridge: needs nats-py, the bridge extra of pysbus: "
                         "pip install nats-py\n")
        return 1
    return run_async("bridge", address, args, lambda logger: Bridge(settings, logger))
