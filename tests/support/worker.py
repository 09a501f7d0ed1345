"""Worker scripts (tests/workers/) run in processes of their own."""
from __future__ import annotations

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
