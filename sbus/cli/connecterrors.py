"""What ``sbus`` says when it cannot connect: the address it tried, where that
address came from, what is at it, and what to check or start."""
from __future__ import annotations

import errno
import os
import stat
from typing import Optional

from .. import address as addresses

CHECK = "check -a ADDRESS or SBUS_ADDRESS"
START = "is sbusd running? start it (sbusd, or make run in a clone of sbus)"


def origin(explicit: Optional[str]) -> str:
    """Where the address came from, as the message names it."""
    if explicit:
        return "from -a"
    if os.environ.get("SBUS_ADDRESS"):
        return "from SBUS_ADDRESS"
    return "the default: neither -a nor SBUS_ADDRESS is set"


def _what_is_at(path: str) -> Optional[str]:
    """What is at ``path`` when it is not a socket, or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else \
        "a regular file" if stat.S_ISREG(mode) else "not a socket"


def explain(where: str, came_from: str, exc: OSError) -> str:
    """The message for a failed connection to ``where``: what was tried,
    what was found, and on a second line what to do."""
    tried = f"cannot connect to {where} ({came_from})"
    parsed = None
    try:
        parsed = addresses.parse(where)
    except addresses.AddressError:
        pass
    if (where.startswith(addresses.ABSTRACT_PREFIX + "/") and parsed is not None
            and not parsed.is_abstract):
        return (f"{tried}: not an abstract address (hex digits, an even number of them, "
                f"follow {addresses.ABSTRACT_PREFIX}/), so it was tried as a file: "
                f"{exc.strerror or exc}\n"
                f"  give the address sbusd printed when started with -a {addresses.ABSTRACT_PREFIX}")
    code = exc.errno
    if parsed is not None and parsed.is_abstract and code == errno.ECONNREFUSED:
        return f"{tried}: no broker listens on this abstract address\n  {START}, or {CHECK}"
    if code in (errno.ENOENT, errno.ENOTDIR):
        return f"{tried}: no such socket\n  {START}, or {CHECK}"
    if code == errno.ECONNREFUSED:
        other = _what_is_at(where)
        if other is not None:
            return f"{tried}: it is {other}, not a socket\n  {CHECK}: it names sbusd's socket"
        return (f"{tried}: a socket is there but no broker listens on it (one that stopped "
                f"without removing it)\n  start sbusd (-r replaces a stale socket), or {CHECK}")
    if code == errno.EPROTOTYPE:
        return (f"{tried}: the socket there is not a SOCK_SEQPACKET one, so not sbusd's\n"
                f"  {CHECK}")
    if code in (errno.EACCES, errno.EPERM):
        return (f"{tried}: permission denied\n  the socket's mode keeps this user out; "
                f"sbusd -g, -o or -u USER lets it in")
    return f"{tried}: {exc.strerror or exc}\n  {CHECK}"
