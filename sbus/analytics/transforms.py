"""Aggregations over broker log events: pure DataFrame -> DataFrame functions.

Each function takes ``events``, a DataFrame of parsed log records with the
columns of ``schema.record_schema()`` (as returned by ``job.read_events``, or
``spark.read.schema(record_schema(False)).json(path)`` in a notebook), and
returns a small aggregate.  None of them triggers a Spark action, so they
compose and run unchanged in local mode or on a cluster.  They ignore events
they do not aggregate, including ones newer than this module.

Two sources of truth are used on purpose:

* counters (``stats``, ``client_disconnect``) are exact and are used for
  traffic, per-client totals and time series;
* ``message`` records are sampled (each carries its ``sample_rate``) and are
  the only source of per-key traffic and fan-out, so those tables report both
  the number of sampled records and estimates weighted by 1/sample_rate.
"""
from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from .. import logschema as ls

__all__ = [
    "client_traffic",
    "disconnect_reasons",
    "event_counts",
    "fanout_distribution",
    "flood_actions",
    "key_prefix",
    "pattern_churn",
    "subscription_churn",
    "throughput",
    "top_publishers",
    "traffic_by_prefix",
]

_TRAFFIC = ("msgs_in", "bytes_in", "msgs_out", "bytes_out")


def _only(events: DataFrame, event: str) -> DataFrame:
    return events.where(F.col("event") == event)


def _sample_weight() -> Column:
    # An out-of-range or missing rate is read as "not sampled" rather than
    # dividing by it: with ANSI mode on, a zero would abort the whole job.
    rate = F.col("sample_rate")
    return F.when((rate > 0) & (rate <= 1), F.lit(1.0) / rate).otherwise(F.lit(1.0))


def key_prefix(key: Column | str, depth: int) -> Column:
    """The first ``depth`` '/'-separated segments of a routing key, joined by '/'.

    A key with fewer segments is its own prefix; ``"a/b/"`` at depth 2 is ``"a/b"``.
    """
    if depth < 1:
        raise ValueError("depth must be at least 1")
    key = F.col(key) if isinstance(key, str) else key
    return F.array_join(F.slice(F.split(key, "/", -1), 1, depth), "/")


def traffic_by_prefix(events: DataFrame, depth: int | None = 1) -> DataFrame:
    """Published traffic per routing-key prefix (``depth`` None: per whole key),
    from the sampled ``message`` records.

    Columns: prefix, sampled (records seen), messages, bytes_in, deliveries,
    bytes_out (estimates: each record weighs 1/sample_rate).
    """
    w = _sample_weight()
    prefix = F.col("key") if depth is None else key_prefix("key", depth)
    return (
        _only(events, ls.MESSAGE)
        .where(F.col("key").isNotNull())
        .groupBy(prefix.alias("prefix"))
        .agg(
            F.count(F.lit(1)).alias("sampled"),
            F.sum(w).alias("messages"),
            F.sum(F.col("size") * w).alias("bytes_in"),
            F.sum(F.col("fanout") * w).alias("deliveries"),
            F.sum(F.col("size") * F.col("fanout") * w).alias("bytes_out"),
        )
        .orderBy(F.desc("messages"), "prefix")
    )


