"""Every install command the documents give installs this project: by its
distribution name, pysbus (``sbus`` on the package index is an unrelated
project), from the wheels in dist/ with --no-index, or a named dependency.
tests/test_wheel.py runs these installs on the built wheels."""
from __future__ import annotations

import json
import re

from support import ROOT

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "tools" / "systemd" / "README.md", ROOT / "bench" / "README.md"]


def texts():
    for path in DOCUMENTS:
        yield path.name, path.read_text()
    notebook = json.loads((ROOT / "tools" / "log_analytics.ipynb").read_text())
    yield "log_analytics.ipynb", "\n".join("".join(c["source"]) for c in notebook["cells"])
    for path in sorted((ROOT / "sbus").rglob("*.py")):
        yield path.name, path.read_text()


def test_the_distribution_is_named_pysbus():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^name = "pysbus"$', pyproject, re.M)


def test_install_commands_name_this_project():
    found = 0
    for name, text in texts():
        for command in re.findall(r"pip install[^`\n#]*", text):
            found += 1
            assert not re.search(r"(?<![\w-])'?sbus(\[|'|\s|$|-\*)", command), (name, command)
            if re.search(r"(?<![\w.-])'?pysbus(\[[a-z,]+\])?'?(\s|$)", command):
                assert "--no-index" in command and "--find-links" in command, (name, command)
    assert found >= 8
