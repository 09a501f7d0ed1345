"""A request server in a process of its own: ``python -m workers.server ADDRESS PATTERN``.
It answers ``KEY BODY`` to each request; a body ``fail`` makes its handler
raise ValueError. Prints "ready" once subscribed."""
from __future__ import annotations

import sys

from sbus import Client


def handler(request):
    if request.payload == b"fail":
        raise ValueError("asked to fail")
    return request.key + b" " + request.payload


def main(address: str, pattern: str) -> None:
    with Client(address) as bus:
        bus.subscribe(pattern)
        bus.whoami(timeout=10.0)     # the broker has taken the SUB
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        bus.serve(pattern, handler)


if __name__ == "__main__":
    main(*sys.argv[1:])
