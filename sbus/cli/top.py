"""``sbus top``: a live view of the broker from ``CMSG stats``, like ``nats top``.

Every second (``--interval``) it asks for the stats and redraws: the totals
and their rates, what the access policy denied (once it has denied
something), each uid's use of its budgets (when the broker reports
``users``), then the busiest clients. Keys: ``s``/``>`` and ``S``/``<`` move
the sort column, a column's letter picks it, ``q`` quits. Drawn with the
standard library's curses, so it works in any terminal terminfo knows,
over ssh too.
"""
from __future__ import annotations

import curses
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import logschema as schema

Row = Dict[str, Any]


@dataclass(frozen=True)
class Column:
    title: str
    key: str            # the key that sorts by it
    width: int
    value: Callable[[Row], Any]     # what it sorts by
    text: Callable[[Row], str]      # what it shows


def _drops(c: Row) -> int:
    return sum(c.get(k, 0) for k in schema.DROP_KINDS)


def _modes(c: Row) -> str:
    text = f"{c.get('soft', '?')}/{c.get('hard', '?')}"
    if c.get("order", "queue") != "queue":
        text += f" {c['order']}"
    return text + ("" if c.get("echo", True) else " no-echo")    # echo is the default


def human(n: float) -> str:
    """1234567 -> 1.2M: counts and bytes in five characters or so."""
    for unit in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" or abs(n) >= 100 else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.0f}P"


COLUMNS = (
    Column("CLIENT", "c", 7, lambda c: -c["client"], lambda c: str(c["client"])),
    Column("PID", "p", 8, lambda c: c.get("pid", 0), lambda c: str(c.get("pid", ""))),
    Column("UID", "u", 6, lambda c: c.get("uid", 0), lambda c: str(c.get("uid", ""))),
    Column("IN/s", "i", 7, lambda c: c["in_rate"], lambda c: human(c["in_rate"])),
    Column("OUT/s", "o", 7, lambda c: c["out_rate"], lambda c: human(c["out_rate"])),
    Column("IN", "I", 7, lambda c: c.get("msgs_in", 0), lambda c: human(c.get("msgs_in", 0))),
    Column("OUT", "O", 7, lambda c: c.get("msgs_out", 0),
           lambda c: human(c.get("msgs_out", 0))),
    Column("QUEUE", "Q", 7, lambda c: c.get("queued_msgs", 0),
           lambda c: human(c.get("queued_msgs", 0))),
    Column("DROPS", "d", 7, _drops, lambda c: human(_drops(c))),
    Column("SUBS", "n", 6, lambda c: c.get("subscriptions", 0),
           lambda c: str(c.get("subscriptions", 0))),
    Column("MODES", "m", 0, _modes, _modes),
)
DEFAULT_SORT = 4        # OUT/s
HELP = "s/> S/< sort column, or its key: c p u i o I O Q d n m   q quit"


