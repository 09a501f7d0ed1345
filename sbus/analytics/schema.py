"""The Spark schema of one log line, built from ``sbus.logschema``.

All events are read through one flat struct: the union of every event's
top-level fields (``logschema.all_fields``).  Declaring it, instead of letting
Spark infer one, keeps a log without, say, any ``flood`` record from
producing a DataFrame without the flood columns, and saves a full pass over
the input.
"""
from __future__ import annotations

from pyspark.sql import types as T

from .. import logschema as ls

# Holds the raw line when it is not a JSON object or a field has the wrong type.
CORRUPT_COLUMN = "_corrupt_record"

_SCALARS = {
    ls.INT: T.LongType(),
    ls.FLOAT: T.DoubleType(),
    ls.STR: T.StringType(),
    ls.BOOL: T.BooleanType(),
    ls.TIMESTAMP: T.TimestampType(),
    # Config values are scalars of any JSON type; as strings they survive all of them.
    ls.CONFIG: T.MapType(T.StringType(), T.StringType()),
}


def _longs(names) -> T.StructType:
    return T.StructType([T.StructField(n, T.LongType()) for n in names])


TOTALS = _longs(ls.TOTALS_FIELDS)
DELTA = _longs(ls.DELTA_FIELDS)
COUNTERS = _longs(ls.CLIENT_COUNTER_FIELDS)

_NESTED = {
    ls.TOTALS: TOTALS,
    ls.DELTA: DELTA,
    ls.COUNTERS: COUNTERS,
    ls.COUNTERS_LIST: T.ArrayType(COUNTERS),
    ls.USERS_LIST: T.ArrayType(_longs(ls.USER_FIELDS)),
}


def spark_type(tag: str) -> T.DataType:
    """The Spark type for a ``logschema`` type tag."""
    return _SCALARS.get(tag) or _NESTED[tag]


def record_schema(corrupt_column: bool = True) -> T.StructType:
    """The declared schema of a log record, optionally with ``CORRUPT_COLUMN``."""
    fields = [T.StructField(name, spark_type(tag)) for name, tag in ls.all_fields().items()]
    if corrupt_column:
        fields.append(T.StructField(CORRUPT_COLUMN, T.StringType()))
    return T.StructType(fields)
