"""The release artefacts, as ``make wheel`` makes them, installed as on a host.

tools/build_wheels.py, which ``make wheel`` runs, builds the sdist and one
repaired manylinux wheel per supported CPython whose interpreter pyenv has
(reused from build/release while the sources are unchanged; `make test`
builds it before pytest). Then (here, and in test_wheel_install.py,
test_wheel_sdist.py and test_wheel_source.py, which run on other workers):

* each wheel's files, tags and metadata are checked, and the sdist's files;
* for every supported version, the wheel goes into a fresh virtual
  environment of that version's interpreter (Debian's own python3.X when
  there is one: another build of CPython than the one the wheel was built
  with), installed from dist/ with ``--no-index --only-binary :all:``; every
  compiler on PATH is a shim that fails and CC is /bin/false. The installed
  ``sbusd`` runs, and the installed ``sbus`` tool and ``sbus.Client`` publish,
  subscribe, ask ``whoami`` and ``stats`` through it. A version without an
  interpreter is skipped, naming it;
* the sdist is installed with pip on a version other than ours (this host
  may compile; pip fetches the build requirements from the index) and runs
  the same way;
* ``pysbus[analytics]`` is installed from the wheel with the PySpark wheel pip
  already built into its cache, and ``python -m sbus.analytics`` aggregates
  the log the installed broker wrote.
"""
from __future__ import annotations

import configparser
import email
import io
import os
import re
import tarfile
import zipfile
from pathlib import Path

import pytest

from support.release import (
    FORBIDDEN_IN_WHEEL,
    NAME,
    ROOT,
    SOURCES,
    SUPPORTED,
    ext_suffix,
    extension_modules,
    interpreter,
    pyproject,
    version,
    versions,
    wheel_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_release_covers_every_supported_version():
    assert SUPPORTED == ["3.9", "3.10", "3.11", "3.12", "3.13"], \
        "pyproject.toml's classifiers name the versions the wheels are built for"
    assert re.search(r'requires-python = ">=3\.9"', (ROOT / "pyproject.toml").read_text())


@versions
def test_wheel_files(dist, ver):
    wheel = wheel_for(dist, ver)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        sos = {n: zf.read(n) for n in names if n.endswith(".so")}
    suffix = ext_suffix(interpreter(ver))
    expected = {f"sbus/_core/{m}{suffix}" for m in extension_modules()}
    assert set(sos) == expected, "compiled extensions in the wheel"
    bad = [n for n in names if FORBIDDEN_IN_WHEEL.search(n)]
    assert not bad, f"not for the wheel: {bad}"
    assert not [n for n in names if ".libs/" in n], "auditwheel grafted libraries: unexpected"
    # Every module of every package under sbus/ is there.
    packages = {str(Path(f).parent) for f in SOURCES
                if f.startswith("sbus/") and f.endswith("/__init__.py")}
    modules = [f for f in SOURCES if f.endswith(".py") and str(Path(f).parent) in packages]
    assert "sbus/client/sync.py" in modules
    assert not [m for m in modules if m not in names], "modules missing from the wheel"
    assert "sbus/py.typed" in names
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"sbus", f"{NAME}-{version()}.dist-info"}, top_level
    # Stripped, and nothing of the build host left in the ELF files.
    elffile = pytest.importorskip("elftools.elf.elffile")
    for name, data in sos.items():
        elf = elffile.ELFFile(io.BytesIO(data))
        assert not [s.name for s in elf.iter_sections() if s.name.startswith(".debug")], name
        assert elf.get_section_by_name(".symtab") is None, f"{name} is not stripped"
        dynamic = elf.get_section_by_name(".dynamic")
        tags = {t.entry.d_tag: t for t in dynamic.iter_tags()}
        assert "DT_RPATH" not in tags and "DT_RUNPATH" not in tags, (
            f"{name} has a run-time library path: "
            f"{[getattr(t, 'rpath', None) or getattr(t, 'runpath', None) for t in tags.values()]}")
        needed = {t.needed for t in dynamic.iter_tags() if t.entry.d_tag == "DT_NEEDED"}
        assert not any("python" in n for n in needed), f"{name} links libpython: {needed}"


def glibc_version() -> tuple:
    name, ver = os.confstr("CS_GNU_LIBC_VERSION").split()
    assert name == "glibc"
    return tuple(int(x) for x in ver.split(".")[:2])


def needed_glibc(data: bytes) -> tuple:
    """The newest GLIBC_x.y symbol version an ELF file asks for."""
    elffile = pytest.importorskip("elftools.elf.elffile")
    elf = elffile.ELFFile(io.BytesIO(data))
    versions_ = [(0, 0)]
    section = elf.get_section_by_name(".gnu.version_r")
    for _, auxiliaries in section.iter_versions() if section else ():
        for aux in auxiliaries:
            m = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", aux.name)
            if m:
                versions_.append((int(m[1]), int(m[2])))
    return max(versions_)


