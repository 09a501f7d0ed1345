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
A wait never ends in silence: every 10 s it says on stderr what it waits for
and the store's counters, and past its bound, or when the count can no longer
add up (a loss of unknown size, a stall), it says what it waited for, the
store's and the broker's counters and both logs' warnings, prints the figures
of the phases before it (and ``gave_up``), and exits 2. Exit 1: messages
were lost in the recording run.

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

from harness import BenchError, NatsServer, Sbusd, say, status_kib

from support import StoreProcess

PAYLOAD = b"p" * 64


# A wait says what it waits for this often (stderr), and gives up when the
# store's count has not moved for STALL_S with nothing queued for it, or
# when the phase passes its bound: no run ends without saying why.
PROGRESS_S = 10.0
STALL_S = 60.0
ANSWER_S = 10.0         # one stats request (the store's or the broker's)


def bound_s(n: int) -> float:
    """A phase over n messages gives up past this: 2 minutes plus 10k
    msgs/s, well beyond any slow run seen (the store records 100-300k/s)."""
    return 120.0 + n / 10_000


def start_store(work: Path, address: str, directory: Path, *extra) -> StoreProcess:
    return StoreProcess(work, address, directory, ["bench/"], "--stats-interval", "0", *extra,
                        log_level="info").ready(timeout=30)


BROKER_FIGURES = ("msgs_out", "drops_soft", "drops_hard", "drops_disconnect", "queued_msgs")


def broker_view(client, pid: int) -> dict:
    """The broker's counters for each of the store's connections (pid
    ``pid``; the data one and the request one), by client id."""
    try:
        stats = client.stats(timeout=ANSWER_S)
    except (TimeoutError, OSError) as exc:
        return {"unanswered": str(exc)}
    return {c["client"]: {k: c.get(k, 0) for k in BROKER_FIGURES}
            for c in stats.get("clients", ()) if c.get("pid") == pid}


STORE_FIGURES = ("recorded", "lost_flood", "lost_unknown", "missed_disk_full", "gaps")


def describe(stats, broker: dict) -> str:
    if stats is None:
        mine = "the store has not answered a stats request"
    else:
        mine = ", ".join(f"{k} {stats.get(k, 0):,}" for k in STORE_FIGURES)
    if "unanswered" in broker:
        theirs = f"no answer ({broker['unanswered']})"
    else:
        theirs = "; ".join(f"client {ident}: " + ", ".join(f"{k} {v:,}" for k, v in c.items())
                           for ident, c in broker.items()) or "none connected"
    return f"store: {mine}. broker, for the store's connections: {theirs}"


def warnings(process, limit: int = 20) -> list:
    """A process's log records at warning or above (the store's gaps, a
    lost broker, a full disk; the broker's flood and disconnect reports):
    what explains a count that does not add up."""
    try:
        records = process.records()
    except OSError:
        return []
    return [r for r in records if r.get("level") in ("warning", "error", "critical")][-limit:]


def give_up(what: str, waited: float, stats, broker: dict, logs: dict) -> BenchError:
    lines = [f"gave up after {waited:.0f} s waiting for {what}", describe(stats, broker)]
    for name, process in logs.items():
        lines += [f"{name} log: " + json.dumps(r) for r in warnings(process)]
    return BenchError("\n  ".join(lines))


