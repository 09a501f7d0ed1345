#!/usr/bin/env python3
"""Publishers in Python through ``sbus.Client``: the rates programs send at.

    bench/pypubs.py pubs -a ADDRESS [-P SERVER_PID] [-N PUBS] [-G PROCS] [-r RATE]
                    [-s SIZE] [-d SECONDS] [-w WINDOW]

`loadgen manypubs` with the publishers written as a program would write them:
PUBS ``sbus.Client`` connections spread over PROCS processes, each sending
one message in turn with ``Client.publish`` (one send(2) per message), to one
subscriber (also an ``sbus.Client``, reading with ``receive_many``) in
``blocking/hard/block`` mode. The payload is loadgen's manypubs header
(sequence number, publisher, CLOCK_MONOTONIC ns at the send) padded to SIZE,
so the subscriber counts loss and order per publisher and times each
delivery from its send. Without -r the publishers keep at most WINDOW
messages in flight toward the subscriber (saturation: as fast as Python
publishers and the broker go); with -r RATE they offer RATE messages/s in
all, spread evenly, and no window applies. Prints one line of JSON with
loadgen's keys (``msgs_per_s``, ``server_cpu_us_per_delivery``, ``p50_us``,
``p99_us``, ``lost``...), so bench/harness.py reads it as a loadgen run.
Speaks only what bench/relay speaks too (MSG, SUB, UNSUB, a CMSG it ignores).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import select
import struct
import sys
import time

from harness import thread_cpu_seconds

import sbus
from sbus.client.protocol import Message

KEY = b"bench/k"
HEADER = struct.Struct("<QIQ")  # seq, publisher, sent at (ns): loadgen's PUB_HEADER layout
SYNC_WAVE = 100
LAT_SAMPLES = 1 << 22
STALL_S = 5.0       # no progress this long: the run is stalled
TAIL_S = 1.0        # the publishers are done and nothing came this long: the rest is lost
# Shared words (8 bytes each): the parent's, the subscriber's, then one per
# publisher process (messages it sent) and one per publisher (its final count).
GO, T0_NS, DONE, TOTAL, PROGRESS, READY, STALLED = range(7)
FIRST_PROC = 8


class Shared:
    """Words in memory mapped before the forks; each word has one writer."""

    def __init__(self, procs: int, pubs: int):
        self.procs = procs
        self.map = mmap.mmap(-1, 8 * (FIRST_PROC + procs + pubs))
        self.w = memoryview(self.map).cast("Q")

    def sent(self) -> int:
        return sum(self.w[FIRST_PROC:FIRST_PROC + self.procs])

    def pub_final(self, pub: int) -> int:
        return self.w[FIRST_PROC + self.procs + pub]


def sync(clients: list, tag_base: int) -> None:
    """The broker has processed all these clients sent: each subscribes to a
    key of its own, publishes on it and waits for it (as loadgen's
    sync_clients; the relay does the same)."""
    for w in range(0, len(clients), SYNC_WAVE):
        wave = list(enumerate(clients[w:w + SYNC_WAVE], tag_base + w))
        for n, c in wave:
            tag = b"sy%dx%d/s" % (os.getpid(), n)
            c.subscribe(tag)
            c.publish(tag)
        for n, c in wave:
            tag = b"sy%dx%d/s" % (os.getpid(), n)
            while True:
                m = c.receive(timeout=10.0)
                if type(m) is Message and m.key == tag:
                    break
            c.unsubscribe(tag)


def subscriber(opts, sh: Shared, out_fd: int) -> None:
    c = sbus.Client(opts.address)
    c.send_cmsg("blocking/hard/block")
    c.subscribe(KEY)
    sync([c], 1_000_000)
    sh.w[READY] += 1
    nxt = [0] * opts.pubs
    lat: list = []
    received = lost = reordered = bad = tail = 0
    progress = 0
    t_last = 0.0
    idle_since = None
    size, w = opts.size, sh.w
    unpack = HEADER.unpack_from
    while True:
        try:
            batch = c.receive_many(64, timeout=0.1)
        except TimeoutError:
            if w[DONE]:
                if progress >= w[TOTAL]:
                    break
                if idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > TAIL_S:
                    for p in range(opts.pubs):
                        gap = sh.pub_final(p) - nxt[p]
                        if gap > 0:
                            lost += gap
                            tail += gap
                    break
            continue
        idle_since = None
        t_now = time.monotonic_ns()
        for m in batch:
            if type(m) is not Message or m.key != KEY or len(m.payload) != size:
                bad += 1
                continue
            seq, pub, sent_ns = unpack(m.payload)
            if pub >= opts.pubs:
                bad += 1
                continue
            received += 1
            want = nxt[pub]
            if seq == want:
                nxt[pub] = seq + 1
                progress += 1
            elif seq > want:
                lost += seq - want
                progress += seq + 1 - want
                nxt[pub] = seq + 1
            else:
                reordered += 1
            if len(lat) < LAT_SAMPLES:
                lat.append(t_now - sent_ns if t_now > sent_ns else 0)
        t_last = time.monotonic()
        w[PROGRESS] = progress
        if w[DONE] and progress >= w[TOTAL]:
            break
    w[PROGRESS] = 1 << 62   # never hold a publisher back again
    lat.sort()

    def pct(p):
        return lat[int(p / 100 * (len(lat) - 1) + 0.5)] / 1e3 if lat else 0.0

    doc = dict(received=received, lost=lost, tail_lost=tail, reordered=reordered, bad=bad,
               t_last=t_last, p50_us=pct(50), p99_us=pct(99), max_us=lat[-1] / 1e3 if lat else 0.0)
    os.write(out_fd, json.dumps(doc).encode())
    os._exit(0)


def publishers(opts, sh: Shared, proc: int, first: int, count: int) -> None:
    clients = [sbus.Client(opts.address) for _ in range(count)]
    sync(clients, 4_000_000 + first)
    w = sh.w
    os.write(opts.ready_w, b"r")
    while not w[GO]:
        time.sleep(0.0002)
    t0 = w[T0_NS] / 1e9
    deadline = t0 + opts.duration
    rate = opts.rate * count / opts.pubs    # this process's share
    pad = b"x" * (opts.size - HEADER.size)
    seq = [0] * count
    pack, mono_ns, mono = HEADER.pack, time.monotonic_ns, time.monotonic
    slot = FIRST_PROC + proc
    sent = 0
    i = 0
    chunk_max = min(count, 64, opts.window // 4)
    while True:
        t = mono()
        if t >= deadline:
            break
        if rate:
            due = int((t - t0) * rate)
            if due <= sent:
                time.sleep(max(0.0, t0 + (sent + 1) / rate - t))
                continue
            chunk = due - sent
        else:
            chunk = chunk_max
            if not wait_window(opts, sh, chunk):
                w[STALLED] = 1
                break
        w[slot] = sent + chunk
        for _ in range(chunk):
            clients[i].publish(KEY, pack(seq[i], first + i, mono_ns()) + pad)
            seq[i] += 1
            i = i + 1 if i + 1 < count else 0
        sent += chunk
    for k in range(count):
        w[FIRST_PROC + sh.procs + first + k] = seq[k]
    os._exit(0)


def wait_window(opts, sh: Shared, chunk: int) -> bool:
    """Room for `chunk` more in flight; False after STALL_S without progress.
    Polls: the subscriber is Python too and a futex is not to be had here;
    the sleeps fall on the load generator's core, not the server's."""
    w = sh.w
    last, since = w[PROGRESS], time.monotonic()
    while sh.sent() - min(w[PROGRESS], sh.sent()) + chunk > opts.window:
        p = w[PROGRESS]
        if p != last:
            last, since = p, time.monotonic()
        elif time.monotonic() - since > STALL_S:
            return False
        time.sleep(0.00005)
    return True


def wait_ready(opts, sh: Shared, pids: list) -> bool:
    """Every publisher process wrote its byte and the subscriber is in place."""
    ready, deadline = 0, time.monotonic() + 60
    while ready < opts.procs or not sh.w[READY]:
        if time.monotonic() > deadline:
            return False
        if any(os.waitpid(pid, os.WNOHANG)[0] for pid in pids):
            return False
        if ready < opts.procs and select.select([opts.ready_r], [], [], 0.1)[0]:
            ready += len(os.read(opts.ready_r, opts.procs))
        elif ready >= opts.procs:
            time.sleep(0.001)
    return True


def own_cpu() -> float:
    s, k = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + k.ru_utime + k.ru_stime


def run(opts) -> int:
    sh = Shared(opts.procs, opts.pubs)
    sub_r, sub_w = os.pipe()
    opts.ready_r, opts.ready_w = os.pipe()
    sub = os.fork()
    if sub == 0:
        try:
            subscriber(opts, sh, sub_w)
        finally:
            os._exit(1)
    pids = []
    first = 0
    for p in range(opts.procs):
        count = opts.pubs // opts.procs + (p < opts.pubs % opts.procs)
        pid = os.fork()
        if pid == 0:
            try:
                publishers(opts, sh, p, first, count)
            finally:
                os._exit(1)
        pids.append(pid)
        first += count
    os.close(sub_w)
    os.close(opts.ready_w)
    if not wait_ready(opts, sh, [sub, *pids]):
        for pid in [sub, *pids]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        print(json.dumps({"error": "clients did not get ready (one exited, or 60 s passed)"}), flush=True)
        return 1
    cpu0 = thread_cpu_seconds(opts.server_pid) if opts.server_pid else None
    t0 = time.monotonic_ns()
    sh.w[T0_NS] = t0
    sh.w[GO] = 1
    for pid in pids:
        os.waitpid(pid, 0)
    sent = sh.sent()
    sh.w[TOTAL] = sent
    sh.w[DONE] = 1
    data = b""
    while chunk := os.read(sub_r, 65536):
        data += chunk
    os.waitpid(sub, 0)
    cpu = thread_cpu_seconds(opts.server_pid) - cpu0 if opts.server_pid else None
    if not data:
        print(json.dumps({"error": "the subscriber exited without figures"}), flush=True)
        return 1
    s = json.loads(data)
    seconds = max(1e-9, s.pop("t_last") - t0 / 1e9)
    received = s["received"]
    doc = dict(mode="pypubs", seconds=seconds, server_cpu=cpu if cpu is not None else -1,
               loadgen_cpu=own_cpu(), publishers=opts.pubs, publisher_procs=opts.procs,
               offered_rate=float(opts.rate), subscribers=1, window=opts.window, messages=sent,
               deliveries=received, stalled=bool(sh.w[STALLED]), unfinished=0, eof=0,
               msgs_per_s=sent / seconds, deliveries_per_s=received / seconds,
               server_cpu_us_per_delivery=cpu * 1e6 / received if cpu is not None and received else -1,
               server_cpu_us_per_msg=cpu * 1e6 / sent if cpu is not None and sent else -1, **s)
    print(json.dumps(doc), flush=True)
    return 2 if doc["stalled"] or s["lost"] or s["reordered"] or s["bad"] else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("pubs",))
    ap.add_argument("-a", dest="address", required=True)
    ap.add_argument("-P", dest="server_pid", type=int, default=0)
    ap.add_argument("-N", dest="pubs", type=int, default=256)
    ap.add_argument("-G", dest="procs", type=int, default=1)
    ap.add_argument("-r", dest="rate", type=float, default=0.0)
    ap.add_argument("-s", dest="size", type=int, default=64)
    ap.add_argument("-d", dest="duration", type=float, default=1.5)
    ap.add_argument("-w", dest="window", type=int, default=256)
    opts = ap.parse_args(argv)
    if opts.size < HEADER.size:
        ap.error(f"-s: payloads carry a {HEADER.size}-byte header")
    if not 1 <= opts.procs <= opts.pubs:
        ap.error("-G: 1 to -N publisher processes")
    return run(opts)


if __name__ == "__main__":
    sys.exit(main())