class View:
    """The state between frames: the last snapshot (for rates) and the sort."""

    def __init__(self, address: str, sort: int = DEFAULT_SORT,
                 is_own: Callable[[Row], bool] = lambda client: False):
        self.address = address
        self.sort = sort
        self.is_own = is_own        # this view's own connection: counted, not listed
        self.own_listed = False
        self.last: Optional[Tuple[float, Dict[str, Any]]] = None
        self.rates: Dict[str, float] = {}
        self.clients: List[Row] = []
        self.stats: Dict[str, Any] = {}

    def update(self, stats: Dict[str, Any], now: float) -> None:
        """Take a new snapshot; rates are per second since the one before."""
        prev_t, prev = self.last if self.last else (now, stats)
        dt = now - prev_t
        before = {c["client"]: c for c in prev.get("clients", ())}

        def rate(new: int, old: int) -> float:
            return max(0, new - old) / dt if dt > 0 else 0.0

        totals, old_totals = stats.get("totals", {}), prev.get("totals", {})
        self.rates = {k: rate(totals.get(k, 0), old_totals.get(k, 0))
                      for k in ("msgs_in", "msgs_out", "bytes_in", "bytes_out")}
        self.rates["drops"] = rate(_drops(totals), _drops(old_totals))
        self.rates["denied"] = rate(totals.get("denied", 0), old_totals.get("denied", 0))
        self.clients = []
        self.own_listed = False
        for c in stats.get("clients", ()):
            if self.is_own(c):
                self.own_listed = True
                continue
            old = before.get(c["client"], c)
            self.clients.append({**c, "in_rate": rate(c.get("msgs_in", 0), old.get("msgs_in", 0)),
                                 "out_rate": rate(c.get("msgs_out", 0), old.get("msgs_out", 0))})
        self.stats = stats
        self.last = (now, stats)

    def key(self, ch: str) -> bool:
        """Handle a key; False to quit."""
        if ch == "q":
            return False
        if ch in ("s", ">", "\t"):
            self.sort = (self.sort + 1) % len(COLUMNS)
        elif ch in ("S", "<"):
            self.sort = (self.sort - 1) % len(COLUMNS)
        else:
            for i, col in enumerate(COLUMNS):
                if col.key == ch:
                    self.sort = i
        return True

    def lines(self, width: int, height: int) -> List[Tuple[str, bool]]:
        """The frame as (text, emphasised) lines, cut to the terminal."""
        s, t, r = self.stats, self.stats.get("totals", {}), self.rates
        out: List[Tuple[str, bool]] = [
            (f"sbus top  {self.address}  up {_duration(s.get('uptime_s', 0))}  "
             f"{s.get('backend', '')}  {time.strftime('%H:%M:%S')}", True),
            (f"clients {t.get('clients', 0)}{' (one is this view)' if self.own_listed else ''}"
             f"  subscriptions {t.get('subscriptions', 0)}  "
             f"connects {t.get('connects', 0)}", False),
            (f"in  {human(r.get('msgs_in', 0))} msg/s {human(r.get('bytes_in', 0))}B/s  "
             f"total {human(t.get('msgs_in', 0))}   "
             f"out {human(r.get('msgs_out', 0))} msg/s {human(r.get('bytes_out', 0))}B/s  "
             f"total {human(t.get('msgs_out', 0))}", False),
            (f"drops {human(r.get('drops', 0))}/s  total {human(_drops(t))}  "
             f"queued {human(t.get('queued_msgs', 0))} msgs {human(t.get('queued_bytes', 0))}B "
             f"(peak {human(t.get('queued_bytes_peak', 0))}B)", False),
        ]
        if t.get("denied") or t.get("policy_subs_refused"):
            # The access policy (sbusd --policy) said no: publishes denied,
            # subscriptions refused.
            out.append((f"policy: denied {human(r.get('denied', 0))}/s  "
                        f"total {human(t.get('denied', 0))}  subscriptions refused "
                        f"{human(t.get('policy_subs_refused', 0))}", False))
        up = s.get("upstream")
        if up:      # a leaf broker (sbusd --upstream): its link to the upstream
            out.append((f"upstream {up.get('state', '?')} {up.get('address', '')}"
                        f"{'  (' + up['reason'] + ')' if up.get('reason') else ''}  "
                        f"patterns {up.get('patterns', 0)}  held {human(up.get('held', 0))}  "
                        f"up {human(up.get('up_msgs', 0))}  down {human(up.get('down_msgs', 0))}  "
                        f"overflow {human(up.get('overflow_dropped', 0))}", False))
        users = s.get("users") or s.get("uids") or ()
        if isinstance(users, dict):
            users = [{"uid": k, **v} for k, v in users.items()]
        if users:
            out.append(("", False))
            out.append((f"{'UID':>7} {'CONNECTIONS':>13} {'SUB BYTES':>15} {'QUEUED BYTES':>15}",
                        True))
            for u in users:
                out.append((f"{u.get('uid', '?'):>7} "
                            f"{_budget(u, 'connections'):>13} {_budget(u, 'sub_bytes'):>15} "
                            f"{_budget(u, 'queued_bytes'):>15}", False))
        out.append(("", False))
        out.append((self.header(), True))
        col = COLUMNS[self.sort]
        rows = sorted(self.clients, key=lambda c: (col.value(c), -c["client"]), reverse=True)
        room = max(0, height - len(out) - 2)
        for c in rows[:room]:
            out.append((self.row(c), False))
        if len(rows) > room:
            out.append((f"... {len(rows) - room} more", False))
        if s.get("clients_omitted"):
            out.append((f"({s['clients_omitted']} clients: too many for one stats reply)", False))
        while len(out) < height - 1:
            out.append(("", False))
        out = out[:height - 1]
        out.append((HELP, False))
        return [(text[:width - 1], bold) for text, bold in out]

    def header(self) -> str:
        cells = []
        for i, col in enumerate(COLUMNS):
            title = f"{col.title}{'*' if i == self.sort else ''}"
            cells.append(title.rjust(col.width) if col.width else " " + title)
        return "".join(cells)

    def row(self, c: Row) -> str:
        return "".join(col.text(c).rjust(col.width) if col.width else " " + col.text(c)
                       for col in COLUMNS)


def _budget(u: Row, field: str) -> str:
    used, limit = u.get(field, 0), u.get("max_" + field)
    return f"{human(used)}/{'-' if limit is None else human(limit)}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def run(fetch: Callable[[], Dict[str, Any]], address: str, interval: float = 1.0,
        is_own: Callable[[Row], bool] = lambda client: False) -> int:
    """Draw until ``q``; ``fetch()`` returns a stats snapshot, in which
    ``is_own`` picks out our own connection (left out of the client list)."""
    view = View(address, is_own=is_own)
    interval = max(interval, 0.1)

    def loop(screen) -> int:
        try:
            curses.curs_set(0)
        except curses.error:
            pass        # a terminal without an invisible cursor (vt100)
        screen.timeout(100)
        due = 0.0
        while True:
            now = time.monotonic()
            if now >= due:
                view.update(fetch(), now)
                due = now + interval
                draw(screen, view)
            ch = screen.getch()
            if ch == -1:
                continue
            if ch == curses.KEY_RESIZE:
                draw(screen, view)
                continue
            if not view.key(chr(ch) if 0 <= ch < 256 else ""):
                return 0
            draw(screen, view)

    return curses.wrapper(loop)


def draw(screen, view: View) -> None:
    height, width = screen.getmaxyx()
    screen.erase()
    for y, (text, bold) in enumerate(view.lines(width, height)):
        try:
            screen.addstr(y, 0, text, curses.A_BOLD if bold else curses.A_NORMAL)
        except curses.error:
            pass        # the last cell of the screen; a terminal smaller than a line
    screen.refresh()
