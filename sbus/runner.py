"""One way to run a process of sbus: sbusd's broker loop, ``sbus store``,
``sbus queue``, ``sbus bridge`` and the leaf link (as systemd's sd_event or
Twisted's service do it).

A signal handler only notes the signal: Python's C-level handler writes to a
wakeup socket (which ends whatever the loop waits in: it polls that socket
too) and the Python-level one appends the signal's number to a list. The
loop takes the noted signals between two of its turns and acts on them there:
SIGTERM and SIGINT stop the service, SIGHUP reopens its log file, SIGUSR1
reloads the access policy (sbusd, and the services that take ``--policy``;
sbusd adds SIGUSR2, the live upgrade). Nothing is
logged, raised, opened or closed inside a handler, which may have interrupted
a write to the very log a reopen would close, or a write to the disk a raise
would leave half done.

Importing this module imports nothing heavy: the ``sbus`` command's option
table uses :func:`add_log_options`.
"""
from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import sys
from collections import deque
from typing import Callable, Deque, Iterable, List, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SERVICE_SIGNALS = (*STOP_SIGNALS, signal.SIGHUP)
STOPPED = "signal"      # the stop reason a service logs after SIGTERM or SIGINT


def add_log_options(parser: argparse.ArgumentParser) -> None:
    """The ``--log-*`` options of a service of the ``sbus`` command (sbusd has
    its own, in its option table, sbus/sbusd/config.py)."""
    log = parser.add_argument_group("logging")
    log.add_argument("--log-format", choices=("json", "console"), default=None,
                     help="default: console on a terminal, else json")
    # The names of sbus.log.LEVELS, which imports structlog.
    log.add_argument("--log-level", choices=("debug", "info", "warning", "error", "off"),
                     default="info")
    log.add_argument("--log-file", metavar="PATH", help="default: stderr (reopened on SIGHUP)")


def configure_log(args: argparse.Namespace):
    """The stream and the logger the ``--log-*`` options in ``args`` ask for."""
    from . import log
    stream = log.ReopenableStream(args.log_file, log.fallback_stream())
    logger = log.configure(args.log_format or log.default_format(stream), args.log_level,
                           stream)
    return stream, logger


