"""The batch job: read new broker logs once, keep every table per day in a dataset.

``run()`` is the whole job; ``sbus.analytics.cli`` is its command line.  The
dataset's layout and manifest are described in ``sbus.analytics.dataset``.

Lines are read as text and parsed with ``from_json`` against the declared
schema, so one bad line costs one count, never the job: a line is
*malformed* when it is not a JSON object, lacks ``event`` or a parseable
``timestamp``, or is one of the schema's events with a field of the wrong
type.  Blank lines are skipped.  A record belongs to the UTC day of its
timestamp.

Speed: the new files are read and parsed once, in one aggregation that
sums the message records (nearly all of a busy log) and keeps every other
record once; what it leaves is small.  It is stored per file and day, and
each table of a day is finished from the stored rows of every file that
covers it.  Up to ``DRIVER_ROWS`` of them (the usual case), the driver
collects them once, writes the new ones and finishes the tables itself
(``daytables``, ``tablefiles``): as ~20 small Spark queries, that step cost
more than the pass over the log, mostly HotSpot compiling Spark's planner.
Above it, Spark stores them and finishes the tables (``transforms``) with
small-input settings (``small_jobs``).
"""
from __future__ import annotations

import datetime as dt
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import reduce
from typing import Callable, Sequence

import pyarrow as pa
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sbus import logschema
from sbus.analytics import daytables, tablefiles
from sbus.analytics import transforms as tf
from sbus.analytics.dataset import COUNT, CSV, DAY, FILE, MALFORMED, PARTIALS, Identity, Manifest, Store, list_inputs
from sbus.analytics.daytables import Stored
from sbus.analytics.schema import CORRUPT_COLUMN, record_schema
from sbus.console import looks_like_console

OK, BAD, BLANK = "ok", "malformed", "blank"
STATUS = "_status"
SOURCE = "_source"
BUCKET_S = 60  # seconds: the time-series tables' buckets
BUCKET = f"{BUCKET_S} seconds"
# The most stored rows (plus the connections their stats records list) that
# the driver collects and finishes the day tables of (``daytables``); more,
# and Spark does (``transforms``).  A 1,000,000-line log keeps ~40,000.
# Measured at 730,000: 2.4 s and 340 MB of Python on the driver, and still
# 6.6 s faster than Spark's way in a new JVM.
DRIVER_ROWS = 500_000
# The share of the new files' non-blank lines that may be malformed: past it
# the run writes nothing and fails (most likely not sbusd's JSON log at all).
MAX_MALFORMED = 0.5


@dataclass(frozen=True)
class Partial:
    """The state several tables are finished from (see ``transforms``).

    ``build`` makes it from records; ``summed``, if set, from the stored
    rows (see ``_compact``), whose message records are summed already.
    """
    name: str
    build: Callable[[DataFrame, Sequence[str]], DataFrame]
    summed: Callable[[DataFrame, Sequence[str]], DataFrame] | None = None


@dataclass(frozen=True)
class Table:
    name: str
    partial: Partial
    finish: Callable[[DataFrame, Sequence[str]], DataFrame]
    order: tuple
    about: str
    on_driver: Callable[[Stored], pa.Table]  # the same table per day, from stored rows


EVENTS = Partial("events", tf.event_partial, lambda c, by: _summed_events(c, by))
MESSAGES = Partial("messages", tf.message_partial, lambda c, by: _summed_messages(c, by))
CLIENTS = Partial("clients", tf.client_partial)
STATS = Partial("throughput", lambda e, by: tf.throughput_partial(e, BUCKET, by))
DISCONNECTS = Partial("disconnects", tf.disconnect_partial)
FLOODS = Partial("floods", tf.flood_partial)
SUBSCRIPTIONS = Partial("subscriptions", lambda e, by: tf.subscription_partial(e, BUCKET, by))
DENIALS = Partial("denials", tf.denial_partial)
PARTIAL_SET = (EVENTS, MESSAGES, CLIENTS, STATS, DISCONNECTS, FLOODS, SUBSCRIPTIONS, DENIALS)

