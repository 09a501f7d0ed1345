"""The shape the code keeps: rooms small enough to read alone, and one home
for what every service shares.

These hold the limits docs/architecture.md gives, so a change that grows a
module past them, or writes a shared declaration a second time, fails here
rather than in a later reader's head.
"""

import re

import pytest

from support import ROOT

SBUS = ROOT / "sbus"
# A module a reader can hold in mind at once; past this a file is split by
# concern (docs/architecture.md).
MAX_LINES = 800
# The two client drivers only make syscalls and wait; what they decide lives
# in sbus/client/session.py, written once.
MAX_DRIVER_LINES = 700
SOURCES = (".py", ".pyx", ".pxd", ".c", ".h", ".pyi")


def source_files():
    for path in sorted(SBUS.rglob("*")):
        if path.suffix not in SOURCES or not path.is_file():
            continue
        # Cython's generated C sits beside its .pyx and is no one's to read.
        if path.suffix == ".c" and path.with_suffix(".pyx").exists():
            continue
        yield path


def lines(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


@pytest.mark.parametrize("path", list(source_files()), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_module_outgrows_a_reading(path):
    assert lines(path) <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines(path)} lines (at most {MAX_LINES})"


def test_the_client_drivers_stay_thin():
    drivers = [SBUS / "client" / "sync.py", SBUS / "client" / "aio.py"]
    total = sum(lines(p) for p in drivers)
    assert total <= MAX_DRIVER_LINES, f"sync.py + aio.py: {total} lines (at most {MAX_DRIVER_LINES})"


def test_the_log_options_are_declared_once_outside_sbusd():
    """sbusd's option table (sbus/sbusd/config.py) declares its own; every
    service takes them from one function."""
    declaring = [p.relative_to(ROOT).as_posix() for p in SBUS.rglob("*.py")
                 if re.search(r"""["']--log-format["']""", p.read_text(encoding="utf-8"))]
    assert len(declaring) == 1, f"--log-format is declared in {declaring}"


def function_body(text, name):
    """The lines of ``def name`` (nested or not): those indented deeper than it."""
    d = re.search(r"^([ \t]*)def " + re.escape(name) + r"\(.*?\)[^:\n]*:[^\n]*\n", text, re.M)
    if not d:
        return ""
    body = []
    for line in text[d.end():].splitlines():
        if line.strip() and len(line) - len(line.lstrip()) <= len(d.group(1)):
            break
        body.append(line)
    return "\n".join(body)


def test_no_signal_handler_raises_or_logs():
    """A handler runs between any two bytecodes of the main thread, inside a
    log write as well: it may only note the signal (see sbus/service.py)."""
    offenders = []
    for path in SBUS.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"signal\.signal\([^,]+,\s*(lambda[^\n]*|\w+)\)", text):
            handler = m.group(1)
            if handler.startswith("lambda"):
                body = handler
            elif handler.startswith("signal") or handler in ("SIG_IGN", "SIG_DFL"):
                continue
            else:
                body = function_body(text, handler)
            if re.search(r"\braise\b|\blog\.|\blogger\.|\bprint\(|\.reopen\(|\.close\(", body):
                offenders.append(f"{path.relative_to(ROOT)}: {handler.split('(')[0]}")
    assert not offenders, f"signal handlers that act instead of noting: {offenders}"
