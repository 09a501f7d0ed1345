"""The day tables finished on the driver, from the stored rows of a few days.

``transforms`` defines every table in Spark: for notebooks, for the merged
view across days, and for days too large to collect.  But a run's new days
usually hold a few thousand stored rows (``job._stored()``: message records
summed, every other record once with its count ``_n``), and finishing thirteen
tables from them as ~20 small Spark queries costs more than the pass over the
log itself: in a new JVM most of it is HotSpot compiling Spark's planner for
them.  So the job collects those rows once and finishes the tables here, in
plain Python, with the same results, columns and types as the Spark
definitions (``tests/test_analytics_daytables.py`` holds the two equal).

Spark's semantics are kept where they show: a sum over nothing but nulls is
null; ``first`` takes the first non-null value in the order the Spark plan
unions its inputs; ``max_by`` skips rows whose ordering value is null and
keeps the first of equal ones; grouping keys may be null.
"""
from __future__ import annotations

from collections import defaultdict
from functools import cached_property
from typing import Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from sbus import logschema as ls
from sbus.analytics.dataset import COUNT, DAY
from sbus.analytics.transforms import CLIENT_COUNTERS as COUNTERS
from sbus.analytics.transforms import MESSAGE_SUMS, SUB_SUMS, TRAFFIC

LONG, DOUBLE, STR = pa.int64(), pa.float64(), pa.string()
TIME = pa.timestamp("us", tz="UTC")  # carried as microseconds since the epoch

FLOOD_SUMS = ("drops_soft", "drops_hard", "blocks")  # of flood records, per connection


def add(total, value):
    """Spark's ``sum`` one value at a time: nulls are skipped, all nulls give null."""
    if value is None:
        return total
    return value if total is None else total + value


def times(value, n: int):
    """``value`` counted ``n`` times (a stored row stands for ``n`` equal records)."""
    return None if value is None else value * n


def _nulls_first(v) -> tuple:
    return (v is not None, v if v is not None else 0)


def _desc_nulls_last(v) -> tuple:
    return (v is None, -v if v is not None else 0)


def _and(a: bool, b: bool | None) -> bool | None:
    """SQL's AND of a known and a possibly unknown (null) truth value."""
    return False if not a else b


