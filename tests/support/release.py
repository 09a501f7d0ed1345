"""The release as ``make wheel`` makes it, and a host to install it on: what
tests/test_wheel*.py share.

tools/build_wheels.py builds the sdist and one repaired manylinux wheel per
supported CPython whose interpreter pyenv has. Each test module asks for the
release on its own; the tool's lock and cache make the first compile and the
others copy, so the modules can run on parallel workers.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

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




def build(tmp_path_factory) -> SimpleNamespace:
    """The release in a fresh dist/ directory, as ``make wheel`` builds it but
    only for the interpreters present."""
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


def dependency_downloader(tmp_path_factory):
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

