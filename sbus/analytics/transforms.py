"""Aggregations over broker log events: pure DataFrame -> DataFrame functions.

Each table is built in three steps so that it can be kept incrementally:

* a *partial* (``*_partial(events, by)``) aggregates records into a small,
  mergeable state, grouped by the extra columns ``by`` (the job uses the day);
* a *merge* (``*_merge(partials, by)``) combines partials into the state of
  their union, grouped by ``by`` (the job merges the message sums it keeps
  per file and day this way);
* a *finish* (``*_table(merged, by)``) turns the state into the reported
  table, one per ``by`` group.

Partials hold sums, counts, minima and maxima, and "the value at the latest
timestamp" pairs, never ratios or averages: merging two partials gives
exactly the partial of all their records.  Where a table counts distinct
things (connections per pattern), the partial keeps one row per thing.

The one-step functions (``client_traffic(events)`` etc.) run the three steps
with no ``by``: they take ``events``, a DataFrame of parsed log records with
the columns of ``schema.record_schema()`` (``job.read_events``, or
``spark.read.schema(record_schema(False)).json(path)`` in a notebook), and
return the table ordered for display.  None of these functions triggers a
Spark action.  They ignore events they do not aggregate, including ones newer
than this module.

Two sources of truth are used on purpose:

* counters (``stats``, ``client_disconnect``) are exact and are used for
  traffic, per-client totals and time series;
* ``message`` records are sampled (each carries its ``sample_rate``) and are
  the only source of per-key traffic and fan-out, so those tables report both
  the number of sampled records and estimates weighted by 1/sample_rate.
"""
from __future__ import annotations

from typing import Sequence

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from .. import logschema as ls

__all__ = [
    "COLUMNS",
    "client_traffic",
    "disconnect_reasons",
    "event_counts",
    "fanout_distribution",
    "flood_actions",
    "key_prefix",
    "pattern_churn",
    "publish_denials",
    "subscription_churn",
    "throughput",
    "top_publishers",
    "traffic_by_prefix",
]

# The record columns the partials read: the job caches only these.
COLUMNS = ("timestamp", "event", "broker_pid", "client", "pid", "uid", "gid", "key", "size",
           "fanout", "sample_rate", "reason", "duration_s", "counters", "delta", "clients",
           "pattern", "accepted", "drops_soft", "drops_hard", "blocks", "queued_msgs",
           "queued_bytes", "soft", "hard", "rule", "action", "suppressed")

TRAFFIC = ("msgs_in", "bytes_in", "msgs_out", "bytes_out")
# client_traffic's counters, from a connection's latest report (traffic first).
CLIENT_COUNTERS = (*TRAFFIC, *ls.DROP_KINDS, "subscriptions")
By = Sequence[str]


def _only(events: DataFrame, event: str) -> DataFrame:
    return events.where(F.col("event") == event)


def _sums(df: DataFrame, keys: Sequence[str], cols: Sequence[str]) -> DataFrame:
    """The merge of an additive partial: sum every column per key."""
    return df.groupBy(*keys).agg(*[F.sum(c).alias(c) for c in cols])


def _share(col: str, by: By) -> Column:
    return F.col(col) / F.sum(col).over(Window.partitionBy(*by))


def _sample_weight() -> Column:
    # An out-of-range or missing rate is read as "not sampled" rather than
    # dividing by it: with ANSI mode on, a zero would abort the whole job.
    rate = F.col("sample_rate")
    return F.when((rate > 0) & (rate <= 1), F.lit(1.0) / rate).otherwise(F.lit(1.0))


def order_columns(spec: Sequence[str]) -> list:
    """Sort columns from an order spec: SQL expressions, descending when prefixed by '-'."""
    return [F.desc(F.expr(s[1:])) if s.startswith("-") else F.expr(s) for s in spec]


def ordered(df: DataFrame, spec: Sequence[str]) -> DataFrame:
    return df.orderBy(*order_columns(spec))


def key_prefix(key: Column | str, depth: int) -> Column:
    """The first ``depth`` '/'-separated segments of a routing key, joined by '/'.

    A key with fewer segments is its own prefix; ``"a/b/"`` at depth 2 is ``"a/b"``.
    """
    if depth < 1:
        raise ValueError("depth must be at least 1")
    key = F.col(key) if isinstance(key, str) else key
    return F.array_join(F.slice(F.split(key, "/", -1), 1, depth), "/")