TABLES: tuple[Table, ...] = (
    Table("events", EVENTS, tf.event_table, tf.EVENT_ORDER, "records per event",
          daytables.events),
    Table("traffic_by_prefix1", MESSAGES, lambda m, by: tf.prefix_table(m, 1, by),
          tf.PREFIX_ORDER, "sampled traffic per first routing-key segment",
          lambda s: daytables.prefix_traffic(s, 1)),
    Table("traffic_by_prefix2", MESSAGES, lambda m, by: tf.prefix_table(m, 2, by),
          tf.PREFIX_ORDER, "sampled traffic per first two routing-key segments",
          lambda s: daytables.prefix_traffic(s, 2)),
    Table("traffic_by_key", MESSAGES, lambda m, by: tf.prefix_table(m, None, by),
          tf.PREFIX_ORDER, "sampled traffic per routing key",
          lambda s: daytables.prefix_traffic(s, None)),
    Table("client_traffic", CLIENTS, tf.client_table, tf.CLIENT_ORDER,
          "per connection seen that day: identity, disconnect, latest counters",
          daytables.client_traffic),
    Table("throughput", STATS, tf.throughput_table, tf.TIME_ORDER,
          "per minute: traffic and drops", daytables.throughput),
    Table("disconnect_reasons", DISCONNECTS, tf.disconnect_table, tf.DISCONNECT_ORDER,
          "disconnects per reason", daytables.disconnect_reasons),
    Table("flood_actions", FLOODS, tf.flood_table, tf.FLOOD_ORDER,
          "flood-control actions per connection", daytables.flood_actions),
    Table("top_publishers", CLIENTS, lambda m, by: tf.publishers_table(m, 20, by),
          tf.PUBLISHER_ORDER, "top 20 publishers by messages",
          lambda s: daytables.top_publishers(s, 20)),
    Table("fanout", MESSAGES, tf.fanout_table, tf.FANOUT_ORDER,
          "fan-out distribution of sampled messages", daytables.fanout),
    Table("subscription_churn", SUBSCRIPTIONS, tf.churn_table, tf.TIME_ORDER,
          "per minute: subscribes, unsubscribes, refusals", daytables.subscription_churn),
    Table("pattern_churn", SUBSCRIPTIONS, tf.pattern_table, tf.PATTERN_ORDER,
          "per pattern: subscribes, unsubscribes, distinct connections",
          daytables.pattern_churn),
    Table("denials", DENIALS, tf.denial_table, tf.DENIAL_ORDER,
          "publishes the access policy denied, per uid, rule and action", daytables.denials),
)


def spark_session(master: str | None = None, app_name: str = "sbus-analytics",
                  conf: dict | None = None) -> SparkSession:
    """A session with UTC time (days, buckets and CSVs do not depend on the host's zone).

    ``master`` None means: whatever spark-submit was given, else ``local[*]``.
    """
    builder = SparkSession.builder.appName(app_name)
    if not master and not _under_spark_submit():
        master = "local[*]"
    if master:
        builder = builder.master(master)
    settings = {"spark.sql.session.timeZone": "UTC", "spark.ui.showConsoleProgress": "false"}
    if master and master.startswith("local"):
        # The aggregates are tiny; Spark's default of 200 shuffle partitions
        # makes a local run spend its time scheduling empty tasks.
        settings["spark.sql.shuffle.partitions"] = "4"
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.conf.set("spark.sql.session.timeZone", "UTC")  # the session may already exist
    return spark


def _under_spark_submit() -> bool:
    # spark-submit starts the JVM first and hands its gateway port to the
    # Python driver; a plain `python` driver has none yet.
    return "PYSPARK_GATEWAY_PORT" in os.environ


def read_lines(spark: SparkSession, paths: Sequence[str]) -> DataFrame:
    """The text lines of files, directories (recursively) and globs; ``.gz`` is
    decompressed by extension.  Columns: value, _source (file path).
    """
    if isinstance(paths, str):
        paths = [paths]
    return (
        spark.read.option("recursiveFileLookup", "true")
        .text(list(paths))
        .select("value", F.col("_metadata.file_path").alias(SOURCE))
    )


