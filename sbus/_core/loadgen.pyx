# cython: language_level=3
"""The load generator (the C of csrc/loadgen/, which setup.py compiles into
this module) built into the package, for ``sbus bench`` and ``make bench``: a
wheel carries it, so no compiler is needed where it runs.

``run(argv)`` is the generator's main: it forks its client processes, prints
one JSON line on the C stdout and may exit the process on a fatal error, so
it belongs in a process of its own: ``python -m sbus.cli.loadgen MODE ...``.
"""
from libc.stdlib cimport malloc, free

cdef extern from "csrc/loadgen/loadgen.h":
    int loadgen_main(int argc, char **argv)


def run(argv):
    """Run the generator with ``argv`` (``argv[0]`` is the program name); its exit status."""
    args = [a if isinstance(a, bytes) else str(a).encode() for a in argv]
    cdef int n = len(args)
    cdef char **cargv = <char **>malloc((n + 1) * sizeof(char *))
    if cargv == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            cargv[i] = args[i]
        cargv[n] = NULL
        return loadgen_main(n, cargv)
    finally:
        free(cargv)