class Stored:
    """The stored rows of some days, as Python values, read as the tables need them.

    Timestamps are microseconds since the epoch; ``bucket_s`` is the length of
    the time-series tables' buckets.
    """

    def __init__(self, rows: pa.Table, bucket_s: int):
        self.rows = rows
        self.bucket_us = int(bucket_s * 1_000_000)
        self.bucket_s = float(bucket_s)

    def of(self, events: Iterable[str] | None, *columns: str) -> list[tuple]:
        """The values of ``columns``, one tuple per stored row of ``events`` (None: all)."""
        rows = self.rows
        if events is not None:
            rows = rows.filter(pc.is_in(rows["event"], pa.array(list(events), STR)))
        return list(zip(*(_values(_column(rows, c)) for c in columns))) if rows.num_rows else []

    def bucket(self, micros: int) -> int:
        return micros - micros % self.bucket_us

    @cached_property
    def message_sums(self) -> list[tuple]:
        """(day, key, fanout, *MESSAGE_SUMS) of the message rows: summed already."""
        return self.of([ls.MESSAGE], DAY, "key", "fanout", *MESSAGE_SUMS)

    @cached_property
    def subscriptions(self) -> list[tuple]:
        """(day, bucket, pattern, broker_pid, client, subscribed, unsubscribed, refused)
        per stored row, as transforms.subscription_partial counts them: a null
        ``accepted`` makes its row's counts null (skipped by the sums), not 0.
        """
        out = []
        for day, t, event, pattern, bp, client, accepted, n in self.of(
                [ls.SUBSCRIBE, ls.UNSUBSCRIBE], DAY, "timestamp", "event", "pattern",
                "broker_pid", "client", "accepted", COUNT):
            sub = event == ls.SUBSCRIBE
            counts = (_and(sub, accepted), _and(not sub, accepted),
                      None if accepted is None else not accepted)
            out.append((day, self.bucket(t), pattern, bp, client,
                        *(None if c is None else n * c for c in counts)))
        return out

    @cached_property
    def connections(self) -> dict:
        """client_traffic's rows by (day, broker_pid, client), before ordering."""
        conns: dict = {}

        def conn(day, broker_pid, client):
            return conns.setdefault((day, broker_pid, client), {
                "pid": None, "uid": None, "gid": None, "connected_at": None,
                "disconnected_at": None, "reason": None, "duration_s": None,
                "rank": None, "c": None, "counters_from": None})

        def report(c, rank, counters, source):
            if c["rank"] is None or rank > c["rank"]:
                c["rank"], c["c"], c["counters_from"] = rank, counters, source

        # In the order of the Spark plan's union: connects, disconnects, snapshots.
        for day, bp, client, pid, uid, gid, t in self.of(
                [ls.CLIENT_CONNECT], DAY, "broker_pid", "client", "pid", "uid", "gid", "timestamp"):
            if client is not None:
                c = conn(day, bp, client)
                _fill(c, pid=pid, uid=uid, gid=gid)
                c["connected_at"] = t if c["connected_at"] is None else min(c["connected_at"], t)
        for day, bp, client, pid, uid, gid, t, reason, duration, *counters in self.of(
                [ls.CLIENT_DISCONNECT], DAY, "broker_pid", "client", "pid", "uid", "gid",
                "timestamp", "reason", "duration_s", *(f"counters.{f}" for f in COUNTERS)):
            if client is not None:
                c = conn(day, bp, client)
                _fill(c, pid=pid, uid=uid, gid=gid)
                if c["disconnected_at"] is None or t > c["disconnected_at"]:
                    c["disconnected_at"], c["reason"], c["duration_s"] = t, reason, duration
                # Final counters beat any periodic snapshot, whatever the timestamps.
                report(c, (1, t), counters, "disconnect")
        for day, bp, t, client, pid, uid, gid, *counters in self.listed_clients():
            if client is not None:
                c = conn(day, bp, client)
                _fill(c, pid=pid, uid=uid, gid=gid)
                report(c, (0, t), counters, "stats")
        return conns

    def listed_clients(self) -> list[tuple]:
        """(day, broker_pid, timestamp, client, pid, uid, gid, *COUNTERS) per
        connection a stats record lists (a null entry: all null but the first three).
        """
        stats = self.rows.filter(pc.equal(self.rows["event"], ls.STATS))
        if not stats.num_rows:
            return []
        lists = pa.concat_arrays(stats["clients"].chunks)
        entries = pc.list_flatten(lists)  # a null entry gives null fields
        at = pc.list_parent_indices(lists).to_pylist()
        own = [[v[i] for i in at] for v in (_values(stats[c]) for c in (DAY, "broker_pid",
                                                                         "timestamp"))]
        fields = [_values(pc.struct_field(entries, f))
                  for f in ("client", "pid", "uid", "gid", *COUNTERS)]
        return list(zip(*own, *fields))


def _column(rows: pa.Table, name: str):
    """A column, or a field of a struct column as ``struct.field`` (null where it is)."""
    if "." not in name:
        return rows[name]
    parent, field = name.split(".")
    return pc.struct_field(rows[parent], field)


def _values(column) -> list:
    if pa.types.is_timestamp(column.type):
        column = column.cast(LONG)
    return column.to_pylist()


def _table(columns: dict, rows: list[tuple], sort_key: Callable | None = None) -> pa.Table:
    """An Arrow table of ``rows`` with the given {name: type} columns, sorted."""
    if sort_key is not None:
        rows = sorted(rows, key=sort_key)
    values = list(zip(*rows)) if rows else [()] * len(columns)
    return pa.table({name: pa.array(v, type=t) for (name, t), v in zip(columns.items(), values)})


