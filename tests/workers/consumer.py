"""A queue consumer in a process of its own: ``python -m workers.consumer ADDRESS PATTERN
PREFETCH MODE``. It prints one JSON line per job as it gets it ({"tag", "deliveries",
"key", "payload"}); MODE ``ack`` acknowledges each once printed, ``hold`` never does
(so the test can see what it holds, and SIGKILL it holding them)."""
from __future__ import annotations

import json
import sys

from sbus import Client
from sbus.client.consume import consume


def main(address: str, pattern: str, prefetch: str, mode: str) -> None:
    with Client(address) as bus:
        for job in consume(bus, pattern, int(prefetch)):
            sys.stdout.write(json.dumps({"tag": job.tag, "deliveries": job.deliveries,
                                         "key": job.key.decode(),
                                         "payload": job.payload.decode()}) + "\n")
            sys.stdout.flush()
            if mode == "ack":
                job.ack()


if __name__ == "__main__":
    main(*sys.argv[1:])
