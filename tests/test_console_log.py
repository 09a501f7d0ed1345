"""`make run`'s console log: short lines, only the settings that differ, no idle stats."""
from __future__ import annotations

import re
import time

from support import ROOT, Sbusd, wait_until

STATS_INTERVAL = 0.2
IDLE_INTERVALS = 6


def make_variable(name: str) -> str:
    m = re.search(rf"^{name}\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"the Makefile has no {name}"
    return m[1].strip()


def make_run_flags(socket_path: str) -> list:
    """The sbusd flags of `make run` (RUN_FLAGS in the Makefile), on our socket;
    its other files keep their paths, relative to sbusd's working directory."""
    flags = make_variable("RUN_FLAGS").replace("$(DEV_SOCKET)", socket_path)
    for name in ("DEV_PIDFILE", "DEV_JSON_LOG"):
        flags = flags.replace(f"$({name})", make_variable(name))
    assert "$(" not in flags, flags
    return flags.split()


def lines_of(b: Sbusd) -> list:
    return [ln for ln in b.stderr_text().split("\n")[:-1] if ln.strip()]


def test_console_log_of_a_session_is_short_and_quiet_when_idle(tmp_path):
    # As `make run`: a socket path relative to the working directory.
    flags = make_run_flags("bus.socket")
    assert "--log-format" in flags and "console" in flags
    (tmp_path / ".run").mkdir()
    b = Sbusd(tmp_path, [*flags, "--stats-interval", str(STATS_INTERVAL)],
              address=str(tmp_path / "bus.socket"), log_level=None, cwd=tmp_path).ready()
    try:
        sub, pub = b.connect(), b.connect()
        sub.sub("news/*")
        sub.sub("x" * 3000)                         # a long pattern is cut, not printed whole
        sub.sync()
        pub.pub("news/1", b"hello")
        pub.sync()
        assert sub.next_packet(timeout=5) == b"MSG news/1\0hello"
        for refused in (b"SUB a/!/b", b"NOT A PACKET"):     # a misused '!', a protocol error
            c = b.connect()
            c.packet(refused)
            c.assert_closed()
        sub.close()
        pub.close()
        wait_until(lambda: sum("client_disconnect" in ln for ln in lines_of(b)) == 4,
                   10, "four client_disconnect lines")
        # The stats line that reports the session, then nothing while idle.
        def stats_after_last_disconnect():
            lines = lines_of(b)
            last = max(i for i, ln in enumerate(lines) if "client_disconnect" in ln)
            return any(" stats " in ln for ln in lines[last:])
        wait_until(stats_after_last_disconnect, 10, "a stats line after the disconnects")
        mark = len(lines_of(b))
        time.sleep(STATS_INTERVAL * IDLE_INTERVALS)
        idle = lines_of(b)[mark:]
    finally:
        b.stop()
    lines = lines_of(b)
    assert [ln for ln in idle if " stats " in ln] == [], idle
    too_long = [ln for ln in lines if len(ln) > 160]
    assert too_long == [], too_long

    def line(event, *words):
        found = [ln for ln in lines if f" {event} " in ln and all(w in ln for w in words)]
        assert found, f"no {event} line with {words} in:\n" + "\n".join(lines)
        return found[0]

    start = line("broker_start", "log_format=console", "foreground=True", "reuse=True")
    assert "backend=" not in start and "max_message=" not in start    # defaults are left out
    line("client_connect", "client=", "pid=", "uid=")
    line("subscribe", "pattern=news/*")
    line("subscribe", "pattern=xxxx", "…")
    line("subscribe", "refused=yes", "reason=bang_misuse")
    line("client_disconnect", "reason=protocol_error")
    line("client_disconnect", "reason=eof", "in=1")
    line("stats", "+in=1", "+out=1")
    line("broker_stop", "reason=SIGTERM")
