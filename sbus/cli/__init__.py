"""The ``sbus`` command: publish, subscribe and ask the broker from the shell.

- ``main``: the command line and every subcommand but the ones below.
- ``render``: how ``sbus sub`` prints a message (plain, ``--json``, ``-F``).
- ``top``: ``sbus top``, the live view of the broker's counters.
- ``metrics``: ``sbus stats --format prometheus``.
- ``benchmark``: ``sbus bench``, which runs ``loadgen`` (``python -m
  sbus.cli.loadgen``, the compiled load generator) against a broker.

``sbus bridge`` is :mod:`sbus.bridge.cli`. ``sbus`` is ``sbus.cli:main``.
"""
from .main import main

__all__ = ["main"]
