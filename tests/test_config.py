"""sbusd's option table (``sbus.sbusd.config``) is the one source of its flags,
defaults, help and checks: every ``Config`` field comes from it, ``--help`` and
README's option table are generated from it, and other modules and docs that
state a default agree with it. The command line itself is exercised, as real
processes, in test_sbusd_cli.py."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sbus.client import protocol as client
from sbus.sbusd import config
from sbus.sbusd.config import OPTIONS, Config, Exit, UsageError, parse_args

ROOT = Path(__file__).resolve().parent.parent
SBUSD = str(Path(sys.executable).parent / "sbusd")


def fields_of(o: config.Option):
    return [o.field] if o.field else []


def test_every_config_field_has_one_option_that_gives_its_default():
    names = [f.name for f in dataclasses.fields(Config)]
    assert names == list(dict.fromkeys(f for o in OPTIONS for f in fields_of(o)))
    for name in names:
        with_default = [o for o in OPTIONS if o.field == name and o.default is not config._UNSET]
        assert len(with_default) == 1, name


def test_the_fields_are_the_ones_the_broker_and_the_logs_know():
    assert [f.name for f in dataclasses.fields(Config)] == [
        "address", "foreground", "pidfile", "users", "auto_close", "mode", "reuse", "backend",
        "max_message", "soft", "hard", "order", "queue_max_bytes", "queue_max_msgs",
        "total_max_bytes", "block_timeout", "max_subscriptions", "max_pattern", "sub_max_bytes",
        "user_sub_max_bytes", "total_sub_max_bytes", "user_max_connections", "user_queue_max_bytes",
        "policy",
        "upstream", "upstream_export", "upstream_buffer", "upstream_flood", "log_format",
        "log_file", "json_log", "log_level", "stats_interval", "log_messages"]


def test_flags_are_unique():
    longs = [o.long for o in OPTIONS]
    shorts = [o.short for o in OPTIONS if o.short]
    assert len(set(longs)) == len(longs) and len(set(shorts)) == len(shorts)


def test_defaults():
    cfg = Config()
    assert (cfg.max_message, cfg.queue_max_bytes, cfg.queue_max_msgs, cfg.total_max_bytes,
            cfg.max_subscriptions, cfg.max_pattern) == (409600, 8 << 20, 65536, 256 << 20,
                                                         65536, 0)
    assert (cfg.sub_max_bytes, cfg.user_sub_max_bytes, cfg.total_sub_max_bytes,
            cfg.user_max_connections, cfg.user_queue_max_bytes) == (
                32 << 20, 64 << 20, 256 << 20, 1024, 64 << 20)
    # No pidfile until the line is parsed: a daemon's default, none in the foreground.
    assert (cfg.mode, cfg.pidfile, cfg.users, cfg.log_format) == (0o700, None, [], None)
    assert Config().users is not Config().users      # no list shared between configs
    assert parse_args([]) == dataclasses.replace(cfg, pidfile="/run/sbus.pid")
    assert parse_args(["-f"]) == dataclasses.replace(cfg, foreground=True)


def test_the_client_library_takes_its_default_from_the_config():
    assert client.MAX_MESSAGE == config.MAX_MESSAGE == Config().max_message


def test_help_is_generated_from_the_table_and_sbusd_prints_it():
    text = config.help_text()
    assert text.startswith(config.USAGE + "\n")
    for o in OPTIONS:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"  {o.flags} "))
        assert o.describe().split("\n")[0] in line
    proc = subprocess.run([SBUSD, "--help"], capture_output=True, text=True, timeout=10)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, text, "")


def test_readme_option_table_is_the_generated_one():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_options_table.py"),
                           "--check"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    readme = (ROOT / "README.md").read_text()
    assert config.markdown_table() in readme


def test_security_limits_table_states_the_configured_defaults():
    """docs/security.md's Limits table quotes defaults; they must be these."""
    text = (ROOT / "docs" / "security.md").read_text()
    by_long = {f"--{o.long}": o for o in OPTIONS}
    checked = []
    for row in re.findall(r"^\|(.+)\|$", text.split("## Limits", 1)[1], re.M):
        cells = [c.strip() for c in row.split("|")]
        for flag in re.findall(r"`(--[a-z-]+)`", cells[2] if len(cells) > 2 else ""):
            assert config.show(by_long[flag].default) in cells[1], (flag, cells)
            checked.append(flag)
    # Every limit, once.
    assert sorted(checked) == sorted([
        "--max-message", "--queue-max-bytes", "--queue-max-msgs", "--total-max-bytes",
        "--block-timeout", "--max-subscriptions", "--max-pattern", "--sub-max-bytes",
        "--user-sub-max-bytes", "--total-sub-max-bytes", "--user-max-connections",
        "--user-queue-max-bytes"])


