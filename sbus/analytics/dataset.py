"""The analytics dataset (the job's ``--out``): its layout, storage and manifest.

::

    OUT/<table>/date=YYYY-MM-DD/*.parquet          the reported tables, one partition a day
    OUT/malformed/file_id=ID/*.parquet             malformed lines, per input file
    OUT/csv/<table>/date=YYYY-MM-DD/part-*.csv     only with --csv
    OUT/_partials/date=D/file_id=ID/*.parquet      per input file and day: its records,
                                                   message records summed per key and fanout
    OUT/_manifest.json                             the input files read, and their days

A day's table is always rebuilt from the stored rows of every known file
that covers that day, so reading a new file never loses what older ones said
about the same day.  Files are known by the checksum of their content
(decompressed, for ``.gz`` and ``.bz2``): a file already read is skipped
wherever it now lives (a rotated log renamed or compressed), and a file
whose content begins with a known file's whole content (a log that kept
growing) replaces it.  The manifest is written last, so a job that dies
half-way leaves files unrecorded and the next run reads them again,
overwriting the same partitions.  One job at a time per dataset.

Paths are Hadoop paths (local, ``hdfs://``, ``s3a://``); only local files
get content checksums and growth detection, others are known by the
checksum their file system reports, else by size and modification time.
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Sequence
from urllib.parse import unquote, urlparse

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

MANIFEST = "_manifest.json"
PARTIALS = "_partials"
MALFORMED = "malformed"
CSV = "csv"
DAY = "date"
FILE = "file_id"
COUNT = "_n"  # of a stored row: how many equal records it stands for
FORMAT = 2  # 1 kept one partial per table group under _partials/partial=P/

_CHUNK = 1 << 20
_DECOMPRESS = {".gz": gzip.open, ".bz2": bz2.open}


def same_file(a: str, b: str) -> bool:
    """Whether two spellings of a Hadoop path (``file:/x``, ``file:///x``) name one file."""
    return _norm(a) == _norm(b)


def _norm(uri: str) -> tuple:
    u = urlparse(uri)
    return (u.scheme or "file", u.netloc, unquote(u.path))


class Store:
    """Files under the dataset's root, through Hadoop's FileSystem (any scheme Spark reads)."""

    def __init__(self, spark: SparkSession, root: str):
        self.spark, self.root = spark, root.rstrip("/") or "/"
        jvm = spark.sparkContext._jvm
        self._Path = jvm.org.apache.hadoop.fs.Path
        self.fs = self._Path(self.root).getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self._Path(self.path(*parts)))

    def delete(self, *parts: str) -> None:
        self.fs.delete(self._Path(self.path(*parts)), True)

    def read_text(self, *parts: str) -> str | None:
        if not self.exists(*parts):
            return None
        stream = self.fs.open(self._Path(self.path(*parts)))
        try:
            return self.spark.sparkContext._jvm.org.apache.commons.io.IOUtils.toString(
                stream, "UTF-8")
        finally:
            stream.close()

    def write_text(self, text: str, *parts: str) -> None:
        self.write_bytes(text.encode(), *parts)

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write via a hidden temporary file and a rename, so a reader sees old or new, never half."""
        final = self._Path(self.path(*parts))
        tmp = self._Path(self.path(*parts[:-1], f".{parts[-1]}.tmp"))
        out = self.fs.create(tmp, True)
        try:
            out.write(bytearray(data))
        finally:
            out.close()
        self.fs.delete(final, False)
        if not self.fs.rename(tmp, final):
            raise OSError(f"could not rename {tmp} to {final}")

    def replace(self, src: Sequence[str], dst: Sequence[str]) -> None:
        """Put the folder ``src`` in the place of ``dst`` (a sibling) by renames:
        the old ``dst`` is out of the way (hidden) for the instant between them."""
        target = self._Path(self.path(*dst))
        old = self._Path(self.path(*dst[:-1], f".{dst[-1]}.old"))
        self.fs.delete(old, True)
        if self.fs.exists(target) and not self.fs.rename(target, old):
            raise OSError(f"could not rename {target} to {old}")
        if not self.fs.rename(self._Path(self.path(*src)), target):
            raise OSError(f"could not rename {self.path(*src)} to {target}")
        self.fs.delete(old, True)

    def read_parquet(self, schema: T.StructType, *parts: str) -> DataFrame:
        """A Parquet directory read with a known schema; empty if it does not exist yet."""
        if not self.exists(*parts):
            return self.spark.createDataFrame([], schema)
        return self.spark.read.schema(schema).parquet(self.path(*parts))

    def file_status(self, uri: str):
        p = self._Path(uri)
        return p.getFileSystem(self.spark.sparkContext._jsc.hadoopConfiguration()), p


@dataclass
class Identity:
    """What the manifest knows a file by."""
    uri: str
    size: int                  # bytes on disk
    length: int | None         # bytes of content (decompressed); None if unknown
    checksum: str              # "sha256:<hex>" of the content, or what the file system reports
    prefixes: dict = field(default_factory=dict)  # content length -> checksum of that prefix

    @property
    def id(self) -> str:
        return hashlib.sha256(self.checksum.encode()).hexdigest()[:16]


def list_inputs(spark: SparkSession, paths: Sequence[str]) -> list[str]:
    """The files that files, directories (recursively) and globs name, as Spark lists them."""
    files = spark.read.option("recursiveFileLookup", "true").text(list(paths)).inputFiles()
    unique = {}
    for f in files:
        unique.setdefault(_norm(f), f)
    return sorted(unique.values())


def identify(store: Store, uri: str, prefix_lengths: Sequence[int] = ()) -> Identity:
    """Size and checksum of a file, with the checksums of its first ``n`` content
    bytes for each ``n`` in ``prefix_lengths`` (local files only).
    """
    u = urlparse(uri)
    if u.scheme in ("", "file"):
        return _local_identity(uri, unquote(u.path), prefix_lengths)
    fs, p = store.file_status(uri)
    status = fs.getFileStatus(p)
    reported = fs.getFileChecksum(p)
    if reported is not None:
        checksum = f"{reported.getAlgorithmName()}:{bytes(reported.getBytes()).hex()}"
    else:
        checksum = f"size-mtime:{status.getLen()}-{status.getModificationTime()}"
    return Identity(uri, status.getLen(), None, checksum)


def _local_identity(uri: str, path: str, prefix_lengths: Sequence[int]) -> Identity:
    opener = next((fn for ext, fn in _DECOMPRESS.items() if path.endswith(ext)), open)
    cuts = sorted({n for n in prefix_lengths if n > 0})
    h, done, prefixes, i = hashlib.sha256(), 0, {}, 0
    with opener(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            view, start = memoryview(chunk), 0
            while i < len(cuts) and cuts[i] <= done + len(chunk):
                cut = cuts[i] - done
                h.update(view[start:cut])
                start = cut
                prefixes[cuts[i]] = "sha256:" + h.copy().hexdigest()
                i += 1
            h.update(view[start:])
            done += len(chunk)
    return Identity(uri, os.path.getsize(path), done, "sha256:" + h.hexdigest(), prefixes)


@dataclass
class Plan:
    """What a run does with its inputs."""
    new: list = field(default_factory=list)          # Identity, to read
    skipped: list = field(default_factory=list)      # (uri, id of the entry already read)
    superseded: dict = field(default_factory=dict)   # new id -> [entries it replaces]


class Manifest:
    """The input files a dataset holds: one entry per distinct content.

    Entry keys: id, checksum, size, length, path (first seen), paths (all
    seen), days, lines, records, malformed, blank, schema_versions, read_at,
    superseded_by (the id of a longer version of the file, once read).
    """

    def __init__(self, entries: list | None = None):
        self.entries = entries or []
        self.changed = False  # paths added to known entries: worth saving

    @classmethod
    def load(cls, store: Store) -> "Manifest":
        text = store.read_text(MANIFEST)
        if text is None:
            return cls()
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"{store.path(MANIFEST)}: manifest format {data.get('format')}, "
                             f"this job knows {FORMAT}")
        return cls(data["files"])

    def save(self, store: Store) -> None:
        store.write_text(json.dumps({"format": FORMAT, "files": self.entries}, indent=1) + "\n",
                         MANIFEST)

    def by_checksum(self) -> dict:
        return {e["checksum"]: e for e in self.entries}

    def active(self) -> list:
        return [e for e in self.entries if not e.get("superseded_by")]

    def days(self) -> set:
        return {d for e in self.active() for d in e["days"]}

    def plan(self, store: Store, uris: Sequence[str]) -> Plan:
        """Identify each input and decide: skip it (content known), read it, and
        which known files it replaces (their whole content is its beginning).
        """
        known = self.by_checksum()
        growable = [e for e in self.active() if e.get("length")
                    and e["checksum"].startswith("sha256:")]
        plan, seen = Plan(), {}
        for uri in uris:
            ident = identify(store, uri, [e["length"] for e in growable])
            entry = known.get(ident.checksum) or seen.get(ident.checksum)
            if entry is not None:
                plan.skipped.append((uri, entry["id"] if isinstance(entry, dict) else entry.id))
                if isinstance(entry, dict) and not any(same_file(uri, p) for p in entry["paths"]):
                    entry["paths"].append(uri)
                    self.changed = True
                continue
            seen[ident.checksum] = ident
            plan.new.append(ident)
            older = [e for e in growable if ident.length and e["length"] < ident.length
                     and ident.prefixes.get(e["length"]) == e["checksum"]]
            if older:
                plan.superseded[ident.id] = older
        return plan

    def record(self, ident: Identity, counts: dict, replaces: Sequence[dict]) -> None:
        self.entries.append({
            "id": ident.id, "checksum": ident.checksum, "size": ident.size,
            "length": ident.length, "path": ident.uri, "paths": [ident.uri],
            **counts,
            "read_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "superseded_by": None,
        })
        for old in replaces:
            old["superseded_by"] = ident.id

