"""``sbusd``: the sbus broker daemon (command line compatible with the C sbusd).

    sbusd [-a address] [-f | -p pidfile] [-u user] ... [-cgor] [long options]

Options are parsed getopt-style, so combined forms such as ``-fa PATH -cr``
or ``-fa/dev/unix/abstract`` work as they do in C. Start-up imports nothing
heavy: a parent may wait for our stdout to close with a one-second alarm.
"""
from __future__ import annotations

import getopt
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

from . import address as addresses
from ._version import __version__
from .errors import AddressError

USAGE = "usage: sbusd [-a address] [-f | -p pidfile] [-u user] ... [-cgor] [options]"

HELP = f"""{USAGE}

The sbus message broker. It listens on a Unix-domain SOCK_SEQPACKET socket
and routes each published message to every client with a matching pattern.

  -a, --address ADDRESS   socket path (default {addresses.DEFAULT_ADDRESS}),
                          /dev/unix/abstract (random; printed on stdout),
                          /dev/unix/abstract/HEX, or /dev/fd/N
  -f, --foreground        do not daemonise; SIGINT, SIGTERM, SIGHUP stop it
  -p, --pidfile PATH      daemon's pidfile (default /run/sbus.pid; /dev/null: none)
  -u, --user USER         allow only USER (name or uid) and our own uid; repeatable
  -c, --auto-close        exit once the last client has left
  -g, --group             socket mode allows the group (0770)
  -o, --other             socket mode allows others (0707; with -g 0777)
  -r, --reuse             replace a stale socket at the path (only a socket)
      --backend NAME      event loop: epoll (default) or select
      --max-message BYTES largest packet accepted (default 409600)
      --soft MODE         default soft flood mode: queue, discard, block, error (queue)
      --hard MODE         default hard flood mode: discard, block, error (discard)
      --order ORDER       default queue order: queue, stack, random (queue)
      --queue-max-bytes N per-client queue limit in bytes (default 8 MiB)
      --queue-max-msgs N  per-client queue limit in messages (default 65536)
      --total-max-bytes N broker-wide cap on queued bytes (default 256 MiB)
      --block-timeout S   a client blocking the bus longer is an error (default 10)
      --max-subscriptions N  per client (default 65536)
      --max-pattern BYTES    longest pattern (default 4096)
      --log-format FORMAT json or console (default: json unless stderr is a terminal)
      --log-file PATH     log here instead of stderr (reopened on SIGHUP as a daemon)
      --log-level LEVEL   debug, info, warning, error or off (default info)
      --stats-interval S  seconds between stats records (default 10; 0: none)
      --log-messages RATE fraction of messages logged as samples, 0..1 (default 0)
  -h, --help              show this help
  -V, --version           show the version
"""

SHORT = "a:cfgop:ru:hV"
LONG = ["address=", "auto-close", "foreground", "group", "other", "pidfile=", "reuse",
        "user=", "help", "version", "backend=", "max-message=", "soft=", "hard=", "order=",
        "queue-max-bytes=", "queue-max-msgs=", "total-max-bytes=", "block-timeout=",
        "max-subscriptions=", "max-pattern=", "log-format=", "log-file=", "log-level=",
        "stats-interval=", "log-messages="]

FLOOD_INTERVAL = 1.0    # seconds between flood summaries of one client


class UsageError(Exception):
    pass


@dataclass
class Config:
    address: str = addresses.DEFAULT_ADDRESS
    foreground: bool = False
    pidfile: Optional[str] = "/run/sbus.pid"
    users: List[str] = field(default_factory=list)
    auto_close: bool = False
    mode: int = 0o700
    reuse: bool = False
    backend: str = "epoll"
    max_message: int = 409600
    soft: str = "queue"
    hard: str = "discard"
    order: str = "queue"
    queue_max_bytes: int = 8 << 20
    queue_max_msgs: int = 65536
    total_max_bytes: int = 256 << 20
    block_timeout: float = 10.0
    max_subscriptions: int = 65536
    max_pattern: int = 4096
    log_format: Optional[str] = None
    log_file: Optional[str] = None
    log_level: str = "info"
    stats_interval: float = 10.0
    log_messages: float = 0.0

    def summary(self) -> dict:
        """The configuration as logged in broker_start (scalars only)."""
        d = {k: v for k, v in self.__dict__.items() if k != "users"}
        if self.foreground:
            d["pidfile"] = None     # only a daemon writes one
        d["mode"] = oct(self.mode)
        d["users"] = ",".join(self.users)
        return d