# --- events ------------------------------------------------------------------------------

def event_partial(events: DataFrame, by: By = ()) -> DataFrame:
    return events.groupBy(*by, "event").agg(F.count(F.lit(1)).alias("records"))


def event_merge(partials: DataFrame, by: By = ()) -> DataFrame:
    return _sums(partials, [*by, "event"], ["records"])


def event_table(merged: DataFrame, by: By = ()) -> DataFrame:
    return merged.select(*by, "event", "records")


EVENT_ORDER = ("-records", "event")


def event_counts(events: DataFrame) -> DataFrame:
    """Records per event name, including events this module does not aggregate."""
    return ordered(event_table(event_merge(event_partial(events))), EVENT_ORDER)


# --- sampled messages: per-key traffic and fan-out ----------------------------------------

MESSAGE_SUMS = ("sampled", "messages", "bytes_in", "deliveries", "bytes_out")


def message_sums() -> list:
    """The message partial's aggregates: sampled records and sums weighted by 1/sample_rate."""
    w = _sample_weight()
    return [
        F.count(F.lit(1)).alias("sampled"),
        F.sum(w).alias("messages"),
        F.sum(F.col("size") * w).alias("bytes_in"),
        F.sum(F.col("fanout") * w).alias("deliveries"),
        F.sum(F.col("size") * F.col("fanout") * w).alias("bytes_out"),
    ]


def message_partial(events: DataFrame, by: By = ()) -> DataFrame:
    """Sampled records and weighted sums per (key, fanout)."""
    return _only(events, ls.MESSAGE).groupBy(*by, "key", "fanout").agg(*message_sums())


def message_merge(partials: DataFrame, by: By = ()) -> DataFrame:
    return _sums(partials, [*by, "key", "fanout"], MESSAGE_SUMS)


def prefix_table(merged: DataFrame, depth: int | None, by: By = ()) -> DataFrame:
    prefix = F.col("key") if depth is None else key_prefix("key", depth)
    return _sums(merged.where(F.col("key").isNotNull()).withColumn("prefix", prefix),
                 [*by, "prefix"], MESSAGE_SUMS)


PREFIX_ORDER = ("-messages", "prefix")


def traffic_by_prefix(events: DataFrame, depth: int | None = 1) -> DataFrame:
    """Published traffic per routing-key prefix (``depth`` None: per whole key),
    from the sampled ``message`` records.

    Columns: prefix, sampled (records seen), messages, bytes_in, deliveries,
    bytes_out (estimates: each record weighs 1/sample_rate).
    """
    return ordered(prefix_table(message_merge(message_partial(events)), depth), PREFIX_ORDER)


def fanout_table(merged: DataFrame, by: By = ()) -> DataFrame:
    per_fanout = _sums(merged.where(F.col("fanout").isNotNull()), [*by, "fanout"],
                       ["sampled", "messages"])
    return per_fanout.withColumn("share", _share("messages", by))


FANOUT_ORDER = ("fanout",)


def fanout_distribution(events: DataFrame) -> DataFrame:
    """How many recipients published messages had, from the sampled ``message`` records.

    Columns: fanout, sampled, messages (estimate), share (of messages).
    """
    return ordered(fanout_table(message_merge(message_partial(events))), FANOUT_ORDER)


# --- connections --------------------------------------------------------------------------

_IDENT = ("broker_pid", "client")


def _client_state(rows: DataFrame, by: By) -> DataFrame:
    """Partial and merge alike: the latest-by-rank counters and the disconnect."""
    return rows.groupBy(*by, *_IDENT).agg(
        F.first("pid", ignorenulls=True).alias("pid"),
        F.first("uid", ignorenulls=True).alias("uid"),
        F.first("gid", ignorenulls=True).alias("gid"),
        F.min("connected_at").alias("connected_at"),
        F.max("disconnected_at").alias("disconnected_at"),
        F.max_by("disconnect_reason", "disconnected_at").alias("disconnect_reason"),
        F.max_by("duration_s", "disconnected_at").alias("duration_s"),
        F.max_by("c", "rank").alias("c"),
        F.max_by("counters_from", "rank").alias("counters_from"),
        F.max("rank").alias("rank"),
    )