def _in_order(row: tuple, keys: int | None = None) -> tuple:
    """A sort key: the row's first ``keys`` values (None: all), nulls first."""
    return tuple(_nulls_first(v) for v in row[:keys])


def _fill(c: dict, **values) -> None:
    """Spark's ``first(ignorenulls=True)``: keep each value only while ``c`` has none."""
    for name, v in values.items():
        if c[name] is None:
            c[name] = v


def _day_totals(rows: list[tuple], value_at: int) -> dict:
    """Per day (each row's first value): the sum of the rows' ``value_at``-th values."""
    totals: dict = defaultdict(lambda: None)
    for r in rows:
        totals[r[0]] = add(totals[r[0]], r[value_at])
    return totals


def _ratio(a, b):
    return None if a is None or b is None else a / b


# --- the tables ---------------------------------------------------------------------------

def events(s: Stored) -> pa.Table:
    records: dict = defaultdict(int)
    for day, event, n in s.of(None, DAY, "event", COUNT):
        records[(day, event)] += n
    rows = [(*k, v) for k, v in records.items()]
    return _table({DAY: pa.date32(), "event": STR, "records": LONG}, rows, _in_order)


def prefix_traffic(s: Stored, depth: int | None) -> pa.Table:
    sums: dict = {}
    for day, key, _fanout, *values in s.message_sums:
        if key is None:
            continue
        prefix = key if depth is None else "/".join(key.split("/")[:depth])
        acc = sums.setdefault((day, prefix), [None] * len(MESSAGE_SUMS))
        for i, v in enumerate(values):
            acc[i] = add(acc[i], v)
    rows = [(*k, *v) for k, v in sums.items()]
    return _table({DAY: pa.date32(), "prefix": STR, "sampled": LONG, "messages": DOUBLE,
                   "bytes_in": DOUBLE, "deliveries": DOUBLE, "bytes_out": DOUBLE},
                  rows, _in_order)


def fanout(s: Stored) -> pa.Table:
    sums: dict = {}
    for day, _key, fan, sampled, messages, *_ in s.message_sums:
        if fan is not None:
            acc = sums.setdefault((day, fan), [None, None])
            acc[0], acc[1] = add(acc[0], sampled), add(acc[1], messages)
    rows = [(*k, *v) for k, v in sums.items()]
    totals = _day_totals(rows, 3)
    rows = [(*r, _ratio(r[3], totals[r[0]])) for r in rows]
    return _table({DAY: pa.date32(), "fanout": LONG, "sampled": LONG, "messages": DOUBLE,
                   "share": DOUBLE}, rows, _in_order)


def client_traffic(s: Stored) -> pa.Table:
    rows = [(*k, c["pid"], c["uid"], c["gid"], c["connected_at"], c["disconnected_at"],
             c["reason"], c["duration_s"],
             *(c["c"] or [None] * len(COUNTERS)), c["counters_from"])
            for k, c in s.connections.items()]
    columns = {DAY: pa.date32(), "broker_pid": LONG, "client": LONG, "pid": LONG, "uid": LONG,
               "gid": LONG, "connected_at": TIME, "disconnected_at": TIME,
               "disconnect_reason": STR, "duration_s": DOUBLE,
               **{f: LONG for f in COUNTERS}, "counters_from": STR}
    return _table(columns, rows, lambda r: _in_order(r, 3))


