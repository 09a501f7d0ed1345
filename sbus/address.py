"""The address syntax shared by ``sbusd``, ``sbus`` and the client library.

Compatible with the original C sbus:

* ``PATH`` -- a socket in the filesystem (default ``/run/sbus.socket``);
* ``/dev/unix/abstract`` -- (server only) bind a random abstract address;
* ``/dev/unix/abstract/HEX`` -- an abstract address: HEX is the hex of
  ``sun_path`` (leading NUL included), zero-padded to the full 108 bytes,
  because C clients bind and connect with ``sizeof(struct sockaddr_un)``;
* ``/dev/fd/N`` -- a socket already open as file descriptor N.

A form that does not parse (odd-length or non-hex HEX, non-numeric N) is taken
as a filesystem path, as the C original does.
"""
from __future__ import annotations

import os
import string
from dataclasses import dataclass
from typing import Optional, Union

from .errors import AddressError

DEFAULT_ADDRESS = "/run/sbus.socket"
SUN_PATH_SIZE = 108
ABSTRACT_PREFIX = "/dev/unix/abstract"
FD_PREFIX = "/dev/fd/"


@dataclass(frozen=True)
class Address:
    """A parsed address; exactly one of ``sun_path``, ``fd`` or ``random`` is set."""

    text: str
    sun_path: Optional[bytes] = None  # what bind/connect take; b"\0..." is abstract
    fd: Optional[int] = None
    random: bool = False

    @property
    def is_abstract(self) -> bool:
        return self.sun_path is not None and self.sun_path[:1] == b"\0"


def parse(text: Union[str, bytes]) -> Address:
    """Parse an address string; raise AddressError if it cannot name a socket."""
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text:
        raise AddressError("empty address")
    if text.startswith(FD_PREFIX):
        digits = text[len(FD_PREFIX):]
        if digits.isdigit() and digits.isascii():
            fd = int(digits)
            if fd > 2**31 - 1:
                raise AddressError(f"bad unix socket address {text!r}: file descriptor out of range")
            return Address(text, fd=fd)
    elif text == ABSTRACT_PREFIX:
        return Address(text, random=True)
    elif text.startswith(ABSTRACT_PREFIX + "/"):
        hexpart = text[len(ABSTRACT_PREFIX) + 1:]
        if len(hexpart) % 2 == 0 and all(c in string.hexdigits for c in hexpart):
            if len(hexpart) > 2 * SUN_PATH_SIZE:
                raise AddressError(f"bad unix socket address {text!r}: name too long")
            raw = bytes.fromhex(hexpart).ljust(SUN_PATH_SIZE, b"\0")
            if raw[:1] != b"\0":
                raise AddressError(f"bad unix socket address {text!r}: an abstract name's hex "
                                   f"begins with 00, its leading NUL (e.g. {ABSTRACT_PREFIX}/00{hexpart})")
            return Address(text, sun_path=raw)
    path = os.fsencode(text)
    if len(path) >= SUN_PATH_SIZE:
        raise AddressError(f"bad unix socket address {text!r}: name too long")
    if b"\0" in path:
        raise AddressError(f"bad unix socket address {text!r}: contains NUL")
    return Address(text, sun_path=path)


def format_abstract(sun_path: bytes) -> str:
    """The ``/dev/unix/abstract/HEX`` form of a bound abstract address."""
    return ABSTRACT_PREFIX + "/" + sun_path.ljust(SUN_PATH_SIZE, b"\0").hex()


def from_environment(explicit: Optional[str] = None) -> str:
    """The address a client should use: explicit, else $SBUS_ADDRESS, else the default."""
    return explicit or os.environ.get("SBUS_ADDRESS") or DEFAULT_ADDRESS
