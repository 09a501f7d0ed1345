"""``sbus store`` against JetStream's file store and SQLite, in one run.

- recording: a ``publish_many`` publisher of N x 64-byte messages into sbusd
  with a store recording them at the default --fsync; every one must be
  recorded (the store's counters: recorded, gaps);
- replay: all of them through :func:`sbus.client.store.replay`, messages/s;
- bytes on disk per message (the segment files);
- memory: the store's VmRSS sampled while it replays ``--rss-records``
  messages (10 million unless --quick) to a client that reads them all;
- anchors: nats-server's JetStream file store through nats-py (publish N
  messages into a stream, then read them back with an ordered consumer), and
  SQLite ``executemany`` (insert, then read back in order).

Figures from a shared machine are indicative; nothing here asserts on speed.

    .venv/bin/python bench/bench_store.py [--quick] [--messages N] [--rss-records N] [--no-anchors]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import NatsServer, Sbusd, status_kib

from support import StoreProcess, wait_until

PAYLOAD = b"p" * 64


def start_store(work: Path, address: str, directory: Path, *extra) -> StoreProcess:
    return StoreProcess(work, address, directory, ["bench/"], "--stats-interval", "0", *extra,
                        log_level="info").ready(timeout=30)


def record(address: str, n: int, batch: int = 1000) -> float:
    import sbus
    from sbus.client.store import store_stats
    with sbus.Client(address) as pub:
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            pub.publish_many((b"bench/%d" % (i % 100), PAYLOAD)
                             for i in range(start, min(n, start + batch)))
        pub.whoami(timeout=60)
        published = time.perf_counter() - t0
        last = [None]

        def caught_up():
            s = store_stats(pub, timeout=60)
            last[0] = s
            return s["recorded"] + s["lost_flood"] >= n
        wait_until(caught_up, 600, "the store to record everything", interval=0.05)
        return published, time.perf_counter() - t0, last[0]


def replay_rate(address: str, n: int):
    import sbus
    from sbus.client.store import replay
    with sbus.Client(address) as c:
        t0 = time.perf_counter()
        count = sum(1 for _ in replay(c, "bench/"))
        return count, count / (time.perf_counter() - t0)


def jetstream(work: Path, n: int):
    import nats
    server = NatsServer(work, extra=["-js", "-sd", str(work / "js")])
    port = server.port

    async def quiet(exc):
        pass

    async def run():
        for _ in range(100):
            try:
                nc = await nats.connect(f"nats://127.0.0.1:{port}", error_cb=quiet,
                                        allow_reconnect=False)
                break
            except Exception:   # noqa: BLE001 - not listening yet
                await asyncio.sleep(0.1)
        js = nc.jetstream()
        await js.add_stream(name="BENCH", subjects=["bench.>"])
        t0 = time.perf_counter()
        for i in range(n):
            await nc.publish("bench.%d" % (i % 100), PAYLOAD)
        await nc.flush()
        while (await js.stream_info("BENCH")).state.messages < n:
            await asyncio.sleep(0.05)
        record_s = time.perf_counter() - t0
        got = 0
        done = asyncio.Event()

        async def cb(msg):
            nonlocal got
            got += 1
            if got == n:
                done.set()
        t0 = time.perf_counter()
        sub = await js.subscribe("bench.>", cb=cb, ordered_consumer=True)
        await asyncio.wait_for(done.wait(), 600)
        replay_s = time.perf_counter() - t0
        await sub.unsubscribe()
        await nc.close()
        return n / record_s, n / replay_s

    try:
        rec, rep = asyncio.run(run())
    finally:
        server.stop()
    size = sum(f.stat().st_size for f in (work / "js").rglob("*.blk"))
    return rec, rep, size / n


def sqlite_anchor(work: Path, n: int):
    db = sqlite3.connect(str(work / "anchor.db"))
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE log (seq INTEGER PRIMARY KEY, time INTEGER, key BLOB, payload BLOB)")
    now = time.time_ns()
    t0 = time.perf_counter()
    for start in range(0, n, 1000):
        db.executemany("INSERT INTO log VALUES (?, ?, ?, ?)",
                       [(i + 1, now, b"bench/%d" % (i % 100), PAYLOAD)
                        for i in range(start, min(n, start + 1000))])
        db.commit()
    rec = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    count = sum(1 for _ in db.execute("SELECT key, payload FROM log ORDER BY seq"))
    rep = count / (time.perf_counter() - t0)
    db.close()
    size = sum(p.stat().st_size for p in work.glob("anchor.db*"))
    return rec, rep, size / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--rss-records", type=int, default=10_000_000)
    ap.add_argument("--quick", action="store_true",
                    help="30,000 messages, the RSS run on 100,000")
    ap.add_argument("--no-anchors", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.messages, args.rss_records = 30_000, 100_000
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        work = Path(tmp)
        sbusd = Sbusd(work, ["-f", "-a", str(work / "bus.socket")], address=str(work / "bus.socket"),
                      log_level="warning").ready()
        address = sbusd.address
        try:
            store = start_store(work, address, work / "log")
            published, recorded_s, stats = record(address, args.messages)
            out["recording"] = {"messages": args.messages, "recorded": stats["recorded"],
                                "lost": stats["lost_flood"], "gaps": stats["gaps"],
                                "publish_msgs_s": round(args.messages / published),
                                "recorded_msgs_s": round(args.messages / recorded_s)}
            count, rate = replay_rate(address, args.messages)
            out["replay"] = {"messages": count, "msgs_s": round(rate)}
            size = sum(p.stat().st_size for p in (work / "log").glob("*.seg"))
            out["bytes_per_message"] = round(size / max(1, stats["recorded"]), 1)
            store.stop()

            # --flood block: every message is recorded, however far the store
            # falls behind the publisher, so the replay is the full count.
            store = start_store(work, address, work / "rss", "--flood", "block")
            extra = args.rss_records
            record(address, extra, batch=4096)
            samples = []
            stop = threading.Event()

            def sample():
                while not stop.is_set():
                    samples.append(status_kib(store.pid, "VmRSS"))
                    time.sleep(0.1)
            before = status_kib(store.pid, "VmRSS")
            t = threading.Thread(target=sample)
            t.start()
            count, rate = replay_rate(address, extra)
            stop.set()
            t.join()
            out["memory"] = {"replayed": count, "rss_kib_before": before,
                             "rss_kib_peak": max(samples or [before]), "msgs_s": round(rate)}
            store.stop()
        finally:
            StoreProcess.stop_all()
            sbusd.stop()
        if not args.no_anchors:
            try:
                rec, rep, per = jetstream(work, args.messages)
                out["jetstream"] = {"record_msgs_s": round(rec), "replay_msgs_s": round(rep),
                                    "bytes_per_message": round(per, 1)}
            except ImportError:
                out["jetstream"] = "skipped: needs nats-py and nats-server (make bench-deps)"
            rec, rep, per = sqlite_anchor(work, args.messages)
            out["sqlite_executemany"] = {"record_msgs_s": round(rec), "replay_msgs_s": round(rep),
                                         "bytes_per_message": round(per, 1)}
    print(json.dumps(out, indent=2))
    lost = out["recording"]["messages"] - out["recording"]["recorded"]
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
