"""The broker process, ``sbusd``: what runs around the compiled broker core.

- ``main``: the command line; parses it, sets up the process, runs the broker.
- ``config``: every option, its default and its help text, in one table.
- ``lifecycle``: the listening socket, daemonising, the pidfile, signals and
  systemd readiness.
- ``events``: what the broker calls back: its log records, the sampled
  message records, flood summaries and periodic stats.

The broker core itself (event loop, send queues, pattern index, message path)
is compiled, in :mod:`sbus._core`. ``sbusd`` is ``sbus.sbusd:main``.
"""
from .main import main

__all__ = ["main"]
