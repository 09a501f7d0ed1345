#!/usr/bin/env python3
"""Python client throughput: sbus.Client and sbus.aio beside nats-py and redis-py.

    bench/bench_clients.py [--count N] [--payload BYTES] [--repeat R] [--rows NAME,...]
                           [--json PATH]

Publish rows publish with no subscriber (the server matches nothing) and
end with a round trip, so every message was taken; receive rows time a
subscriber from its first message to its last while another process
publishes as fast as its client can (sbus: publish_many; NATS: publish and
flush; Redis: a pipeline of 100). Every server runs on this machine: sbusd
on a unix socket, nats-server on loopback TCP, redis-server on a unix socket.
The ``-frames`` rows take frames first (``take_frames()``, granted to the
broker's own uid or root: docs/clients.md), the receive row on both ends.

Rows are interleaved (each repeat runs every row once) so that a change in
the machine's load falls on all of them alike; the table gives the median
and the load average seen. Prints the table on stdout, progress on stderr,
and writes the raw figures as JSON (default bench/results/clients-<UTC>.json).
Each measurement runs in a fresh process: ``--worker ROW`` is that process.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import NatsServer, Sbusd, alternate, cpu_seconds, end_process, nats_server_path, results_path, say

BIN = Path(sys.executable).parent
KEY = "bench/key"
IDLE = 5.0          # seconds without a message before a receiver gives up (loss)
REDIS_BATCH = 100

# name: (system, kind, what the row calls, share of --count it publishes)
ROWS = {
    "sbus-sync-publish": ("sbus", "publish", "sbus.Client.publish()", 1.0),
    "sbus-sync-publish-buffered": ("sbus", "publish", "sbus.Client(buffered=True).publish()", 1.0),
    "sbus-sync-publish-many": ("sbus", "publish", "sbus.Client.publish_many()", 1.0),
    "sbus-sync-publish-many-frames": ("sbus", "publish", "publish_many(), after take_frames()", 1.0),
    "sbus-aio-publish": ("sbus", "publish", "await sbus.aio.Client.publish()", 1.0),
    "sbus-aio-publish-buffered": ("sbus", "publish", "sbus.aio.Client(buffered=True).publish()", 1.0),
    "sbus-aio-publish-many": ("sbus", "publish", "await sbus.aio.Client.publish_many()", 1.0),
    "nats-publish": ("nats", "publish", "await nats-py publish() + flush()", 1.0),
    "redis-publish": ("redis", "publish", "redis-py publish()", 0.1),
    "redis-publish-pipelined": ("redis", "publish", f"redis-py pipeline of {REDIS_BATCH}", 0.5),
    "sbus-sync-receive": ("sbus", "receive", "sbus.Client.receive()", 1.0),
    "sbus-sync-receive-iter": ("sbus", "receive", "for m in sbus.Client (batched)", 1.0),
    "sbus-sync-receive-many": ("sbus", "receive", "sbus.Client.receive_many(64)", 1.0),
    "sbus-sync-receive-many-frames": ("sbus", "receive", "receive_many(64), both ends take_frames()",
                                      1.0),
    "sbus-aio-receive": ("sbus", "receive", "await sbus.aio.Client.receive()", 1.0),
    "sbus-aio-receive-iter": ("sbus", "receive", "async for m in sbus.aio.Client (batched)", 1.0),
    "nats-receive": ("nats", "receive", "nats-py subscription callback", 1.0),
    "redis-receive": ("redis", "receive", "redis-py PubSub.get_message()", 0.5),
}
TARGETS = {"publish": 650_000, "receive": 400_000}


# CPU time this process spent in the timed part of a run (user + system):
# what the client costs per message, whatever else the machine is doing.
_CPU = {"start": 0.0, "end": 0.0}


def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def start_clock():
    _CPU["start"] = _cpu()
    return time.perf_counter()


def stop_clock():
    _CPU["end"] = _cpu()
    return time.perf_counter()


# ------------------------------------------------------------------ servers

class Servers:
    """sbusd, nats-server and redis-server in a temporary directory."""

    def __init__(self, systems):
        self.dir = Path(tempfile.mkdtemp(prefix="sbus-bench-clients-"))
        self.addresses = {}
        self.pids = {}          # system: the server's pid, for its CPU time
        self.sbusd = self.nats = self.redis = None
        if "sbus" in systems:
            path = str(self.dir / "sbus.socket")
            self.sbusd = Sbusd(self.dir, ["-f", "-a", path, "--log-level", "off",
                                          "--stats-interval", "0"],
                               address=path, log_level=None).ready(timeout=10)
            self.addresses["sbus"] = path
            self.pids["sbus"] = self.sbusd.pid
        if "nats" in systems:
            if not nats_server_path():
                raise SystemExit("bench_clients: nats-server not found; run `make bench-deps`")
            self.nats = NatsServer(self.dir)
            self.addresses["nats"] = self.nats.url
            self.pids["nats"] = self.nats.proc.pid
        if "redis" in systems:
            path = str(self.dir / "redis.socket")
            self.redis = subprocess.Popen(
                [_which("redis-server"), "--port", "0", "--unixsocket", path, "--save", "",
                 "--appendonly", "no", "--client-output-buffer-limit", "pubsub 0 0 0"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while not os.path.exists(path):
                if time.monotonic() > deadline or self.redis.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.01)
            self.addresses["redis"] = path
            self.pids["redis"] = self.redis.pid

    def stop(self):
        if self.sbusd:
            self.sbusd.stop(timeout=5)
        if self.nats:
            self.nats.stop()
        if self.redis:
            end_process(self.redis, timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)


def _which(name):
    found = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        raise SystemExit(f"bench_clients: {name} not found; run `make bench-deps`")
    return found


# ------------------------------------------------------------------ publishers

def publish_sbus_sync(address, n, payload, how):
    from sbus import Client
    with Client(address, buffered=how == "buffered") as c:
        if how == "many-frames":
            take_frames(c)
        start = start_clock()
        if how.startswith("many"):
            c.publish_many([(KEY, payload)] * n)
        else:
            publish = c.publish
            for _ in range(n):
                publish(KEY, payload)
        c.whoami()          # the broker has read every message
        return stop_clock() - start


def take_frames(client):
    """Frames (docs/clients.md): the broker grants them to its own uid or root."""
    answer = client.take_frames(timeout=5)
    if answer != b"ok":
        raise SystemExit(f"bench_clients: the broker did not grant frames: {answer!r}")


async def publish_sbus_aio(address, n, payload, how):
    from sbus import aio
    async with aio.Client(address, buffered=how == "buffered") as c:
        start = start_clock()
        if how == "many":
            await c.publish_many([(KEY, payload)] * n)
        else:
            publish = c.publish
            for _ in range(n):
                await publish(KEY, payload)
        await c.whoami()
        return stop_clock() - start


async def publish_nats(address, n, payload):
    import nats
    nc = await nats.connect(address, pending_size=64 << 20)
    start = start_clock()
    publish = nc.publish
    for _ in range(n):
        await publish(KEY.replace("/", "."), payload)
    await nc.flush(timeout=60)
    elapsed = stop_clock() - start
    await nc.close()
    return elapsed


def publish_redis(address, n, payload, pipelined):
    import redis
    r = redis.Redis(unix_socket_path=address)
    start = start_clock()
    if pipelined:
        for i in range(0, n, REDIS_BATCH):
            pipe = r.pipeline(transaction=False)
            for _ in range(min(REDIS_BATCH, n - i)):
                pipe.publish(KEY, payload)
            pipe.execute()
    else:
        for _ in range(n):
            r.publish(KEY, payload)
    elapsed = stop_clock() - start
    r.close()
    return elapsed


# ------------------------------------------------------------------ receivers

def start_publisher(system, address, n, payload_size):
    """A process publishing n messages as fast as its client can."""
    return subprocess.Popen([sys.executable, __file__, "--feed", system, "--address", address,
                             "--count", str(n), "--payload", str(payload_size)])


def feed(system, address, n, payload):
    if system.startswith("sbus"):    # sbus, or sbus-frames
        publish_sbus_sync(address, n, payload, "many-frames" if system == "sbus-frames" else "many")
    elif system == "nats":
        asyncio.run(publish_nats(address, n, payload))
    else:
        publish_redis(address, n, payload, True)


def receive_sbus_sync(address, n, payload_size, how):
    from sbus import Client
    with Client(address) as c:
        c.send_cmsg("blocking/hard/block")      # lossless: the broker waits for us
        c.subscribe(KEY)
        if how == "many-frames":
            take_frames(c)
        c.whoami()
        pub = start_publisher("sbus-frames" if how == "many-frames" else "sbus", address, n,
                              payload_size)
        got, first = 0, None
        try:
            if how == "iter":
                c.receive(timeout=IDLE)
                first, got = start_clock(), 1
                for _ in c:
                    got += 1
                    if got == n:
                        break
            elif how.startswith("many"):
                got = len(c.receive_many(1, timeout=IDLE))
                first = start_clock()     # timing starts at the first message
                while got < n:
                    got += len(c.receive_many(64, timeout=IDLE))
            else:
                receive = c.receive
                receive(timeout=IDLE)
                first, got = start_clock(), 1
                while got < n:
                    receive()
                    got += 1
        except TimeoutError:
            pass
        elapsed = stop_clock() - first
        pub.wait()
        return elapsed, got


async def receive_sbus_aio(address, n, payload_size, how):
    from sbus import aio
    async with aio.Client(address) as c:
        await c.send_cmsg("blocking/hard/block")
        await c.subscribe(KEY)
        await c.whoami()
        pub = start_publisher("sbus", address, n, payload_size)
        await asyncio.wait_for(c.receive(), IDLE)
        first, got = start_clock(), 1
        if how == "iter":
            async for _ in c:
                got += 1
                if got == n:
                    break
        else:
            receive = c.receive
            while got < n:
                await receive()
                got += 1
        elapsed = stop_clock() - first
        pub.wait()
        return elapsed, got


async def receive_nats(address, n, payload_size):
    import nats
    nc = await nats.connect(address)
    state = {"got": 0, "first": None, "last": None}
    done = asyncio.get_running_loop().create_future()

    async def on_message(msg):
        state["got"] += 1
        if state["first"] is None:
            state["first"] = start_clock()
        if state["got"] == n and not done.done():
            state["last"] = stop_clock()
            done.set_result(None)

    await nc.subscribe(KEY.replace("/", "."), cb=on_message, pending_msgs_limit=n + 10,
                       pending_bytes_limit=1 << 30)
    await nc.flush()
    pub = start_publisher("nats", address, n, payload_size)
    last_seen = -1
    while not done.done():      # give up after IDLE seconds without progress (slow consumer)
        await asyncio.wait([done], timeout=IDLE)
        if state["got"] == last_seen:
            break
        last_seen = state["got"]
    end = state["last"] or stop_clock()
    await asyncio.get_running_loop().run_in_executor(None, pub.wait)
    await nc.close()
    return end - (state["first"] or end), state["got"]


def receive_redis(address, n, payload_size):
    import redis
    r = redis.Redis(unix_socket_path=address)
    ps = r.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(KEY)
    while ps.get_message(timeout=1) is None and not ps.subscribed:
        pass
    pub = start_publisher("redis", address, n, payload_size)
    got, first = 0, None
    get = ps.get_message
    while got < n:
        m = get(timeout=IDLE)
        if m is None:
            break
        if first is None:
            first = start_clock()
        got += 1
    elapsed = stop_clock() - (first or time.perf_counter())
    pub.wait()
    ps.close()
    r.close()
    return elapsed, got


# ------------------------------------------------------------------ one measurement

def measure(row, address, n, payload_size):
    """{"rate", "count", "seconds"} for one run of a row (in this process)."""
    payload = b"p" * payload_size
    got = n
    if row == "sbus-sync-publish":
        t = publish_sbus_sync(address, n, payload, "one")
    elif row == "sbus-sync-publish-buffered":
        t = publish_sbus_sync(address, n, payload, "buffered")
    elif row.startswith("sbus-sync-publish-many"):
        t = publish_sbus_sync(address, n, payload, row[len("sbus-sync-publish-"):])
    elif row == "sbus-aio-publish":
        t = asyncio.run(publish_sbus_aio(address, n, payload, "one"))
    elif row == "sbus-aio-publish-buffered":
        t = asyncio.run(publish_sbus_aio(address, n, payload, "buffered"))
    elif row == "sbus-aio-publish-many":
        t = asyncio.run(publish_sbus_aio(address, n, payload, "many"))
    elif row == "nats-publish":
        t = asyncio.run(publish_nats(address, n, payload))
    elif row == "redis-publish":
        t = publish_redis(address, n, payload, False)
    elif row == "redis-publish-pipelined":
        t = publish_redis(address, n, payload, True)
    elif row.startswith("sbus-sync-receive"):
        t, got = receive_sbus_sync(address, n, payload_size, row[len("sbus-sync-receive-"):])
    elif row.startswith("sbus-aio-receive"):
        t, got = asyncio.run(receive_sbus_aio(address, n, payload_size,
                                              row[len("sbus-aio-receive-"):]))
    elif row == "nats-receive":
        t, got = asyncio.run(receive_nats(address, n, payload_size))
    elif row == "redis-receive":
        t, got = receive_redis(address, n, payload_size)
    else:
        raise SystemExit(f"unknown row {row!r}")
    # a receive row's clock starts at its first message
    timed = got - 1 if ROWS[row][1] == "receive" else got
    cpu = _CPU["end"] - _CPU["start"]
    return {"rate": timed / t if t > 0 else 0.0, "count": got, "expected": n, "seconds": t,
            "cpu_seconds": cpu, "cpu_us_per_msg": cpu / max(1, timed) * 1e6}


def run_worker(row, address, n, payload_size):
    cmd = [sys.executable, __file__, "--worker", row, "--address", address,
           "--count", str(n), "--payload", str(payload_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{row}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ report

def table(summary, payload_size, load):
    sync = {k: v for k, v in summary.items()}
    lines = [f"Python clients, {payload_size}-byte payloads, median of the runs "
             f"(load average {load[0]:.1f} before, {load[1]:.1f} after)",
             "client CPU: user+system time of the client's process per message in the timed "
             "part (1/it: what one core would do alone); server: the server's, whole run",
             "", f"{'row':<30} {'calls':<45} {'msgs/s':>10} {'CPU us/msg':>10} {'server':>7} "
                 f"{'runs':>5}  note",
             "-" * 129]
    for row, (system, kind, calls, _) in ROWS.items():
        if row not in summary:
            continue
        s = summary[row]
        note = []
        if s["lost"]:
            note.append(f"{s['lost']} not received")
        if system == "sbus" and row.endswith(("-many", "-iter", "-buffered")):
            note.append(f"target {TARGETS[kind] // 1000}k")
        if row.startswith("sbus-aio"):
            twin = row.replace("sbus-aio", "sbus-sync")
            if twin in sync and sync[twin]["rate"]:
                note.append(f"{s['rate'] / sync[twin]['rate']:.2f}x sync")
        nats = sync.get(f"nats-{kind}")
        if system == "sbus" and nats and nats["rate"]:
            note.append(f"{s['rate'] / nats['rate']:.2f}x nats-py")
        lines.append(f"{row:<30} {calls:<45} {s['rate']:>10,.0f} {s['cpu_us']:>10.2f} "
                     f"{s['server_cpu_us']:>7.2f} {s['runs']:>5}  {'; '.join(note)}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=200_000, help="messages per run (default 200000)")
    ap.add_argument("--payload", type=int, default=64, help="payload bytes (default 64)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row, interleaved (default 3)")
    ap.add_argument("--rows", help="comma-separated row names (default all): " + ", ".join(ROWS))
    ap.add_argument("--json", type=Path, help="where to write the raw figures")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--feed", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.feed:
        feed(args.feed, args.address, args.count, b"p" * args.payload)
        return 0
    if args.worker:
        print(json.dumps(measure(args.worker, args.address, args.count, args.payload)))
        return 0

    rows = args.rows.split(",") if args.rows else list(ROWS)
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows: {', '.join(unknown)}")
    servers = Servers({ROWS[r][0] for r in rows})
    load_before = os.getloadavg()[0]

    def run_one(row):
        n = max(1000, int(args.count * ROWS[row][3]))
        server = servers.pids[ROWS[row][0]]
        before = cpu_seconds(server)
        result = run_worker(row, servers.addresses[ROWS[row][0]], n, args.payload)
        # the whole run (connecting included), in clock ticks: 0.05 us at 200k
        result["server_cpu_us_per_msg"] = (cpu_seconds(server) - before) / n * 1e6
        result["load"] = os.getloadavg()[0]
        return result

    def progress(i, row, result):
        n = max(1000, int(args.count * ROWS[row][3]))
        say(f"[{i + 1}/{args.repeat}] {row:<30} {result['rate']:>12,.0f} msgs/s"
            f" {result['cpu_us_per_msg']:6.2f} us CPU/msg"
            f" (server {result['server_cpu_us_per_msg']:.2f})"
            f"  ({result['count']}/{n}, load {result['load']:.1f})")

    try:
        series = alternate(rows, args.repeat, run_one, progress)
    finally:
        servers.stop()
    load = (load_before, os.getloadavg()[0])
    runs = {r: series[r].runs for r in rows}
    summary = {r: {"rate": s.median("rate"),
                   "runs": len(s.runs),
                   "cpu_us": s.median("cpu_us_per_msg"),
                   "server_cpu_us": s.median("server_cpu_us_per_msg"),
                   "lost": max(x["expected"] - x["count"] for x in s.runs)}
               for r, s in series.items() if s.runs}
    print(table(summary, args.payload, load))
    out = args.json or results_path("clients")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "when": dt.datetime.utcnow().isoformat() + "Z", "payload": args.payload,
        "count": args.count, "repeat": args.repeat, "cpus": os.cpu_count(),
        "load_average": load, "rows": {r: {"calls": ROWS[r][2], "kind": ROWS[r][1],
                                           "system": ROWS[r][0], **summary.get(r, {}),
                                           "runs": runs[r]} for r in rows},   # each run, not the count
    }, indent=1))
    say(f"raw figures: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