def parse(lines: DataFrame) -> DataFrame:
    """Parse the ``value`` column into the record columns plus ``_status``
    (ok, malformed or blank), keeping ``lines``' own columns (``_source``).
    """
    options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT_COLUMN}
    rec = F.from_json("value", record_schema(corrupt_column=True), options).alias("r")
    kept = lines.columns  # value, _source and whatever else the caller gave
    parsed = lines.select(*kept, rec).select(*kept, "r.*")
    # A type clash only matters for the events the schema defines: other
    # events may reuse a name with another type (accept_paused's `clients` is
    # a number), and from_json still fills in their event and timestamp.
    known = F.col("event").isin(*logschema.EVENT_FIELDS)
    status = (
        F.when(F.trim("value") == "", F.lit(BLANK))
        .when(F.col("event").isNull() | F.col("timestamp").isNull()
              | (F.col(CORRUPT_COLUMN).isNotNull() & known), F.lit(BAD))
        .otherwise(F.lit(OK))
    )
    return parsed.withColumn(STATUS, status)


def events_of(parsed: DataFrame) -> DataFrame:
    """The well-formed records of ``parse()``'s output, with the record columns only."""
    fields = record_schema(corrupt_column=False).fieldNames()
    return parsed.where(F.col(STATUS) == OK).select(*fields)


def read_events(spark: SparkSession, paths: Sequence[str]) -> DataFrame:
    """The well-formed records of the given logs: the input of every transform."""
    return events_of(parse(read_lines(spark, paths)))


def line_summary(parsed: DataFrame, examples: int = 5) -> dict:
    """Counts of lines by status and of records by schema version, and a few malformed lines."""
    counts = parsed.groupBy(STATUS, "schema").agg(F.count(F.lit(1)).alias("n")).collect()
    summary = _line_counts(counts)
    summary["malformed_examples"] = _examples(parsed, examples)
    return summary


def _line_counts(rows) -> dict:
    by_status, versions = {}, {}
    for r in rows:
        by_status[r[STATUS]] = by_status.get(r[STATUS], 0) + r["n"]
        if r[STATUS] == OK:
            key = str(r["schema"])
            versions[key] = versions.get(key, 0) + r["n"]
    return {
        "lines": sum(by_status.values()),
        "records": by_status.get(OK, 0),
        "malformed": by_status.get(BAD, 0),
        "blank": by_status.get(BLANK, 0),
        "schema_versions": dict(sorted(versions.items())),
    }


class TooMalformed(Exception):
    """More of the new files' lines are malformed than the run allows; the
    text says how many, and what the files look like."""


def check_malformed(summary: dict, max_malformed: float, examples: Callable[[], list]) -> None:
    """Raise TooMalformed if more than ``max_malformed`` of the non-blank
    lines counted in ``summary`` are malformed; ``examples()`` gives a few."""
    nonblank = summary["records"] + summary["malformed"]
    if summary["malformed"] <= max_malformed * nonblank:
        return
    shown = examples()
    text = (f"{summary['malformed']} of {nonblank} lines are not sbusd JSON records, more than "
            f"--max-malformed {max_malformed:g} of them; nothing was written")
    if sum(looks_like_console(ex["line"]) for ex in shown) * 2 > len(shown):
        text += ("\n  they look like sbusd's console format (--log-format console); give the job "
                 "its JSON log: sbusd --log-format json, or --json-log PATH beside the console "
                 "(make run writes .run/sbusd.json)")
    else:
        text += "".join(f"\n  malformed: {ex['source']}: {ex['line']!r}" for ex in shown)
    raise TooMalformed(text)


def _examples(parsed: DataFrame, n: int) -> list:
    bad = parsed.where(F.col(STATUS) == BAD).select("value", SOURCE).limit(n)
    return [{"source": r[SOURCE], "line": r["value"][:200]} for r in bad.collect()]