def record(address: str, n: int, store: StoreProcess, sbusd: Sbusd, batch: int = 1000):
    """Publish n messages, then wait until the store has counted each one
    as recorded or lost; (publish seconds, seconds to that count, its stats).
    Says every PROGRESS_S what it waits for; BenchError past bound_s(n), or
    when the count cannot be reached (a loss of unknown size, a stall)."""
    import sbus
    from sbus.client.store import StoreError, store_stats
    what = f"the store to count {n:,} messages as recorded or lost"
    logs = {"store": store, "sbusd": sbusd}
    with sbus.Client(address) as pub:
        t0 = time.perf_counter()
        said = t0
        for start in range(0, n, batch):
            pub.publish_many((b"bench/%d" % (i % 100), PAYLOAD)
                             for i in range(start, min(n, start + batch)))
            now = time.perf_counter()
            if now - said >= PROGRESS_S:
                # --flood block: the publisher goes at the store's pace.
                said = now
                if now - t0 > bound_s(n):
                    raise give_up(f"the publisher to send {n:,} messages ({start + batch:,} "
                                  "sent)", now - t0, None, broker_view(pub, store.pid), logs)
                say(f"bench_store: {now - t0:.0f} s publishing: {start + batch:,} of {n:,} sent")
        pub.whoami(timeout=60)
        published = time.perf_counter() - t0
        stats, unanswered = None, 0
        moved = said = start = time.monotonic()
        counted = -1
        while True:
            try:
                stats = store_stats(pub, timeout=ANSWER_S)
            except StoreError:
                unanswered += 1     # said with the counters; a busy store answers late
            now = time.monotonic()
            if stats is not None:
                done = stats["recorded"] + stats["lost_flood"]
                if done >= n:
                    return published, time.perf_counter() - t0, stats
                if done != counted:
                    counted, moved = done, now
                if stats["lost_unknown"]:
                    raise give_up(what + " (it lost its connection: how many it missed is "
                                  "unknown, so the count cannot add up)", now - start, stats,
                                  broker_view(pub, store.pid), logs)
            if store.proc.poll() is not None:
                raise give_up(what + f" (the store exited, status {store.proc.returncode})",
                              now - start, stats, broker_view(pub, store.pid), logs)
            stalled = now - moved >= STALL_S
            if stalled or now - start >= bound_s(n):
                broker = broker_view(pub, store.pid)
                queued = sum(c.get("queued_msgs", 0) for c in broker.values()
                             if isinstance(c, dict))
                if not stalled or not queued:
                    why = (f"no change in {STALL_S:.0f} s, nothing queued for it" if stalled
                           else f"the bound, {bound_s(n):.0f} s")
                    if unanswered:
                        why += f"; {unanswered} stats requests unanswered"
                    raise give_up(f"{what} ({why})", now - start, stats, broker, logs)
            if now - said >= PROGRESS_S:
                said = now
                say(f"bench_store: {now - start:.0f} s waiting for {what}: "
                    f"{describe(stats, broker_view(pub, store.pid))}"
                    + (f"; {unanswered} stats requests unanswered" if unanswered else ""))
            time.sleep(0.05)


def replay_rate(address: str, n: int):
    """Replay everything recorded (n expected); (count, msgs/s). A thread
    says every PROGRESS_S how far it got; a replay the store stops answering
    ends after the client's timeout (10 s without an answer): BenchError."""
    import sbus
    from sbus.client.store import StoreError, replay
    with sbus.Client(address) as c:
        t0 = time.perf_counter()
        with replay(c, "bench/") as it:
            done = threading.Event()

            def progress():
                while not done.wait(PROGRESS_S):
                    say(f"bench_store: {time.perf_counter() - t0:.0f} s replaying {n:,} "
                        f"messages: at seq {it.seq:,} of {it.last:,}")
            watch = threading.Thread(target=progress, daemon=True)
            watch.start()
            try:
                # Counted as before the progress thread: nothing per message added.
                count = sum(1 for _ in it)
            except StoreError as exc:
                raise BenchError(f"the replay of {n:,} messages failed at seq {it.seq:,} "
                                 f"of {it.last:,}: {exc}") from None
            finally:
                done.set()
                watch.join()
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
        deadline = time.monotonic() + bound_s(n)
        while (stored := (await js.stream_info("BENCH")).state.messages) < n:
            if time.monotonic() > deadline:
                raise BenchError(f"gave up after {bound_s(n):.0f} s waiting for JetStream "
                                 f"to store {n:,} messages: {stored:,} stored")
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
        try:
            await asyncio.wait_for(done.wait(), bound_s(n))
        except asyncio.TimeoutError:
            raise BenchError(f"gave up after {bound_s(n):.0f} s waiting for JetStream's "
                             f"replay of {n:,} messages: {got:,} received") from None
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
    out: dict = {}
    try:
        return run(out)
    except BenchError as exc:
        say(f"bench_store: {exc}")
        # The phases measured before the one that gave up.
        out["gave_up"] = str(exc).splitlines()[0]
        print(json.dumps(out, indent=2))
        return 2


def run(out: dict) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--rss-records", type=int, default=10_000_000)
    ap.add_argument("--quick", action="store_true",
                    help="30,000 messages, the RSS run on 100,000")
    ap.add_argument("--no-anchors", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.messages, args.rss_records = 30_000, 100_000
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        work = Path(tmp)
        sbusd = Sbusd(work, ["-f", "-a", str(work / "bus.socket")], address=str(work / "bus.socket"),
                      log_level="warning").ready()
        address = sbusd.address
        try:
            store = start_store(work, address, work / "log")
            published, recorded_s, stats = record(address, args.messages, store, sbusd)
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
            record(address, extra, store, sbusd, batch=4096)
            samples = []
            stop = threading.Event()

            def sample():
                while not stop.is_set():
                    samples.append(status_kib(store.pid, "VmRSS"))
                    time.sleep(0.1)
            before = status_kib(store.pid, "VmRSS")
            t = threading.Thread(target=sample)
            t.start()
            try:
                count, rate = replay_rate(address, extra)
            finally:
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