@pytest.mark.parametrize("argv, field, value", [
    (["-a", "/x"], "address", "/x"),
    (["-fa/dev/unix/abstract"], "address", "/dev/unix/abstract"),
    (["-p", "/dev/null"], "pidfile", None),
    (["-f", "-p", "/x.pid"], "pidfile", "/x.pid"),
    (["-f"], "pidfile", None),
    (["-p", "/x.pid"], "pidfile", "/x.pid"),
    (["--max-pattern", "0"], "max_pattern", 0),
    (["--user-max-connections", "3"], "user_max_connections", 3),
    (["--sub-max-bytes", "4096"], "sub_max_bytes", 4096),
    (["-u", "root", "-u1000"], "users", ["root", "1000"]),
    (["-g"], "mode", 0o770),
    (["-o"], "mode", 0o707),
    (["-go"], "mode", 0o777),
    (["-crf"], "auto_close", True),
    (["--backend", "select"], "backend", "select"),
    (["--max-message=64"], "max_message", 64),
    (["--hard", "block"], "hard", "block"),
    (["--block-timeout", "0.5"], "block_timeout", 0.5),
    (["--max-subscriptions", str(2**32 - 1)], "max_subscriptions", 2**32 - 1),
    (["--log-level", "off"], "log_level", "off"),
    (["--log-messages", "1"], "log_messages", 1.0),
    (["--stats-interval", "0"], "stats_interval", 0.0),
])
def test_parse(argv, field, value):
    assert getattr(parse_args(argv), field) == value


@pytest.mark.parametrize("argv, message", [
    (["--backend", "kqueue"], "--backend: choose one of epoll, select, io_uring"),
    (["--hard", "queue"], "--hard: choose one of discard, block, error"),
    (["--max-message", "lots"], "--max-message: not a whole number: 'lots'"),
    (["--max-message", "63"], "--max-message: out of range: '63' (64 to 67108864)"),
    (["--max-subscriptions", str(2**32)], f"--max-subscriptions: out of range: '{2**32}' (1 to {2**32 - 1})"),
    (["--stats-interval", "nan"], "--stats-interval: not a finite number: 'nan'"),
    (["--block-timeout", "-inf"], "--block-timeout: not a finite number: '-inf'"),
    (["--log-messages", "1.5"], "--log-messages: out of range: '1.5' (0 to 1)"),
    (["-x"], "option -x not recognized"),
    (["-a"], "option -a requires argument"),
    (["extra"], "unexpected argument 'extra'"),
])
def test_usage_errors_name_the_option(argv, message):
    with pytest.raises(UsageError) as e:
        parse_args(argv)
    assert str(e.value) == message


def test_help_and_version_stop_parsing_where_they_stand():
    with pytest.raises(Exit) as e:
        parse_args(["-f", "-h", "--backend", "kqueue"])
    assert e.value.text == config.help_text()
    with pytest.raises(UsageError):         # a bad option before -V is reported
        parse_args(["--backend", "kqueue", "-V"])


def test_summary_is_the_broker_start_config():
    s = parse_args(["-f", "-g", "-u", "a", "-u", "b"]).summary()
    assert (s["pidfile"], s["mode"], s["users"]) == (None, "0o770", "a,b")
    assert set(s) == {f.name for f in dataclasses.fields(Config)}
    assert all(v is None or isinstance(v, (str, int, float, bool)) for v in s.values())