def client_traffic(events: DataFrame) -> DataFrame:
    """One row per client connection with its lifetime counters.

    A connection is (broker_pid, client).  Its counters come from its
    ``client_disconnect`` record if there is one, else from the latest
    ``stats`` record listing it (``counters_from`` says which, null if
    neither: the log ended before the broker reported on it).
    """
    ident = ["broker_pid", "client", "pid", "uid", "gid"]
    connects = _only(events, ls.CLIENT_CONNECT).select(
        *ident, F.col("timestamp").alias("connected_at"))
    disconnects = _only(events, ls.CLIENT_DISCONNECT).select(
        *ident,
        F.col("timestamp").alias("disconnected_at"),
        F.col("reason").alias("disconnect_reason"),
        "duration_s",
        F.col("counters").alias("c"),
        # Final counters beat any periodic snapshot, whatever the timestamps.
        F.struct(F.lit(1).alias("final"), F.col("timestamp").alias("t")).alias("rank"),
        F.lit("disconnect").alias("src"),
    )
    snapshots = (
        _only(events, ls.STATS)
        .select("broker_pid", "timestamp", F.explode("clients").alias("c"))
        .select(
            "broker_pid", "c.client", "c.pid", "c.uid", "c.gid", "c",
            F.struct(F.lit(0).alias("final"), F.col("timestamp").alias("t")).alias("rank"),
            F.lit("stats").alias("src"),
        )
    )
    rows = connects.unionByName(disconnects, allowMissingColumns=True).unionByName(
        snapshots, allowMissingColumns=True)
    counter_cols = [*_TRAFFIC, *ls.DROP_KINDS, "subscriptions"]
    return (
        rows.where(F.col("client").isNotNull())
        .groupBy("broker_pid", "client")
        .agg(
            F.first("pid", ignorenulls=True).alias("pid"),
            F.first("uid", ignorenulls=True).alias("uid"),
            F.first("gid", ignorenulls=True).alias("gid"),
            F.min("connected_at").alias("connected_at"),
            F.max("disconnected_at").alias("disconnected_at"),
            F.max_by("disconnect_reason", "disconnected_at").alias("disconnect_reason"),
            F.max_by("duration_s", "disconnected_at").alias("duration_s"),
            F.max_by("c", "rank").alias("c"),
            F.max_by("src", "rank").alias("counters_from"),
        )
        .select(
            "broker_pid", "client", "pid", "uid", "gid", "connected_at", "disconnected_at",
            "disconnect_reason", "duration_s",
            *[F.col("c")[name].alias(name) for name in counter_cols],
            "counters_from",
        )
        .orderBy("broker_pid", "client")
    )


def top_publishers(events: DataFrame, n: int = 20) -> DataFrame:
    """The ``n`` processes (pid, uid) that published the most messages, all connections summed."""
    return (
        client_traffic(events)
        .groupBy("pid", "uid")
        .agg(
            F.count(F.lit(1)).alias("connections"),
            *[F.sum(c).alias(c) for c in _TRAFFIC],
        )
        .orderBy(F.desc("msgs_in"), F.desc("bytes_in"), "pid", "uid")
        .limit(n)
    )


def throughput(events: DataFrame, bucket: str = "1 minute") -> DataFrame:
    """Traffic and drops per time bucket, summed from the ``delta`` of ``stats`` records.

    A record's whole delta is credited to the bucket of its timestamp.
    Columns: time (bucket start), seconds (bucket length), stats_records,
    the DELTA_FIELDS, drops (all kinds), msgs_in_per_s, msgs_out_per_s.
    Buckets without a stats record (broker down) are absent, not zero.
    """
    win = F.window("timestamp", bucket)
    out = (
        _only(events, ls.STATS)
        .groupBy(win.alias("w"))
        .agg(
            F.count(F.lit(1)).alias("stats_records"),
            *[F.coalesce(F.sum(F.col("delta")[f]), F.lit(0)).alias(f) for f in ls.DELTA_FIELDS],
        )
        .withColumn("seconds",
                    (F.unix_micros(F.col("w.end")) - F.unix_micros(F.col("w.start"))) / 1e6)
        .withColumn("drops", sum((F.col(k) for k in ls.DROP_KINDS), F.lit(0)))
        .withColumn("msgs_in_per_s", F.col("msgs_in") / F.col("seconds"))
        .withColumn("msgs_out_per_s", F.col("msgs_out") / F.col("seconds"))
    )
    return out.select(F.col("w.start").alias("time"), "seconds", "stats_records",
                      *ls.DELTA_FIELDS, "drops", "msgs_in_per_s", "msgs_out_per_s"
                      ).orderBy("time")


def disconnect_reasons(events: DataFrame) -> DataFrame:
    """Disconnects per reason, with their share and the traffic of those clients."""
    per_reason = (
        _only(events, ls.CLIENT_DISCONNECT)
        .groupBy(F.coalesce(F.col("reason"), F.lit("unknown")).alias("reason"))
        .agg(
            F.count(F.lit(1)).alias("disconnects"),
            F.avg("duration_s").alias("avg_duration_s"),
            F.sum(F.col("counters.msgs_in")).alias("msgs_in"),
            F.sum(F.col("counters.msgs_out")).alias("msgs_out"),
        )
    )
    total = per_reason.agg(F.sum("disconnects").alias("_total"))
    return (
        per_reason.crossJoin(total)
        .withColumn("share", F.col("disconnects") / F.col("_total"))
        .select("reason", "disconnects", "share", "avg_duration_s", "msgs_in", "msgs_out")
        .orderBy(F.desc("disconnects"), "reason")
    )