def _number(opt: str, value: str, kind=int, low=0, high=None):
    try:
        n = kind(value)
    except ValueError:
        raise UsageError(f"{opt}: not a number: {value!r}")
    if n != n or n in (float("inf"), float("-inf")):     # nan, inf: no JSON for them either
        raise UsageError(f"{opt}: not a finite number: {value!r}")
    if n < low or (high is not None and n > high):
        raise UsageError(f"{opt}: out of range: {value!r}")
    return n


def _choice(opt: str, value: str, choices):
    if value not in choices:
        raise UsageError(f"{opt}: choose one of {', '.join(choices)}")
    return value


def parse_args(argv: List[str]) -> Config:
    try:
        opts, rest = getopt.gnu_getopt(argv, SHORT, LONG)
    except getopt.GetoptError as e:
        raise UsageError(str(e))
    if rest:
        raise UsageError(f"unexpected argument {rest[0]!r}")
    cfg = Config()
    for opt, val in opts:
        if opt in ("-a", "--address"):
            cfg.address = val
        elif opt in ("-c", "--auto-close"):
            cfg.auto_close = True
        elif opt in ("-f", "--foreground"):
            cfg.foreground = True
        elif opt in ("-g", "--group"):
            cfg.mode |= 0o070
        elif opt in ("-o", "--other"):
            cfg.mode |= 0o007
        elif opt in ("-p", "--pidfile"):
            cfg.pidfile = val
        elif opt in ("-r", "--reuse"):
            cfg.reuse = True
        elif opt in ("-u", "--user"):
            cfg.users.append(val)
        elif opt in ("-h", "--help"):
            raise SystemExit(print(HELP, end="") or 0)
        elif opt in ("-V", "--version"):
            raise SystemExit(print(f"sbusd {__version__}") or 0)
        elif opt == "--backend":
            cfg.backend = _choice(opt, val, ("epoll", "select"))
        elif opt == "--max-message":
            cfg.max_message = _number(opt, val, low=64, high=64 << 20)
        elif opt == "--soft":
            cfg.soft = _choice(opt, val, ("queue", "discard", "block", "error"))
        elif opt == "--hard":
            cfg.hard = _choice(opt, val, ("discard", "block", "error"))
        elif opt == "--order":
            cfg.order = _choice(opt, val, ("queue", "stack", "random"))
        elif opt == "--queue-max-bytes":
            cfg.queue_max_bytes = _number(opt, val, low=1)
        elif opt == "--queue-max-msgs":
            cfg.queue_max_msgs = _number(opt, val, low=1)
        elif opt == "--total-max-bytes":
            cfg.total_max_bytes = _number(opt, val, low=1)
        elif opt == "--block-timeout":
            cfg.block_timeout = _number(opt, val, float, low=0.001)
        elif opt == "--max-subscriptions":
            cfg.max_subscriptions = _number(opt, val, low=1, high=2**32 - 1)
        elif opt == "--max-pattern":
            cfg.max_pattern = _number(opt, val, low=1, high=1 << 20)
        elif opt == "--log-format":
            cfg.log_format = _choice(opt, val, ("json", "console"))
        elif opt == "--log-file":
            cfg.log_file = val
        elif opt == "--log-level":
            cfg.log_level = _choice(opt, val, ("debug", "info", "warning", "error", "off"))
        elif opt == "--stats-interval":
            cfg.stats_interval = _number(opt, val, float, low=0)
        elif opt == "--log-messages":
            cfg.log_messages = _number(opt, val, float, low=0, high=1)
    if cfg.pidfile == "/dev/null":
        cfg.pidfile = None
    return cfg


