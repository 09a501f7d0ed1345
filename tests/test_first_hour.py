"""What a newcomer's slips get told: a misspelled ``sbus`` command gets the
likeliest one, and a second sbusd on a live socket is told a broker is there
(not to use -r, which replaces only a stale socket). Real processes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import SBUS, SBUSD
from support.sbusd import ROOT

TIMEOUT = 20.0


@pytest.mark.parametrize("typed, meant", [("sbu", "sub"), ("replya", "replay"),
                                           ("consum", "consume"), ("whoamI", "whoami")])
def test_a_misspelled_command_gets_did_you_mean(typed, meant):
    r = subprocess.run([SBUS, "-a", "/nowhere", typed, "x"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines()[-1].startswith(
        f"sbus: error: unknown command {typed!r}; did you mean {meant!r}? (commands: pub sub ")


def test_a_command_like_none_gets_the_list():
    r = subprocess.run([SBUS, "zzzz"], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2
    last = r.stderr.splitlines()[-1]
    assert last.startswith("sbus: error: unknown command 'zzzz' (commands: pub sub whoami ")
    assert last.endswith("; sbus COMMAND -h for each)")


def test_a_second_sbusd_on_a_live_socket_is_told_a_broker_is_there(start_broker):
    broker = start_broker()
    for flags in ([], ["-r"]):
        r = subprocess.run([SBUSD, "-f", *flags, "-a", broker.address, "-p", "/dev/null"],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=TIMEOUT)
        assert r.returncode == 1
        assert r.stderr.splitlines()[-1] == (
            f"sbusd: {broker.address} is in use: a broker is listening there; use it, or stop it "
            "first, or give this one another -a (-r replaces only a stale socket)")
    assert broker.proc.poll() is None


def test_import_sbus_works_from_the_clones_parent_folder(tmp_path):
    """Issue 38: from the folder that holds a clone (named sbus, as git names
    it) Python sees the clone as a namespace package; the venv's Python must
    still import the real package there. The make targets install sbus with
    the checkout on sys.path (setuptools' compat mode), where a regular
    package beats a namespace portion; the default editable import hook was
    never asked, and ``sbus.Client`` was missing."""
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(tmp_path / "sbus")],
                   check=True, capture_output=True, timeout=TIMEOUT * 3)
    assert not (tmp_path / "sbus" / "__init__.py").exists()
    r = subprocess.run([sys.executable, "-c", "import sbus; sbus.Client; print(sbus.__file__)"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, (r.stderr + "\n(a venv set up before the compat mode: make build "
                               "installs sbus again)")
    assert r.stdout.strip() == str(Path(sys.modules["sbus"].__file__))
