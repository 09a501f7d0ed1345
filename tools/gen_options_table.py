#!/usr/bin/env python3
"""Write sbusd's option table into README.md from ``sbus.sbusd.config.OPTIONS``.

    python tools/gen_options_table.py [--check]

The table sits between the ``<!-- options: ... -->`` and ``<!-- /options -->``
markers. ``--check`` changes nothing and exits 1 if the README is stale
(tests/test_config.py makes the same check).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from sbus.sbusd.config import markdown_table  # noqa: E402

README = ROOT / "README.md"
BEGIN, END = "<!-- options:", "<!-- /options -->"


def with_table(text: str) -> str:
    """``text`` with the lines between the markers replaced by the table."""
    head, rest = text.split(BEGIN, 1)
    marker, rest = rest.split("\n", 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}{marker}\n{markdown_table()}{END}{tail}"


def main(argv) -> int:
    text = README.read_text()
    fresh = with_table(text)
    if "--check" in argv:
        if fresh != text:
            print("README.md: the option table is stale; run tools/gen_options_table.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
