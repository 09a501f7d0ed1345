"""``python -m sbus.cli.loadgen MODE -a ADDRESS ...``: the compiled load generator
(``sbus._core.loadgen``) in a process of its own; see sbus/_core/csrc/loadgen/
for its modes and options. ``sbus bench`` and bench/harness.py run it this way."""
import sys

from .._core.loadgen import run

if __name__ == "__main__":
    sys.exit(run(sys.argv))
