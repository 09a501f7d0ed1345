"""sbusd's configuration: every option's flags, default, help and validation, once.

``OPTIONS`` is the table; ``Config``, the getopt specification, ``help_text()``
and the option table in README.md (``markdown_table()``) are all built from it,
and the broker reads its settings from a ``Config`` under the same names.
Plain Python with light imports: sbusd parses its command line before it
loads anything heavy.
"""
from __future__ import annotations

import dataclasses
import getopt
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from .. import argtypes, logschema
from .._version import __version__
from ..address import DEFAULT_ADDRESS
from ..client.protocol import MAX_MESSAGE

# Defaults that another module also needs live here as names, once.
QUEUE_MAX_BYTES = 8 << 20
QUEUE_MAX_MSGS = 65536
TOTAL_MAX_BYTES = 256 << 20
MAX_SUBSCRIPTIONS = 65536
MAX_PATTERN = 0                 # none: as long as a packet allows
# Budgets (docs/security.md): subscription bytes count each pattern's storage
# with the index's own share (budget.pattern_cost).
SUB_MAX_BYTES = 32 << 20        # per connection
USER_SUB_MAX_BYTES = 64 << 20   # per uid, all its connections together
TOTAL_SUB_MAX_BYTES = 256 << 20
USER_MAX_CONNECTIONS = 1024
USER_QUEUE_MAX_BYTES = 64 << 20
PIDFILE = "/run/sbus.pid"
NO_PIDFILE = "/dev/null"        # -p /dev/null: write no pidfile
SOCKET_MODE = 0o700             # -g and -o add group and other bits
UPSTREAM_BUFFER = 65536         # upward messages held while the upstream is away

USAGE = "usage: sbusd [-a address] [-f] [-p pidfile] [-u user] ... [-cgor] [options]"


class UsageError(Exception):
    """A command line sbusd cannot run with; the text names the option."""


class Upgrade(Exception):
    """--upgrade: not a setting but a command, for the sbusd ``pidfile`` names."""

    def __init__(self, pidfile: Optional[str]):
        super().__init__(pidfile)
        self.pidfile = pidfile


class Reload(Upgrade):
    """--reload: have the sbusd ``pidfile`` names load its --policy file again."""


class Exit(Exception):
    """--help or --version: print ``text`` on stdout and exit 0."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


# --- validation: each returns the value for (flag, text) or raises UsageError ---

def number(kind: type = int, low: float = 0,
           high: Optional[float] = None) -> Callable[[str, str], Any]:
    def parse(flag: str, text: str):
        try:
            return argtypes.number(text, kind, low, high)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    return parse


def verbatim(flag: str, value: str) -> str:
    return value


_UNSET = object()       # no default here: the field's first option gives it


@dataclass(frozen=True)
class Option:
    """One command-line option.

    ``field`` is the ``Config`` attribute it sets (None for --help,
    --version, --upgrade and --reload). ``arg`` names its value in the help; an option without one is
    a switch that stores ``const`` (``|`` it in with ``store="or"``). The first
    option for a field gives its ``default``. ``help`` may use ``{default}``
    and ``{choices}``; a newline starts a continuation line.
    """
    field: Optional[str]
    long: str
    help: str
    short: Optional[str] = None
    arg: Optional[str] = None
    default: Any = _UNSET
    choices: Sequence[str] = ()
    parse: Callable[[str, str], Any] = verbatim
    store: str = "set"              # "set", "append" or "or"
    const: Any = True

    @property
    def flags(self) -> str:
        """The flags as --help and README show them: ``-a, --address ADDRESS``."""
        short = f"-{self.short}, " if self.short else "    "
        return f"{short}--{self.long}" + (f" {self.arg}" if self.arg else "")

    def describe(self) -> str:
        *most, last = self.choices or ("",)
        choices = f"{', '.join(most)} or {last}" if most else last
        return self.help.format(default=show(self.default), choices=choices)

    def value(self, flag: str, text: str) -> Any:
        if self.choices and text not in self.choices:
            raise UsageError(f"{flag}: choose one of {', '.join(self.choices)}")
        return self.parse(flag, text)


def show(value: Any) -> str:
    """A default as a person reads it: 8 MiB, 10 (not 10.0)."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 \
            and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return str(value)


