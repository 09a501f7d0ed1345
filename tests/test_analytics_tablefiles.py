"""The day tables' files, written by the driver with pyarrow and read back by Spark.

Every column type the tables use (and the nested ones a table could) goes
through both ways of collecting a table -- Arrow batches from the JVM
(PySpark 4) and ``collect()`` (PySpark 3.5) -- and must come back the same,
also where the driver's zone keeps summer time.  Replacing a day must leave
the others alone, and leave one file in its folder and nothing beside it.
"""
from __future__ import annotations

import datetime as dt
import os
import time

import pytest

pytestmark = [
    pytest.mark.spark,
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas"),
]

D1, D2 = dt.date(2026, 10, 24), dt.date(2026, 10, 25)
UTC = dt.timezone.utc
# 00:30 UTC on 25 October 2026 is 02:30 in Berlin, the hour that comes twice
# when summer time ends there: a naive local time would not say which one.
AMBIGUOUS = dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
SCHEMA = ("date date, n long, x double, s string, ok boolean, t timestamp, "
          "pair struct<a: long, b: string>, ns array<long>, m map<string, string>")


def frame(spark):
    rows = [
        (D1, 1, 1.5, "a", True, dt.datetime(2026, 10, 24, 23, 59, 59, 999999, tzinfo=UTC),
         (7, "seven"), [1, 2], {"k": "v"}),
        (D1, None, None, None, None, None, None, None, None),
        (D2, 3, -0.25, "é ✓", False, AMBIGUOUS, (None, "b"), [], {}),
    ]
    return spark.createDataFrame(rows, SCHEMA).coalesce(1)


@pytest.fixture
def berlin():
    """The driver in a zone with summer time, for the length of a test."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Europe/Berlin"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_both_ways_of_collecting_give_the_same_table(spark, berlin):
    from sbus.analytics import tablefiles

    df = frame(spark)
    rows = tablefiles.collect_rows(df)
    assert rows.column("t").to_pylist()[2] == AMBIGUOUS
    assert rows.column("t").to_pylist()[0] == dt.datetime(2026, 10, 24, 23, 59, 59, 999999,
                                                         tzinfo=UTC)
    assert rows.to_pylist()[0]["pair"] == {"a": 7, "b": "seven"}
    assert rows.to_pylist()[0]["m"] == [("k", "v")]
    assert rows.to_pylist()[1] == {"date": D1, **{k: None for k in rows.column_names[1:]}}
    if hasattr(df, "toArrow"):
        arrow = tablefiles.collect_table(df)
        # The JVM's batches also say which columns cannot be null; the values agree.
        assert arrow.to_pylist() == rows.to_pylist()
        assert [f.type for f in arrow.schema] == [f.type for f in rows.schema]


def test_written_days_read_back_as_spark_wrote_them(spark, tmp_path):
    from pyspark.sql import functions as F

    from sbus.analytics import tablefiles
    from sbus.analytics.dataset import Store

    df = frame(spark)
    store = Store(spark, str(tmp_path))
    tablefiles.write_days(store, "t1", tablefiles.collect_table(df), [D1, D2])
    back = spark.read.parquet(str(tmp_path / "t1"))
    assert dict(back.dtypes) == dict(df.dtypes)
    assert sorted(back.select(*df.columns).collect(), key=repr) == sorted(df.collect(), key=repr)
    assert (back.where(F.col("t") == F.lit(AMBIGUOUS.replace(tzinfo=None)).cast("timestamp"))
            .count() == 1)  # the session's zone is UTC


def test_replacing_a_day_keeps_the_others_and_an_empty_day_keeps_its_schema(spark, tmp_path):
    from sbus.analytics import tablefiles
    from sbus.analytics.dataset import Store

    df = frame(spark)
    store = Store(spark, str(tmp_path))
    tablefiles.write_days(store, "t1", tablefiles.collect_table(df), [D1, D2])
    day2 = sorted((tmp_path / "t1" / f"date={D2}").iterdir())

    only_d2 = df.where(f"date = '{D2}'")
    tablefiles.write_days(store, "t1", tablefiles.collect_table(only_d2), [D1])  # D1: no rows now
    files = sorted(p.name for p in (tmp_path / "t1" / f"date={D1}").iterdir()
                   if not p.name.startswith("."))
    assert len(files) == 1 and files[0].startswith("part-") and files[0].endswith(".parquet")
    assert sorted((tmp_path / "t1" / f"date={D2}").iterdir()) == day2  # untouched
    assert sorted(p.name for p in (tmp_path / "t1").iterdir()) == [f"date={D1}", f"date={D2}"]

    back = spark.read.parquet(str(tmp_path / "t1"))
    assert dict(back.dtypes) == dict(df.dtypes)
    assert back.where(f"date = '{D1}'").count() == 0
    assert back.where(f"date = '{D2}'").count() == 1
    empty_day = spark.read.parquet(str(tmp_path / "t1" / f"date={D1}"))
    assert empty_day.count() == 0 and empty_day.columns == df.columns[1:]
