"""``python -m sbus.analytics LOGS... --out DIR``: the command line of ``job.run``."""
from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sbus.analytics",
        description="Aggregate sbusd JSON-lines logs with Spark; write each table "
                    "as Parquet and CSV under --out and print it.")
    p.add_argument("logs", nargs="+", metavar="LOGS",
                   help="log files, directories (read recursively) or globs; .gz is fine")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output directory (any Hadoop path: local, hdfs://, s3a://)")
    p.add_argument("--master", default=None,
                   help="Spark master (default: spark-submit's, else local[*])")
    p.add_argument("--show", type=int, default=20, metavar="N",
                   help="rows to print per table, 0 to print only the summary (default 20)")
    p.add_argument("--tables", default=None, metavar="NAME,...",
                   help="compute only these tables (default: all)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Spark setting, repeatable")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    conf = {}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"--conf expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        conf[key] = value

    from .job import TABLES

    known = [t.name for t in TABLES]
    tables = args.tables.split(",") if args.tables else None
    unknown = sorted(set(tables or ()) - set(known))
    if unknown:
        print(f"unknown table(s) {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return 2

    from pyspark.errors import AnalysisException
    from pyspark.sql import SparkSession

    from .job import run, spark_session

    # Called from a notebook or a test, main() borrows the running session
    # and must leave it running.
    owned = SparkSession.getActiveSession() is None
    spark = spark_session(args.master, conf=conf)
    try:
        run(spark, args.logs, args.out, show=args.show, tables=tables)
    except AnalysisException as exc:
        # Typically a path that does not exist; the Java stack trace helps no one.
        print(f"sbus.analytics: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        if owned:
            spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
