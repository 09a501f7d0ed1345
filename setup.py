"""Lists the Cython extensions; everything else is in pyproject.toml."""
import glob
import os

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("SBUS_DEBUG") == "1"
# -O2 unless the builder's CFLAGS name an optimisation level: a packager's -O
# (or -O0 for a quick build of the sdist) comes before ours on gcc's command line.
OPTIMISE = [] if any(f.startswith("-O") for f in os.environ.get("CFLAGS", "").split()) else ["-O2"]
# Every .pyx of sbus/_core is an extension of the same name, so a new module
# is in every build and every wheel without being listed here. The C files of
# sbus/_core/csrc/NAME/, if there is such a directory, are compiled into NAME.
HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = sorted(os.path.basename(p)[:-len(".pyx")]
                 for p in glob.glob(os.path.join(HERE, "sbus", "_core", "*.pyx")))
if not MODULES:
    raise SystemExit(f"setup.py: no .pyx under {HERE}/sbus/_core")

extensions = [
    Extension(
        f"sbus._core.{name}",
        [f"sbus/_core/{name}.pyx"] + sorted(glob.glob(f"sbus/_core/csrc/{name}/*.c")),
        depends=sorted(glob.glob(f"sbus/_core/csrc/{name}/*.h")),
        extra_compile_args=[*OPTIMISE, "-fno-strict-aliasing"] + (["-g", "-O0"] if DEBUG else []),
        define_macros=[("SBUS_DEBUG", "1" if DEBUG else "0")],
    )
    for name in MODULES
]


class BuildExt(build_ext):
    """Link without the interpreter's run-time library path. A Python built
    with --enable-shared and an rpath (pyenv, for one) has -Wl,-rpath,<its lib
    dir> in LDSHARED, which would put the build host's path into every .so of
    the wheel; auditwheel keeps it. The extensions do not link libpython."""

    def finalize_options(self):
        super().finalize_options()
        # One compiler a core unless told (-j): a host installing the sdist
        # waits for the modules' compile, not for each in turn.
        if not self.parallel:
            self.parallel = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else True

    def build_extensions(self):
        for attr in ("linker_so", "linker_so_cxx"):
            args = getattr(self.compiler, attr, None)
            if args:
                setattr(self.compiler, attr, [
                    a for a in args if not a.startswith(("-Wl,-rpath,", "-Wl,-rpath=", "-Wl,-R"))])
        super().build_extensions()


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
)
