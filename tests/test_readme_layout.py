"""README's Layout section is the newcomer's map: it must name every package,
every module and every document that is in the tree.

The map is the fenced block under "## Layout": an entry starts at column 0
with a folder (``sbus/client/``) and goes on over the indented lines below
it. A module is named when its stem appears as a word in its folder's entry,
so the prose stays free; what the test holds is that nothing is left out and
nothing named is gone.
"""

import re

import pytest

from support import ROOT

README = ROOT / "README.md"
# Files a reader never opens to learn the layout: entry points, the version
# and build products.
NOT_MODULES = {"__init__", "__main__", "_version"}
MODULE_SUFFIXES = (".py", ".pyx", ".pxd", ".c", ".h")


def layout_entries():
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1]
    block = section.split("```", 2)[1]
    entries, folder = {}, None
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            folder, _, rest = line.partition(" ")
            entries[folder] = rest
        elif folder is not None:
            entries[folder] += " " + line.strip()
    return entries


def packages():
    """Every folder of sbus/ that holds source, as README writes it."""
    found = []
    for path in sorted((ROOT / "sbus").rglob("*")):
        if not path.is_dir() or path.name == "__pycache__":
            continue
        if any(p.suffix in MODULE_SUFFIXES for p in path.iterdir()):
            found.append(path)
    return [ROOT / "sbus", *found]


def modules(folder):
    stems = set()
    for path in folder.iterdir():
        if path.is_file() and path.suffix in MODULE_SUFFIXES and path.stem not in NOT_MODULES:
            # A .c file beside its .pyx is Cython's output, not a module.
            if path.suffix == ".c" and (folder / (path.stem + ".pyx")).exists():
                continue
            stems.add(path.stem)
    return sorted(stems)


def entry_for(entries, folder):
    """The entry naming this folder, or its parent's for a folder of helpers
    (csrc, includes) that the parent's entry describes."""
    rel = folder.relative_to(ROOT).as_posix() + "/"
    while rel not in entries and rel.count("/") > 1:
        rel = rel.rsplit("/", 2)[0] + "/"
    return rel, entries.get(rel)


def named(stem, text):
    return re.search(r"(?<![\w.])" + re.escape(stem) + r"(?![\w])", text) is not None


@pytest.mark.parametrize("folder", packages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_module_is_on_the_map(folder):
    entries = layout_entries()
    rel, text = entry_for(entries, folder)
    if folder.parent == ROOT / "sbus" and (folder / "__init__.py").exists():
        assert rel == folder.relative_to(ROOT).as_posix() + "/", f"README's layout has no entry for {rel}"
    assert text is not None, f"README's layout has no entry for {folder.relative_to(ROOT)}/"
    missing = [m for m in modules(folder) if not named(m, text)]
    assert not missing, f"README's layout entry {rel} does not name {missing}"


def test_the_map_names_nothing_that_is_gone():
    for folder in layout_entries():
        assert (ROOT / folder).is_dir(), f"README's layout names {folder}, which is not in the tree"


def test_every_document_is_on_the_map_and_linked():
    text = README.read_text(encoding="utf-8")
    docs_entry = layout_entries()["docs/"]
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert named(doc.stem, docs_entry), f"README's layout entry docs/ does not name {doc.name}"
        assert f"(docs/{doc.name})" in text, f"README links nowhere to docs/{doc.name}"
