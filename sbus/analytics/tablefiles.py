"""The day tables' Parquet files, written by the driver.

A run's tables are small by design (aggregates of a few days), and Spark's
own writer costs a job, a commit protocol and, on a fresh JVM, its warm-up
for each of them: more than the tables' whole content.  So each table is
computed on the driver (``daytables``) or collected (``collect_table``), and
its day partitions are written here with pyarrow, one file per table and
day, through the dataset's ``Store`` (any file system Spark reads).  Spark
reads them back like its own.  A run's stored rows, when the driver has
collected them, are written the same way (``write_partitions``).

A partition's new file is complete, in a hidden folder, before that folder
is renamed into the partition's place, so a reader sees its old rows or its
new ones, never both (and none only between two renames).  A day with no
rows gets a file with no rows: its schema is still there to read.
"""
from __future__ import annotations

import io
import uuid
from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sbus.analytics.dataset import DAY, Store

_SCALARS = {
    T.LongType: pa.int64(),
    T.IntegerType: pa.int32(),
    T.DoubleType: pa.float64(),
    T.StringType: pa.string(),
    T.BooleanType: pa.bool_(),
    T.DateType: pa.date32(),
    # Collected as microseconds since the epoch (see collect_rows).
    T.TimestampType: pa.timestamp("us", tz="UTC"),
}


def arrow_type(t: T.DataType) -> pa.DataType:
    """The Arrow type Spark reads back as ``t``."""
    if type(t) in _SCALARS:
        return _SCALARS[type(t)]
    if isinstance(t, T.StructType):
        return pa.struct([pa.field(f.name, arrow_type(f.dataType)) for f in t.fields])
    if isinstance(t, T.ArrayType):
        return pa.list_(arrow_type(t.elementType))
    if isinstance(t, T.MapType):
        return pa.map_(arrow_type(t.keyType), arrow_type(t.valueType))
    raise TypeError(f"no Arrow type for Spark type {t.simpleString()}")


def collect_table(df: DataFrame) -> pa.Table:
    """``df``'s rows, in order, as an Arrow table of the same columns."""
    if hasattr(df, "toArrow"):  # PySpark 4: Arrow batches straight from the JVM
        return df.toArrow()
    return collect_rows(df)


def collect_rows(df: DataFrame) -> pa.Table:
    """``collect_table`` through ``collect()``, for PySpark 3.5.

    Top-level timestamps travel as microseconds: ``collect()`` would turn
    them into naive datetimes in the driver's local zone, ambiguous for an
    hour each autumn where that zone keeps summer time.
    """
    schema = df.schema
    for f in schema.fields:
        if not isinstance(f.dataType, T.TimestampType) and "timestamp" in f.dataType.simpleString():
            raise TypeError(f"column {f.name}: nested timestamps are not collected exactly")
    cols = [F.unix_micros(f.name).alias(f.name) if isinstance(f.dataType, T.TimestampType)
            else F.col(f.name) for f in schema.fields]
    rows = df.select(*cols).collect()
    arrow = pa.schema([pa.field(f.name, arrow_type(f.dataType)) for f in schema.fields])
    columns = list(zip(*rows)) if rows else [() for _ in schema.fields]
    return pa.Table.from_arrays(
        [pa.array(c if _flat(f.type) else [_plain(v) for v in c], type=f.type)
         for c, f in zip(columns, arrow)], schema=arrow)


def _flat(t: pa.DataType) -> bool:
    return not pa.types.is_nested(t)


def _plain(value):
    """A collected value as pyarrow takes it: Rows (structs) as dicts."""
    if isinstance(value, T.Row):
        return value.asDict(recursive=True)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def write_days(store: Store, name: str, table: pa.Table, days: Sequence) -> None:
    """Replace ``store``'s ``name/date=D/`` for each of ``days`` with ``table``'s rows of D."""
    write_partitions(store, name, table, [DAY], [(day,) for day in days])


def write_partitions(store: Store, name: str, table: pa.Table, columns: Sequence[str],
                     values: Sequence[tuple]) -> None:
    """Replace ``store``'s ``name/c1=v1/c2=v2/`` for each tuple of ``values`` of
    ``columns`` with ``table``'s rows that have them, less those columns, as
    Spark lays out ``partitionBy(*columns)``.  Values are dates or strings.
    """
    for vals in values:
        mask = None
        for column, value in zip(columns, vals):
            match = pc.equal(table[column], pa.scalar(value, table.schema.field(column).type))
            mask = match if mask is None else pc.and_(mask, match)
        rows = table.filter(mask).drop_columns(list(columns))
        # Every column nullable, as Spark writes them: files of one table agree.
        rows = rows.cast(pa.schema([f.with_nullable(True) for f in rows.schema]))
        buf = io.BytesIO()
        pq.write_table(rows, buf, compression="snappy")
        *parent, folder = [f"{c}={_text(v)}" for c, v in zip(columns, vals)]
        new = f".{folder}.new"  # hidden from readers until renamed
        store.delete(name, *parent, new)  # left by a run that died here
        store.write_bytes(buf.getvalue(), name, *parent, new, f"part-{uuid.uuid4()}.parquet")
        store.replace((name, *parent, new), (name, *parent, folder))


def _text(value) -> str:
    return value.isoformat() if hasattr(value, "isoformat") else str(value)
