"""The command line of the analytics job, and the file to give ``spark-submit``.

    python -m sbus.analytics LOGS... --out DATASET [--master URL] [--csv] [--max-malformed F]
    spark-submit [--master URL] .../sbus/analytics/cli.py LOGS... --out DATASET

Run as a file, this module is not part of its package, so it imports the
package by its absolute name: ``sbus`` must be installed where the driver's
Python runs (the analytics extra, ``pysbus[analytics]``).  Executors need only Java:
the job uses no Python functions on them.
"""
from __future__ import annotations

import argparse
import sys


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1, got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    from sbus.analytics.job import MAX_MALFORMED
    p = argparse.ArgumentParser(
        prog="python -m sbus.analytics",
        description="Aggregate sbusd JSON-lines logs with Spark into a dataset of tables "
                    "partitioned by day; files already read are skipped, the days new "
                    "ones cover are rebuilt, and those days' tables are printed.")
    p.add_argument("logs", nargs="+", metavar="LOGS",
                   help="log files, directories (read recursively) or globs; .gz is fine")
    p.add_argument("--out", required=True, metavar="DATASET",
                   help="the dataset directory, created or updated (any Hadoop path: "
                        "local, hdfs://, s3a://)")
    p.add_argument("--master", default=None,
                   help="Spark master (default: spark-submit's, else local[*])")
    p.add_argument("--show", type=int, default=20, metavar="N",
                   help="rows to print per table, 0 to print only the summary (default 20)")
    p.add_argument("--csv", action="store_true",
                   help="also write every table as CSV under DATASET/csv/ (one file a day)")
    p.add_argument("--max-malformed", type=_fraction, default=MAX_MALFORMED, metavar="FRACTION",
                   help="fail, writing nothing, when more than this fraction of the new "
                        "files' non-blank lines are not sbusd JSON records (default "
                        f"{MAX_MALFORMED:g}; 1: never)")
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

    from pyspark.errors import AnalysisException
    from pyspark.sql import SparkSession

    from sbus.analytics import job

    # Called from a notebook or a test, main() borrows the running session
    # and must leave it running.
    owned = SparkSession.getActiveSession() is None
    spark = job.spark_session(args.master, conf=conf)
    try:
        job.run(spark, args.logs, args.out, show=args.show, csv=args.csv,
                max_malformed=args.max_malformed)
    except job.TooMalformed as exc:
        print(f"sbus.analytics: {exc}", file=sys.stderr)
        return 1
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