def client_partial(events: DataFrame, by: By = ()) -> DataFrame:
    """Per connection (broker_pid, client): identity, connect and disconnect
    times, and the counters of its highest-ranked report with their rank.
    """
    ident = [*by, "broker_pid", "client", "pid", "uid", "gid"]
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
        F.lit("disconnect").alias("counters_from"),
    )
    snapshots = (
        _only(events, ls.STATS)
        .select(*by, "broker_pid", "timestamp", F.explode("clients").alias("c"))
        .select(
            *by, "broker_pid", "c.client", "c.pid", "c.uid", "c.gid", "c",
            F.struct(F.lit(0).alias("final"), F.col("timestamp").alias("t")).alias("rank"),
            F.lit("stats").alias("counters_from"),
        )
    )
    rows = connects.unionByName(disconnects, allowMissingColumns=True).unionByName(
        snapshots, allowMissingColumns=True)
    return _client_state(rows.where(F.col("client").isNotNull()), by)


def client_merge(partials: DataFrame, by: By = ()) -> DataFrame:
    return _client_state(partials, by)


def client_table(merged: DataFrame, by: By = ()) -> DataFrame:
    return merged.select(
        *by, "broker_pid", "client", "pid", "uid", "gid", "connected_at", "disconnected_at",
        "disconnect_reason", "duration_s",
        *[F.col("c")[name].alias(name) for name in CLIENT_COUNTERS],
        "counters_from",
    )


CLIENT_ORDER = ("broker_pid", "client")


def client_traffic(events: DataFrame) -> DataFrame:
    """One row per client connection with its lifetime counters.

    A connection is (broker_pid, client).  Its counters come from its
    ``client_disconnect`` record if there is one, else from the latest
    ``stats`` record listing it (``counters_from`` says which, null if
    neither: the log ended before the broker reported on it).
    """
    return ordered(client_table(client_merge(client_partial(events))), CLIENT_ORDER)


def publishers_table(merged: DataFrame, n: int = 20, by: By = ()) -> DataFrame:
    per_process = (
        client_table(merged, by)
        .groupBy(*by, "pid", "uid")
        .agg(F.count(F.lit(1)).alias("connections"), *[F.sum(c).alias(c) for c in TRAFFIC])
    )
    ranking = Window.partitionBy(*by).orderBy(*order_columns(PUBLISHER_ORDER))
    rank = F.row_number().over(ranking)
    return per_process.withColumn("_rank", rank).where(F.col("_rank") <= n).drop("_rank")


PUBLISHER_ORDER = ("-msgs_in", "-bytes_in", "pid", "uid")


def top_publishers(events: DataFrame, n: int = 20) -> DataFrame:
    """The ``n`` processes (pid, uid) that published the most messages, all connections summed."""
    return ordered(publishers_table(client_merge(client_partial(events)), n), PUBLISHER_ORDER)


# --- time series --------------------------------------------------------------------------

def throughput_partial(events: DataFrame, bucket: str = "1 minute", by: By = ()) -> DataFrame:
    """Per time bucket: stats records and the sums of their ``delta``."""
    win = F.window("timestamp", bucket)
    seconds = (F.unix_micros(win.end) - F.unix_micros(win.start)) / 1e6
    return (
        _only(events, ls.STATS)
        .groupBy(*by, win.start.alias("time"), seconds.alias("seconds"))
        .agg(
            F.count(F.lit(1)).alias("stats_records"),
            *[F.coalesce(F.sum(F.col("delta")[f]), F.lit(0)).alias(f) for f in ls.DELTA_FIELDS],
        )
    )


def throughput_merge(partials: DataFrame, by: By = ()) -> DataFrame:
    return _sums(partials, [*by, "time", "seconds"], ["stats_records", *ls.DELTA_FIELDS])


def throughput_table(merged: DataFrame, by: By = ()) -> DataFrame:
    return (
        merged
        .withColumn("drops", sum((F.col(k) for k in ls.DROP_KINDS), F.lit(0)))
        .withColumn("msgs_in_per_s", F.col("msgs_in") / F.col("seconds"))
        .withColumn("msgs_out_per_s", F.col("msgs_out") / F.col("seconds"))
        .select(*by, "time", "seconds", "stats_records", *ls.DELTA_FIELDS, "drops",
                "msgs_in_per_s", "msgs_out_per_s")
    )


TIME_ORDER = ("time",)