class Service:
    """Glue between the Cython broker and logging, signals and the tick."""

    def __init__(self, cfg: Config, log, stream):
        self.cfg = cfg
        self.log = log
        self.stream = stream
        self.broker = None
        self.next_stats = 0.0
        self.next_flood = 0.0

    def on_event(self, name: str, fields: dict) -> None:
        from .log import emit
        emit(self.log, name, fields)

    def on_message(self, client, pid, uid, key: bytes, size: int, fanout: int) -> None:
        self.message_log.info("message", client=client, pid=pid, uid=uid,
                              key=key.decode("utf-8", "backslashreplace"), size=size,
                              fanout=fanout, sample_rate=self.cfg.log_messages)

    def on_tick(self) -> None:
        self.stream.flush()     # sampled message records since the last tick
        now = time.monotonic()
        if now >= self.next_flood:
            self.next_flood = now + FLOOD_INTERVAL
            for record in self.broker.take_flood_report():
                self.log.warning("flood", interval_s=FLOOD_INTERVAL, **record)
        if self.cfg.stats_interval > 0 and now >= self.next_stats:
            self.next_stats = now + self.cfg.stats_interval
            self.write_stats()

    def write_stats(self) -> None:
        totals, delta = self.broker.take_stats_delta()
        self.log.info("stats", interval_s=self.cfg.stats_interval, totals=totals, delta=delta,
                      clients=self.broker.take_changed_clients())


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(argv)
        return run(cfg)
    except UsageError as e:
        print(f"sbusd: {e}\n{USAGE}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def run(cfg: Config) -> int:
    from . import daemon

    def warn(text: str) -> None:
        print(f"sbusd: {text}", file=sys.stderr)

    # The socket accepts connections before the broker loop exists: a stop
    # signal arriving in between is remembered and honoured at once, so the
    # broker still exits cleanly and removes its socket. (A log reopen
    # request before the log is open has nothing to do.)
    early_stop: List[str] = []

    def remember(signo, frame):
        if signo != signal.SIGHUP or cfg.foreground:
            early_stop.append(signal.Signals(signo).name)

    for signo in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signo, remember)
    daemon.ensure_stdio()

    # A daemon chdirs to "/": every path it keeps using must be absolute.
    if cfg.pidfile:
        cfg.pidfile = os.path.abspath(cfg.pidfile)
    if cfg.log_file:
        cfg.log_file = os.path.abspath(cfg.log_file)
        try:
            from .log import open_log
            open_log(cfg.log_file).close()
        except OSError as e:
            warn(f"--log-file {cfg.log_file}: {e.strerror}")
            return 1
    try:
        addr = addresses.parse(cfg.address)
        allowed = daemon.resolve_users(cfg.users)
        listener = daemon.make_listener(addr, reuse=cfg.reuse, mode=cfg.mode, warn=warn)
    except (AddressError, daemon.StartupError) as e:
        warn(str(e))
        return 1
    except OSError as e:
        warn(f"{cfg.address}: {e.strerror or e}")
        return 1

    pidfile_written = False
    try:
        if listener.printed_address:
            daemon.announce(listener.printed_address)
        ready = None
        if not cfg.foreground:
            ready = daemon.daemonise()
            if cfg.pidfile:
                daemon.write_pidfile(cfg.pidfile)
                pidfile_written = True
            if not cfg.log_file:
                daemon.release_stderr()
        if allowed:
            allowed.append(os.getuid())
        return serve(cfg, listener, allowed, ready, early_stop)
    except daemon.StartupError as e:
        warn(str(e))
        return 1
    finally:
        if listener.path is not None:
            try:
                os.unlink(listener.path)
            except OSError:
                pass
        if pidfile_written:
            try:
                os.unlink(cfg.pidfile)
            except OSError:
                pass


def serve(cfg: Config, listener, allowed, ready, early_stop=()) -> int:
    from . import daemon, log as logging_
    from ._core.broker import Broker

    stream = logging_.ReopenableStream(cfg.log_file, logging_.fallback_stream())
    fmt = cfg.log_format or logging_.default_format(stream)
    log = logging_.configure(fmt, cfg.log_level, stream)
    service = Service(cfg, log, stream)
    service.message_log = logging_.message_logger(fmt, cfg.log_level, stream)
    wakeup = daemon.SignalWakeup()
    tick = min(FLOOD_INTERVAL, cfg.stats_interval) if cfg.stats_interval > 0 else FLOOD_INTERVAL
    broker = Broker(
        listener.sock.fileno(), cfg, allowed_uids=allowed,
        access_mode=cfg.mode if listener.abstract else -1, wakeup_fd=wakeup.fileno(),
        on_event=service.on_event, on_message=service.on_message,
        on_tick=service.on_tick, tick_interval=tick)
    service.broker = broker
    service.next_stats = time.monotonic() + cfg.stats_interval

    def stop(signo, frame):
        broker.stop(signal.Signals(signo).name)

    def reopen(signo, frame):
        stream.reopen()
        log.info("log_reopened", path=cfg.log_file)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop if cfg.foreground else reopen)
    if early_stop:
        broker.stop(early_stop[0])      # run() then returns at once

    started = time.monotonic()
    log.info("broker_start", version=__version__, address=listener.printed_address or cfg.address,
             pid=os.getpid(), config=cfg.summary())
    daemon.detach_stdio()
    if ready is not None:
        ready()
    daemon.sd_notify("READY=1")
    reason = "error"
    try:
        reason = broker.run()
    finally:
        daemon.sd_notify("STOPPING=1")
        broker.close()
        log.info("broker_stop", reason=reason, uptime_s=round(time.monotonic() - started, 3),
                 totals=broker.totals())
        stream.flush()
        wakeup.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
