"""The fast path's seam into nats-py: where sbus._core.natswire meets its client.

nats-py keeps connecting, authentication, TLS, the seed list, reconnecting
and PING/PONG. The bridge hooks two narrow places of ``nats.aio.client.Client``
(checked by :func:`missing`, relied on for the versions pyproject's
``bridge`` extra allows):

- reading: the read loop calls ``nc._ps.parse(data)`` for every read of
  the socket and ``nc._ps.reset()`` on every new connection. :class:`Parser`
  stands in for ``nc._ps``: the bridge's own MSG/HMSG frames go to a
  natswire Importer, everything else, whole and in order, to nats-py's own
  parser (which stays the reference);
- writing: the bridge appends a run of HPUB frames to ``nc._pending`` (the
  buffer ``publish()`` appends to) and waits on ``nc._flush_pending()``'s
  future, which the flusher task sets once the transport drained it.

Without these (another nats-py), the bridge uses the public API for every
message, as with ``--no-fast-path``.
"""
from __future__ import annotations

from typing import Callable, Optional

# The nats-py versions whose private names above were read and tested, [from, to);
# pyproject's bridge extra pins the same.
TESTED = ((2, 16), (2, 17))


def _version() -> Optional[tuple]:
    try:
        from nats.aio.client import __version__ as text
    except ImportError:
        return None
    try:
        return tuple(int(x) for x in text.split(".")[:2])
    except ValueError:
        return None


def missing(nc) -> Optional[str]:
    """Why the seam is absent from the nats-py client ``nc``, or None."""
    version = _version()
    if version is None or not TESTED[0] <= version < TESTED[1]:
        return f"nats-py {version} is outside the tested range {TESTED}"
    ps = getattr(nc, "_ps", None)
    if ps is None or not callable(getattr(ps, "parse", None)) or not callable(
            getattr(ps, "reset", None)):
        return "nats-py has no Client._ps parser"
    if not isinstance(getattr(nc, "_pending", None), list) or not isinstance(
            getattr(nc, "_pending_data_size", None), int):
        return "nats-py has no Client._pending buffer"
    if not callable(getattr(nc, "_flush_pending", None)):
        return "nats-py has no Client._flush_pending"
    return None


class Parser:
    """Stands in for ``nc._ps``: natswire first, nats-py's parser for the rest."""

    def __init__(self, reference, importer, on_read: Callable[[], None]) -> None:
        self.reference = reference
        self.importer = importer
        self.on_read = on_read

    def reset(self) -> None:
        self.importer.reset()
        self.reference.reset()

    async def parse(self, data: bytes = b"") -> None:
        rest = self.importer.feed(bytes(data))
        self.on_read()
        if rest is not None:
            await self.reference.parse(rest)


def install(nc, importer, on_read: Callable[[], None]) -> None:
    """Put a :class:`Parser` in front of ``nc``'s own; call before connecting."""
    nc._ps = Parser(nc._ps, importer, on_read)


async def write(nc, frames: bytes, count: int, payload_bytes: int) -> None:
    """Hand ``frames`` (``count`` whole PUB/HPUB frames) to nats-py's writer as
    one buffer, and wait until its flusher has drained it to the socket."""
    nc._pending.append(frames)
    nc._pending_data_size += len(frames)
    nc.stats["out_msgs"] += count
    nc.stats["out_bytes"] += payload_bytes
    done = await nc._flush_pending()
    if done is not None:
        await done