def top_publishers(s: Stored, n: int = 20) -> pa.Table:
    per_process: dict = {}
    for (day, _bp, _client), c in s.connections.items():
        acc = per_process.setdefault((day, c["pid"], c["uid"]), [0] + [None] * len(TRAFFIC))
        acc[0] += 1
        for i in range(len(TRAFFIC)):  # COUNTERS begin with them
            acc[1 + i] = add(acc[1 + i], None if c["c"] is None else c["c"][i])
    by_day: dict = defaultdict(list)
    for (day, pid, uid), (connections, *traffic) in per_process.items():
        by_day[day].append((day, pid, uid, connections, *traffic))
    def rank(r):  # as transforms.PUBLISHER_ORDER: -msgs_in, -bytes_in, pid, uid
        return (_desc_nulls_last(r[4]), _desc_nulls_last(r[5]), _nulls_first(r[1]),
                _nulls_first(r[2]))

    rows = [r for day in sorted(by_day) for r in sorted(by_day[day], key=rank)[:n]]
    return _table({DAY: pa.date32(), "pid": LONG, "uid": LONG, "connections": LONG,
                   **{f: LONG for f in TRAFFIC}}, rows)


def throughput(s: Stored) -> pa.Table:
    buckets: dict = {}
    for day, t, n, *delta in s.of([ls.STATS], DAY, "timestamp", COUNT,
                                  *(f"delta.{f}" for f in ls.DELTA_FIELDS)):
        acc = buckets.setdefault((day, s.bucket(t)), [0] + [None] * len(ls.DELTA_FIELDS))
        acc[0] += n
        for i, v in enumerate(delta, 1):
            acc[i] = add(acc[i], times(v, n))
    rows = []
    for (day, time), (records, *sums) in buckets.items():
        sums = [0 if v is None else v for v in sums]
        d = dict(zip(ls.DELTA_FIELDS, sums))
        rows.append((day, time, s.bucket_s, records, *sums, sum(d[k] for k in ls.DROP_KINDS),
                     d["msgs_in"] / s.bucket_s, d["msgs_out"] / s.bucket_s))
    return _table({DAY: pa.date32(), "time": TIME, "seconds": DOUBLE, "stats_records": LONG,
                   **{f: LONG for f in ls.DELTA_FIELDS}, "drops": LONG,
                   "msgs_in_per_s": DOUBLE, "msgs_out_per_s": DOUBLE}, rows, _in_order)


def disconnect_reasons(s: Stored) -> pa.Table:
    reasons: dict = {}
    for day, reason, n, duration, msgs_in, msgs_out in s.of(
            [ls.CLIENT_DISCONNECT], DAY, "reason", COUNT, "duration_s", "counters.msgs_in",
            "counters.msgs_out"):
        acc = reasons.setdefault((day, "unknown" if reason is None else reason),
                                 [0, None, 0, None, None])
        acc[0] += n
        acc[1] = add(acc[1], times(duration, n))
        acc[2] += n if duration is not None else 0
        acc[3], acc[4] = add(acc[3], times(msgs_in, n)), add(acc[4], times(msgs_out, n))
    rows = [(day, reason, n, duration / count if count else None, m_in, m_out)
            for (day, reason), (n, duration, count, m_in, m_out) in reasons.items()]
    totals = _day_totals(rows, 2)
    rows = [(day, reason, n, n / totals[day], *rest) for day, reason, n, *rest in rows]
    return _table({DAY: pa.date32(), "reason": STR, "disconnects": LONG, "share": DOUBLE,
                   "avg_duration_s": DOUBLE, "msgs_in": LONG, "msgs_out": LONG},
                  rows, _in_order)