def _compact_frame(spark: SparkSession, idents: Sequence[Identity]) -> DataFrame:
    """The one pass over the new files: their lines parsed and compacted
    (``_compact``), cached.  Each file is read on its own, so its lines carry
    its short id as a constant instead of a path to look up line by line.
    """
    files = [spark.read.text(i.uri).select("value", F.lit(i.uri).alias(SOURCE),
                                           F.lit(i.id).alias(FILE)) for i in idents]
    lines = reduce(lambda a, b: a.union(b), files)
    # One partition after the aggregation (its map side has made it small):
    # what is derived from it then needs no shuffle.
    return _compact(parse(lines), F.col(FILE)).coalesce(1).persist()


def _compact(parsed: DataFrame, file_id) -> DataFrame:
    """``parse()``'s lines reduced as they are read, to what the tables need.

    Message records (nearly every line of a busy log) are summed per (file,
    day, key, fanout) with the message partial's own sums; every other line
    is kept once per distinct content with ``_n``, the number of lines it
    stands for, so ``_records()`` gives back each of them exactly.  Only the
    columns the tables read are kept, and the raw line and path only where
    it is malformed.  One hash aggregation over the parsed lines costs little
    more than parsing them; caching every parsed line instead cost several times it.
    """
    bad = F.col(STATUS) == BAD
    summed = (F.col(STATUS) == OK) & (F.col("event") == logschema.MESSAGE)
    # Few grouping keys (the rest packed in a struct) keep the generated code
    # small enough for the JVM to compile it.
    rest = [c for c in tf.COLUMNS if c not in _MESSAGE_KEYS]
    compact = parsed.groupBy(
        file_id.alias(FILE), STATUS, "schema", F.to_date("timestamp").alias(DAY),
        *_MESSAGE_KEYS, F.when(~summed, F.struct(*rest)).alias("_rec"),
        F.when(bad, F.struct("value", SOURCE)).alias("_bad"),
    ).agg(F.count(F.lit(1)).alias(COUNT), *tf.message_sums())
    return compact.select(FILE, STATUS, "schema", DAY, *_MESSAGE_KEYS, "_rec.*", "_bad.*",
                          COUNT, *tf.MESSAGE_SUMS)


_MESSAGE_KEYS = ("event", "key", "fanout")


def _stored(compact: DataFrame) -> DataFrame:
    """What the dataset keeps of ``_compact()``'s rows: the well-formed records."""
    return compact.where(F.col(STATUS) == OK).select(
        DAY, FILE, *_MESSAGE_KEYS, *(c for c in tf.COLUMNS if c not in _MESSAGE_KEYS),
        COUNT, *tf.MESSAGE_SUMS)


def _expanded(compact: DataFrame) -> DataFrame:
    """Each row of ``compact`` repeated ``_n`` times: one per line again."""
    return compact.withColumn(
        "_line", F.explode(F.array_repeat(F.lit(True), F.col(COUNT).cast("int")))).drop("_line")


def _records(stored: DataFrame) -> DataFrame:
    """The records ``_stored()`` did not sum, one row per line."""
    return _expanded(stored.where(F.col("event") != logschema.MESSAGE)).select(
        DAY, FILE, *tf.COLUMNS)


def _summed_events(stored: DataFrame, by: Sequence[str]) -> DataFrame:
    """The events partial from ``_stored()`` rows: their line counts summed."""
    return stored.groupBy(*by, "event").agg(F.sum(COUNT).alias("records"))


def _summed_messages(stored: DataFrame, by: Sequence[str]) -> DataFrame:
    """The message partial from ``_stored()`` rows: its message rows are partials already."""
    return tf.message_merge(stored.where(F.col("event") == logschema.MESSAGE), by)


def _state(partial: Partial, stored: DataFrame, by: Sequence[str],
           records: DataFrame | None = None) -> DataFrame:
    """``partial``'s state per ``by`` group from ``_stored()`` rows (and
    ``records``, their ``_records()``, if the caller has them already).
    """
    if partial.summed:
        return partial.summed(stored, by)
    return partial.build(_records(stored) if records is None else records, by)