@versions
def test_wheel_tags(dist, ver):
    wheel = wheel_for(dist, ver)
    m = re.fullmatch(NAME + r"-(?P<version>[^-]+)-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl",
                     wheel.name)
    assert m, wheel.name
    assert m["version"] == version()
    tag = "cp" + ver.replace(".", "")
    assert (m["py"], m["abi"]) == (tag, tag)
    plats = m["plat"].split(".")
    for plat in plats:
        pm = re.fullmatch(r"manylinux(?:_(\d+)_(\d+)_|(1|2010|2014)_)x86_64", plat)
        assert pm, f"not a manylinux tag: {plat}"
    glibcs = [(int(a), int(b)) for a, b in re.findall(r"manylinux_(\d+)_(\d+)_", m["plat"])]
    assert glibcs and max(glibcs) <= glibc_version(), "the wheel wants a newer glibc than ours"
    with zipfile.ZipFile(wheel) as zf:
        wheel_info = email.message_from_bytes(zf.read(f"{NAME}-{version()}.dist-info/WHEEL"))
        needs = max(needed_glibc(zf.read(n)) for n in zf.namelist() if n.endswith(".so"))
    # The tag names the oldest glibc the extensions need (manylinux2014 is 2.17,
    # the oldest policy auditwheel knows for x86_64 today).
    assert min(glibcs) == max(needs, (2, 17)), (min(glibcs), needs)
    assert wheel_info["Root-Is-Purelib"] == "false"
    assert sorted(wheel_info.get_all("Tag")) == sorted(f"{tag}-{tag}-{p}" for p in plats)


@versions
def test_wheel_metadata(dist, ver):
    wheel = wheel_for(dist, ver)
    project = pyproject()
    info = f"{NAME}-{version()}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        # Core metadata is UTF-8 (the README is not all ASCII).
        meta = email.message_from_string(zf.read(f"{info}/METADATA").decode("utf-8"))
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    assert meta["Name"] == NAME
    assert meta["Version"] == version()
    assert meta["Summary"] == project["description"]
    assert meta["Requires-Python"] == project["requires-python"]
    license_ = project["license"]
    if isinstance(license_, str):
        assert meta["License-Expression"] == license_
    else:
        assert meta["License"] == license_["text"]
    assert meta.get_all("Classifier") == project["classifiers"]
    assert f"Programming Language :: Python :: {ver}" in project["classifiers"]
    assert "analytics" in meta.get_all("Provides-Extra")
    requires = meta.get_all("Requires-Dist")
    for dep in project["dependencies"]:
        assert any(r.replace(" ", "") == dep.replace(" ", "") for r in requires), (dep, requires)
    for dep in project["optional-dependencies"]["analytics"]:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0)
        assert any(r.startswith(name) and 'extra == "analytics"' in r for r in requires), requires
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().strip() == (ROOT / "README.md").read_text().strip()
    eps = configparser.ConfigParser()
    eps.read_string(entry_points)
    assert dict(eps["console_scripts"]) == {"sbusd": "sbus.sbusd:main", "sbus": "sbus.cli:main"}
    assert dict(eps["console_scripts"]) == project["scripts"]


def test_sdist_files(dist):
    root = f"{NAME}-{version()}"
    assert dist.sdist.name == f"{root}.tar.gz"
    with tarfile.open(dist.sdist) as tf:
        names = {m.name[len(root) + 1:] for m in tf.getmembers() if m.isfile()}
        pkg_info = email.message_from_bytes(tf.extractfile(f"{root}/PKG-INFO").read())
    assert (pkg_info["Name"], pkg_info["Version"]) == (NAME, version())
    wanted = {"pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "PKG-INFO",
              "tools/systemd/sbusd.socket", "tools/systemd/sbusd.service",
              "tools/systemd/README.md"}
    wanted |= {f for f in SOURCES if f.startswith("sbus/") and f.endswith((".pyx", ".pxd", ".py"))}
    # C written by hand (the load generator, the io_uring ring), not generated by Cython.
    wanted |= {f for f in SOURCES if f.startswith("sbus/_core/csrc/") and f.endswith((".c", ".h"))}
    assert not wanted - names, f"missing from the sdist: {sorted(wanted - names)}"
    bad = [n for n in names if re.search(r"^sbus/(?!_core/csrc/).*\.(c|html)$|\.(so|o|pyc)$|__pycache__/|"
                                         r"^(build|dist|\.venv)/", n)]
    assert not bad, f"generated or local files in the sdist: {bad}"
