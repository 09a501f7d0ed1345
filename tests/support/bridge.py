"""What the bridge tests share: the mapping cases, the recorded NATS frames,
a subscriber that collects, publishing on either side."""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from sbus import Client
from sbus.client import MAX_MESSAGE, Message

from .waiting import wait_until

STATS_KEY = b"sbus/bridge/stats"
# The payload of the largest message with an empty key.
BIGGEST = MAX_MESSAGE - 5
# Frames recorded from a real nats-server through nats-py's public API, by
# tools/record_nats_frames.py (which says how to record them again).
FRAMES_PATH = Path(__file__).resolve().parent.parent / "data" / "nats_frames.json"

# (key, subject, Sbus-Key value): the table of docs/bridge.md.
MAPPING_CASES = [
    (b"news/sport", "sbus.news.sport", "news/sport"),
    (b"", "sbus.%", ""),
    (b"a//b", "sbus.a.%.b", "a//b"),
    (b"a/", "sbus.a.%", "a/"),
    (b"/a", "sbus.%.a", "/a"),
    (b"with space/x", "sbus.with%20space.x", "with%20space/x"),
    ("caf\u00e9/\u2603".encode(), "sbus.caf%C3%A9.%E2%98%83", "caf%C3%A9/%E2%98%83"),
    (b"v1.2/*/>", "sbus.v1%2E2.%2A.%3E", "v1.2/*/>"),
    (b"100%/tab\there", "sbus.100%25.tab%09here", "100%25/tab%09here"),
    (b"\xff\x01/\x7f", "sbus.%FF%01.%7F", "%FF%01/%7F"),
]


def wire_cases(biggest_payload: bytes = b"") -> list:
    """(key, payload) for every mapping case with a binary payload, binary and
    empty payloads, CRLF in a payload, and the largest message (empty key,
    ``biggest_payload`` or a fixed pattern of BIGGEST bytes)."""
    out = [(key, bytes(range(256)) + key) for key, _, _ in MAPPING_CASES]
    out += [(b"bin", b"\0\r\n\xff" * 50), (b"empty", b""), (b"crlf/in/payload", b"\r\nMSG x\r\n"),
            (b"", biggest_payload or (bytes(range(256)) * (BIGGEST // 256 + 1))[:BIGGEST])]
    return out


def load_frames() -> dict:
    """tests/data/nats_frames.json with its byte strings as bytes (see the recorder)."""
    data = json.loads(FRAMES_PATH.read_text())
    for case in data["cases"]:
        case["key"] = unlatin(case["key"])
        case["payload"] = unpayload(case["payload"])
        for name in ("hpub", "hmsg", "msg"):
            case[name] = unlatin(case[name]) + case["payload"] + b"\r\n"
    return data


def latin(b: bytes) -> str:
    """Bytes as a JSON-friendly string (one code point per byte)."""
    return b.decode("latin-1")


def unlatin(s: str) -> bytes:
    return s.encode("latin-1")


def unpayload(spec) -> bytes:
    """A payload as the frames file keeps it: a string, or a long repeated pattern."""
    if isinstance(spec, str):
        return unlatin(spec)
    pattern = unlatin(spec["pattern"])
    return (pattern * (spec["length"] // len(pattern) + 1))[:spec["length"]]


class Collector:
    """A subscriber on a broker, receiving in a thread into ``messages``
    (the bridge's stats and the cluster tests' probes left out)."""

    def __init__(self, host, *patterns, modes=()):
        self.bus = Client(host.address)
        for mode in modes:      # flood control, before the first message can come
            self.bus.send_cmsg(mode)
        for p in patterns:
            self.bus.subscribe(p)
        self.bus.whoami(timeout=10)     # SUBs registered
        self.messages = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            try:
                m = self.bus.receive(timeout=0.1)
            except TimeoutError:
                continue
            except Exception:
                return
            if type(m) is Message and m.key != STATS_KEY and not m.key.endswith(b"/probe"):
                self.messages.append((m.key, m.payload))

    def wait_count(self, n, timeout=30.0, what="messages"):
        wait_until(lambda: len(self.messages) >= n, timeout,
                   f"{n} {what} (have {len(self.messages)})")
        return self.messages

    def stop(self):
        self._stop = True
        self._thread.join(5)
        self.bus.close()


def publish_all(host, messages):
    """Publish (key, payload) pairs on a broker; returns once it took them all."""
    with Client(host.address) as bus:
        for key, payload in messages:
            bus.publish(key, payload)
        bus.whoami(timeout=10)


def nats_publish(url, messages):
    """Publish (subject, payload, headers or None) with plain nats-py, flushed."""
    import nats

    async def main():
        nc = await nats.connect(url)
        # A round trip first: nats-server delivered the first publications of a
        # client that had just connected to nobody in about 1 of 10 tries here
        # (the bridge flushes after connecting for the same reason).
        await nc.flush()
        for subject, payload, headers in messages:
            await nc.publish(subject, payload, headers=headers)
        await nc.flush()
        await nc.close()

    asyncio.run(main())


def restart_under(bridge, broker, workdir: Path, cleanup):
    """Stops the bridge's broker and starts another on its address (logging
    in ``workdir``); the new broker once the bridge is back on it."""
    from .sbusd import Sbusd
    mark = bridge.mark()
    broker.stop()
    bridge.wait_for("bridge_local_lost", since=mark)
    again = Sbusd.foreground(workdir, address=broker.address)
    cleanup(again)
    bridge.wait_for("bridge_local_back", 30, since=mark)
    return again


__all__ = ["BIGGEST", "FRAMES_PATH", "MAPPING_CASES", "STATS_KEY", "Collector", "latin",
           "load_frames", "nats_publish", "publish_all", "restart_under", "unlatin", "unpayload", "wire_cases"]
