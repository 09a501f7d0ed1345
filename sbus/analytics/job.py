"""The batch job: read broker logs, compute every table, write and print them.

Runs as ``python -m sbus.analytics LOGS... --out DIR`` or, for a cluster,
``spark-submit sbus/analytics/job.py LOGS... --out DIR`` (with the sbus
package installed on the driver, or shipped with ``--py-files``).

Lines are read as text and parsed with ``from_json`` against the declared
schema, so one bad line costs one count, never the job: a line is
*malformed* when it is not a JSON object, lacks ``event`` or a parseable
``timestamp``, or is one of the schema's events with a field of the wrong
type.  Blank lines are skipped.
"""
from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    # spark-submit runs this file as a plain script: make the package that
    # contains it importable when sbus is not installed (a source checkout).
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sbus import logschema
from sbus.analytics import transforms as tf
from sbus.analytics.schema import CORRUPT_COLUMN, record_schema

OK, MALFORMED, BLANK = "ok", "malformed", "blank"
STATUS = "_status"
SOURCE = "_source"


@dataclass(frozen=True)
class Table:
    name: str
    build: Callable[[DataFrame], DataFrame]
    about: str


TABLES: tuple[Table, ...] = (
    Table("events", tf.event_counts, "records per event"),
    Table("traffic_by_prefix1", lambda e: tf.traffic_by_prefix(e, 1),
          "sampled traffic per first routing-key segment"),
    Table("traffic_by_prefix2", lambda e: tf.traffic_by_prefix(e, 2),
          "sampled traffic per first two routing-key segments"),
    Table("client_traffic", tf.client_traffic, "per connection: published and delivered"),
    Table("throughput", lambda e: tf.throughput(e, "1 minute"),
          "per minute: traffic and drops"),
    Table("disconnect_reasons", tf.disconnect_reasons, "disconnects per reason"),
    Table("flood_actions", tf.flood_actions, "flood-control actions per connection"),
    Table("top_publishers", lambda e: tf.top_publishers(e, 20),
          "top 20 publishers by messages"),
    Table("fanout", tf.fanout_distribution, "fan-out distribution of sampled messages"),
    Table("subscription_churn", lambda e: tf.subscription_churn(e, "1 minute"),
          "per minute: subscribes, unsubscribes, refusals"),
    Table("pattern_churn", tf.pattern_churn, "per pattern: subscribes, unsubscribes"),
)


def spark_session(master: str | None = None, app_name: str = "sbus-analytics",
                  conf: dict | None = None) -> SparkSession:
    """A session with UTC time (buckets and CSVs do not depend on the host's zone).

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
    (ok, malformed or blank) and ``_source``.
    """
    options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT_COLUMN}
    rec = F.from_json("value", record_schema(corrupt_column=True), options).alias("r")
    parsed = lines.select("value", SOURCE, rec).select("value", SOURCE, "r.*")
    # A type clash only matters for the events the schema defines: other
    # events may reuse a name with another type (accept_paused's `clients` is
    # a number), and from_json still fills in their event and timestamp.
    known = F.col("event").isin(*logschema.EVENT_FIELDS)
    status = (
        F.when(F.trim("value") == "", F.lit(BLANK))
        .when(F.col("event").isNull() | F.col("timestamp").isNull()
              | (F.col(CORRUPT_COLUMN).isNotNull() & known), F.lit(MALFORMED))
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
    by_status, versions = {}, {}
    for r in parsed.groupBy(STATUS, "schema").agg(F.count(F.lit(1)).alias("n")).collect():
        by_status[r[STATUS]] = by_status.get(r[STATUS], 0) + r["n"]
        if r[STATUS] == OK:
            versions[str(r["schema"])] = r["n"]
    bad = parsed.where(F.col(STATUS) == MALFORMED).select("value", SOURCE).limit(examples)
    return {
        "lines": sum(by_status.values()),
        "records": by_status.get(OK, 0),
        "malformed": by_status.get(MALFORMED, 0),
        "blank": by_status.get(BLANK, 0),
        "schema_versions": dict(sorted(versions.items())),
        "malformed_examples": [{"source": r[SOURCE], "line": r["value"][:200]}
                               for r in bad.collect()],
    }


def write_table(df: DataFrame, out: str, name: str) -> None:
    """``out/parquet/<name>/`` and ``out/csv/<name>/`` (one CSV part with a header)."""
    df.write.mode("overwrite").parquet(f"{out}/parquet/{name}")
    # Aggregates are small: one part file is what a person opening the CSV wants.
    # Quotes are escaped by doubling (RFC 4180), not Spark's default backslash,
    # so spreadsheets and Python's csv module read malformed lines back intact.
    (df.coalesce(1).write.mode("overwrite").option("header", "true").option("escape", '"')
     .csv(f"{out}/csv/{name}"))


def run(spark: SparkSession, paths: Sequence[str], out: str, *, show: int = 20,
        tables: Sequence[str] | None = None, echo: Callable[[str], None] = print) -> dict:
    """Read ``paths``, write the tables (default: all of ``TABLES``) under
    ``out`` and print them; return the summary.  The ``malformed`` and
    ``summary`` tables are always written.
    """
    chosen = [t for t in TABLES if tables is None or t.name in tables]
    started = time.perf_counter()
    # Everything below reads this cache; the raw text is kept only where a
    # line is malformed, which roughly halves what is cached.
    parsed = (
        parse(read_lines(spark, paths))
        .drop(CORRUPT_COLUMN)
        .withColumn("value", F.when(F.col(STATUS) != OK, F.col("value")))
        .persist()
    )
    try:
        summary = line_summary(parsed)
        events = events_of(parsed)
        bad = parsed.where(F.col(STATUS) == MALFORMED).select(
            F.col(SOURCE).alias("source"), F.col("value").alias("line"))
        write_table(bad, out, "malformed")
        for table in chosen:
            df = table.build(events).persist()
            try:
                write_table(df, out, table.name)
                if show:
                    echo(f"\n== {table.name}: {table.about}")
                    echo(render(df, show))
            finally:
                df.unpersist()
    finally:
        parsed.unpersist()
    summary["seconds"] = round(time.perf_counter() - started, 3)
    summary["tables"] = ["malformed", *(t.name for t in chosen), "summary"]
    summary["out"] = out
    counts = [(k, float(summary[k])) for k in ("lines", "records", "malformed", "blank", "seconds")]
    write_table(spark.createDataFrame(counts, "metric string, value double"), out, "summary")
    echo(f"\n== summary\n{summary['lines']} lines: {summary['records']} records, "
         f"{summary['malformed']} malformed, {summary['blank']} blank "
         f"({summary['seconds']} s); tables in {out}")
    for ex in summary["malformed_examples"]:
        echo(f"  malformed: {ex['source']}: {ex['line']!r}")
    newer = [v for v in summary["schema_versions"] if v.isdigit()
             and int(v) > logschema.SCHEMA_VERSION]
    if newer:
        echo(f"  note: records with schema {', '.join(newer)} (newer than "
             f"{logschema.SCHEMA_VERSION}); unknown fields were ignored")
    return summary


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


if __name__ == "__main__":
    from sbus.analytics.__main__ import main

    sys.exit(main())
