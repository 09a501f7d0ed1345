"""Lists the Cython extensions; everything else is in pyproject.toml."""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("SBUS_DEBUG") == "1"
MODULES = ["protocol", "index", "sendq", "loop", "policy", "report", "server", "broker", "batch"]

extensions = [
    Extension(
        f"sbus._core.{name}",
        [f"sbus/_core/{name}.pyx"],
        extra_compile_args=["-O2", "-fno-strict-aliasing"] + (["-g", "-O0"] if DEBUG else []),
        define_macros=[("SBUS_DEBUG", "1" if DEBUG else "0")],
    )
    for name in MODULES
]


class BuildExt(build_ext):
    """Link without the interpreter's run-time library path. A Python built
    with --enable-shared and an rpath (pyenv, for one) has -Wl,-rpath,<its lib
    dir> in LDSHARED, which would put the build host's path into every .so of
    the wheel; auditwheel keeps it. The extensions do not link libpython."""

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
