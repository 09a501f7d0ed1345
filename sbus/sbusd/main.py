"""``sbusd``: the sbus broker daemon (command line compatible with the C sbusd).

    sbusd [-a address] [-f] [-p pidfile] [-u user] ... [-cgor] [long options]

This is the thin main: parse the line (``config``), set up the socket and
the process (``lifecycle``), wire the broker to its ``events.Service``
and run it. Start-up imports nothing heavy: a parent may wait for our stdout
to close with a one-second alarm.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import List, Optional

from .. import address as addresses
from .. import logschema as schema
from .._version import __version__
from ..errors import AddressError
from .config import USAGE, Config, Exit, Reload, Upgrade, UsageError, parse_args

SIGNALLED = "signalled"     # Broker.run()'s stop reason: a signal to act on between turns


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(argv)
        return run(cfg, argv)
    except Reload as e:
        from .reload import request as request_reload
        return request_reload(e.pidfile)
    except Upgrade as e:
        from .upgrade import request
        return request(e.pidfile)
    except Exit as e:
        print(e.text, end="")
        return 0
    except UsageError as e:
        print(f"sbusd: {e}\n{USAGE}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def run(cfg: Config, argv: List[str] = ()) -> int:
    from ..runner import Signals
    from . import lifecycle
    from .upgrade import Successor

    # A live upgrade's new process: the socket and the clients come from the
    # old one (sbus/sbusd/upgrade.py).
    successor = Successor.from_env()
    # Where we were started: a live upgrade starts the new process there, so
    # relative paths on the command line mean the same.
    start_dir = os.getcwd()

    # Warnings about the configuration go to stderr now and, once the log
    # is open, into it as config_warning records.
    warnings: List[str] = []

    def warn(text: str) -> None:
        print(f"sbusd: {text}", file=sys.stderr)
        warnings.append(text)

    # An upgrade asked for before the loop runs has nothing to hand over yet.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    lifecycle.ensure_stdio()
    # The socket accepts connections before the broker loop exists: a signal
    # arriving in between is noted (sbus.runner) and acted on at the loop's
    # first turn, so a stopped broker still exits cleanly and removes its
    # socket. After ensure_stdio: the wakeup socket must not be a stdio fd.
    # SIGUSR1 (reload the policy) too: its default action would kill us.
    signals = Signals().catch((signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1))
    tenure = Tenure(argv, start_dir)

    # A daemon chdirs to "/": every path it keeps using must be absolute.
    if cfg.pidfile:
        cfg.pidfile = os.path.abspath(cfg.pidfile)
    for flag, field in (("--log-file", "log_file"), ("--json-log", "json_log")):
        path = getattr(cfg, field)
        if path:
            setattr(cfg, field, os.path.abspath(path))
            try:
                from ..log import open_log
                open_log(getattr(cfg, field)).close()
            except OSError as e:
                warn(f"{flag} {getattr(cfg, field)}: {e.strerror}")
                return 1
    # The access policy, before anything is served: a file that does not
    # load stops us here, and a live upgrade's new process (started with
    # the same line) reads the file as it is now, telling the old one why
    # it cannot serve it.
    policy = None
    if cfg.policy:
        from ..access import PolicyError
        from .reload import load
        cfg.policy = os.path.abspath(cfg.policy)
        try:
            policy = load(cfg.policy)
        except PolicyError as e:
            if successor is not None:
                successor.refuse("policy", str(e))
            warn(str(e))
            return 1
    if successor is not None:
        return serve_successor(cfg, successor, tenure, signals, warnings, policy)
    try:
        addr = addresses.parse(cfg.address)
        if cfg.upstream:
            check_upstream(cfg.upstream)
        allowed = lifecycle.resolve_users(cfg.users)
        listener = lifecycle.make_listener(addr, reuse=cfg.reuse, mode=cfg.mode, warn=warn)
        if listener.path is not None or listener.abstract:     # a mode we set and enforce
            spec_of = dict(zip(allowed, cfg.users))
            for uid, flag in lifecycle.kept_out(allowed, cfg.mode, os.getuid(), os.getgid()):
                warn(f"-u {spec_of[uid]}: uid {uid} cannot connect: the socket's mode "
                     f"{cfg.mode:04o} keeps it out ({flag} would let it in)")
    except (AddressError, lifecycle.StartupError) as e:
        warn(str(e))
        return 1
    except OSError as e:
        warn(f"{cfg.address}: {e.strerror or e}")
        return 1

    pidfile_written = False
    try:
        if listener.printed_address:
            lifecycle.announce(listener.printed_address)
        ready = None
        if cfg.foreground and cfg.pidfile:      # -p is honoured in the foreground too
            lifecycle.write_pidfile(cfg.pidfile)
            pidfile_written = True
        if not cfg.foreground:
            # A person who typed sbusd sees where it went; a script or a
            # service manager reads nothing new.
            ready = lifecycle.daemonise(
                on_ready=_tell_terminal(where_listening(cfg, listener))
                if sys.stderr.isatty() else None)
            if cfg.pidfile:
                lifecycle.write_pidfile(cfg.pidfile)
                pidfile_written = True
            if not cfg.log_file:
                lifecycle.release_stderr()
        if allowed:
            allowed.append(os.getuid())
        return serve(cfg, listener, allowed, ready, tenure, signals, warnings, policy=policy)
    except lifecycle.StartupError as e:
        warn(str(e))
        return 1
    finally:
        if tenure.owned:
            leave(cfg, listener, pidfile_written)


def leave(cfg: Config, listener, pidfile_written: bool) -> None:
    """Remove the socket file and the pidfile (with the last upgrade's
    outcome beside it): the broker that owned them stops."""
    from . import lifecycle
    from .upgrade import status_path
    if listener.path is not None:
        lifecycle.remove_quietly(listener.path)
    if pidfile_written:
        lifecycle.remove_quietly(cfg.pidfile)
        lifecycle.remove_quietly(status_path(cfg.pidfile))


class Tenure:
    """What this process owns: the socket file and the pidfile, until it
    hands them to a new sbusd (``owned`` False), or, in the new one, from
    the moment it takes over. ``argv`` and ``start_dir`` start the next one."""

    def __init__(self, argv: List[str], start_dir: str, owned: bool = True):
        self.argv = list(argv)
        self.start_dir = start_dir
        self.owned = owned
        self.listener = None    # a successor's, once it takes over


def serve_successor(cfg: Config, successor, tenure: Tenure, signals, warnings,
                    policy=None) -> int:
    """The new process of a live upgrade: serve what the old one hands over.
    Before it takes over it owns nothing, and leaves without a trace."""
    from . import lifecycle
    from .upgrade import UpgradeFailed
    tenure.owned = False
    try:
        allowed = lifecycle.resolve_users(cfg.users)
    except lifecycle.StartupError as e:
        print(f"sbusd: {e}", file=sys.stderr)
        return 1
    if allowed:
        allowed.append(os.getuid())
    try:
        return serve(cfg, None, allowed, None, tenure, signals, warnings, successor, policy)
    except UpgradeFailed as e:
        print(f"sbusd: upgrade: {e.step}: {e.reason}", file=sys.stderr)
        return 1
    finally:
        if tenure.owned:
            leave(cfg, tenure.listener, cfg.pidfile is not None)


def check_upstream(text: str) -> None:
    """A clear error at start when --upstream is no sbusd that lets us in;
    later losses are the link's to retry (and log)."""
    from .lifecycle import StartupError
    from .upstream import UpstreamError, probe
    try:
        probe(text)
    except UpstreamError as e:
        raise StartupError(f"--upstream {e}") from None


