"""The hostile worker of the live fuzz (test_fuzz.py), in a process of its own:
``python -m workers.hostile ADDRESS SEED SECONDS NCLIENTS VICTIM_CRED``.
Prints one JSON report: what it did, and any private message it saw that
named someone else."""
from __future__ import annotations

import json
import os
import random
import re
import socket
import sys
import time
from collections import Counter

from sbus.client import MAX_MESSAGE

from support.conn import SO_SNDBUFFORCE
from support.garbage import BAD_CRED, CONTROLS, STEADY, VERBS, bang_everywhere, rand_key


class Hostile:
    """One process's worth of hostile clients, driven round-robin."""

    def __init__(self, address, seed, nclients, victim_cred):
        self.address = address
        self.rng = random.Random(seed)
        self.socks = [None] * nclients
        self.victim_cred = victim_cred        # b"!/cred/G/U/P/" of the steady subscriber
        self.own = (os.getgid(), os.getuid(), os.getpid())
        self.stats = Counter()
        self.leaks = []
        self.actions = [
            (self.random_verb, 6), (self.msg_without_nul, 3), (self.huge_pattern, 2),
            (self.sub_unsub_burst, 3), (self.bang_everywhere, 5), (self.bad_cred, 4),
            (self.foreign_cred, 2), (self.oversized, 1), (self.half_close, 2),
            (self.empty_packet, 1), (self.garbage, 4), (self.valid_traffic, 8),
            (self.control, 4), (self.abrupt_close, 2), (self.drain, 6),
            (self.sub_everything, 2), (self.unsub_unknown, 2),
        ]
        self.weights = [w for _, w in self.actions]
        # The first half of the clients mostly behave, so they live long enough
        # to pile up subscriptions, queues and flood modes before they go.
        fatal = {"random_verb", "msg_without_nul", "huge_pattern", "bang_everywhere",
                 "bad_cred", "foreign_cred", "oversized", "half_close", "empty_packet",
                 "garbage", "abrupt_close"}
        self.calm_weights = [w / 50 if f.__name__ in fatal else w for f, w in self.actions]

    # -- plumbing ----------------------------------------------------------

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5)
        s.connect(self.address)
        try:        # room for oversized packets (root may force it)
            s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 4 << 20)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setblocking(False)
        self.stats["connects"] += 1
        return s

    def send(self, s, packet):
        """Send without blocking; a full socket just drops the attempt."""
        if STEADY in packet:
            packet = packet.replace(STEADY, b"xteady")
        try:
            s.send(packet)
            self.stats["packets"] += 1
        except BlockingIOError:
            self.stats["would_block"] += 1

    def check_packet(self, packet):
        """A !/cred/ message must name our own credentials, never another's
        (an empty field names no one)."""
        if not packet.startswith(b"MSG !/cred/"):
            return
        m = re.match(rb"MSG !/cred/(\d*)/(\d*)/(\d*)/", packet)
        if m is None or any(g and int(g) != own for g, own in zip(m.groups(), self.own)):
            self.leaks.append(packet[:80].decode("latin-1"))

    def drain(self, s):
        for _ in range(256):
            try:
                packet = s.recv(1 << 20)
            except BlockingIOError:
                return
            if packet == b"":
                raise ConnectionResetError("eof")
            self.stats["received"] += 1
            self.check_packet(packet)

    # -- actions -----------------------------------------------------------

    def random_verb(self, s):
        rng = self.rng
        packet = rng.choice(VERBS) + rand_key(rng)
        if rng.random() < 0.5:
            packet += b"\0" + rng.randbytes(rng.randrange(20))
        self.send(s, packet)

    def msg_without_nul(self, s):
        self.send(s, b"MSG " + rand_key(self.rng).replace(b"\0", b""))

    def huge_pattern(self, s):
        n = self.rng.choice([4095, 4096, 4097, 5000, 65536, 300000])
        verb = self.rng.choice([b"SUB ", b"UNSUB ", b"SUB !/cred////"])
        self.send(s, verb + b"p" * n)

    def sub_unsub_burst(self, s):
        rng = self.rng
        patterns = [rand_key(rng, 6).replace(b"!", b"") for _ in range(rng.randrange(1, 60))]
        for p in patterns:
            self.send(s, b"SUB " + p)
        rng.shuffle(patterns)
        for p in patterns[: rng.randrange(len(patterns) + 1)]:
            self.send(s, b"UNSUB " + p)

    def bang_everywhere(self, s):
        verb = self.rng.choice([b"SUB ", b"UNSUB ", b"MSG ", b"CMSG "])
        packet = verb + bang_everywhere(self.rng)
        if verb == b"MSG ":
            packet += b"\0x"
        self.send(s, packet)

    def bad_cred(self, s):
        verb = self.rng.choice([b"SUB ", b"UNSUB ", b"MSG "])
        packet = verb + self.rng.choice(BAD_CRED)
        if verb == b"MSG ":
            packet += b"\0payload"
        self.send(s, packet)

    def foreign_cred(self, s):
        """Subscribe to the steady subscriber's private keys (refused)."""
        rest = self.rng.choice([b"", b"x", b"*", b"xteady/"])
        self.send(s, b"SUB " + self.victim_cred + rest)

    def oversized(self, s):
        n = self.rng.choice([MAX_MESSAGE + 1, MAX_MESSAGE + 2, 2 * MAX_MESSAGE, 1 << 20])
        verb = self.rng.choice([b"MSG k\0", b"SUB ", b"CMSG k\0", b"GARBAGE"])
        self.send(s, verb + b"\0" * (n - len(verb)))

    def half_close(self, s):
        how = self.rng.choice([socket.SHUT_WR, socket.SHUT_RD, socket.SHUT_RDWR])
        self.send(s, b"SUB half/closed")
        self.send(s, b"MSG half/closed\0x")
        s.shutdown(how)
        if how != socket.SHUT_WR:
            raise ConnectionResetError("half-closed for reading")
        # Write side closed: the broker sees EOF, we keep reading until it closes.
        s.settimeout(5)
        try:
            while s.recv(1 << 20):
                pass
        except OSError:
            pass
        raise ConnectionResetError("half-closed for writing")

    def empty_packet(self, s):
        self.send(s, b"")

    def garbage(self, s):
        self.send(s, self.rng.randbytes(self.rng.randrange(1, 200)))

    def valid_traffic(self, s):
        rng = self.rng
        for _ in range(rng.randrange(1, 20)):
            key = rng.choice([b"fuzz/a", b"fuzz/b/c", b"x", b"", b"a/b", b"!/cred////anyone",
                              b"!/cred/0/0/1/init-only"])   # pid 1 is no client here
            if rng.random() < 0.3:
                key = rand_key(rng, 4).replace(b"!", b"")
            self.send(s, b"MSG " + key + b"\0" + rng.randbytes(rng.randrange(200)))
        if rng.random() < 0.05:
            self.send(s, b"MSG fuzz/big\0" + b"B" * rng.randrange(100000, 400000))

    def control(self, s):
        self.send(s, self.rng.choice(CONTROLS))

    def abrupt_close(self, s):
        for i in range(self.rng.randrange(50)):
            self.send(s, b"MSG fuzz/a\0%d" % i)
        raise ConnectionResetError("closed mid-burst")

    def sub_everything(self, s):
        self.send(s, b"SUB " + self.rng.choice([b"", b"*", b"*/", b"!/cred////", b"fuzz/"]))

    def unsub_unknown(self, s):
        self.send(s, b"UNSUB " + rand_key(self.rng).replace(b"!", b"x"))

    # -- the loop ------------------------------------------------------------

    def run(self, seconds):
        deadline = time.monotonic() + seconds
        rng = self.rng
        while time.monotonic() < deadline:
            i = rng.randrange(len(self.socks))
            try:
                if self.socks[i] is None:
                    self.socks[i] = self.connect()
                s = self.socks[i]
                weights = self.calm_weights if i < len(self.socks) // 2 else self.weights
                action = rng.choices(self.actions, weights)[0][0]
                self.stats["action:" + action.__name__] += 1
                action(s)
                if rng.random() < 0.3:
                    self.drain(s)
            except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError,
                    socket.timeout, OSError) as e:
                self.stats["disconnects"] += 1
                self.stats["disconnect:" + type(e).__name__] += 1
                if self.socks[i] is not None:
                    self.socks[i].close()
                    self.socks[i] = None
            time.sleep(0.0005)      # a rate the broker can take alongside the steady pair
        for s in self.socks:
            if s is not None:
                try:
                    self.drain(s)
                except OSError:
                    pass
                s.close()
        return {"pid": os.getpid(), "stats": dict(self.stats), "leaks": self.leaks[:20],
                "nleaks": len(self.leaks)}


def hostile_main(argv):
    address, seed, seconds, nclients, victim = argv
    report = Hostile(address, int(seed), int(nclients), victim.encode()).run(float(seconds))
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(hostile_main(sys.argv[1:]))
