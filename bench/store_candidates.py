"""Which embedded store for ``sbus store``: segment files, SQLite or LMDB.

Each candidate appends N records (a 12-byte key, a 64-byte payload, a seq and
a time, framed and checksummed as the store sends them) in batches of 512,
one commit per batch and one sync at the end; then it reads them all back in
order as the store does for a replay, into 64 KiB answer bodies (the framed
records back to back); and its files are measured. SQLite and LMDB keep each
framed record as one value under its seq. The candidates run
interleaved, round after round, and the table gives medians: on a shared
machine only the ratios mean anything. LMDB is skipped if the ``lmdb`` module
is missing (pip install lmdb).

    .venv/bin/python bench/store_candidates.py [--records N] [--rounds R] [--quick]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sbus.store.segments import Log, pack_record  # noqa: E402

BATCH = 512
ANSWER = 64 * 1024    # bytes of records per answer


def entries(n):
    payload = b"x" * 64
    return [(b"sensors/%04d" % (i % 1000), payload) for i in range(n)]


def du(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def segments(d: Path, data):
    log = Log(str(d), fsync="never")
    t0 = time.perf_counter()
    for i in range(0, len(data), BATCH):
        log.append(data[i:i + BATCH])
    os.fsync(log._fd)
    t1 = time.perf_counter()
    n = 0
    position = log.start()
    while True:
        chunk, position, last = log.read(position, ANSWER)
        if not chunk:
            break
        n = last
    t2 = time.perf_counter()
    log.close()
    return t1 - t0, t2 - t1, n


def framed(data, first):
    now = time.time_ns()
    return [(first + j, pack_record(first + j, now, k, p)) for j, (k, p) in enumerate(data)]


def sqlite(d: Path, data):
    db = sqlite3.connect(str(d / "log.db"))
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")
    db.execute("CREATE TABLE log (seq INTEGER PRIMARY KEY, rec BLOB)")
    t0 = time.perf_counter()
    for i in range(0, len(data), BATCH):
        db.executemany("INSERT INTO log VALUES (?, ?)", framed(data[i:i + BATCH], i + 1))
        db.commit()
    db.execute("PRAGMA wal_checkpoint(FULL)")
    t1 = time.perf_counter()
    n = 0
    body, size = [], 0
    for (rec,) in db.execute("SELECT rec FROM log ORDER BY seq"):
        body.append(rec)
        size += len(rec)
        n += 1
        if size >= ANSWER:
            b"".join(body)
            body, size = [], 0
    b"".join(body)
    t2 = time.perf_counter()
    db.close()
    return t1 - t0, t2 - t1, n


def lmdb_store(d: Path, data):
    import lmdb
    env = lmdb.open(str(d), map_size=1 << 30, sync=False, metasync=False)
    t0 = time.perf_counter()
    for i in range(0, len(data), BATCH):
        with env.begin(write=True) as txn:
            txn.cursor().putmulti([(seq.to_bytes(8, "big"), rec)
                                   for seq, rec in framed(data[i:i + BATCH], i + 1)], append=True)
    env.sync(True)
    t1 = time.perf_counter()
    n = 0
    body, size = [], 0
    with env.begin() as txn:
        for rec in txn.cursor().iternext(keys=False, values=True):
            body.append(rec)
            size += len(rec)
            n += 1
            if size >= ANSWER:
                b"".join(body)
                body, size = [], 0
    b"".join(body)
    t2 = time.perf_counter()
    env.close()
    return t1 - t0, t2 - t1, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="20,000 records, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.records, args.rounds = 20_000, 1
    candidates = {"segment files": segments, "SQLite (WAL, executemany)": sqlite}
    try:
        import lmdb  # noqa: F401
        candidates["LMDB"] = lmdb_store
    except ImportError:
        print("LMDB: skipped (no lmdb module)", file=sys.stderr)
    data = entries(args.records)
    results = {name: ([], [], []) for name in candidates}
    for r in range(args.rounds):
        for name, fn in candidates.items():
            d = Path(tempfile.mkdtemp(prefix="store-bench-"))
            try:
                w, s, n = fn(d, data)
                assert n == args.records, (name, n)
                results[name][0].append(args.records / w)
                results[name][1].append(args.records / s)
                results[name][2].append(du(d) / args.records)
            finally:
                shutil.rmtree(d)
            print(f"round {r + 1} {name}: done", file=sys.stderr)
    print(f"{args.records} records of 12 B key + 64 B payload, batches of {BATCH}, "
          f"medians of {args.rounds} interleaved rounds")
    print("| candidate | append, records/s | read for replay, records/s | bytes on disk per record |")
    print("|---|---|---|---|")
    for name, (w, s, b) in results.items():
        print(f"| {name} | {statistics.median(w):,.0f} | {statistics.median(s):,.0f} | "
              f"{statistics.median(b):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
