"""`make run` as a new user meets it: it says "listening" once sbusd listens,
with command lines that work as printed; a second one says a broker is there
and how to stop it; its JSON log is what the analytics job reads, and the
job refuses its console log, saying why.

Each run overrides the Makefile's DEV_* paths to keep out of the tree's .run/.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from support import ROOT, SBUSD, Conn, alive, read_records, wait_until
from support.procfs import wait_gone

MAKE_TIMEOUT = 300      # `make run` builds first: quick unless a .pyx changed


def make_run(paths: dict, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        ["make", "-s", "-C", str(ROOT), "run", *(f"{k}={v}" for k, v in paths.items())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        **popen)


def connect(path: Path) -> Conn:
    c = Conn()
    c.connect(str(path))
    return c


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A `make run` broker that saw one publish and one refused client, stopped."""
    tmp = tmp_path_factory.mktemp("make-run")
    paths = {"DEV_SOCKET": tmp / "bus.socket", "DEV_PIDFILE": tmp / "sbusd.pid",
             "DEV_JSON_LOG": tmp / "sbusd.json"}
    proc = make_run(paths)
    try:
        first = proc.stdout.readline()
        # Printed only once sbusd listens: the socket takes a connection now.
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            probe.connect(str(paths["DEV_SOCKET"]))
        hints = [proc.stdout.readline() for _ in range(7)]
        second = make_run(paths)
        second_out, second_err = second.communicate(timeout=MAKE_TIMEOUT)
        pid = int(paths["DEV_PIDFILE"].read_text())
        sub, pub = connect(paths["DEV_SOCKET"]), connect(paths["DEV_SOCKET"])
        sub.sub("hello/")
        sub.sync()
        pub.pub("hello/world", b"hi")
        assert sub.next_packet(timeout=5) == b"MSG hello/world\0hi"
        bad = connect(paths["DEV_SOCKET"])
        bad.packet(b"NOT A PACKET")
        bad.assert_closed()
        for c in (sub, pub):
            c.close()
        # Our probe, the second make run's, sub, pub and the refused one.
        wait_until(lambda: len([r for r in read_records(paths["DEV_JSON_LOG"])
                                if r["event"] == "client_disconnect"]) == 5,
                   10, "five client_disconnect records")
        os.kill(pid, signal.SIGINT)     # what Ctrl-C sends
        wait_gone(pid, 10)
        _, console = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return dict(paths=paths, tmp=tmp, pid=pid, first=first, hints=hints,
                second=(second.returncode, second_out, second_err), console=console)


def test_listening_is_said_once_sbusd_listens_with_lines_that_work(session):
    p, pid = session["paths"], session["pid"]
    assert session["first"] == f"sbusd: listening on {p['DEV_SOCKET']} as pid {pid}; Ctrl-C stops it\n"
    assert session["hints"] == [
        "  in another terminal:\n",
        f"    . {ROOT}/.venv/bin/activate\n",
        f"    export SBUS_ADDRESS={p['DEV_SOCKET']}\n",
        "    sbus sub ''                # print every message\n",
        "    sbus pub hello/world 'hi'  # publish one\n",
        "    sbus top                   # live view\n",
        f"    python -m sbus.analytics {p['DEV_JSON_LOG']} --out {ROOT}/.run/dataset\n",
    ]
    assert Path(f"{ROOT}/.venv/bin/activate").is_file()
    assert " broker_start " in session["console"] and " broker_stop " in session["console"]


def test_a_second_make_run_says_a_broker_is_there_and_how_to_stop_it(session):
    p, pid = session["paths"], session["pid"]
    code, out, err = session["second"]
    assert code != 0 and out == ""
    assert err.splitlines()[:2] == [
        f"make run: a broker is already listening on {p['DEV_SOCKET']} (pid {pid})",
        f"  use it, or stop it (Ctrl-C in its terminal, or: kill {pid}) and run make run again",
    ]