OPTIONS = (
    Option("address", "address", short="a", arg="ADDRESS", default=DEFAULT_ADDRESS,
           help="socket path (default {default}),\n/dev/unix/abstract (random; printed on"
                " stdout),\n/dev/unix/abstract/HEX, or /dev/fd/N"),
    Option("foreground", "foreground", short="f", default=False,
           help="do not daemonise; SIGINT, SIGTERM, SIGHUP stop it"),
    Option("pidfile", "pidfile", short="p", arg="PATH", default=None,
           help=f"pidfile, also with -f (a daemon's default: {PIDFILE};\n{NO_PIDFILE}: none)"),
    Option("users", "user", short="u", arg="USER", default=(), store="append",
           help="allow only USER (name or uid) and our own uid; repeatable"),
    Option("auto_close", "auto-close", short="c", default=False,
           help="exit once the last client has left"),
    Option("mode", "group", short="g", default=SOCKET_MODE, store="or", const=0o070,
           help="socket mode allows the group (0770)"),
    Option("mode", "other", short="o", store="or", const=0o007,
           help="socket mode allows others (0707; with -g 0777)"),
    Option("reuse", "reuse", short="r", default=False,
           help="replace a stale socket at the path (only a socket)"),
    Option("backend", "backend", arg="NAME", default="epoll", choices=("epoll", "select", "io_uring"),
           help="event loop: {choices} (default {default}); io_uring falls back to epoll, "
                "with a warning, where the kernel lacks or refuses it"),
    Option("max_message", "max-message", arg="BYTES", default=MAX_MESSAGE,
           parse=number(low=64, high=64 << 20),
           help="largest packet accepted (default {default})"),
    Option("soft", "soft", arg="MODE", default="queue",
           choices=("queue", "discard", "block", "error"),
           help="default soft flood mode: {choices} ({default})"),
    Option("hard", "hard", arg="MODE", default="discard", choices=("discard", "block", "error"),
           help="default hard flood mode: {choices} ({default})"),
    Option("order", "order", arg="ORDER", default="queue", choices=("queue", "stack", "random"),
           help="default queue order: {choices} ({default})"),
    Option("queue_max_bytes", "queue-max-bytes", arg="N", default=QUEUE_MAX_BYTES,
           parse=number(low=1), help="per-client queue limit in bytes (default {default})"),
    Option("queue_max_msgs", "queue-max-msgs", arg="N", default=QUEUE_MAX_MSGS,
           parse=number(low=1), help="per-client queue limit in messages (default {default})"),
    Option("total_max_bytes", "total-max-bytes", arg="N", default=TOTAL_MAX_BYTES,
           parse=number(low=1), help="broker-wide cap on queued bytes (default {default})"),
    Option("block_timeout", "block-timeout", arg="S", default=10.0,
           parse=number(float, low=0.001),
           help="a client blocking the bus longer is an error (default {default})"),
    Option("max_subscriptions", "max-subscriptions", arg="N", default=MAX_SUBSCRIPTIONS,
           parse=number(low=1, high=2**32 - 1), help="per client (default {default})"),
    Option("max_pattern", "max-pattern", arg="BYTES", default=MAX_PATTERN,
           parse=number(low=0, high=64 << 20),
           help="longest pattern (default {default}: as long as a packet allows)"),
    Option("sub_max_bytes", "sub-max-bytes", arg="N", default=SUB_MAX_BYTES,
           parse=number(low=1), help="subscription bytes per client (default {default})"),
    Option("user_sub_max_bytes", "user-sub-max-bytes", arg="N", default=USER_SUB_MAX_BYTES,
           parse=number(low=1), help="subscription bytes per uid (default {default})"),
    Option("total_sub_max_bytes", "total-sub-max-bytes", arg="N", default=TOTAL_SUB_MAX_BYTES,
           parse=number(low=1), help="broker-wide subscription bytes (default {default})"),
    Option("user_max_connections", "user-max-connections", arg="N",
           default=USER_MAX_CONNECTIONS, parse=number(low=1, high=2**32 - 1),
           help="connections per uid (default {default})"),
    Option("user_queue_max_bytes", "user-queue-max-bytes", arg="N",
           default=USER_QUEUE_MAX_BYTES, parse=number(low=1),
           help="queued bytes per uid (default {default})"),
    Option("policy", "policy", arg="FILE", default=None,
           help="enforce the access policy in FILE (docs/policy.md): who may\n"
                "publish and subscribe to what; reloaded on SIGUSR1"),
    Option("upstream", "upstream", arg="ADDRESS", default=None,
           help="be a leaf of the sbusd at ADDRESS: local publishes go up,\n"
                "what local clients subscribe to comes down (docs/hierarchy.md)"),
    Option("upstream_export", "upstream-export", arg="PATTERN", default=(), store="append",
           help="send up only what PATTERN matches; repeatable (default: all)"),
    Option("upstream_buffer", "upstream-buffer", arg="N", default=UPSTREAM_BUFFER,
           parse=number(low=1),
           help="upward messages held while the upstream is away (default {default})"),
    Option("upstream_flood", "upstream-flood", arg="MODE", default="block", choices=("block", "discard"),
           help="when the link falls behind the upstream, the upstream holds its\n"
                "publishers for it (block: nothing lost) or drops for it (discard)\n"
                "(default {default})"),
    Option("log_format", "log-format", arg="FORMAT", default=None, choices=("json", "console"),
           help="{choices} (default: json unless stderr is a terminal)"),
    Option("log_file", "log-file", arg="PATH", default=None,
           help="log here instead of stderr (reopened on SIGHUP as a daemon)"),
    Option("json_log", "json-log", arg="PATH", default=None,
           help="also write every record to PATH as JSON lines, whatever\n--log-format "
                "says (for the analytics job; reopened\non SIGHUP as a daemon)"),
    Option("log_level", "log-level", arg="LEVEL", default="info",
           choices=(*logschema.LEVELS, "off"), help="{choices} (default {default})"),
    Option("stats_interval", "stats-interval", arg="S", default=10.0, parse=number(float, low=0),
           help="seconds between stats records (default {default}; 0: none)"),
    Option("log_messages", "log-messages", arg="RATE", default=0.0,
           parse=number(float, low=0, high=1),
           help="fraction of messages logged as samples, 0..1 (default {default})"),
    Option(None, "upgrade",
           help="upgrade the running sbusd that -p names in place (docs/upgrade.md)\n"
                "and wait: exit 0 once a new pid serves, 1 with the reason"),
    Option(None, "reload",
           help="have the running sbusd that -p names load its --policy file\n"
                "again and wait: exit 0 once it enforces it, 1 with the reason"),
    Option(None, "help", short="h", help="show this help"),
    Option(None, "version", short="V", help="show the version"),
)


