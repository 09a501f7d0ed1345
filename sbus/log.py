"""Structured logging for sbusd: structlog configured once at start-up.

Records follow the versioned schema in ``sbus.logschema`` (docs/logging.md).
``json`` writes one object per line; ``console`` (``sbus.console``) one short
line per event, for people. A second sink may take a JSON copy of every
record whatever the main format (``--json-log``: a console for people and a
file for the analytics job). Output files can be reopened (SIGHUP in a
daemon, for logrotate).
"""
from __future__ import annotations

import os
import sys
from typing import IO, Optional

import structlog

from . import logschema as schema

# "off" filters at CRITICAL, a level sbusd never logs at.
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "off": 50}

# Events that say a client did something wrong, or the broker is in trouble.
_WARNING_REASONS = frozenset(schema.DISCONNECT_REASONS) - {
    schema.DISCONNECT_EOF, schema.DISCONNECT_SHUTDOWN}
_EVENT_LEVELS = {
    schema.CMSG_IGNORED: "debug",
    schema.FLOOD: "warning",
    schema.FD_EXHAUSTED: "error",
    schema.ACCEPT_PAUSED: "error",
    schema.ACCEPT_ERROR: "error",
    schema.PUBLISH_DENIED: "warning",
}


class ReopenableStream:
    """A text sink that is a path (reopenable) or an inherited stream."""

    def __init__(self, path: Optional[str], fallback: IO[str]):
        self.path = path
        self._fallback = fallback
        self._file: IO[str] = fallback
        if path:
            self.reopen()

    def reopen(self) -> None:
        """Open the path again (after logrotate renamed it). Not from a signal
        handler, which may have interrupted a write to the file this closes:
        sbus.runner's loops call it between turns."""
        if not self.path:
            return
        new = open_log(self.path)
        old, self._file = self._file, new
        if old is not self._fallback:
            old.close()

    def write(self, text: str) -> None:
        try:
            self._file.write(text)
        except (OSError, ValueError):
            pass  # a full disk or a closed stderr must not stop the bus

    def flush(self) -> None:
        try:
            self._file.flush()
        except (OSError, ValueError):
            pass

    def isatty(self) -> bool:
        try:
            return self._file.isatty()
        except (OSError, ValueError):
            return False


def open_log(path: str) -> IO[str]:
    """Open a log for appending; a new one is private (0600): it holds
    patterns and, with --log-messages, private routing keys."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    # Block-buffered: every logger but the sampled-message one flushes after
    # each record; sampled ones are flushed together by the tick.
    return os.fdopen(fd, "a", encoding="utf-8")


def _add_common(broker_pid: int):
    def processor(logger, method_name, event_dict):
        event_dict.setdefault("schema", schema.SCHEMA_VERSION)
        event_dict.setdefault("broker_pid", broker_pid)
        return event_dict
    return processor


def _order_keys(logger, method_name, event_dict):
    """timestamp, level, event first: easier to read, same to parse."""
    head = {k: event_dict.pop(k) for k in ("timestamp", "level", "event") if k in event_dict}
    head.update(event_dict)
    return head


def default_format(stream: ReopenableStream) -> str:
    return "console" if stream.isatty() else "json"


def _json_line():
    import json
    encode = json.JSONEncoder(separators=(",", ":"), default=str).encode
    return lambda event_dict: encode(_order_keys(None, None, event_dict))


class JsonCopy:
    """A processor that writes each record as a JSON line to ``sink`` and
    passes it on unchanged to the main renderer."""

    def __init__(self, sink: ReopenableStream):
        self.sink = sink
        self._line = _json_line()

    def __call__(self, logger, method_name, event_dict):
        self.sink.write(self._line(dict(event_dict)) + "\n")
        self.sink.flush()
        return event_dict


def configure(fmt: str, level: str, stream: ReopenableStream,
              json_copy: Optional[ReopenableStream] = None):
    """Configure structlog for the whole process; returns the bound logger.

    With ``json_copy``, every record is also written there as a JSON line.
    """
    processors = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_common(os.getpid()),
    ]
    if json_copy is not None:
        processors.append(JsonCopy(json_copy))
    if fmt == "json":
        line = _json_line()
        processors.append(lambda logger, method_name, event_dict: line(event_dict))
    else:
        from .console import CompactRenderer
        processors.append(CompactRenderer(colours=stream.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger()


class _Deferred:
    """The same stream, flushed by the tick instead of after every record:
    sampled message records are many, and each flush is a write(2)."""

    def __init__(self, stream: ReopenableStream):
        self.write = stream.write

    def flush(self) -> None:
        pass


def message_logger(fmt: str, level: str, stream: ReopenableStream, json_copy: bool = False):
    """A lean structlog logger for sampled ``message`` records.

    With a JSON copy, or in the console format, it is the general logger. In
    JSON alone its one processor renders the record straight to a line with the
    same fields and order as every other record; it costs a fraction of the
    general pipeline, which keeps sampling cheap for the broker.
    """
    if fmt != "json" or json_copy:
        return structlog.get_logger()
    import json
    import time

    quote = json.JSONEncoder().encode
    tail = ',"schema":%d,"broker_pid":%d}' % (schema.SCHEMA_VERSION, os.getpid())
    second = [-1, ""]       # the formatted UTC second, reused within it

    def render(logger, method_name, ev):
        now = time.time_ns() // 1000
        sec, micro = divmod(now, 1_000_000)
        if sec != second[0]:
            second[0] = sec
            second[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        return ('{"timestamp":"%s.%06dZ","level":"info","event":"message","client":%d,"pid":%d,'
                '"uid":%d,"key":%s,"size":%d,"fanout":%d,"sample_rate":%r%s'
                % (second[1], micro, ev["client"], ev["pid"], ev["uid"], quote(ev["key"]),
                   ev["size"], ev["fanout"], ev["sample_rate"], tail))

    return structlog.wrap_logger(
        structlog.WriteLogger(_Deferred(stream)), processors=[render],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level])).bind()


def level_of(event: str, fields: dict) -> str:
    """The level a broker event is logged at."""
    if event == "client_disconnect":
        return "warning" if fields.get("reason") in _WARNING_REASONS else "info"
    if event in ("subscribe", "unsubscribe") and not fields.get("accepted", True):
        return "warning" if event == "subscribe" else "info"
    return _EVENT_LEVELS.get(event, "info")


def emit(logger, event: str, fields: dict) -> None:
    """Log one broker event at its level."""
    getattr(logger, level_of(event, fields))(event, **fields)


def fallback_stream() -> IO[str]:
    return sys.stderr