def run(spark: SparkSession, paths: Sequence[str], out: str, *, show: int = 20,
        csv: bool = False, echo: Callable[[str], None] = print,
        max_malformed: float = MAX_MALFORMED) -> dict:
    """Bring the dataset ``out`` up to date with the logs under ``paths``: read
    the files it has not read, rebuild the days they cover, print those days'
    tables (``show`` rows each) and return a summary of the run.

    Raises TooMalformed, before writing anything, when more than
    ``max_malformed`` of the new files' non-blank lines are malformed.

    The summary's ``stored_rows`` is the size of the days rebuilt, as
    measured against ``DRIVER_ROWS``, and ``tables_by`` who finished their
    tables: "driver" or "spark" (None when no file was new).
    """
    started = time.perf_counter()
    store = Store(spark, out)
    manifest = Manifest.load(store)
    plan = manifest.plan(store, list_inputs(spark, paths))
    summary = {"lines": 0, "records": 0, "malformed": 0, "blank": 0, "schema_versions": {},
               "malformed_examples": [], "stored_rows": 0, "tables_by": None}
    days: set = set()
    if plan.new:
        summary, days = _ingest(spark, store, manifest, plan, max_malformed)
    if plan.new or manifest.changed:
        if csv:
            write_csv(spark, out)
        manifest.save(store)  # last: what it lists is complete
    elif csv:
        write_csv(spark, out)
    summary.update(
        seconds=round(time.perf_counter() - started, 3),
        files_read=[i.uri for i in plan.new],
        files_skipped=[uri for uri, _ in plan.skipped],
        files_replaced=sorted(e["path"] for old in plan.superseded.values() for e in old),
        days=sorted(d.isoformat() for d in days),
        tables=[t.name for t in TABLES],
        out=out,
    )
    _report(spark, store, summary, show, echo)
    return summary


def _ingest(spark: SparkSession, store: Store, manifest: Manifest, plan,
            max_malformed: float) -> tuple[dict, set]:
    """Read the plan's new files once, store their rows, rebuild the days they touch."""
    frame = _compact_frame(spark, plan.new)
    try:
        counts = frame.groupBy(FILE, DAY, STATUS, "schema").agg(
            F.sum(COUNT).alias("n"), *_size_of()).collect()  # also fills the cache
        summary = _line_counts(counts)
        check_malformed(summary, max_malformed, lambda: _examples(frame, 5))
        days = _record_files(store, manifest, plan, counts)
        fresh = _stored(frame)
        _SCHEMAS.setdefault("stored", fresh.schema)  # analysed already: spares a second
        size = sum(r["rows"] + r["listed"] for r in counts if r[STATUS] == OK)
        older = _read_partitions(spark, store, _older_partitions(manifest, plan, days))
        rows = fresh
        if older is not None:
            rows = fresh.unionByName(older)
            size += _size(older)
        summary.update(stored_rows=size, tables_by="driver" if size <= DRIVER_ROWS else "spark")
        if summary["tables_by"] == "driver":
            # The usual case: the rows are collected once, and the driver
            # writes the new ones and finishes the day tables from them all.
            collected = tablefiles.collect_table(rows)
            steps = [lambda: _write_partials_on_driver(store, collected, plan.new),
                     lambda: _rebuild_days_on_driver(store, days, collected)]
        else:
            steps = [lambda: _write_partials(store, fresh),
                     lambda: rebuild_days(spark, store, days, rows)]
        if summary["malformed"]:
            steps.append(lambda: _write_malformed(store, frame))
        with small_jobs(spark):
            # The days are rebuilt from the new rows in memory while they are
            # written: the small jobs of both then share the cores.
            _concurrently(lambda step: step(), steps)
            summary["malformed_examples"] = _examples(frame, 5) if summary["malformed"] else []
    finally:
        frame.unpersist()
    return summary, days


def _record_files(store: Store, manifest: Manifest, plan, counts) -> set:
    """Enter the plan's new files in the manifest, drop what the files they
    replace contributed, and return the days to rebuild.
    """
    days = set()
    for ident in plan.new:
        mine = [r for r in counts if r[FILE] == ident.id]
        file_days = sorted({r[DAY] for r in mine if r[STATUS] == OK and r[DAY] is not None})
        days.update(file_days)
        replaces = plan.superseded.get(ident.id, [])
        for old in replaces:
            _drop_file(store, old)
            days.update(dt.date.fromisoformat(d) for d in old["days"])
        manifest.record(ident, {**_line_counts(mine), "days": [d.isoformat() for d in file_days]},
                        replaces)
    return days


