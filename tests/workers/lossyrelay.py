"""A relay that loses and reorders on purpose, for the load generator's own
checks (test_loadgen_manypubs.py): ``python -m workers.lossyrelay PATH``.

Routes "MSG key" to every connection subscribed to exactly that key, with
blocking sends; ignores CMSG. Of the manypubs payloads (seq, publisher), it
drops publisher 0's message 5 and delivers publisher 1's message 3 after its
message 4. Prints "ready" once listening."""
from __future__ import annotations

import selectors
import socket
import struct
import sys

PAYLOAD = struct.Struct("<QI")   # loadgen's manypubs header: seq, then publisher


def main(path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(512)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    subs: dict[bytes, set[socket.socket]] = {}
    held = None
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            s = key.fileobj
            if s is listener:
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ)
                continue
            pkt = s.recv(1 << 17)
            if not pkt:
                sel.unregister(s)
                for group in subs.values():
                    group.discard(s)
                s.close()
                continue
            verb, _, rest = pkt.partition(b" ")
            if verb == b"SUB":
                subs.setdefault(rest, set()).add(s)
            elif verb == b"UNSUB":
                subs.get(rest, set()).discard(s)
            elif verb == b"MSG":
                k, _, payload = rest.partition(b"\0")
                out = [pkt]
                if len(payload) >= PAYLOAD.size:
                    seq, pub = PAYLOAD.unpack_from(payload)
                    if (pub, seq) == (0, 5):
                        out = []
                    elif (pub, seq) == (1, 3):
                        held, out = pkt, []
                    elif (pub, seq) == (1, 4) and held is not None:
                        out, held = [pkt, held], None
                for c in list(subs.get(k, ())):
                    for p in out:
                        c.sendall(p)


if __name__ == "__main__":
    main(sys.argv[1])
