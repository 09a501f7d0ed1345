"""Reply keys: where answers to one asker go, made here and nowhere else.

Every service convention that answers a client (request/reply, ``sbus
queue``, ``sbus store``) uses the one form documented in docs/requests.md
("Reply keys"): the asker learns its credentials with ``whoami``
(``!/cred/GID/UID/PID``, longer behind other brokers) and makes an *inbox*
under them, ``<credentials>/<kind>/<id>/``: ``kind`` names the service
(``reply``, ``queue``, ``store``) and ``id`` is 64 random bits, so two
inboxes of one process never meet. It subscribes to the inbox (the pattern
ends in ``/``: everything under it) and tells the other side a key in it,
``<inbox><suffix>``, the suffix saying what the answer is (a correlation id
for a reply, ``job`` for a queue delivery, ``answer`` for the store). The
broker hands a key under ``!/cred/GID/UID/PID/`` only to a client with those
credentials, so nobody else reads an answer, and an answer to an asker that
has gone is dropped.

This module makes and reads such keys; it sends nothing.
"""
from __future__ import annotations

import os
from typing import Optional, Union

from .protocol import Credentials

# Bytes of randomness in an id: 64 bits, so ids are neither guessed nor repeated.
ID_BYTES = 8


def new_id() -> str:
    """A fresh random id (hex): an inbox's, a correlation id, a token."""
    return os.urandom(ID_BYTES).hex()


def is_private(key: bytes) -> bool:
    """True for a key under ``!/cred/``, which only its owner may subscribe to."""
    return key.startswith(b"!/cred/")


def local_form(key: bytes) -> bytes:
    """A private key as its owner receives it: a nested key (under a leaf
    broker's or a private bridge's prefix, as whoami answers there) from its
    last ``!/cred/`` form on, since each hop takes its own prefix off."""
    at = key.rfind(b"/!/cred/")
    return key[at + 1:] if at >= 0 else key


class PrivateInbox:
    """``<credentials>/<kind>/<id>/``: where one asker's answers arrive.

    ``pattern`` is what the asker subscribes to; ``key(suffix)`` is where an
    answer goes; ``suffix_of(key)`` is the suffix of a key in the inbox (as
    the broker delivers it: in the local form), or None for any other key.
    """

    __slots__ = ("prefix", "id", "_bytes", "_raw")

    def __init__(self, credentials: Credentials, kind: str, id: Optional[str] = None) -> None:
        if not kind or "/" in kind:
            raise ValueError(f"an inbox kind is one key segment, not {kind!r}")
        self.id = id or new_id()
        self.prefix = f"{credentials}/{kind}/{self.id}/"
        self._bytes = self.prefix.encode()
        self._raw = local_form(self._bytes)

    @property
    def pattern(self) -> str:
        return self.prefix

    def key(self, suffix: Union[str, bytes] = "") -> Union[str, bytes]:
        """A reply key: the inbox and ``suffix`` (bytes for a bytes suffix)."""
        if isinstance(suffix, bytes):
            return self._bytes + suffix
        return self.prefix + suffix

    @property
    def local(self) -> bytes:
        """The inbox as its owner receives its keys (see :func:`local_form`)."""
        return self._raw

    def suffix_of(self, key: bytes) -> Optional[bytes]:
        return key[len(self._raw):] if key.startswith(self._raw) else None

    def __str__(self) -> str:
        return self.prefix

    def __repr__(self) -> str:
        return f"PrivateInbox({self.prefix!r})"