def _older_partitions(manifest: Manifest, plan, days: set) -> list:
    """(day, file id) of the stored rows of ``days`` that files read before hold."""
    new = {i.id for i in plan.new}
    wanted = {d.isoformat() for d in days}
    return [(d, e["id"]) for e in manifest.active() if e["id"] not in new
            for d in e["days"] if d in wanted]


def _read_partitions(spark: SparkSession, store: Store, parts: Sequence) -> DataFrame | None:
    """The stored rows of the given (day, file id) partitions, read without
    listing the others (a dataset keeps every day it has seen)."""
    paths = [store.path(PARTIALS, f"{DAY}={d}", f"{FILE}={i}") for d, i in parts]
    if not paths:
        return None
    return (spark.read.schema(stored_schema(spark)).option("basePath", store.path(PARTIALS))
            .parquet(*paths))


def _write_partials(store: Store, rows: DataFrame) -> None:
    (rows.write.mode("overwrite").option("partitionOverwriteMode", "dynamic")
     .partitionBy(DAY, FILE).parquet(store.path(PARTIALS)))


def _write_partials_on_driver(store: Store, rows: pa.Table, new: Sequence[Identity]) -> None:
    """``_write_partials`` for collected rows: the partitions of the ``new`` files."""
    ids = {i.id for i in new}
    parts = {(day, file) for day, file in zip(rows[DAY].to_pylist(), rows[FILE].to_pylist())
             if file in ids}
    tablefiles.write_partitions(store, PARTIALS, rows, [DAY, FILE], sorted(parts))


def _write_malformed(store: Store, frame: DataFrame) -> None:
    bad = _expanded(frame.where(F.col(STATUS) == BAD)).select(
        FILE, F.col(SOURCE).alias("source"), F.col("value").alias("line"))
    (bad.coalesce(1).write.mode("overwrite").option("partitionOverwriteMode", "dynamic")
     .partitionBy(FILE).parquet(store.path(MALFORMED)))


@contextmanager
def small_jobs(spark: SparkSession):
    """Settings for the jobs after the pass, over stored rows and tables (small
    next to the log even when there are more than ``DRIVER_ROWS``): one
    shuffle partition and no adaptive re-planning, whose fixed costs would
    dominate.  The session's own settings come back afterwards.
    """
    settings = {
        "spark.sql.shuffle.partitions": "1", "spark.sql.adaptive.enabled": "false",
        # Interpreted, not compiled: generating and compiling code for each of
        # the ~20 queries that finish the tables (some 130 classes, more than
        # the codegen cache keeps, so a session compiles them again on every
        # run) cost more than interpreting a few thousand rows, and as much
        # as it saves at 730,000 (measured).
        "spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN",
    }
    saved = {k: spark.conf.get(k, None) for k in settings}
    for k, v in settings.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


def _drop_file(store: Store, entry: dict) -> None:
    """Remove what a replaced file contributed: its stored rows and malformed lines."""
    for day in entry["days"]:
        store.delete(PARTIALS, f"{DAY}={day}", f"{FILE}={entry['id']}")
    store.delete(MALFORMED, f"{FILE}={entry['id']}")


def stored_schema(spark: SparkSession) -> T.StructType:
    """The columns of the stored rows (derived from the code, not inferred from files)."""
    if "stored" not in _SCHEMAS:  # analysing a plan costs a good part of a second
        lines = spark.createDataFrame([], f"value string, {SOURCE} string")
        _SCHEMAS["stored"] = _stored(_compact(parse(lines), F.lit(""))).schema
    return _SCHEMAS["stored"]


_SCHEMAS: dict = {}


def read_stored(spark: SparkSession, store: Store) -> DataFrame:
    """The stored rows of every file and day (``_stored()``)."""
    return store.read_parquet(stored_schema(spark), PARTIALS)


