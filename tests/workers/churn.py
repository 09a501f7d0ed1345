"""The churn worker of the soak (test_soak.py), in a process of its own:
``python -m workers.churn ADDRESS SECONDS SEED``. Waves of clients connect,
subscribe, publish and leave (cleanly, mid-burst, half-closed, with data
queued, or SIGKILLed in forked children). Prints one JSON report of counts."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import sys
import time
from collections import Counter

from support.conn import SO_SNDBUFFORCE, Conn


def _connect(address, timeout=10.0):
    return Conn.to(address, timeout)



PATTERNS = [b"churn/%d", b"churn/", b"", b"steady/", b"churn/*/x", b"!/cred////churn/",
            b"*", b"churn/%d/x"]
SIZES = [16, 200, 2000, 20000]


def _subscribe(rng, s):
    for _ in range(rng.randrange(5)):
        p = rng.choice(PATTERNS)
        s.send(b"SUB " + (p % rng.randrange(20) if b"%d" in p else p))
    if rng.random() < 0.2:
        s.send(rng.choice([b"CMSG blocking/soft/discard", b"CMSG order/stack",
                           b"CMSG order/random", b"CMSG echo/off", b"CMSG blocking/hard/error"]))


def _burst(rng, s, n):
    """Up to n messages without blocking; returns how many went out."""
    s.setblocking(False)
    sent = 0
    for _ in range(n):
        size = rng.choice(SIZES) if rng.random() > 0.002 else 200000
        try:
            s.send(b"MSG churn/%d/x\0" % rng.randrange(20) + b"c" * size)
        except BlockingIOError:
            break
        sent += 1
    return sent


def _in_process_wave(rng, address, stats):
    socks = []
    for _ in range(rng.randrange(50, 150)):
        try:
            s = _connect(address)
            _subscribe(rng, s)
        except OSError:
            stats["connect_errors"] += 1
            continue
        socks.append(s)
        stats["clients"] += 1
    keep = []
    for s in socks:
        try:
            stats["messages"] += _burst(rng, s, rng.randrange(40))
            fate = rng.random()
            if fate < 0.25:
                stats["closed_mid_burst"] += 1
                s.close()
                continue
            if fate < 0.35:
                s.shutdown(socket.SHUT_WR)
                stats["half_closed"] += 1
            elif fate < 0.45:
                s.shutdown(socket.SHUT_RDWR)
                stats["shut_rdwr"] += 1
            elif fate < 0.6:
                try:
                    s.recv(1 << 20)
                except (BlockingIOError, OSError):
                    pass
                stats["read_then_closed"] += 1
                s.close()
                continue
        except OSError:
            stats["send_errors"] += 1
        keep.append(s)
    keep += _hoard(rng, address, stats)
    time.sleep(rng.uniform(0, 0.2))         # hold the queues a while: part of the churn
    for s in keep:          # the rest leave all at once, most with data queued
        s.close()


HOARD_BYTES = 8 << 20       # the default per-client queue limit


def _hoard(rng, address, stats):
    """Two subscribers that never read get a full queue each (distinct keys,
    so nothing is shared): memory abuse the broker must give back."""
    hoarders, pub = [], _connect(address)
    pub.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 4 << 20)
    for _ in range(2):
        key = b"hoard/%d/%d" % (os.getpid(), rng.randrange(1 << 30))
        h = _connect(address)
        h.send(b"SUB " + key)
        h.settimeout(30)
        h.sync()            # subscribed before the flood starts
        hoarders.append(h)
        size = rng.choice([4000, 20000, 60000])
        for _ in range(HOARD_BYTES // size):
            pub.send(b"MSG " + key + b"\0" + b"h" * size)
        stats["hoarded_bytes"] += HOARD_BYTES
    pub.close()
    stats["clients"] += 3
    return hoarders


def _child(address, seed):
    rng = random.Random(seed)
    socks = []
    for _ in range(rng.randrange(3, 8)):
        s = _connect(address)
        _subscribe(rng, s)
        socks.append(s)
    until = time.monotonic() + rng.uniform(0.1, 1.0)
    while time.monotonic() < until:     # send until killed, or leave without closing
        s = rng.choice(socks)
        s.settimeout(1)
        for _ in range(rng.randrange(1, 20)):
            try:
                s.send(b"MSG churn/%d/x\0" % rng.randrange(20) + b"k" * rng.choice(SIZES))
            except OSError:
                break
        time.sleep(0.005)                   # a steady sender, until it is killed


def _forked_wave(rng, address, stats):
    pids = []
    for _ in range(rng.randrange(4, 12)):
        seed = rng.randrange(1 << 30)
        pid = os.fork()
        if pid == 0:
            try:
                _child(address, seed)
            finally:
                os._exit(0)
        pids.append(pid)
    stats["children"] += len(pids)
    time.sleep(rng.uniform(0.05, 0.3))      # let the children send before killing them
    for pid in pids:
        if rng.random() < 0.7:
            try:
                os.kill(pid, signal.SIGKILL)
                stats["children_killed"] += 1
            except ProcessLookupError:
                pass
    for pid in pids:
        os.waitpid(pid, 0)


def churn_main(argv):
    address, seconds, seed = argv[0], float(argv[1]), int(argv[2])
    rng = random.Random(seed)
    stats = Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _in_process_wave(rng, address, stats)
        _forked_wave(rng, address, stats)
        stats["waves"] += 1
        time.sleep(0.05)                    # a breath between waves
    sys.stdout.write(json.dumps(stats) + "\n")
    return 0



if __name__ == "__main__":
    sys.exit(churn_main(sys.argv[1:]))
