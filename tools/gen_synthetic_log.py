#!/usr/bin/env python3
"""Write a synthetic, schema-conformant sbusd JSON-lines log.

    python tools/gen_synthetic_log.py OUT [--lines 1000000] [--seed 1] [--gzip]
                                          [--malformed 0.001] [--sample-rate 1.0]

OUT may be "-" for stdout; a name ending in ".gz" is gzipped.  The output is
a deterministic function of the arguments.  It simulates one broker run:
clients connect, subscribe to patterns, publish on a fixed key space (fan-out
is computed as the broker does, with the spec's matcher from sbus._ref.protocol
against the live subscriptions), some consume slowly and lose deliveries, and
the broker writes ``stats`` and ``flood`` records every --stats-interval
simulated seconds, so counters, deltas and sampled messages agree with each
other the way a real broker's would.

Speed matters (the benchmark needs a million lines), so the frequent records
are written from string templates rather than ``json.dumps``.
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sbus import logschema as ls  # noqa: E402
from sbus._ref.protocol import cred_form, matches  # noqa: E402  (the spec's matcher)
from sbus.sbusd.config import Config  # noqa: E402

START_US = 1_795_219_200_000_000  # 2026-11-21T00:00:00Z: fixed, so output is reproducible
BROKER_PID = 4242
# Pattern -> weight when a client picks one; match-everything taps are rare.
PATTERNS = {"": 1, "sensors/": 4, "sensors/*/temp": 6, "sensors/kitchen/": 6, "logs/": 3,
            "logs/*/error": 8, "jobs/": 3, "jobs/*/done": 8, "metrics/cpu/": 6,
            "metrics/*/h1": 6, "chat/": 4, "!/cred/": 2, "solo": 2}
SLOW_FRACTION = 0.15
DROP_PROBABILITY = 0.3
DISCONNECT_WEIGHTS = {
    ls.DISCONNECT_EOF: 80, ls.DISCONNECT_ERROR: 4, ls.DISCONNECT_PROTOCOL_ERROR: 4,
    ls.DISCONNECT_BANG_MISUSE: 2, ls.DISCONNECT_CRED_REFUSED: 2, ls.DISCONNECT_OVERSIZE: 2,
    ls.DISCONNECT_LIMIT: 1,
}


def _keys(rng: random.Random) -> list:
    keys = []
    for room in ("kitchen", "hall", "garage", "attic", "lab"):
        keys += [f"sensors/{room}/temp", f"sensors/{room}/humidity"]
    keys += [f"logs/{svc}/{lvl}" for svc in ("web", "db", "cron", "auth")
             for lvl in ("info", "error")]
    keys += [f"jobs/{n}/{s}" for n in range(8) for s in ("start", "done")]
    keys += [f"metrics/{m}/{h}" for m in ("cpu", "mem", "net") for h in ("h1", "h2", "h3")]
    keys += ["chat/general", "chat/random", "!/cred/100/1000/77/inbox", "solo"]
    rng.shuffle(keys)
    return keys


def _reaches(cred, c: "Client") -> bool:
    """Whether a key with this !/cred/ form may reach ``c``."""
    gid, uid, pid, _ = cred
    return all(want is None or want == have for want, have in ((gid, c.gid), (uid, c.uid),
                                                               (pid, c.pid)))


class Client:
    __slots__ = ("id", "pid", "uid", "gid", "since_us", "patterns", "slow", "soft", "hard",
                 "c", "flood")

    def __init__(self, cid, pid, uid, gid, since_us, slow, soft, hard):
        self.id, self.pid, self.uid, self.gid = cid, pid, uid, gid
        self.since_us, self.slow, self.soft, self.hard = since_us, slow, soft, hard
        self.patterns = []
        self.c = dict.fromkeys(ls.CLIENT_COUNTER_FIELDS, 0)
        self.c.update(client=cid, pid=pid, uid=uid, gid=gid)
        self.flood = [0, 0, 0]  # drops_soft, drops_hard, blocks in this stats interval


class Generator:
    def __init__(self, seed=1, rate=200.0, clients=48, stats_interval=10.0, sample_rate=1.0,
                 malformed=0.0):
        self.rng = random.Random(seed)
        self.rate, self.target_clients = rate, clients
        self.stats_us = int(stats_interval * 1e6)
        self.sample_rate, self.malformed = sample_rate, malformed
        self.keys = _keys(self.rng)
        self.key_json = {k: json.dumps(k) for k in self.keys}
        # Patterns and keys are few: match each pair once, with the reference matcher.
        self.matching = {k: frozenset(p for p in PATTERNS if matches(p.encode(), k.encode()))
                         for k in self.keys}
        self.cred = {k: cred_form(k.encode()) for k in self.keys}
        self.pattern_names = list(PATTERNS)
        self.pattern_cum = list(itertools.accumulate(PATTERNS.values()))
        self.ids: list = []  # self.clients' keys, rebuilt on connect/disconnect
        self.now = START_US
        self.clients: dict = {}
        self.next_id = 1
        self.fanout_cache: dict = {}
        self.totals = dict.fromkeys(ls.TOTALS_FIELDS, 0)
        self.last_totals = dict(self.totals)
        self.next_stats = START_US + self.stats_us
        self.counts: Counter = Counter()
        self._sec, self._sec_str = None, ""

    # -- formatting ---------------------------------------------------------
    def ts(self) -> str:
        sec, us = divmod(self.now, 1_000_000)
        if sec != self._sec:
            self._sec, self._sec_str = sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        return f"{self._sec_str}.{us:06d}Z"

    def record(self, event: str, level: str = "info", **fields) -> str:
        head = {"timestamp": self.ts(), "level": level, "event": event,
                "schema": ls.SCHEMA_VERSION, "broker_pid": BROKER_PID}
        return json.dumps({**head, **fields}, separators=(",", ":")) + "\n"

    # -- simulation ---------------------------------------------------------
    def connect(self, out: list) -> None:
        rng = self.rng
        cid, self.next_id = self.next_id, self.next_id + 1
        c = Client(cid, rng.randrange(1000, 60000), rng.choice((0, 1000, 1000, 1001, 1002)),
                   100, self.now, rng.random() < SLOW_FRACTION,
                   rng.choice(("queue", "discard", "discard", "error")),
                   rng.choice(("discard", "block")))
        self.clients[cid] = c
        self.ids = list(self.clients)
        self.totals["connects"] += 1
        self.totals["clients"] += 1
        out.append(self.record(ls.CLIENT_CONNECT, client=cid, pid=c.pid, uid=c.uid, gid=c.gid))
        for _ in range(rng.randint(0, 3)):
            self.subscribe(c, self.pick_pattern(), out)

    def pick_pattern(self) -> str:
        return self.rng.choices(self.pattern_names, cum_weights=self.pattern_cum, k=1)[0]

    def subscribe(self, c: Client, pattern: str, out: list) -> None:
        refused = pattern == "!/cred/" and c.uid != 1000
        out.append(self.record(ls.SUBSCRIBE, client=c.id, pid=c.pid, uid=c.uid, pattern=pattern,
                               accepted=not refused,
                               reason=ls.REFUSE_CRED_MISMATCH if refused else None))
        if not refused:
            c.patterns.append(pattern)
            c.c["subscriptions"] += 1
            self.totals["subscriptions"] += 1
            self.fanout_cache.clear()

    def unsubscribe(self, c: Client, out: list) -> None:
        held = bool(c.patterns) and self.rng.random() < 0.9
        pattern = self.rng.choice(c.patterns) if held else "never/subscribed"
        out.append(self.record(ls.UNSUBSCRIBE, client=c.id, pid=c.pid, uid=c.uid, pattern=pattern,
                               accepted=held, reason=None if held else ls.REFUSE_NOT_SUBSCRIBED))
        if held:
            c.patterns.remove(pattern)
            c.c["subscriptions"] -= 1
            self.totals["subscriptions"] -= 1
            self.fanout_cache.clear()

    def disconnect(self, c: Client, reason: str, out: list, detail=None) -> None:
        del self.clients[c.id]
        self.ids = list(self.clients)
        self.totals["clients"] -= 1
        self.totals["disconnects"] += 1
        self.totals["subscriptions"] -= len(c.patterns)
        self.fanout_cache.clear()
        out.append(self.record(ls.CLIENT_DISCONNECT, client=c.id, pid=c.pid, uid=c.uid, gid=c.gid,
                               reason=reason, detail=detail,
                               duration_s=round((self.now - c.since_us) / 1e6, 6),
                               counters=c.c))

    def refuse_user(self, out: list) -> None:
        cid, self.next_id = self.next_id, self.next_id + 1
        c = dict.fromkeys(ls.CLIENT_COUNTER_FIELDS, 0)
        c.update(client=cid, pid=self.rng.randrange(1000, 60000), uid=666, gid=666)
        out.append(self.record(ls.CLIENT_DISCONNECT, "warning", client=cid, pid=c["pid"], uid=666,
                               gid=666, reason=ls.DISCONNECT_USER_REFUSED,
                               detail="uid 666 not allowed", duration_s=0.0, counters=c))

    def recipients(self, key: str) -> list:
        """As the broker picks them: each client once, however many of its
        patterns match, and a !/cred/ key only for the credentials it names."""
        got = self.fanout_cache.get(key)
        if got is None:
            matching, cred = self.matching[key], self.cred[key]
            got = [c for c in self.clients.values()
                   if not matching.isdisjoint(c.patterns) and (cred is None or _reaches(cred, c))]
            self.fanout_cache[key] = got
        return got

    def publish(self, out: list) -> None:
        rng = self.rng
        if not self.clients:
            return
        # Publishers are skewed: low client ids publish most (a "top publishers" story).
        ids = self.ids
        pub = self.clients[ids[min(int(rng.expovariate(4.0) * len(ids)), len(ids) - 1)]]
        key = self.keys[min(int(rng.expovariate(0.15)), len(self.keys) - 1)]
        size = 4 + len(key) + 1 + int(rng.expovariate(1 / 120))
        t = self.totals
        pub.c["msgs_in"] += 1
        pub.c["bytes_in"] += size
        t["msgs_in"] += 1
        t["bytes_in"] += size
        # As the broker does, fan-out counts every matching client, including
        # deliveries flood control then drops.
        recipients = self.recipients(key)
        fanout = len(recipients)
        for r in recipients:
            if r.slow and rng.random() < DROP_PROBABILITY:
                kind = "drops_soft" if r.soft == "discard" else "drops_hard"
                r.c[kind] += 1
                t[kind] += 1
                r.flood[0 if kind == "drops_soft" else 1] += 1
                if r.hard == "block":
                    r.flood[2] += 1
                continue
            r.c["msgs_out"] += 1
            r.c["bytes_out"] += size
            t["msgs_out"] += 1
            t["bytes_out"] += size
        if self.sample_rate >= 1.0 or rng.random() < self.sample_rate:
            out.append(
                f'{{"timestamp":"{self.ts()}","level":"debug","event":"message",'
                f'"schema":{ls.SCHEMA_VERSION},"broker_pid":{BROKER_PID},'
                f'"client":{pub.id},"pid":{pub.pid},"uid":{pub.uid},'
                f'"key":{self.key_json[key]},"size":{size},"fanout":{fanout},'
                f'"sample_rate":{self.sample_rate}}}\n')

    def stats(self, out: list) -> None:
        interval = self.stats_us / 1e6
        for c in list(self.clients.values()):
            if any(c.flood):
                out.append(self.record(ls.FLOOD, "warning", client=c.id, pid=c.pid, uid=c.uid,
                                       interval_s=interval, drops_soft=c.flood[0],
                                       drops_hard=c.flood[1], blocks=c.flood[2],
                                       queued_msgs=c.flood[2], queued_bytes=c.flood[2] * 128,
                                       soft=c.soft, hard=c.hard))
                c.flood = [0, 0, 0]
                if c.soft == "error" and self.rng.random() < 0.5:
                    self.disconnect(c, ls.DISCONNECT_FLOOD_ERROR, out, "send queue full")
        t = self.totals
        t["queued_bytes_peak"] = max(t["queued_bytes_peak"], t["queued_bytes"])
        delta = {f: t[f] - self.last_totals[f] for f in ls.DELTA_FIELDS}
        self.last_totals = dict(t)
        uids = sorted({c.c["uid"] for c in self.clients.values()})
        users = [dict(zip(ls.USER_FIELDS, (
            uid, sum(c.c["uid"] == uid for c in self.clients.values()), 1024, 0, 64 << 20, 0,
            64 << 20))) for uid in uids]
        out.append(self.record(ls.STATS, interval_s=interval, totals=t, delta=delta,
                               clients=[c.c for c in self.clients.values()], users=users))

    def lines(self, n: int):
        """Yield chunks (lists of lines) totalling exactly ``n`` lines."""
        rng = self.rng
        mean_gap_us = 1e6 / self.rate
        cfg = Config(stats_interval=self.stats_us / 1e6, log_messages=self.sample_rate)
        # A fixed version keeps the output a function of the arguments alone.
        out = [self.record(ls.BROKER_START, version="0.1.0", address=cfg.address,
                           pid=BROKER_PID, config=cfg.summary())]
        written = 0
        while True:
            # One step writes at most a flood record and a disconnect per
            # client, a stats record and a connect with its subscriptions;
            # keep that much room, then fill up exactly with messages.
            if written + len(out) + 3 * len(self.clients) + 10 >= n:
                break
            self.step(out, mean_gap_us)
            if len(out) >= 4096:
                written += len(out)
                yield self._finish(out)
                out = []
        # The shutdown sequence: one disconnect per client, stats, stop.
        while written + len(out) + len(self.clients) + 2 < n:
            self.now += 1 + int(rng.expovariate(1.0) * mean_gap_us)
            if self.clients:
                self.publish(out)
            else:
                self.connect(out)
        self.now += 1000
        for c in list(self.clients.values()):
            self.disconnect(c, ls.DISCONNECT_SHUTDOWN, out)
        self.stats(out)
        out.append(self.record(ls.BROKER_STOP, reason="SIGTERM",
                               uptime_s=round((self.now - START_US) / 1e6, 6), totals=self.totals))
        out = out[: max(0, n - written)]  # only a tiny n can overshoot
        yield self._finish(out)

    def step(self, out: list, mean_gap_us: float) -> None:
        """Advance the clock to the next action and perform it."""
        rng = self.rng
        self.now += 1 + int(rng.expovariate(1.0) * mean_gap_us)
        if self.now >= self.next_stats:
            self.stats(out)
            self.next_stats += self.stats_us
        x = rng.random()
        # Connects and disconnects are equally likely, which keeps the
        # population near the target instead of drifting.
        n = len(self.clients)
        if n < self.target_clients // 2 or (x < 0.0035 and n < self.target_clients * 3 // 2):
            self.connect(out)
        elif x < 0.007 and n > self.target_clients // 2:
            reason = rng.choices(list(DISCONNECT_WEIGHTS), list(DISCONNECT_WEIGHTS.values()))[0]
            self.disconnect(self.clients[rng.choice(self.ids)], reason, out)
        elif x < 0.0085 and self.clients:
            c = self.clients[rng.choice(self.ids)]
            if rng.random() < 0.5:
                self.subscribe(c, self.pick_pattern(), out)
            else:
                self.unsubscribe(c, out)
        elif x < 0.0087:
            self.refuse_user(out)
        else:
            self.publish(out)

    def _finish(self, chunk: list) -> list:
        """Replace a fraction of lines by malformed ones (in place) and count the chunk."""
        rng, counts = self.rng, self.counts
        for i, line in enumerate(chunk):
            if self.malformed > 0 and rng.random() < self.malformed:
                kind = rng.randrange(4)
                if kind == 0:
                    chunk[i] = line[: len(line) // 2] + "\n"  # truncated write
                elif kind == 1:
                    chunk[i] = "Traceback (most recent call last):\n"  # stray stderr
                elif kind == 2:
                    chunk[i] = "[1, 2, 3]\n"  # JSON, not an object
                else:
                    # the wrong type
                    chunk[i] = line.replace(f'"schema":{ls.SCHEMA_VERSION}', '"schema":"two"', 1)
                counts["_malformed"] += 1
            else:
                counts[line.split('"event":"', 1)[1].split('"', 1)[0]] += 1
        return chunk


def generate(path, lines=1_000_000, *, seed=1, gz=None, malformed=0.0, sample_rate=1.0,
             rate=200.0, clients=48, stats_interval=10.0) -> dict:
    """Write the log and return what was written: lines, malformed, events (per name)."""
    gen = Generator(seed=seed, rate=rate, clients=clients, stats_interval=stats_interval,
                    sample_rate=sample_rate, malformed=malformed)
    path = str(path)
    gz = path.endswith(".gz") if gz is None else gz
    if path == "-":
        sink = sys.stdout
    elif gz:
        # mtime=0 keeps the gzip header, and so the file, reproducible.
        sink = gzip.GzipFile(path, "wb", compresslevel=1, mtime=0)
    else:
        sink = open(path, "w", encoding="utf-8", buffering=1 << 20)
    total = 0
    try:
        for chunk in gen.lines(lines):
            total += len(chunk)
            text = "".join(chunk)
            sink.write(text.encode() if gz and path != "-" else text)
    finally:
        if sink is not sys.stdout:
            sink.close()
    counts = dict(gen.counts)
    return {"lines": total, "malformed": counts.pop("_malformed", 0),
            "events": {k: v for k, v in sorted(counts.items()) if v}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help='output file ("-" for stdout; ".gz" suffix gzips)')
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gzip", action="store_true", help="gzip even without a .gz suffix")
    p.add_argument("--malformed", type=float, default=0.0, metavar="FRACTION",
                   help="fraction of lines to replace by malformed ones")
    p.add_argument("--sample-rate", type=float, default=1.0,
                   help="fraction of messages logged as `message` records, in (0, 1]")
    p.add_argument("--rate", type=float, default=200.0, help="simulated messages per second")
    p.add_argument("--clients", type=int, default=48, help="typical number of clients")
    p.add_argument("--stats-interval", type=float, default=10.0, help="simulated seconds")
    a = p.parse_args(argv)
    if a.lines < 2 or not 0 < a.sample_rate <= 1 or not 0 <= a.malformed < 1:
        p.error("need --lines >= 2, 0 < --sample-rate <= 1 and 0 <= --malformed < 1")
    t = time.perf_counter()
    info = generate(a.out, a.lines, seed=a.seed, gz=a.gzip or None, malformed=a.malformed,
                    sample_rate=a.sample_rate, rate=a.rate, clients=a.clients,
                    stats_interval=a.stats_interval)
    info["seconds"] = round(time.perf_counter() - t, 2)
    print(json.dumps(info), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
