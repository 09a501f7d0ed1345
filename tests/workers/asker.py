"""An asker in a process of its own: ``python -m workers.asker ADDRESS KEY N NAME``.
It makes N requests, one after the other, with the bodies ``NAME:0`` ...
and prints one JSON report: {"replies": [...]} in order."""
from __future__ import annotations

import json
import sys

from sbus import Client


def main(address: str, key: str, n: str, name: str) -> None:
    with Client(address) as bus:
        replies = [bus.request(key, f"{name}:{i}", timeout=20.0).decode()
                   for i in range(int(n))]
    sys.stdout.write(json.dumps({"replies": replies}) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
