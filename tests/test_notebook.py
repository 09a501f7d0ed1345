"""tools/log_analytics.ipynb, executed headless on the log of a real sbusd run under load,
by the command docs/logging.md gives, from this environment (the notebook extra):
it reads the log into an analytics dataset and reports from the dataset.

The notebook prints a ``RESULT {...}`` digest; every number in it is checked
against what this test sent and against the log read with plain ``json``.
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from support import ROOT, SBUSD, wait_until

NOTEBOOK = ROOT / "tools" / "log_analytics.ipynb"
PUBLISHED = 3000
HOT_KEY = b"load/0/a"  # most published key: the notebook's top key


class Drain(threading.Thread):
    """Reads packets until stopped, counting them."""

    def __init__(self, sock):
        super().__init__(daemon=True)
        self.sock, self.count, self.stopped = sock, 0, threading.Event()
        sock.settimeout(0.05)

    def run(self):
        while not self.stopped.is_set():
            try:
                if self.sock.recv(1 << 16):
                    self.count += 1
            except socket.timeout:
                continue
            except OSError:
                return


def make_load(b) -> int:
    """Subscribers, a reader that never reads, two publishers, one misbehaving client."""
    readers = [b.connect(), b.connect()]
    readers[0].send(b"SUB load/")
    readers[1].send(b"SUB load/*/a")
    readers[1].send(b"SUB other/")
    readers[1].send(b"UNSUB never/subscribed")  # refused
    for s in readers:
        s.sync()            # subscribed before the first message
    drains = [Drain(s) for s in readers]
    for d in drains:
        d.start()
    lazy = b.connect()
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lazy.send(b"CMSG blocking/soft/discard")
    lazy.send(b"SUB ")
    lazy.sync()
    pubs = [b.connect(), b.connect()]
    load_msgs = 0
    for i in range(PUBLISHED):
        if i % 4 == 3:
            pubs[1].send(b"MSG other/x\0" + b"y" * (i % 50))
        else:
            key = HOT_KEY if i % 2 == 0 else b"load/%d/b" % (i % 7)
            pubs[0].send(b"MSG " + key + b"\0" + b"x" * (i % 300))
            load_msgs += 1
    bad = b.connect()
    bad.send(b"garbage")  # protocol_error
    # Everything published has been routed once the full subscriber saw it all.
    assert wait_until(lambda: drains[0].count >= load_msgs, 20, fail=False), \
        (drains[0].count, load_msgs)
    mark = len(b.records())
    wait_until(lambda: len([r for r in b.records()[mark:] if r["event"] == "stats"]) >= 2, 20,
               "two stats records after the last message")
    for d in drains:
        d.stopped.set()
        d.join(2)
    for s in [*readers, *pubs, lazy, bad]:
        s.close()
    return PUBLISHED


def documented_command() -> str:
    """The nbconvert command line of docs/logging.md, which the notebook repeats."""
    doc = (ROOT / "docs" / "logging.md").read_text()
    (line,) = [ln for ln in doc.splitlines() if "jupyter nbconvert --execute" in ln]
    assert f"`{line}`" in "".join(json.loads(NOTEBOOK.read_text())["cells"][0]["source"])
    return line


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_notebook_runs_as_documented_on_a_real_broker_log(start_broker, tmp_path):
    pytest.importorskip("pyspark")
    jupyter = Path(sys.executable).parent / "jupyter"
    assert jupyter.exists(), "no jupyter here: pip install -e '.[notebook]' (make build does)"
    if not os.path.exists(SBUSD):
        pytest.skip("sbusd is not installed in this environment")

    b = start_broker("--stats-interval", "0.2", "--log-messages", "1")
    sent = make_load(b)
    wait_until(lambda: len(b.events("client_disconnect")) >= 6, 20, "six disconnect records")
    b.stop()

    # The oracle: the log itself, read with json.
    lines = [ln for ln in b.log_path.read_text().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]
    of = lambda name: [r for r in records if r["event"] == name]  # noqa: E731
    stats = of("stats")
    assert sum(r["delta"]["msgs_in"] for r in stats) == sent
    assert of("broker_stop")[0]["totals"]["msgs_in"] == sent
    messages = of("message")
    assert len(messages) == sent  # --log-messages 1 logs every one
    connections = (
        {(r["broker_pid"], r["client"]) for r in of("client_connect") + of("client_disconnect")}
        | {(r["broker_pid"], c["client"]) for r in stats for c in r["clients"]})
    want = {
        "lines": len(lines),
        "records": len(records),
        "malformed": 0,
        "msgs_in": sent,
        "msgs_out": sum(r["delta"]["msgs_out"] for r in stats),
        "drops": sum(r["delta"][k] for r in stats
                     for k in ("drops_soft", "drops_hard", "drops_disconnect")),
        "connections": len(connections),
        "disconnects": dict(Counter(r["reason"] for r in of("client_disconnect"))),
        "sampled_messages": sent,
        "top_key": Counter(r["key"] for r in messages).most_common(1)[0][0],
        "plots": ["throughput", "drops_per_client", "top_keys"],
    }
    assert want["top_key"] == HOT_KEY.decode()
    assert want["disconnects"].get("protocol_error") == 1

    # A clone after `make run`: its .run/sbusd.json is this broker's log.
    clone = tmp_path / "clone"
    (clone / ".run").mkdir(parents=True)
    shutil.copy(b.log_path, clone / ".run" / "sbusd.json")
    (clone / "tools").symlink_to(ROOT / "tools")
    env = {**os.environ, "PATH": os.pathsep.join([str(jupyter.parent), os.environ["PATH"]]),
           "SBUS_MASTER": "local[1]",
           # Every JVM the notebook starts without the optimising compiler, whose
           # warm-up costs more CPU than this small log's queries (as the spark fixture).
           "JDK_JAVA_OPTIONS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}
    r = subprocess.run(["sh", "-c", documented_command()], cwd=clone, env=env,
                       capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stderr[-5000:]

    out = clone / ".run" / "notebook"
    page = (out / "log_analytics.html").read_text()
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    result_line = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    assert result_line, text[-2000:]
    got = json.loads(result_line[-1][len("RESULT "):])
    assert got == want
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', page)) == 3
    for name in want["plots"]:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.count("<table") >= 10  # every aggregation was displayed
    # The notebook read the log into a dataset, one partition per day of the log.
    dataset = clone / ".run" / "dataset"
    days = {r["timestamp"][:10] for r in records}
    assert {p.name for p in (dataset / "events").glob("date=*")} == {f"date={d}" for d in days}
    assert json.loads((dataset / "_manifest.json").read_text())["files"][0]["lines"] == len(lines)