def flood_actions(s: Stored) -> pa.Table:
    conns: dict = {}

    def conn(day, bp, client, pid, uid):
        c = conns.setdefault((day, bp, client), {
            "pid": None, "uid": None, "records": 0, **{f: None for f in FLOOD_SUMS},
            "max_queued_msgs": None, "max_queued_bytes": None, "at": None,
            "soft": None, "hard": None, "kicked": 0})
        _fill(c, pid=pid, uid=uid)
        return c

    # In the order of the Spark plan's union: flood summaries, then disconnects.
    for day, bp, client, pid, uid, t, n, *sums, qm, qb, soft, hard in s.of(
            [ls.FLOOD], DAY, "broker_pid", "client", "pid", "uid", "timestamp", COUNT,
            *FLOOD_SUMS, "queued_msgs", "queued_bytes", "soft", "hard"):
        c = conn(day, bp, client, pid, uid)
        c["records"] += n
        for f, v in zip(FLOOD_SUMS, sums):
            c[f] = add(c[f], times(v, n))
        for f, v in (("max_queued_msgs", qm), ("max_queued_bytes", qb)):
            if v is not None and (c[f] is None or v > c[f]):
                c[f] = v
        if c["at"] is None or t > c["at"]:
            c["at"], c["soft"], c["hard"] = t, soft, hard
    for day, bp, client, pid, uid, reason, n in s.of(
            [ls.CLIENT_DISCONNECT], DAY, "broker_pid", "client", "pid", "uid", "reason", COUNT):
        if reason == ls.DISCONNECT_FLOOD_ERROR:
            conn(day, bp, client, pid, uid)["kicked"] += n
    rows = [(*k, c["pid"], c["uid"], c["records"], *(c[f] or 0 for f in FLOOD_SUMS),
             c["max_queued_msgs"], c["max_queued_bytes"], c["soft"], c["hard"], c["kicked"])
            for k, c in conns.items()]
    return _table({DAY: pa.date32(), "broker_pid": LONG, "client": LONG, "pid": LONG,
                   "uid": LONG, "flood_records": LONG, **{f: LONG for f in FLOOD_SUMS},
                   "max_queued_msgs": LONG, "max_queued_bytes": LONG, "soft_mode": STR,
                   "hard_mode": STR, "flood_disconnects": LONG},
                  rows, lambda r: _in_order(r, 3))


def subscription_churn(s: Stored) -> pa.Table:
    sums: dict = {}
    for day, time, _pattern, _bp, _client, *values in s.subscriptions:
        acc = sums.setdefault((day, time), [None] * len(SUB_SUMS))
        for i, v in enumerate(values):
            acc[i] = add(acc[i], v)
    rows = [(*k, *v, None if v[0] is None or v[1] is None else v[0] - v[1])
            for k, v in sums.items()]
    return _table({DAY: pa.date32(), "time": TIME, **{f: LONG for f in SUB_SUMS}, "net": LONG},
                  rows, _in_order)


def pattern_churn(s: Stored) -> pa.Table:
    sums: dict = {}
    for day, _time, pattern, bp, client, *values in s.subscriptions:
        acc = sums.setdefault((day, pattern), [None] * len(SUB_SUMS) + [set()])
        for i, v in enumerate(values):
            acc[i] = add(acc[i], v)
        if bp is not None and client is not None:
            acc[-1].add((bp, client))
    rows = [(*k, *v[:-1], len(v[-1])) for k, v in sums.items()]
    return _table({DAY: pa.date32(), "pattern": STR, **{f: LONG for f in SUB_SUMS},
                   "clients": LONG}, rows, _in_order)


def denials(s: Stored) -> pa.Table:
    by_key: dict = {}
    for day, uid, rule, action, key, t, suppressed, n in s.of(
            [ls.PUBLISH_DENIED], DAY, "uid", "rule", "action", "key", "timestamp",
            "suppressed", COUNT):
        acc = by_key.setdefault((day, uid, rule, action, key), [0, None, t, t])
        acc[0] += n
        acc[1] = add(acc[1], times(suppressed, n))
        acc[2], acc[3] = min(acc[2], t), max(acc[3], t)
    groups: dict = {}
    for (day, uid, rule, action, key), (n, suppressed, first, last) in by_key.items():
        g = groups.setdefault((day, uid, rule, action), [0, 0, None, first, last])
        g[0] += n
        g[1] += key is not None
        g[2] = add(g[2], suppressed)
        g[3], g[4] = min(g[3], first), max(g[4], last)
    rows = [(*k, *v) for k, v in groups.items()]
    return _table({DAY: pa.date32(), "uid": LONG, "rule": LONG, "action": STR, "denials": LONG,
                   "keys": LONG, "suppressed": LONG, "first_at": TIME, "last_at": TIME},
                  rows, lambda r: _in_order(r, 4))