def _size_of() -> list:
    """Aggregates of stored rows that measure them against ``DRIVER_ROWS``."""
    listed = F.when(F.col("clients").isNotNull(), F.size("clients"))
    return [F.count(F.lit(1)).alias("rows"),
            F.coalesce(F.sum(listed), F.lit(0)).alias("listed")]


def _size(stored: DataFrame) -> int:
    r = stored.agg(*_size_of()).first()
    return r["rows"] + r["listed"]


def _rebuild_days_on_driver(store: Store, days: set, rows: pa.Table) -> None:
    """``rebuild_days`` on the driver, from the collected stored rows of ``days``."""
    day_list = sorted(days)
    stored = Stored(rows, BUCKET_S)
    tables = {t.name: t.on_driver(stored) for t in TABLES}
    _concurrently(lambda t: tablefiles.write_days(store, t.name, tables[t.name], day_list),
                  TABLES)


def rebuild_days(spark: SparkSession, store: Store, days: set, rows: DataFrame) -> None:
    """Rewrite each table's partitions of ``days`` from ``rows``: the stored
    rows (``_stored()``) of every file that covers those days.
    """
    if not days:
        return
    day_list = sorted(days)
    # One partition: every aggregation and window below then needs no shuffle
    # (these rows are few by design).
    stored = rows.where(F.col(DAY).isin(day_list)).coalesce(1).persist()
    records = _records(stored).persist()  # five partials read them

    def state(p: Partial) -> DataFrame:
        df = _state(p, stored, [DAY], records)
        return df.persist() if sum(t.partial is p for t in TABLES) > 1 else df  # shared: cached

    states = dict(zip((p.name for p in PARTIAL_SET), _concurrently(state, PARTIAL_SET)))

    def rebuild(t: Table) -> None:
        table = t.finish(states[t.partial.name], [DAY]).coalesce(1).sortWithinPartitions(
            DAY, *tf.order_columns(t.order))
        tablefiles.write_days(store, t.name, tablefiles.collect_table(table), day_list)

    try:
        _concurrently(rebuild, TABLES)
    finally:
        for df in (*states.values(), records, stored):
            df.unpersist()


def _concurrently(fn: Callable, items: Sequence) -> list:
    """``fn`` over ``items`` from a few driver threads: the jobs are small, so
    planning and scheduling them one after another would leave the cores idle.
    """
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(fn, items))


def read_table(spark: SparkSession, out: str, name: str, days: Sequence | None = None,
               merged: bool = False) -> DataFrame:
    """A table of the dataset ``out``, ordered for display.

    Default: the stored day tables (a ``date`` column, one set of rows per
    day), optionally only ``days``.  ``merged=True``: one table over those
    days (all by default), recomputed from the partials, so that, e.g., a
    connection that spans midnight is one row and distinct counts stay distinct.
    """
    table = next(t for t in TABLES if t.name == name)
    store = Store(spark, out)
    if merged:
        stored = read_stored(spark, store)
        if days is not None:
            stored = stored.where(F.col(DAY).isin(list(days)))
        return tf.ordered(table.finish(_state(table.partial, stored, []), []), table.order)
    df = _read_table(spark, store, name)
    if df is None:
        return table.finish(_state(table.partial, read_stored(spark, store), [DAY]), [DAY])
    if days is not None:
        df = df.where(F.col(DAY).isin(list(days)))
    return df.orderBy(DAY, *tf.order_columns(table.order))


def _read_table(spark: SparkSession, store: Store, name: str) -> DataFrame | None:
    """A stored table, or None while it holds no rows: in a dataset written
    before the driver wrote the tables, a day with no rows of a table (no
    floods, say) left a folder with no Parquet file to read."""
    if not store.exists(name):
        return None
    try:
        return spark.read.parquet(store.path(name))
    except AnalysisException as exc:
        if "UNABLE_TO_INFER_SCHEMA" not in str(exc):
            raise
        return None


def read_files(spark: SparkSession, out: str, replaced: bool = False) -> list[dict]:
    """The manifest's entries: the files the dataset holds (with ``replaced``,
    also those replaced by a longer version) and their line counts and days.
    """
    manifest = Manifest.load(Store(spark, out))
    return list(manifest.entries if replaced else manifest.active())


