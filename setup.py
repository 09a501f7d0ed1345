"""Lists the Cython extensions; everything else is in pyproject.toml."""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("SBUS_DEBUG") == "1"
MODULES = ["protocol", "index", "sendq", "loop", "broker"]

extensions = [
    Extension(
        f"sbus._core.{name}",
        [f"sbus/_core/{name}.pyx"],
        extra_compile_args=["-O2", "-fno-strict-aliasing"] + (["-g", "-O0"] if DEBUG else []),
        define_macros=[("SBUS_DEBUG", "1" if DEBUG else "0")],
    )
    for name in MODULES
]

setup(
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
