"""The release's sdist installed with pip on a version other than ours: this
host may compile, and pip fetches the build requirements from the index. The
installed broker then runs without a compiler (support.release.check_installed).
"""
from __future__ import annotations

import os

import pytest

from support.release import (
    BUILD_TIMEOUT,
    INTERPRETERS,
    OURS,
    SUPPORTED,
    check_installed,
    compiler_shims,
    host_env,
    interpreter,
    make_venv,
    run,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


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
    # with setuptools and Cython from the index. At -O0 (setup.py takes the
    # builder's -O): what this proves, that the sdist builds and the build
    # serves, does not depend on the optimiser, and gcc takes half the CPU.
    run([venv / "bin" / "python", "-m", "pip", "install", "--no-cache-dir", dist.sdist],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "CFLAGS": "-O0 -g0"},
        timeout=BUILD_TIMEOUT)
    env = host_env(venv, home, compiler_shims(tmp_path / "shims"))
    check_installed(venv, home, env)
