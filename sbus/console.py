"""The ``--log-format console`` renderer: one short line per event, for people.

    19:04:05.123 INFO  client_connect     client=3 pid=4711 uid=1000
    19:04:05.130 WARN  client_disconnect  client=3 pid=4711 uid=1000 reason=oversize in=2 out=0

Each event shows the fields that matter for it (``_FIELDS``); nested records
are summed up in a few words; a ``stats`` record is written only when
something changed since the one before; ``broker_start`` shows only the
settings that differ from sbusd's defaults. JSON logs are not affected.
"""
from __future__ import annotations

import os
import re
import time
from typing import Any, Dict, List, Optional

import structlog

from . import logschema as schema

LINE_MAX = 160          # no line is longer, whatever a client sends
VALUE_MAX = 48          # a pattern or key longer than this is cut

_LEVELS = {"debug": "DEBUG", "info": "INFO ", "warning": "WARN ", "error": "ERROR"}
_COLOURS = {"debug": "\x1b[2m", "warning": "\x1b[33m", "error": "\x1b[31;1m"}
_EVENT_WIDTH = 18

_IDENT = ("client", "pid", "uid")
# The fields shown per event, in order; an event not listed shows all of its own.
_FIELDS = {
    schema.CLIENT_CONNECT: _IDENT,
    schema.CLIENT_DISCONNECT: _IDENT + ("reason", "detail"),
    schema.SUBSCRIBE: _IDENT + ("pattern", "reason"),
    schema.UNSUBSCRIBE: _IDENT + ("pattern", "reason"),
    schema.FLOOD: _IDENT + ("drops_soft", "drops_hard", "blocks", "queued_msgs", "soft", "hard"),
    schema.MESSAGE: _IDENT + ("key", "size", "fanout"),
    schema.CMSG_IGNORED: _IDENT + ("key",),
    schema.BROKER_STOP: ("reason", "uptime_s"),
    schema.BROKER_START: ("version", "address", "pid"),
}


_LINE_START = re.compile(r"(\x1b\[[0-9;]*m)?\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO |WARN |ERROR) \w")


def looks_like_console(line: str) -> bool:
    """Whether ``line`` begins as this renderer's lines do (the analytics job
    names a console log it is given instead of JSON)."""
    return _LINE_START.match(line) is not None


def _show(value: Any, tail: bool = False) -> str:
    """A value in at most VALUE_MAX characters; ``tail`` keeps the end (paths)."""
    if isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, str):
        # repr only when needed: empty, spaces, control characters, '='.
        plain = value and value.isprintable() and not any(c in value for c in " ='\"")
        text = value if plain else repr(value)
    else:
        text = str(value)
    if len(text) <= VALUE_MAX:
        return text
    return "…" + text[1 - VALUE_MAX:] if tail else text[:VALUE_MAX - 1] + "…"


_PATHS = frozenset({"address", "log_file", "json_log", "pidfile", "path"})


def _path(value: Any) -> Any:
    """A path under the working directory as a relative one (`make run`'s
    files are all in .run/); a daemon's working directory is /, kept whole."""
    if not isinstance(value, str) or not value.startswith("/"):
        return value
    here = os.getcwd()
    if here != "/" and value.startswith(here + "/"):
        return value[len(here) + 1:]
    return value


def _pairs(items) -> str:
    return " ".join(f"{k}={_show(_path(v), True) if k in _PATHS else _show(v)}"
                    for k, v in items if v is not None)


def _traffic(counts: Dict[str, int], prefix: str = "") -> List[tuple]:
    """in/out counts, and drops only when there were some."""
    out = [(prefix + "in", counts.get("msgs_in", 0)), (prefix + "out", counts.get("msgs_out", 0))]
    drops = sum(counts.get(k, 0) for k in schema.DROP_KINDS)
    if drops:
        out.append((prefix + "drops", drops))
    return out


class CompactRenderer:
    """A structlog renderer; keeps the last stats totals to skip idle ones."""

    def __init__(self, colours: bool = False, defaults: Optional[dict] = None):
        self.colours = colours
        if defaults is None:
            from .sbusd.config import Config  # broker_start lists only what differs from these
            defaults = Config().summary()
        self.defaults = defaults
        self.last_totals: Optional[dict] = None

    def __call__(self, logger, method_name: str, ev: Dict[str, Any]) -> str:
        event = ev.get("event", "")
        body = self.body(event, ev)     # raises DropEvent for an idle stats record
        level = ev.get("level", method_name)
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        lvl = _LEVELS.get(level, level.upper()[:5].ljust(5))
        line = f"{stamp} {lvl} {event:<{_EVENT_WIDTH}} {body}".rstrip()
        if len(line) > LINE_MAX:
            line = line[:LINE_MAX - 1] + "…"
        if self.colours and level in _COLOURS:
            line = f"{_COLOURS[level]}{line}\x1b[0m"
        return line

    def body(self, event: str, ev: Dict[str, Any]) -> str:
        if event == schema.STATS:
            return self.stats(ev)
        names = _FIELDS.get(event)
        if names is None:
            skip = {"timestamp", "level", "event", "schema", "broker_pid"}
            items = [(k, v) for k, v in ev.items() if k not in skip]
        else:
            items = [(k, ev.get(k)) for k in names]
        if event in (schema.SUBSCRIBE, schema.UNSUBSCRIBE) and not ev.get("accepted", True):
            items.insert(len(_IDENT) + 1, ("refused", "yes"))
        if event == schema.CLIENT_DISCONNECT:
            items.append(("time", f"{ev.get('duration_s', 0):.3f}s"))
            items += _traffic(ev.get("counters") or {})
        elif event == schema.BROKER_STOP:
            items += _traffic(ev.get("totals") or {})
        elif event == schema.BROKER_START:
            config = ev.get("config") or {}
            shown = {k for k, _ in items}
            items += [(k, v) for k, v in config.items()
                      if k not in shown and (k not in self.defaults or self.defaults[k] != v)]
        return _pairs(items)

    def stats(self, ev: Dict[str, Any]) -> str:
        totals = ev.get("totals") or {}
        delta = ev.get("delta") or {}
        changed = ev.get("clients") or []
        idle = not any(delta.values()) and not changed and totals == self.last_totals
        self.last_totals = totals
        if idle:
            raise structlog.DropEvent
        seconds = ev.get("interval_s") or 0
        items = [("clients", totals.get("clients")), ("subs", totals.get("subscriptions"))]
        items += _traffic(delta, "+")
        if seconds:
            items.append(("in/s", round(delta.get("msgs_in", 0) / seconds, 1)))
        items += [("queued", totals.get("queued_msgs")), ("changed", len(changed))]
        return _pairs(items)
