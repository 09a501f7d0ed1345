"""``sbus fds``: its options (nothing heavy imported) and its main."""
from __future__ import annotations

import argparse
import sys

from .. import argtypes
from ..runner import add_log_options
from .defaults import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID, MAX_FDS_PER_UID, TIMEOUT


def add_parser(commands, common: argparse.ArgumentParser) -> None:
    """Add ``fds`` to the ``sbus`` subcommands."""
    p = commands.add_parser(
        "fds", parents=[common], help="hand file descriptors to a process named by !/cred/",
        description="Take fds offered for a !/cred/GID/UID/PID address on a socket of its "
                    "own and pass them to that process only, when it claims them "
                    "(docs/fds.md).")
    p.add_argument("--socket", metavar="PATH",
                   help="the service's socket, mode 0666 (default: $SBUS_FDS_SOCKET, else "
                        "the bus socket's path + '.fds')")
    p.add_argument("--timeout", metavar="SECONDS", type=argtypes.positive_seconds,
                   default=TIMEOUT,
                   help=f"fds nobody claimed this long are closed, and a connection "
                        f"silent this long is closed (default {TIMEOUT:g})")
    p.add_argument("--max-fds-per-uid", metavar="N", type=argtypes.count,
                   default=MAX_FDS_PER_UID,
                   help=f"fds the offers of one uid may hold at once (default {MAX_FDS_PER_UID})")
    p.add_argument("--max-fds", metavar="N", type=argtypes.count, default=None,
                   help="fds all offers may hold (default: what RLIMIT_NOFILE leaves)")
    p.add_argument("--max-connections", metavar="N", type=argtypes.argtype(int, low=1),
                   default=MAX_CONNECTIONS,
                   help=f"connections at once (default {MAX_CONNECTIONS}; "
                        f"{MAX_CONNECTIONS_PER_UID} of one uid)")
    add_log_options(p)
    p.set_defaults(standalone=main)


def main(args: argparse.Namespace, address: str) -> int:
    """Run the service until SIGTERM/SIGINT; 0, or 1 with a message on stderr."""
    from ..runner import STOPPED, Runner, configure_log
    from . import wire
    from .service import FdService, Settings, StartupError
    try:
        path = args.socket or wire.default_socket(address)
    except ValueError as exc:
        sys.stderr.write(f"sbus fds: {exc}\n")
        return 2
    settings = Settings(address=address, socket_path=path, timeout=args.timeout,
                        max_fds_per_uid=args.max_fds_per_uid, max_fds=args.max_fds,
                        max_connections=args.max_connections,
                        max_connections_per_uid=min(MAX_CONNECTIONS_PER_UID, args.max_connections),
                        max_message=args.max_message)
    stream, logger = configure_log(args)
    service = FdService(settings, logger)
    reason = STOPPED
    with Runner(stream) as runner:
        try:
            reason = service.run(runner.between_turns, wake=runner.fileno())
        except (StartupError, OSError) as exc:
            reason = f"error: {exc}"
            text = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            sys.stderr.write(f"sbus fds: {text}\n")
            return 1
        finally:
            service.stop(reason)
    return 0