def sd_notify(state: str) -> None:
    """Tell systemd our state (READY=1, STOPPING=1, MAINPID=) if it asked to
    be told (``$NOTIFY_SOCKET``, ``Type=notify``); no libsystemd needed."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return
    if target.startswith("@"):
        target = "\0" + target[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(target)
            s.sendall(state.encode())
    except OSError:
        pass  # systemd gone: nothing useful to do


def ready(logger, service: str, **fields) -> None:
    """A service is ready, once, when what it serves is in place (its
    subscriptions acknowledged by the broker): one ``service_ready`` record,
    and READY=1 for systemd. ``sbus ready`` is the waiting side."""
    from . import logschema as schema
    logger.info(schema.SERVICE_READY, service=service, pid=os.getpid(), **fields)
    sd_notify("READY=1")
    settle_heap()


def settle_heap() -> None:
    """Take what a service has made so far (its modules, its setup) out of
    the cyclic collector's reach, for good. A service allocates as it works
    (coroutines, futures, its plans' tuples), so the collector runs often,
    and each full collection walked every object of the process: in the
    bridge and the queue, more CPU than their messages. Garbage made before
    this is never reclaimed: a service calls it once it is set up."""
    gc.collect()
    gc.freeze()


class Signals:
    """The signals a loop acts on, noted by handlers that do nothing else.

    ``fileno()`` becomes readable when a signal arrives (the process's
    ``signal.set_wakeup_fd``): a loop polls it beside its own descriptors,
    and calls ``take()`` between turns. ``catch()`` installs the handlers;
    ``on_note``, if given, is called inside the handler and must only set a
    flag (sbusd's ``Broker.stop``, which ends the broker's turn).
    """

    def __init__(self) -> None:
        self._noted: Deque[int] = deque()
        self._on_note: Optional[Callable[[], None]] = None
        self._previous: dict = {}
        self._r, self._w = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._r.setblocking(False)
        self._w.setblocking(False)
        signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)

    def catch(self, signums: Iterable[int] = SERVICE_SIGNALS,
              on_note: Optional[Callable[[], None]] = None) -> "Signals":
        self._on_note = on_note
        for signum in signums:
            self._previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, frame) -> None:
        self._noted.append(signum)
        if self._on_note is not None:
            self._on_note()

    def fileno(self) -> int:
        return self._r.fileno()

    def pending(self) -> bool:
        """Signals were noted since the last ``take()``."""
        return bool(self._noted)

    def take(self) -> List[int]:
        """The signals noted since the last call, oldest first."""
        try:
            while self._r.recv(4096):
                pass
        except OSError:
            pass    # drained (or closed)
        return [self._noted.popleft() for _ in range(len(self._noted))]

    def close(self) -> None:
        """Put back the handlers ``catch()`` replaced and the wakeup fd."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        signal.set_wakeup_fd(-1)
        self._r.close()
        self._w.close()


class Runner:
    """A service's signals and the log they reopen: SIGTERM and SIGINT stop
    it, SIGHUP reopens ``stream`` (a ``sbus.log.ReopenableStream``; a
    process with no log file of its own, the leaf link, has none). With
    ``reload`` (the services that take ``--policy``), SIGUSR1 calls it,
    between turns as the others."""

    def __init__(self, stream=None, reload: Optional[Callable[[], object]] = None) -> None:
        self.stream = stream
        self.reload = reload
        signums = SERVICE_SIGNALS + ((signal.SIGUSR1,) if reload is not None else ())
        self.signals = Signals().catch(signums)
        self.stop_signal: Optional[int] = None

    def fileno(self) -> int:
        """Readable once a signal is noted: poll it beside the service's own."""
        return self.signals.fileno()

    def between_turns(self) -> bool:
        """Act on the signals noted since the last turn; True once one of them
        asked the service to stop."""
        for signum in self.signals.take():
            if signum == signal.SIGHUP:
                if self.stream is not None:
                    try:
                        self.stream.reopen()
                    except OSError:
                        pass    # it goes on where it was: a log file is no reason to stop
            elif signum == signal.SIGUSR1:
                if self.reload is not None:
                    self.reload()
            elif self.stop_signal is None:
                self.stop_signal = signum
        return self.stop_signal is not None

    def close(self) -> None:
        self.signals.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_async(name: str, address: str, args: argparse.Namespace, make) -> int:
    """Run an asyncio service of the ``sbus`` command (the bridge, the queue)
    with the log its ``--log-*`` options ask for, until SIGTERM or SIGINT;
    SIGHUP reopens the log file. ``make(logger)`` builds the service, which
    has ``await run(stop_event) -> reason`` and ``stopped(reason)``, and
    ``reload_policy()`` for SIGUSR1 if its command takes ``--policy``.
    Returns 0, or 1 with the broker's error on stderr."""
    import asyncio

    stream, logger = configure_log(args)
    made: list = []

    def reload() -> None:
        if made:
            made[0].reload_policy()

    async def run(runner: Runner) -> int:
        stop = asyncio.Event()

        def between_turns() -> None:
            if runner.between_turns():
                stop.set()

        asyncio.get_running_loop().add_reader(runner.fileno(), between_turns)
        service = make(logger)
        made.append(service)
        try:
            reason = await service.run(stop)
        except OSError as exc:
            service.stopped(f"error: {exc}")
            sys.stderr.write(f"sbus {name}: {address}: {exc.strerror or exc}\n")
            return 1
        service.stopped(reason)
        return 0

    # Before asyncio.run: its own SIGINT handler then stays out of the way.
    with Runner(stream, reload if hasattr(args, "policy") else None) as runner:
        return asyncio.run(run(runner))
