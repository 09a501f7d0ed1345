"""``sbus fds``: file descriptors handed from one process to another named by
its ``!/cred/GID/UID/PID`` address (docs/fds.md).

``wire`` is the convention (packets, keys, the default socket path),
``service`` the process, ``cli`` its options, ``client`` the calls of both
sides: ``give`` and ``Receiver``, and their asyncio twins ``agive`` and
``AsyncReceiver``.
"""
from .client import (
    AsyncClaimer,
    AsyncGiver,
    AsyncReceiver,
    Claimer,
    FdsError,
    Giver,
    Handed,
    Receiver,
    aclaim,
    agive,
    claim,
    give,
)

__all__ = ["AsyncClaimer", "AsyncGiver", "AsyncReceiver", "Claimer", "FdsError", "Giver",
           "Handed", "Receiver", "aclaim", "agive", "claim", "give"]