def _build_config(options: Sequence[Option]) -> type:
    fields: Dict[str, Any] = {}
    for o in options:
        if o.field is None:
            continue
        if o.field in fields:
            if o.default is not _UNSET:
                raise ValueError(f"{o.field}: default given twice")
            continue
        if o.default is _UNSET:
            raise ValueError(f"{o.field}: the first option for it gives no default")
        if o.store == "append":     # mutable: each Config gets its own list
            fields[o.field] = dataclasses.field(default_factory=lambda d=o.default: list(d))
        else:
            fields[o.field] = dataclasses.field(default=o.default)
    return dataclasses.make_dataclass(
        "Config", [(name, Any, f) for name, f in fields.items()],
        namespace={"summary": _summary, "__module__": __name__,
                   "__doc__": "sbusd's settings; one field per option in OPTIONS."})


def _summary(self) -> dict:
    """The configuration as logged in broker_start (scalars only)."""
    d = {k: v for k, v in dataclasses.asdict(self).items()
         if k not in ("users", "upstream_export")}
    d["upstream_export"] = ",".join(self.upstream_export)
    d["mode"] = oct(self.mode)
    d["users"] = ",".join(self.users)
    return d


Config = _build_config(OPTIONS)

_BY_FLAG = {f"--{o.long}": o for o in OPTIONS}
_BY_FLAG.update({f"-{o.short}": o for o in OPTIONS if o.short})
_GETOPT_SHORT = "".join(o.short + (":" if o.arg else "") for o in OPTIONS if o.short)
_GETOPT_LONG = [o.long + ("=" if o.arg else "") for o in OPTIONS]


def parse_args(argv: List[str]) -> "Config":
    """The Config for sbusd's arguments, parsed getopt-style as the C sbusd does.

    Raises UsageError for a bad line, Exit for --help and --version, Upgrade
    for --upgrade, Reload for --reload.
    """
    try:
        opts, rest = getopt.gnu_getopt(argv, _GETOPT_SHORT, _GETOPT_LONG)
    except getopt.GetoptError as e:
        raise UsageError(str(e)) from None
    if rest:
        raise UsageError(f"unexpected argument {rest[0]!r}")
    cfg = Config()
    upgrade = reload = False
    for flag, text in opts:
        o = _BY_FLAG[flag]
        if o.long == "help":
            raise Exit(help_text())
        if o.long == "version":
            raise Exit(f"sbusd {__version__}\n")
        if o.long == "upgrade":
            upgrade = True
            continue
        if o.long == "reload":
            reload = True
            continue
        value = o.value(flag, text) if o.arg else o.const
        if o.store == "append":
            getattr(cfg, o.field).append(value)
        elif o.store == "or":
            setattr(cfg, o.field, getattr(cfg, o.field) | value)
        else:
            setattr(cfg, o.field, value)
    # -p is honoured in the foreground too; only a daemon has a default one.
    if cfg.pidfile is None and not cfg.foreground:
        cfg.pidfile = PIDFILE
    elif cfg.pidfile == NO_PIDFILE:
        cfg.pidfile = None
    if reload:
        raise Reload(cfg.pidfile)
    if upgrade:
        raise Upgrade(cfg.pidfile)
    return cfg


_HELP_COLUMN = 26


def help_text() -> str:
    lines = [USAGE, "",
             "The sbus message broker. It listens on a Unix-domain SOCK_SEQPACKET socket",
             "and routes each published message to every client with a matching pattern.", ""]
    for o in OPTIONS:
        first, *more = o.describe().split("\n")
        left = f"  {o.flags}"
        gap = " " * (_HELP_COLUMN - len(left) if len(left) < _HELP_COLUMN else 2)
        lines.append(f"{left}{gap}{first}")
        lines.extend(" " * _HELP_COLUMN + line for line in more)
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The option table README.md carries between its ``options`` markers."""
    rows = ["| option | meaning |", "|---|---|"]
    for o in OPTIONS:
        flags = ", ".join(f"`{f}`" for f in o.flags.strip().split(", "))
        rows.append(f"| {flags} | {' '.join(o.describe().split(chr(10)))} |")
    return "\n".join(rows) + "\n"