def test_make_run_follows_its_broker_across_a_live_upgrade_and_ctrl_c_still_stops_it(tmp_path):
    paths = {"DEV_SOCKET": tmp_path / "bus.socket", "DEV_PIDFILE": tmp_path / "sbusd.pid",
             "DEV_JSON_LOG": tmp_path / "sbusd.json"}
    # A session of its own, as a terminal gives make: Ctrl-C is SIGINT to its group.
    proc = make_run(paths, start_new_session=True)
    try:
        assert proc.stdout.readline().startswith("sbusd: listening on ")
        for _ in range(7):
            proc.stdout.readline()
        old = int(paths["DEV_PIDFILE"].read_text())
        sub = connect(paths["DEV_SOCKET"])
        sub.sub("hello/")
        sub.sync()
        up = subprocess.run([SBUSD, "--upgrade", "-p", str(paths["DEV_PIDFILE"])],
                            capture_output=True, text=True, timeout=60)
        assert up.returncode == 0, up.stderr
        new = int(paths["DEV_PIDFILE"].read_text())
        assert new != old and up.stdout == f"sbusd: upgraded: pid {old} handed over to pid {new}\n"
        # make goes on, following the new pid, and says so.
        assert proc.stdout.readline() == (
            f"make run: sbusd was upgraded in place; following it as pid {new} "
            "(Ctrl-C stops it)\n")
        assert proc.poll() is None
        pub = connect(paths["DEV_SOCKET"])
        pub.pub("hello/world", b"after")
        assert sub.next_packet(timeout=5) == b"MSG hello/world\0after"
        for c in (sub, pub):
            c.close()
        os.killpg(proc.pid, signal.SIGINT)      # what Ctrl-C sends
        wait_gone(new, 10)
        out, console = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in (locals().get("new"),):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not paths["DEV_SOCKET"].exists() and not paths["DEV_PIDFILE"].exists()
    # The successor's log came to make's terminal, to its stop.
    after = console[console.index(" upgrade_done "):]
    assert " client_connect " in after and " broker_stop " in after


def analytics(capsys, log: Path, out: Path, *flags) -> SimpleNamespace:
    """The job's command line (python -m sbus.analytics) run in this process
    on the tests' Spark session, which it borrows: as a notebook runs it,
    without a JVM of its own for each run."""
    from sbus.analytics import cli

    capsys.readouterr()
    code = cli.main([str(log), "--out", str(out), "--show", "0", *flags])
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


@pytest.mark.spark
def test_the_json_log_of_make_run_is_what_the_job_reads(session, spark, capsys):
    log = session["paths"]["DEV_JSON_LOG"]
    records = read_records(log)
    events = [r["event"] for r in records]
    assert events[0] == "broker_start" and events[-1] == "broker_stop"
    assert events.count("client_disconnect") == 5
    r = analytics(capsys, log, session["tmp"] / "dataset")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{len(records)} lines: {len(records)} records, 0 malformed" in r.stdout


@pytest.mark.spark
def test_the_job_refuses_a_console_log_and_says_which_log_to_give_it(session, spark, capsys):
    log = session["tmp"] / "console.log"
    log.write_text(session["console"])
    lines = len(session["console"].splitlines())
    dataset = session["tmp"] / "console-dataset"
    r = analytics(capsys, log, dataset)
    assert r.returncode == 1, r.stdout[-3000:]
    assert r.stderr.splitlines()[-2:] == [
        f"sbus.analytics: {lines} of {lines} lines are not sbusd JSON records, more than "
        "--max-malformed 0.5 of them; nothing was written",
        "  they look like sbusd's console format (--log-format console); give the job its JSON "
        "log: sbusd --log-format json, or --json-log PATH beside the console (make run writes "
        ".run/sbusd.json)",
    ]
    assert not (dataset / "_manifest.json").exists()
    # The threshold is the user's to raise.
    r = analytics(capsys, log, dataset, "--max-malformed", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{lines} lines: 0 records, {lines} malformed" in r.stdout


def test_max_malformed_must_be_a_fraction():
    r = subprocess.run([sys.executable, "-m", "sbus.analytics", "x.log", "--out", "d",
                        "--max-malformed", "50%"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == ("python -m sbus.analytics: error: argument "
                                         "--max-malformed: expected a fraction from 0 to 1, "
                                         "got '50%'")




def test_the_malformed_limit_and_what_the_refusal_says():
    from sbus.analytics.job import TooMalformed, check_malformed
    examples = [{"source": "file:/x.log", "line": "hello"}, {"source": "file:/x.log", "line": "{"}]
    # At the limit: accepted, and the examples are not even asked for.
    check_malformed({"records": 5, "malformed": 5}, 0.5, lambda: 1 / 0)
    check_malformed({"records": 0, "malformed": 0}, 0.0, lambda: 1 / 0)
    with pytest.raises(TooMalformed) as info:
        check_malformed({"records": 4, "malformed": 6}, 0.5, lambda: examples)
    assert str(info.value).splitlines() == [
        "6 of 10 lines are not sbusd JSON records, more than --max-malformed 0.5 of them; "
        "nothing was written",
        "  malformed: file:/x.log: 'hello'",
        "  malformed: file:/x.log: '{'",
    ]
