"""The systemd units shipped in tools/systemd, read as key/value lists."""
from __future__ import annotations

from .sbusd import ROOT

UNITS = ROOT / "tools" / "systemd"


def read_unit(name: str) -> dict:
    """{section: [(key, value), ...]} from a unit file, keeping repeated keys."""
    sections: dict = {}
    current = None
    for raw in (UNITS / name).read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections
