"""``sbus.aio`` is the asyncio client, :mod:`sbus.client.aio`, under its short name.

The alias is the module itself, so ``sbus.aio.FLUSH_DELAY`` and
``sbus.client.aio.FLUSH_DELAY`` are one setting.
"""
import sys

from .client import aio as _aio

sys.modules[__name__] = _aio
