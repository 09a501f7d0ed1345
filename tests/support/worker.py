"""Worker scripts (tests/workers/) run in processes of their own."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .sbusd import TESTS


def start_worker(name: str, *args) -> subprocess.Popen:
    """``python -m workers.NAME ARGS...`` with stdout and stderr piped."""
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", f"workers.{name}", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": path})


def worker_report(proc: subprocess.Popen, timeout: float) -> dict:
    """Wait for a worker to finish (kill it after ``timeout``); its JSON
    report. Fails with the worker's stderr if it did not exit 0."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    return json.loads(out)