def read_malformed(spark: SparkSession, out: str) -> DataFrame:
    """The malformed lines of every file read: file_id, source, line."""
    store = Store(spark, out)
    if not store.exists(MALFORMED):
        return spark.createDataFrame([], f"source string, line string, {FILE} string")
    return spark.read.parquet(store.path(MALFORMED))


def write_csv(spark: SparkSession, out: str) -> None:
    """``out/csv/<table>/date=D/part-*.csv``: every day of every table, with a header.

    Quotes are escaped by doubling (RFC 4180), not Spark's default backslash,
    so spreadsheets and Python's csv module read malformed lines back intact.
    """
    store = Store(spark, out)
    for t in TABLES:
        if store.exists(t.name):
            df = read_table(spark, out, t.name).repartition(DAY).sortWithinPartitions(
                DAY, *tf.order_columns(t.order))
            (df.write.mode("overwrite").partitionBy(DAY).option("header", "true")
             .option("escape", '"').csv(store.path(CSV, t.name)))
    (read_malformed(spark, out).coalesce(1).write.mode("overwrite").option("header", "true")
     .option("escape", '"').csv(store.path(CSV, MALFORMED)))


# Under a message table that is empty because the log has no message records.
NOT_SAMPLED = ("  (this log has no message records: sbusd writes them only when it samples "
               "messages, which is off by default; start it with --log-messages RATE, 1 for "
               "every message, 0.01 for one in a hundred; docs/logging.md)")


def sampled(spark, out: str, days: Sequence | None = None) -> bool:
    """Whether the dataset's ``days`` have any message record (sbusd's
    --log-messages was on): else the per-key traffic and fan-out tables are
    empty for want of samples, not of traffic."""
    events = read_table(spark, out, "events", days=days)
    return events.where(F.col("event") == logschema.MESSAGE).limit(1).count() > 0


def _report(spark, store: Store, summary: dict, show: int, echo) -> None:
    if show and summary["days"]:
        has_samples = sampled(spark, store.root, summary["days"])
        for t in TABLES:
            echo(f"\n== {t.name}: {t.about}")
            table = read_table(spark, store.root, t.name, days=summary["days"])
            echo(render(table, show))
            if t.partial is MESSAGES and not has_samples:
                echo(NOT_SAMPLED)
    read, skipped = summary["files_read"], summary["files_skipped"]
    echo(f"\n== summary\nread {len(read)} file(s), skipped {len(skipped)} already read; "
         f"{summary['lines']} lines: {summary['records']} records, "
         f"{summary['malformed']} malformed, {summary['blank']} blank "
         f"({summary['seconds']} s); days rebuilt: {', '.join(summary['days']) or 'none'}; "
         f"dataset {summary['out']}")
    for uri in read:
        echo(f"  read: {uri}")
    for uri in skipped:
        echo(f"  already read: {uri}")
    for uri in summary["files_replaced"]:
        echo(f"  replaced by a longer version: {uri}")
    for ex in summary["malformed_examples"]:
        echo(f"  malformed: {ex['source']}: {ex['line']!r}")
    newer = [v for v in summary["schema_versions"] if v.isdigit()
             and int(v) > logschema.SCHEMA_VERSION]
    if newer:
        echo(f"  note: records with schema {', '.join(newer)} (newer than "
             f"{logschema.SCHEMA_VERSION}); unknown fields were ignored")


def render(df: DataFrame, n: int = 20) -> str:
    """The first ``n`` rows of ``df`` as a fixed-width text table."""
    rows = df.limit(n + 1).collect()
    more = len(rows) > n
    rows = rows[:n]
    cells = [list(df.columns)] + [["null" if v is None else _cell(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(df.columns))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = [rule]
    for i, row in enumerate(cells):
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            lines.append(rule)
    lines.append(rule)
    if not rows:
        lines.append("(no rows)")
    elif more:
        lines.append(f"(first {n} rows)")
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return f"{value:.6g}" if abs(value) < 1e6 else f"{value:.1f}"
    return str(value)
