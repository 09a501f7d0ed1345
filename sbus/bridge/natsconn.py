"""The bridge's two ways into nats-py: the fast path and the reference path.

Both share everything per message: sbus._core.natswire's Exporter maps,
bounds and counts what goes to NATS, its Importer maps, checks and counts
what comes from NATS. They differ only in how those meet nats-py, which
keeps connecting, authentication, TLS, the seed list, reconnecting and
PING/PONG either way.

:class:`FastPath` runs on the nats-py releases in :data:`TESTED_NATS_PY`
only. It takes each subscription's sid from ``Subscription._id`` and hooks
two narrow places of ``nats.aio.client.Client`` (checked by :func:`missing`):

- reading: the read loop calls ``nc._ps.parse(data)`` for every read of
  the socket and ``nc._ps.reset()`` on every new connection. :class:`Parser`
  stands in for ``nc._ps``: the bridge's own MSG/HMSG frames go to the
  Importer, everything else, whole and in order, to nats-py's own parser;
- writing: a run of the Exporter's HPUB frames is appended to
  ``nc._pending`` (the buffer ``publish()`` appends to), and the bridge
  waits on ``nc._flush_pending()``'s future, which the flusher task sets
  once the transport drained it.

:class:`ReferencePath` uses nats-py's public API only: subscription
callbacks hand each message to ``Importer.push()``, and ``publish()``
sends each message of ``Exporter.take_messages()``. It runs with
``--no-fast-path`` and with any other nats-py release.
"""
from __future__ import annotations

import collections
from typing import Callable, Optional, Tuple

from . import mapping

# The nats-py release series (major.minor) whose private names FastPath uses
# were read and tested; on any other the bridge takes the reference path.
TESTED_NATS_PY = ("2.16",)

# (messages, payload bytes) handed to nats-py by one send(); None when nats-py
# took nothing because its connection is away (send again once it is back).
Sent = Optional[Tuple[int, int]]


def nats_py_version() -> str:
    """The installed nats-py's version, or "" without one."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("nats-py")
    except PackageNotFoundError:
        return ""


def untested(version: str) -> Optional[str]:
    """Why the fast path is not used with nats-py ``version``, or None."""
    if ".".join(version.split(".")[:2]) in TESTED_NATS_PY:
        return None
    return f"nats-py {version or '(unknown)'} is not among the tested {', '.join(TESTED_NATS_PY)}"


def missing(nc) -> Optional[str]:
    """Why FastPath's private names are absent from the nats-py client ``nc``, or None."""
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
    """Stands in for ``nc._ps``: the Importer first, nats-py's parser for the rest."""

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


class FastPath:
    """Frames straight between natswire and nats-py's socket buffers."""

    held = 0    # taken from the Exporter and not yet handed to nats-py: never any

    def __init__(self, importer, on_read: Callable[[], None]) -> None:
        self.name = "fast"
        self.importer = importer
        self.on_read = on_read

    def install(self, nc) -> None:
        """Put a :class:`Parser` in front of ``nc``'s own; call before connecting."""
        nc._ps = Parser(nc._ps, self.importer, self.on_read)

    def subscribed(self, sub) -> None:
        """From now on the frames of ``sub`` go to the Importer."""
        self.importer.add_sid(sub._id)

    async def send(self, nc, exporter, max_bytes: int) -> Sent:
        """Hand the oldest run of frames to nats-py's writer as one buffer and
        wait until its flusher has drained it to the socket."""
        taken = exporter.take(max_bytes)
        if taken is None:
            return 0, 0
        frames, count, payload_bytes = taken
        nc._pending.append(frames)
        nc._pending_data_size += len(frames)
        nc.stats["out_msgs"] += count
        nc.stats["out_bytes"] += payload_bytes
        done = await nc._flush_pending()
        if done is not None:
            await done
        return count, payload_bytes


class ReferencePath:
    """nats-py's public API for every message."""

    def __init__(self, why: str, dropped: Callable[..., None]) -> None:
        self.name = f"reference ({why})"
        # Taken from the Exporter, refused by publish() while NATS was away:
        # sent first once it is back.
        self._unsent: collections.deque = collections.deque()
        self._dropped = dropped

    @property
    def held(self) -> int:
        return len(self._unsent)

    def install(self, nc) -> None:
        pass

    def subscribed(self, sub) -> None:
        pass

    async def send(self, nc, exporter, max_bytes: int) -> Sent:
        """publish() the oldest run of messages, one by one."""
        from nats.errors import (
            ConnectionClosedError,
            ConnectionReconnectingError,
            MaxPayloadError,
            OutboundBufferLimitError,
        )
        unsent = self._unsent
        if not unsent:
            taken = exporter.take_messages(max_bytes)
            if taken is None:
                return 0, 0
            unsent.extend(taken[0])
        count = payload_bytes = 0
        while unsent:
            subject, value, payload = unsent[0]
            try:
                await nc.publish(subject, payload, headers={mapping.HEADER: value})
            except (ConnectionClosedError, ConnectionReconnectingError, OutboundBufferLimitError):
                return (count, payload_bytes) if count else None
            except MaxPayloadError:
                # A server with a smaller max_payload than the one the Exporter checked against.
                self._dropped("out", "unmappable", mapping.decode_header(value), len(payload),
                              "larger than NATS's max_payload")
            else:
                count += 1
                payload_bytes += len(payload)
            unsent.popleft()
        return count, payload_bytes


def choose(fast: bool, importer, on_read: Callable[[], None], dropped: Callable[..., None]):
    """FastPath if wanted and nats-py is a tested release with the names it
    uses, else ReferencePath saying why not."""
    if not fast:
        return ReferencePath("--no-fast-path", dropped)
    why = untested(nats_py_version())
    if why is None:
        import nats.aio.client
        why = missing(nats.aio.client.Client())
    if why is not None:
        return ReferencePath(why, dropped)
    return FastPath(importer, on_read)
