"""Spark analytics over sbusd's JSON-lines logs (needs the analytics extra, ``pysbus[analytics]``).

The broker never imports this package; ``import sbus`` does not either.

- ``cli``: ``python -m sbus.analytics`` and the ``spark-submit`` entry.
- ``job``: a run: read the logs, update the dataset, write the tables.
- ``schema``: the record schema Spark reads with (from :mod:`sbus.logschema`).
- ``transforms``: the aggregations, as Spark DataFrames.
- ``dataset``: the stored rows and tables on disk; ``tablefiles``: writing them.
- ``daytables``: the day tables computed on the driver when the rows are few.
"""
try:
    import pyspark  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("sbus.analytics needs PySpark, the analytics extra of pysbus: "
                      "pip install pyspark pyarrow") from exc

from .job import (
    NOT_SAMPLED,
    TABLES,
    events_of,
    line_summary,
    parse,
    read_events,
    read_files,
    read_lines,
    read_malformed,
    read_table,
    render,
    run,
    sampled,
    spark_session,
)
from .schema import CORRUPT_COLUMN, record_schema
from .transforms import (
    client_traffic,
    disconnect_reasons,
    event_counts,
    fanout_distribution,
    flood_actions,
    key_prefix,
    pattern_churn,
    publish_denials,
    subscription_churn,
    throughput,
    top_publishers,
    traffic_by_prefix,
)

__all__ = [
    "NOT_SAMPLED",
    "CORRUPT_COLUMN",
    "TABLES",
    "client_traffic",
    "disconnect_reasons",
    "event_counts",
    "events_of",
    "fanout_distribution",
    "flood_actions",
    "key_prefix",
    "line_summary",
    "parse",
    "pattern_churn",
    "publish_denials",
    "read_events",
    "read_files",
    "read_lines",
    "read_malformed",
    "read_table",
    "record_schema",
    "render",
    "run",
    "sampled",
    "spark_session",
    "subscription_churn",
    "throughput",
    "top_publishers",
    "traffic_by_prefix",
]