def throughput(events: DataFrame, bucket: str = "1 minute") -> DataFrame:
    """Traffic and drops per time bucket, summed from the ``delta`` of ``stats`` records.

    A record's whole delta is credited to the bucket of its timestamp.
    Columns: time (bucket start), seconds (bucket length), stats_records,
    the DELTA_FIELDS, drops (all kinds), msgs_in_per_s, msgs_out_per_s.
    Buckets without a stats record (broker down) are absent, not zero.
    """
    merged = throughput_merge(throughput_partial(events, bucket))
    return ordered(throughput_table(merged), TIME_ORDER)


# --- disconnects and flood control --------------------------------------------------------

_DISCONNECT_SUMS = ("disconnects", "duration_sum", "duration_n", "msgs_in", "msgs_out")


def disconnect_partial(events: DataFrame, by: By = ()) -> DataFrame:
    return (
        _only(events, ls.CLIENT_DISCONNECT)
        .groupBy(*by, F.coalesce(F.col("reason"), F.lit("unknown")).alias("reason"))
        .agg(
            F.count(F.lit(1)).alias("disconnects"),
            F.sum("duration_s").alias("duration_sum"),
            F.count("duration_s").alias("duration_n"),
            F.sum(F.col("counters.msgs_in")).alias("msgs_in"),
            F.sum(F.col("counters.msgs_out")).alias("msgs_out"),
        )
    )


def disconnect_merge(partials: DataFrame, by: By = ()) -> DataFrame:
    return _sums(partials, [*by, "reason"], _DISCONNECT_SUMS)


def disconnect_table(merged: DataFrame, by: By = ()) -> DataFrame:
    n = F.col("duration_n")
    return merged.select(
        *by, "reason", "disconnects", _share("disconnects", by).alias("share"),
        F.when(n > 0, F.col("duration_sum") / n).alias("avg_duration_s"), "msgs_in", "msgs_out")


DISCONNECT_ORDER = ("-disconnects", "reason")


def disconnect_reasons(events: DataFrame) -> DataFrame:
    """Disconnects per reason, with their share and the traffic of those clients."""
    return ordered(disconnect_table(disconnect_merge(disconnect_partial(events))), DISCONNECT_ORDER)


_FLOOD_SUMS = ("flood_records", "drops_soft", "drops_hard", "blocks", "flood_disconnects")


def flood_partial(events: DataFrame, by: By = ()) -> DataFrame:
    """Per connection: sums of its ``flood`` summaries, the modes of the latest
    one (with its time) and how often it was disconnected for flooding.
    """
    keys = [*by, "broker_pid", "client", "pid", "uid"]
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
        .groupBy(*by, "broker_pid", "client")
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
            F.max("timestamp").alias("last_flood_at"),
            F.coalesce(F.sum("kicked"), F.lit(0)).alias("flood_disconnects"),
        )
    )


def flood_merge(partials: DataFrame, by: By = ()) -> DataFrame:
    return partials.groupBy(*by, "broker_pid", "client").agg(
        F.first("pid", ignorenulls=True).alias("pid"),
        F.first("uid", ignorenulls=True).alias("uid"),
        *[F.sum(c).alias(c) for c in _FLOOD_SUMS],
        F.max("max_queued_msgs").alias("max_queued_msgs"),
        F.max("max_queued_bytes").alias("max_queued_bytes"),
        F.max_by("soft_mode", "last_flood_at").alias("soft_mode"),
        F.max_by("hard_mode", "last_flood_at").alias("hard_mode"),
        F.max("last_flood_at").alias("last_flood_at"),
    )


def flood_table(merged: DataFrame, by: By = ()) -> DataFrame:
    return merged.select(*by, "broker_pid", "client", "pid", "uid", "flood_records",
                         "drops_soft", "drops_hard", "blocks", "max_queued_msgs",
                         "max_queued_bytes", "soft_mode", "hard_mode", "flood_disconnects")


FLOOD_ORDER = ("-(drops_soft + drops_hard)", "-blocks", "broker_pid", "client")


def flood_actions(events: DataFrame) -> DataFrame:
    """Flood-control actions per connection: drops and blocks from ``flood``
    summaries, and whether it was disconnected for flooding (``flood_error``).
    """
    return ordered(flood_table(flood_merge(flood_partial(events))), FLOOD_ORDER)


# --- subscriptions ------------------------------------------------------------------------

SUB_SUMS = ("subscribed", "unsubscribed", "refused")


