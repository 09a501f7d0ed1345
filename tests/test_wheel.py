"""The release artefacts, as ``make wheel`` makes them, installed as on a host.

tools/build_wheels.py, which ``make wheel`` runs, builds the sdist and one
repaired manylinux wheel per supported CPython whose interpreter pyenv has
(reused from build/release while the sources are unchanged). Then:

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
import csv
import email
import functools
import importlib.util
import io
import json
import os
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import tarfile
import zipfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TIMEOUT = 30.0
BUILD_TIMEOUT = 1200
SPARK_TIMEOUT = 300
COMPILERS = ("cc", "gcc", "clang", "c++", "g++", "x86_64-linux-gnu-gcc", "cython", "cythonize")
# What may never be in the wheel: sources and leftovers of the build.
FORBIDDEN_IN_WHEEL = re.compile(
    r"(^|/)(tests?|build|dist|docs|bench|tools|__pycache__)/|\.egg-info/|"
    r"\.(c|h|pyx|pxd|pxi|html|o|a|pyc|pyo)$")


def _load_build_tool():
    spec = importlib.util.spec_from_file_location("build_wheels", ROOT / "tools" / "build_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_wheels = _load_build_tool()
SUPPORTED = build_wheels.supported_versions(ROOT)
INTERPRETERS = build_wheels.find_interpreters(SUPPORTED)
OURS = f"{sys.version_info.major}.{sys.version_info.minor}"


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


# The distribution's name (the import package is sbus): wheels, sdist and
# dist-info are named after it.
NAME = re.search(r'^name = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]


def version() -> str:
    text = (ROOT / "sbus" / "_version.py").read_text()
    return re.search(r'__version__\s*=\s*"([^"]+)"', text).group(1)


SOURCES = build_wheels.source_files(ROOT)


def extension_modules() -> list:
    """The compiled extensions: setup.py builds every sbus/_core/*.pyx."""
    return sorted(Path(f).stem for f in SOURCES if re.fullmatch(r"sbus/_core/[^/]+\.pyx", f))


def interpreter(ver: str) -> Path:
    """pyenv's CPython ``ver``; the test is skipped when there is none."""
    python = INTERPRETERS[ver]
    if python is None:
        pytest.skip(f"no CPython {ver} interpreter: nothing under "
                    f"{build_wheels.pyenv_root() / 'versions'}/{ver}.N (pyenv install {ver})")
    return python


@functools.lru_cache(maxsize=None)
def ext_suffix(python: Path) -> str:
    return run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"]
               ).stdout.strip()


# ---------------------------------------------------------------- the build

@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    if not (ROOT / "README.md").is_file():
        pytest.fail("README.md is missing: pyproject.toml names it as the readme, "
                    "so neither the sdist nor the wheel can be built")
    top = tmp_path_factory.mktemp("release")
    out, manifest = top / "dist", top / "release.json"
    # As `make wheel` runs it, but building only for the interpreters present.
    run([sys.executable, ROOT / "tools" / "build_wheels.py", "--out", out, "--allow-missing",
         "--manifest", manifest], timeout=BUILD_TIMEOUT)
    release = json.loads(manifest.read_text())
    assert sorted(out.iterdir()) == sorted(
        out / n for n in [release["sdist"], *release["wheels"].values()]), "dist/ holds the release"
    assert set(release["wheels"]) == {v for v, p in INTERPRETERS.items() if p is not None}
    return SimpleNamespace(dir=out, sdist=out / release["sdist"],
                           wheels={v: out / n for v, n in release["wheels"].items()})


def wheel_for(dist, ver: str) -> Path:
    interpreter(ver)
    return dist.wheels[ver]


versions = pytest.mark.parametrize("ver", SUPPORTED)


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


# ---------------------------------------------------------------- installs

def host_python(ver: str) -> Path:
    """A Python ``ver`` as a host has it: the distribution's own python3.X
    (another build of CPython than the one the wheel was built with) when it
    can make a venv, else pyenv's."""
    python = interpreter(ver)
    distro = Path(f"/usr/bin/python{ver}")
    if os.access(distro, os.X_OK) and run([distro, "-c", "import ensurepip, venv"],
                                          check=False).returncode == 0:
        return distro
    return python


def make_venv(python: Path, where: Path) -> Path:
    run([python, "-m", "venv", where], timeout=300)
    return where


def compiler_shims(where: Path) -> Path:
    """A directory of every compiler's name, each a program that fails."""
    where.mkdir()
    for tool in COMPILERS:
        shim = where / tool
        shim.write_text(f"#!/bin/sh\necho '{tool}: there is no compiler on this host' >&2\nexit 1\n")
        shim.chmod(0o755)
    return where


def host_env(venv: Path, home: Path, shims: Path, extra_path=()) -> dict:
    """PATH with failing compilers first, then the venv's bin (and nothing else
    unless asked); no pip configuration of ours; CC that fails."""
    path = os.pathsep.join(map(str, (shims, venv / "bin", *extra_path)))
    return {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8", "CC": "/bin/false",
            "CXX": "/bin/false", "PIP_CONFIG_FILE": os.devnull,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


@pytest.fixture(scope="module")
def dependency_wheels(tmp_path_factory):
    """sbus's dependencies as released wheels, per Python version (a
    dependency may have dropped an old Python in its newest release)."""
    top = tmp_path_factory.mktemp("dependencies")

    @functools.lru_cache(maxsize=None)
    def download(ver: str, *requirements: str) -> Path:
        dest = top / ver
        # That version's own pip: it evaluates the requirements' markers for it.
        run([interpreter(ver), "-m", "pip", "download", "--only-binary=:all:", "--dest", dest,
             *requirements], timeout=300)
        return dest

    return download


def runtime_requirements() -> list:
    return pyproject()["dependencies"]


def install_wheel(dist, deps: Path, venv: Path, env: dict, requirement=NAME, *find_links,
                  extra=()) -> None:
    links = [a for d in (dist.dir, deps, *find_links) for a in ("--find-links", d)]
    run([venv / "bin" / "python", "-m", "pip", "install", "--no-index", "--only-binary=:all:",
         *links, *extra, requirement], env=env, timeout=600)


def check_installed(venv: Path, home: Path, env: dict) -> None:
    for tool in COMPILERS:
        found = shutil.which(tool, path=env["PATH"])
        assert found is None or Path(found).parent == Path(env["PATH"].split(os.pathsep)[0]), \
            f"{tool} on the host's PATH is {found}, not the failing shim"
        if found:
            assert run([found, "--version"], env=env, check=False).returncode != 0
    py = venv / "bin" / "python"
    probe = run([py, "-c", "import importlib.util as u, sbus._core.broker as b; "
                 "print(b.__file__); print(u.find_spec('Cython'))"], env=env, cwd=home)
    ext_file, cython = probe.stdout.split()
    assert Path(ext_file).is_relative_to(venv), f"sbus imported from {ext_file}"
    assert ext_file.endswith(ext_suffix(py)), f"{ext_file} is not built for {py}"
    assert cython == "None", "Cython is installed on the host"
    bin_ = venv / "bin"
    assert run([bin_ / "sbusd", "--version"], env=env, cwd=home).stdout == f"sbusd {version()}\n"
    assert run([bin_ / "sbus", "--version"], env=env, cwd=home).stdout.strip() == \
        f"sbus {version()}"
    end_to_end(bin_, env, home)


def wait_readable(f, what: str) -> None:
    ready, _, _ = select.select([f], [], [], TIMEOUT)
    assert ready, f"nothing from {what} within {TIMEOUT} s"


# Run by the installed Python: the client library, against the installed broker.
LIBRARY_ROUND_TRIP = """
import json, os, sys
from sbus import Client
with Client(sys.argv[1]) as sub, Client(sys.argv[1]) as pub:
    sub.subscribe("library/")
    sub.whoami(timeout=10)  # the broker has handled the SUB
    pub.publish("library/hello", "hi from the library")
    msg = sub.receive(timeout=10)
    creds = pub.whoami(timeout=10)
    stats = pub.stats(timeout=10)
print(json.dumps({"key": msg.key_str, "payload": msg.text, "pid": os.getpid(),
                  "creds": [creds.gid, creds.uid, creds.pid], "stats": stats}))
"""


def end_to_end(bin_: Path, env: dict, work: Path) -> Path:
    """Start the installed sbusd; the installed sbus tool and client library
    subscribe, publish, ask whoami and stats through it; stop. The log's path."""
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
        whoami = run([bin_ / "sbus", "whoami", "-a", address], env=env, cwd=work).stdout
        m = re.fullmatch(r"!/cred/(\d+)/(\d+)/(\d+)\n", whoami)
        assert m and (int(m[1]), int(m[2])) == (os.getgid(), os.getuid()), whoami

        lib = json.loads(run([bin_ / "python", "-c", LIBRARY_ROUND_TRIP, address],
                             env=env, cwd=work).stdout)
        assert (lib["key"], lib["payload"]) == ("library/hello", "hi from the library")
        assert lib["creds"] == [os.getgid(), os.getuid(), lib["pid"]]
        # One message from the tool, one from the library; each delivered once.
        totals = lib["stats"]["totals"]
        assert (totals["msgs_in"], totals["msgs_out"]) == (2, 2), totals
        stats = json.loads(run([bin_ / "sbus", "stats", "-a", address], env=env, cwd=work).stdout)
        assert stats["totals"]["msgs_in"] == 2 and stats["totals"]["clients"] == 1, stats

        # sbus bench runs from the wheel alone: its load generator is compiled in.
        bench = run([bin_ / "sbus", "bench", "-a", address, "pair", "-n", "2000"],
                    env=env, cwd=work).stdout
        assert re.search(r"^pair: 2000 msgs of 64 B to 1 subscriber in .*; nothing lost, in order$",
                         bench, re.M), bench

        broker.send_signal(signal.SIGTERM)
        assert broker.wait(TIMEOUT) == 0, broker.stderr.read()
        assert not address.exists(), "sbusd left its socket behind"
        events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
        assert events[0] == "broker_start" and events[-1] == "broker_stop", events
        return log
    finally:
        for p in (sub, broker):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


@versions
def test_wheel_installs_and_runs_without_a_compiler(dist, dependency_wheels, ver, tmp_path):
    wheel_for(dist, ver)
    venv = make_venv(host_python(ver), tmp_path / "host")
    home = tmp_path / "home"
    home.mkdir()
    env = host_env(venv, home, compiler_shims(tmp_path / "shims"))
    install_wheel(dist, dependency_wheels(ver, *runtime_requirements()), venv, env)
    check_installed(venv, home, env)
    if platform.machine() == "x86_64" and shutil.which("cc"):
        without_io_uring(venv / "bin", env, home, seccomp_launcher(tmp_path))


def seccomp_launcher(where: Path) -> Path:
    """tests/c/no_io_uring.c, built before the host's PATH hides the compiler."""
    exe = where / "no_io_uring"
    run(["cc", "-O2", "-Wall", "-o", exe, ROOT / "tests" / "c" / "no_io_uring.c"])
    return exe


def without_io_uring(bin_: Path, env: dict, work: Path, launcher: Path) -> None:
    """The installed sbusd asked for io_uring on a host that refuses it (a
    seccomp filter, as in containers): it serves on epoll and says so."""
    address = work / "no-uring.socket"
    log = work / "no-uring.log"
    broker = subprocess.Popen(
        [launcher, "38", bin_ / "sbusd", "-f", "-a", address, "--backend", "io_uring",
         "--log-format", "json", "--log-file", log],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=work)
    try:
        wait_readable(broker.stdout, "sbusd under the seccomp filter")
        assert broker.stdout.read() == b"" and address.exists(), broker.stderr.read()
        stats = json.loads(run([bin_ / "sbus", "stats", "-a", address], env=env, cwd=work).stdout)
        assert stats["backend"] == "epoll", stats
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(TIMEOUT) == 0, broker.stderr.read()
        warned = [r["detail"] for r in map(json.loads, log.read_text().splitlines())
                  if r["event"] == "config_warning"]
        assert warned == ["--backend io_uring: io_uring is unavailable "
                          "(io_uring_setup: Function not implemented): using epoll"], warned
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()


def sdist_version() -> str:
    """A supported version other than ours, the newest present."""
    others = [v for v in reversed(SUPPORTED) if v != OURS and INTERPRETERS[v] is not None]
    if not others:
        pytest.skip(f"no supported CPython but {OURS} is installed")
    return others[0]


def test_sdist_installs_from_source(dist, tmp_path):
    ver = sdist_version()
    venv = make_venv(interpreter(ver), tmp_path / "from-sdist")
    home = tmp_path / "home"
    home.mkdir()
    # This host may compile: pip builds a wheel from the sdist, in isolation,
    # with setuptools and Cython from the index.
    run([venv / "bin" / "python", "-m", "pip", "install", "--no-cache-dir", dist.sdist],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}, timeout=BUILD_TIMEOUT)
    env = host_env(venv, home, compiler_shims(tmp_path / "shims"))
    check_installed(venv, home, env)


# ---------------------------------------------------------------- analytics

def cached_wheel(name: str, version_: str) -> Path:
    """``name`` as the wheel pip built into its cache when the project's
    environment was set up (PySpark is released as an sdist only), or None."""
    r = run([sys.executable, "-m", "pip", "cache", "list", f"{name}-{version_}",
             "--format=abspath"], check=False)
    found = [Path(p) for p in r.stdout.split() if p.endswith(".whl")]
    return found[0] if found else None


@pytest.mark.spark
def test_analytics_extra_from_the_wheel(dist, dependency_wheels, tmp_path):
    from importlib.metadata import version as installed_version
    pyspark_version = installed_version("pyspark")
    # The newest supported Python present: PySpark 4 needs 3.11 or newer.
    ver = next((v for v in reversed(SUPPORTED) if INTERPRETERS[v] is not None), None)
    if ver is None:
        pytest.skip("no supported CPython is installed")
    java = shutil.which("java")
    assert java, "the PySpark tests need Java 17 or newer (make test checks for it)"
    pyspark = cached_wheel("pyspark", pyspark_version)
    spark_links = [pyspark.parent] if pyspark else []
    # py4j is small and a wheel on the index; PySpark only without pip's cache.
    others = [r for r in pyproject()["optional-dependencies"]["analytics"]
              if not r.startswith("pyspark")]
    deps = dependency_wheels(ver, *runtime_requirements(), *others,
                             f"py4j=={installed_version('py4j')}")
    venv = make_venv(host_python(ver), tmp_path / "host")
    home = tmp_path / "home"
    home.mkdir()
    # Spark's launcher scripts need the system's tools; the shims still come first.
    env = host_env(venv, home, compiler_shims(tmp_path / "shims"), extra_path=("/usr/bin", "/bin"))
    env["JAVA_HOME"] = str(Path(os.path.realpath(java)).parent.parent)
    if pyspark is None:
        deps = dependency_wheels(ver, f"pyspark=={pyspark_version}")  # a long download
    # --no-compile: byte-compiling PySpark's thousands of modules is most of the time.
    install_wheel(dist, deps, venv, env, f"{NAME}[analytics]", *spark_links, extra=["--no-compile"])
    check_installed(venv, home, env)
    py = venv / "bin" / "python"
    usage = run([py, "-m", "sbus.analytics", "--help"], env=env, cwd=home).stdout
    assert usage.startswith("usage: python -m sbus.analytics"), usage

    log = home / "sbusd.log"  # written by the installed broker in check_installed
    records = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    out = tmp_path / "out"
    r = run([py, "-m", "sbus.analytics", log, "--out", out, "--master", "local[1]",
             "--show", "0", "--csv",
             "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.shuffle.partitions=1",
             "--conf", "spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1"],
            env=env, cwd=home, timeout=SPARK_TIMEOUT)
    assert f"{len(records)} records, 0 malformed" in r.stdout, r.stdout
    got = Counter()
    for part in (out / "csv" / "events").glob("date=*/part-*.csv"):    # one folder per day
        with open(part, newline="") as f:
            got.update({row["event"]: int(row["records"]) for row in csv.DictReader(f)})
    assert got == Counter(records)