def where_listening(cfg: Config, listener) -> str:
    """The address as a person can give it to ``sbus -a``."""
    if listener.printed_address:
        return listener.printed_address
    if listener.path is not None:
        return os.path.abspath(os.fsdecode(listener.path))
    return cfg.address


def _tell_terminal(where: str):
    def tell(pid: int) -> None:
        sys.stderr.write(f"sbusd: listening on {where} in the background as pid {pid}; "
                         f"stop it with: kill {pid}\n")
        sys.stderr.flush()
    return tell


def serve(cfg: Config, listener, allowed, ready, tenure: Tenure, signals, warnings=(),
          successor=None, policy=None) -> int:
    """Run the broker until it stops or hands over. A successor (a live
    upgrade's new process) brings the listener and the state with it."""
    from functools import partial

    from .. import log as logging_

    # Loaded now, with the broker it was built with: an upgrade may replace
    # both on disk before SIGUSR2.
    from .._core import handover
    from .._core.broker import Broker
    from ..runner import sd_notify
    from . import lifecycle
    from . import reload as policy_reload
    from .events import Service
    from .upgrade import Predecessor, ms_since
    from .uplink import LinkFailed, Uplink

    stream = logging_.ReopenableStream(cfg.log_file, logging_.fallback_stream())
    json_copy = logging_.ReopenableStream(cfg.json_log, stream) if cfg.json_log else None
    fmt = cfg.log_format or logging_.default_format(stream)
    log = logging_.configure(fmt, cfg.log_level, stream, json_copy)
    if successor is not None:
        successor.hello()
        listener = successor.receive_listener()
    # The link's watcher looks each tick and ends the turn; it acts between turns.
    uplink = Uplink(cfg, log, stop_turn=lambda: service.broker.stop(SIGNALLED)) \
        if cfg.upstream else None
    make_broker = partial(Broker, listener.sock.fileno(), cfg, allowed_uids=allowed,
                          access_mode=cfg.mode if listener.abstract else -1,
                          wakeup_fd=signals.fileno())
    service = Service(cfg, log=log, stream=stream, make_broker=make_broker,
                      message_log=logging_.message_logger(fmt, cfg.log_level, stream,
                                                          json_copy is not None),
                      also_on_tick=uplink.tick if uplink is not None else None)
    broker = service.broker
    if successor is not None:
        successor.prebuild(broker)
        successor.receive_state()
        successor.restore(broker)
        if policy is not None:
            # Each restored connection's identity compiled afresh, and its
            # subscriptions held to the file as it is now, before any is read.
            policy_reload.enforce(broker, policy, log, reload=False)
        successor.take_over(cfg.pidfile)
        tenure.owned = True
        tenure.listener = listener

    def reopen() -> None:
        stream.reopen()
        if json_copy is not None:
            json_copy.reopen()
        log.info(schema.LOG_REOPENED, path=cfg.log_file)

    started = time.monotonic()
    if successor is None:
        log.info(schema.BROKER_START, version=__version__,
                 address=listener.printed_address or cfg.address, pid=os.getpid(),
                 config=cfg.summary())
        if policy is not None:
            policy_reload.enforce(broker, policy, log, reload=False)
        # Before the loop reads any client: the link is told of each from the first.
        if uplink is not None:
            try:
                uplink.start(broker)
            except LinkFailed as e:
                broker.close()
                log.info(schema.BROKER_STOP, reason="upstream link",
                         uptime_s=round(time.monotonic() - started, 3), totals=broker.totals())
                stream.flush()
                raise lifecycle.StartupError(f"--upstream {cfg.upstream}: {e}") from None
    else:
        log.info(schema.UPGRADE_DONE, version=__version__, old_pid=successor.meta["old_pid"],
                 old_version=successor.meta["version"], clients=broker.client_count,
                 restore_ms=ms_since(successor.started), **successor.figures)
        # The broker's start time came over with its state: broker_stop's
        # uptime goes on from it, as CMSG stats's does.
        started -= broker.stats()["uptime_s"]
        if uplink is not None:
            uplink.adopt(broker, successor.link())
    upgrade = Predecessor(cfg, tenure.argv, tenure.start_dir, log, listener,
                          lambda: uplink.pid if uplink is not None else None)
    upgrade.broker = broker

    # A handler runs between any two bytecodes of this thread, even inside
    # the logger's lock (a log line written from a broker callback): it only
    # notes the signal and ends the loop's turn (sbus.runner). The loop acts
    # on it between two turns, where logging, starting a process and handing
    # over are safe.
    signals.catch((signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                   signal.SIGUSR2), on_note=partial(broker.stop, SIGNALLED))
    if signals.pending():
        broker.stop(SIGNALLED)      # noted before the loop: its first turn ends at once
    if broker.backend_fallback:
        warnings = [*warnings, f"--backend {cfg.backend}: {broker.backend_fallback}"]
    for text in warnings:
        log.warning(schema.CONFIG_WARNING, detail=text)
    lifecycle.detach_stdio()
    if ready is not None:
        ready()
    if successor is None and uplink is None:
        sd_notify("READY=1")    # a leaf's link says it, once its subscriptions are in place
    reason = "error"
    handed_over = False
    try:
        while not handed_over:
            reason = broker.run()
            if reason != SIGNALLED:
                break
            handover.resume(broker)     # a signal noted now ends the next turn
            noted = signals.take()
            stops = [signo for signo in noted
                     if signo not in (signal.SIGUSR1, signal.SIGUSR2)
                     and (signo != signal.SIGHUP or cfg.foreground)]
            if stops:
                reason = signal.Signals(stops[0]).name     # an upgrade under way ends with us
                break
            if uplink is not None:
                uplink.act()    # after the stops: a link a stop signal ended stays ended
            if signal.SIGHUP in noted:
                reopen()
            if signal.SIGUSR1 in noted:
                policy_reload.act(cfg, broker, log)
            if signal.SIGUSR2 in noted:
                handed_over = upgrade.act()
    finally:
        if handed_over:
            # The new process serves every client, the socket and the pidfile:
            # leave without touching them.
            tenure.owned = False
        else:
            upgrade.abandon()
            sd_notify("STOPPING=1")
            broker.close()
            if uplink is not None:
                uplink.stop()
            log.info(schema.BROKER_STOP, reason=reason,
                     uptime_s=round(time.monotonic() - started, 3), totals=broker.totals())
        stream.flush()
        signals.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
