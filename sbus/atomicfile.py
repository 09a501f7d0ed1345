"""Files written whole or not at all: the live upgrade's pidfile and status
file, ``sbus stats --output``'s textfile for node_exporter."""
from __future__ import annotations

import os


def write_atomically(path: str, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` in one rename: a reader sees the old
    content or the new, never a part. The file gets ``mode`` whatever the
    umask (node_exporter, for one, reads as another user)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