def subscription_partial(events: DataFrame, bucket: str = "1 minute", by: By = ()) -> DataFrame:
    """Accepted subscribes, unsubscribes and refusals per (time bucket, pattern,
    connection): the connection is kept so that distinct ones can be counted.
    """
    is_sub = F.col("event") == ls.SUBSCRIBE
    ok = F.col("accepted") == F.lit(True)
    return (
        events.where(F.col("event").isin(ls.SUBSCRIBE, ls.UNSUBSCRIBE))
        .groupBy(*by, F.window("timestamp", bucket).start.alias("time"), "pattern",
                 "broker_pid", "client")
        .agg(
            F.sum((is_sub & ok).cast("long")).alias("subscribed"),
            F.sum((~is_sub & ok).cast("long")).alias("unsubscribed"),
            F.sum((F.col("accepted") == F.lit(False)).cast("long")).alias("refused"),
        )
    )


def subscription_merge(partials: DataFrame, by: By = ()) -> DataFrame:
    return _sums(partials, [*by, "time", "pattern", "broker_pid", "client"], SUB_SUMS)


def churn_table(merged: DataFrame, by: By = ()) -> DataFrame:
    return (_sums(merged, [*by, "time"], SUB_SUMS)
            .withColumn("net", F.col("subscribed") - F.col("unsubscribed")))


def subscription_churn(events: DataFrame, bucket: str = "1 minute") -> DataFrame:
    """Accepted subscribes and unsubscribes, and refusals, per time bucket.

    Columns: time, subscribed, unsubscribed, refused, net (subscribed - unsubscribed).
    """
    merged = subscription_merge(subscription_partial(events, bucket))
    return ordered(churn_table(merged), TIME_ORDER)


def pattern_table(merged: DataFrame, by: By = ()) -> DataFrame:
    return merged.groupBy(*by, "pattern").agg(
        *[F.sum(c).alias(c) for c in SUB_SUMS],
        F.count_distinct("broker_pid", "client").alias("clients"),
    )


PATTERN_ORDER = ("-subscribed", "pattern")


def pattern_churn(events: DataFrame) -> DataFrame:
    """Per pattern: accepted subscribes and unsubscribes, refusals, distinct connections."""
    return ordered(pattern_table(subscription_merge(subscription_partial(events))), PATTERN_ORDER)


# --- the access policy ----------------------------------------------------------------------

DENIAL_SUMS = ("denials", "suppressed")


def denial_partial(events: DataFrame, by: By = ()) -> DataFrame:
    """Logged ``publish_denied`` records per (uid, rule, action, key): the key
    is kept so that distinct ones can be counted."""
    return (
        _only(events, ls.PUBLISH_DENIED)
        .groupBy(*by, "uid", "rule", "action", "key")
        .agg(
            F.count(F.lit(1)).alias("denials"),
            F.sum("suppressed").alias("suppressed"),
            F.min("timestamp").alias("first_at"),
            F.max("timestamp").alias("last_at"),
        )
    )


def denial_merge(partials: DataFrame, by: By = ()) -> DataFrame:
    return partials.groupBy(*by, "uid", "rule", "action", "key").agg(
        *[F.sum(c).alias(c) for c in DENIAL_SUMS],
        F.min("first_at").alias("first_at"), F.max("last_at").alias("last_at"))


def denial_table(merged: DataFrame, by: By = ()) -> DataFrame:
    return merged.groupBy(*by, "uid", "rule", "action").agg(
        F.sum("denials").alias("denials"),
        F.count("key").alias("keys"),
        F.sum("suppressed").alias("suppressed"),
        F.min("first_at").alias("first_at"),
        F.max("last_at").alias("last_at"),
    )


DENIAL_ORDER = ("-denials", "uid", "rule", "action")


def publish_denials(events: DataFrame) -> DataFrame:
    """Publishes the access policy denied, per uid, deciding rule (0: the
    default) and action (drop or disconnect): the ``publish_denied`` records,
    how many distinct keys they name, and when the first and last were.

    The broker logs at most ``logschema.PUBLISH_DENIED_PER_S`` denials a
    second; ``suppressed`` sums what these records say was left out before
    each of them (of any uid), so ``denials`` is a floor whenever it is not
    zero. The exact count per uid is the broker's ``policy_uids`` (``CMSG
    stats``, ``sbus_user_policy_denied_total``).
    """
    return ordered(denial_table(denial_merge(denial_partial(events))), DENIAL_ORDER)