def flood_actions(events: DataFrame) -> DataFrame:
    """Flood-control actions per connection: drops and blocks from ``flood``
    summaries, and whether it was disconnected for flooding (``flood_error``).
    """
    keys = ["broker_pid", "client", "pid", "uid"]
    floods = _only(events, ls.FLOOD).select(
        *keys, "timestamp", "drops_soft", "drops_hard", "blocks", "queued_msgs",
        "queued_bytes", "soft", "hard", F.lit(1).alias("is_flood"))
    kicked = (
        _only(events, ls.CLIENT_DISCONNECT)
        .where(F.col("reason") == ls.DISCONNECT_FLOOD_ERROR)
        .select(*keys, F.lit(1).alias("kicked"))
    )
    return (
        floods.unionByName(kicked, allowMissingColumns=True)
        .groupBy("broker_pid", "client")
        .agg(
            F.first("pid", ignorenulls=True).alias("pid"),
            F.first("uid", ignorenulls=True).alias("uid"),
            F.coalesce(F.sum("is_flood"), F.lit(0)).alias("flood_records"),
            F.coalesce(F.sum("drops_soft"), F.lit(0)).alias("drops_soft"),
            F.coalesce(F.sum("drops_hard"), F.lit(0)).alias("drops_hard"),
            F.coalesce(F.sum("blocks"), F.lit(0)).alias("blocks"),
            F.max("queued_msgs").alias("max_queued_msgs"),
            F.max("queued_bytes").alias("max_queued_bytes"),
            F.max_by("soft", "timestamp").alias("soft_mode"),
            F.max_by("hard", "timestamp").alias("hard_mode"),
            F.coalesce(F.sum("kicked"), F.lit(0)).alias("flood_disconnects"),
        )
        .orderBy(F.desc(F.col("drops_soft") + F.col("drops_hard")), F.desc("blocks"),
                 "broker_pid", "client")
    )


def fanout_distribution(events: DataFrame) -> DataFrame:
    """How many recipients published messages had, from the sampled ``message`` records.

    Columns: fanout, sampled, messages (estimate), share (of messages).
    """
    per_fanout = (
        _only(events, ls.MESSAGE)
        .where(F.col("fanout").isNotNull())
        .groupBy("fanout")
        .agg(F.count(F.lit(1)).alias("sampled"), F.sum(_sample_weight()).alias("messages"))
    )
    total = per_fanout.agg(F.sum("messages").alias("_total"))
    return (
        per_fanout.crossJoin(total)
        .withColumn("share", F.col("messages") / F.col("_total"))
        .drop("_total")
        .orderBy("fanout")
    )


def _subscription_events(events: DataFrame) -> DataFrame:
    is_sub = F.col("event") == ls.SUBSCRIBE
    ok = F.col("accepted") == F.lit(True)
    return events.where(F.col("event").isin(ls.SUBSCRIBE, ls.UNSUBSCRIBE)).select(
        "*",
        (is_sub & ok).cast("long").alias("_sub"),
        (~is_sub & ok).cast("long").alias("_unsub"),
        (F.col("accepted") == F.lit(False)).cast("long").alias("_refused"),
    )


def subscription_churn(events: DataFrame, bucket: str = "1 minute") -> DataFrame:
    """Accepted subscribes and unsubscribes, and refusals, per time bucket.

    Columns: time, subscribed, unsubscribed, refused, net (subscribed - unsubscribed).
    """
    return (
        _subscription_events(events)
        .groupBy(F.window("timestamp", bucket).start.alias("time"))
        .agg(
            F.sum("_sub").alias("subscribed"),
            F.sum("_unsub").alias("unsubscribed"),
            F.sum("_refused").alias("refused"),
        )
        .withColumn("net", F.col("subscribed") - F.col("unsubscribed"))
        .orderBy("time")
    )


def pattern_churn(events: DataFrame) -> DataFrame:
    """Per pattern: accepted subscribes and unsubscribes, refusals, distinct connections."""
    return (
        _subscription_events(events)
        .groupBy("pattern")
        .agg(
            F.sum("_sub").alias("subscribed"),
            F.sum("_unsub").alias("unsubscribed"),
            F.sum("_refused").alias("refused"),
            F.count_distinct("broker_pid", "client").alias("clients"),
        )
        .orderBy(F.desc("subscribed"), "pattern")
    )


def event_counts(events: DataFrame) -> DataFrame:
    """Records per event name, including events this module does not aggregate."""
    return events.groupBy("event").agg(F.count(F.lit(1)).alias("records")).orderBy(
        F.desc("records"), "event")
