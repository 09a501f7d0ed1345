"""The store's log on disk: a directory of append-only segment files.

A segment is named by the sequence number of its first record
(``00000000000000000001.seg``) and holds records back to back, each
self-describing and checksummed (``RECORD``, little-endian)::

    u32 size      the whole record, header included
    u32 crc32     zlib.crc32 of everything after this field
    u64 seq       1, 2, 3 ... across segments, never reused
    i64 time_ns   when the store received it (never decreasing)
    u32 key_len
    key bytes, then payload bytes

Keys that start with ``!`` are never recorded, so the log uses them for its
own notes: a record with key ``!gap`` says that messages were lost there
(its payload: ``lost=N reason=WHY``).

Everything else is rebuilt from the files when the log is opened: a sparse
index (seq, time, offset) every ``INDEX_EVERY`` bytes of each segment, and the
last record of each key. Opening also recovers from a crash: the records are
read and checked, and the first one that is short, inconsistent or fails its
checksum ends the log there (the torn tail is cut off and reported).
"""
from __future__ import annotations

import bisect
import errno
import os
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

RECORD = struct.Struct("<IIQqI")
HEADER = RECORD.size
_HEAD = struct.Struct("<II")     # size, crc32
_BODY = struct.Struct("<QqI")    # seq, time_ns, key_len: where the checksum starts
SUFFIX = ".seg"
GAP_KEY = b"!gap"
INDEX_EVERY = 32 * 1024     # bytes between sparse index entries
READ_CHUNK = 1 << 20

FSYNC_ALWAYS = "always"
FSYNC_NEVER = "never"


def pack_record(seq: int, time_ns: int, key: bytes, payload: bytes) -> bytes:
    body = _BODY.pack(seq, time_ns, len(key)) + key + payload
    return _HEAD.pack(8 + len(body), zlib.crc32(body)) + body


def gap_payload(lost: int, reason: str) -> bytes:
    return b"lost=%d reason=%s" % (lost, reason.encode())


def parse_gap(payload: bytes) -> Tuple[int, str]:
    """(lost, reason) of a ``!gap`` record; lost is -1 when unknown."""
    fields = dict(f.split(b"=", 1) for f in payload.split() if b"=" in f)
    return int(fields.get(b"lost", b"-1")), fields.get(b"reason", b"").decode("ascii", "replace")


@dataclass
class Segment:
    first_seq: int
    path: str
    size: int = 0
    last_seq: int = 0           # 0: empty
    first_time: int = 0
    last_time: int = 0
    records: int = 0
    # Sparse index: parallel lists, one entry every INDEX_EVERY bytes.
    idx_seq: List[int] = field(default_factory=list)
    idx_time: List[int] = field(default_factory=list)
    idx_off: List[int] = field(default_factory=list)
    _indexed_at: int = -INDEX_EVERY

    def note(self, seq: int, time_ns: int, offset: int) -> None:
        if not self.records:
            self.first_time = time_ns
        self.records += 1
        self.last_seq, self.last_time = seq, time_ns
        if offset - self._indexed_at >= INDEX_EVERY:
            self.idx_seq.append(seq)
            self.idx_time.append(time_ns)
            self.idx_off.append(offset)
            self._indexed_at = offset

    def offset_for_seq(self, seq: int) -> int:
        i = bisect.bisect_right(self.idx_seq, seq) - 1
        return self.idx_off[i] if i >= 0 else 0

    def offset_for_time(self, time_ns: int) -> int:
        # The entry before the first one at or after time_ns: records with
        # equal times may sit on both sides of an entry.
        i = bisect.bisect_left(self.idx_time, time_ns) - 1
        return self.idx_off[i] if i >= 0 else 0


@dataclass
class Recovery:
    segments: int = 0
    records: int = 0
    bytes: int = 0
    cut_bytes: int = 0
    cut_segment: str = ""


class DiskFull(Exception):
    """A write found the disk full (or over quota); the log is as before it."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(exc.strerror or str(exc))
        self.errno = exc.errno


_FULL = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG))


def _scan(data: memoryview, base: int, expect_seq: int, seg: Segment,
          last: Optional[Dict[bytes, Tuple[int, int, int]]]) -> Tuple[int, int, bool]:
    """Check and index the records in ``data`` (file offset ``base``).
    Returns (bytes consumed, next seq, bad): bad means the record at the
    returned position is damaged; a record cut by the chunk's end is not."""
    pos, end = 0, len(data)
    unpack = RECORD.unpack_from
    crc32 = zlib.crc32
    while end - pos >= HEADER:
        size, crc, seq, time_ns, key_len = unpack(data, pos)
        if size < HEADER or key_len > size - HEADER or (expect_seq and seq != expect_seq):
            return pos, expect_seq, True
        if end - pos < size:
            return pos, expect_seq, False
        if crc32(data[pos + 8:pos + size]) != crc:
            return pos, expect_seq, True
        seg.note(seq, time_ns, base + pos)
        if last is not None:
            key = bytes(data[pos + HEADER:pos + HEADER + key_len])
            if key[:1] != b"!":
                last[key] = (seq, seg.first_seq, base + pos)
        expect_seq = seq + 1
        pos += size
    return pos, expect_seq, False


class Log:
    """The segments of one directory; one writer (the service) at a time.

    ``fsync`` is ``"always"``, ``"never"`` or a number of milliseconds:
    :meth:`append` syncs at once, never, or when that long has passed since
    the last sync (and :meth:`sync_due`/:meth:`sync` let the loop finish a
    pending one while idle).
    """

    def __init__(self, directory: str, *, segment_bytes: int = 64 << 20, fsync="100") -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.sync_interval = None if fsync in (FSYNC_ALWAYS, FSYNC_NEVER) else int(fsync) / 1000
        self.segments: List[Segment] = []
        self.last_values: Dict[bytes, Tuple[int, int, int]] = {}   # key -> (seq, segment, offset)
        self.next_seq = 1
        self.last_time = 0
        self.dirty_since: Optional[float] = None
        self.syncs = 0
        self._fd = -1
        self._readers: Dict[int, int] = {}      # first_seq -> read fd
        os.makedirs(directory, exist_ok=True)
        self.recovery = self._open()

    # -- opening and recovery ---------------------------------------------------

    def _open(self) -> Recovery:
        rec = Recovery()
        names = sorted(n for n in os.listdir(self.directory)
                       if n.endswith(SUFFIX) and n[:-len(SUFFIX)].isdigit())
        for n, name in enumerate(names):
            first = int(name[:-len(SUFFIX)])
            seg = Segment(first, os.path.join(self.directory, name))
            expect = self.next_seq if self.segments else 0
            if expect and first != expect:
                # A segment that does not continue the previous one (its
                # predecessor was cut): everything from here is unusable.
                self._cut(seg, 0, rec)
                os.unlink(seg.path)
                continue
            self._recover_segment(seg, rec)
            if seg.records:
                self.next_seq = seg.last_seq + 1
                self.last_time = max(self.last_time, seg.last_time)
            elif not self.segments:
                self.next_seq = first
            if seg.records or n == len(names) - 1:
                self.segments.append(seg)
            else:
                os.unlink(seg.path)
            rec.segments += 1
        if not self.segments:
            self.segments.append(self._create(self.next_seq))
        active = self.segments[-1]
        self._fd = os.open(active.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        return rec

    def _recover_segment(self, seg: Segment, rec: Recovery) -> None:
        fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            file_size = os.fstat(fd).st_size
            offset, expect, carry = 0, seg.first_seq, b""
            while True:
                chunk = os.pread(fd, READ_CHUNK, offset + len(carry))
                data = memoryview(carry + chunk)
                used, expect, bad = _scan(data, offset, expect, seg, self.last_values)
                offset += used
                if bad or not chunk:
                    break
                carry = bytes(data[used:])
                if len(carry) > READ_CHUNK:     # one record larger than a chunk
                    more = os.pread(fd, RECORD.unpack_from(carry)[0] - len(carry),
                                    offset + len(carry))
                    carry += more
        finally:
            os.close(fd)
        rec.records += seg.records
        rec.bytes += offset
        seg.size = offset
        if offset < file_size:
            self._cut(seg, offset, rec, file_size)

    def _cut(self, seg: Segment, offset: int, rec: Recovery, file_size: Optional[int] = None) -> None:
        size = os.stat(seg.path).st_size if file_size is None else file_size
        rec.cut_bytes += size - offset
        rec.cut_segment = os.path.basename(seg.path)
        with open(seg.path, "r+b") as f:
            f.truncate(offset)
            os.fsync(f.fileno())

    def _create(self, first_seq: int) -> Segment:
        path = os.path.join(self.directory, "%020d%s" % (first_seq, SUFFIX))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        os.close(fd)
        self._sync_directory()
        return Segment(first_seq, path)

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- writing ----------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    @property
    def first_seq(self) -> int:
        for seg in self.segments:
            if seg.records:
                return seg.first_seq
        return self.next_seq

    @property
    def bytes(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def records(self) -> int:
        return sum(s.records for s in self.segments)

    def append(self, entries: List[Tuple[bytes, bytes]], now_ns: Optional[int] = None) -> int:
        """Write (key, payload) entries as records with one write(2); their
        count. DiskFull leaves the log as it was, nothing of them written."""
        if not entries:
            return 0
        seg = self.segments[-1]
        if seg.size >= self.segment_bytes:
            seg = self._roll()
        t = max(time.time_ns() if now_ns is None else now_ns, self.last_time)
        first = seg.first_seq
        seq = self.next_seq
        offset = seg.size
        indexed_at = seg._indexed_at
        parts = []
        index = []
        values = []
        crc32 = zlib.crc32
        pack_body, pack_head = _BODY.pack, _HEAD.pack
        for key, payload in entries:
            body = pack_body(seq, t, len(key)) + key + payload
            size = 8 + len(body)
            parts.append(pack_head(size, crc32(body)))
            parts.append(body)
            if offset - indexed_at >= INDEX_EVERY:
                index.append((seq, offset))
                indexed_at = offset
            if key[:1] != b"!":
                values.append((key, (seq, first, offset)))
            seq += 1
            offset += size
        data = b"".join(parts)
        try:
            written = os.write(self._fd, data)
        except OSError as exc:
            if exc.errno in _FULL:
                raise DiskFull(exc) from exc
            raise
        if written != len(data):
            # A short write: the disk filled up during it.
            os.ftruncate(self._fd, seg.size)
            raise DiskFull(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        if not seg.records:
            seg.first_time = t
        seg.records += len(entries)
        seg.last_seq, seg.last_time = seq - 1, t
        for s, off in index:
            seg.idx_seq.append(s)
            seg.idx_time.append(t)
            seg.idx_off.append(off)
        seg._indexed_at = indexed_at
        self.last_values.update(values)
        seg.size = offset
        self.next_seq = seq
        self.last_time = t
        if self.dirty_since is None:
            self.dirty_since = time.monotonic()
        if self.fsync == FSYNC_ALWAYS:
            self.sync()
        elif self.sync_interval is not None and time.monotonic() - self.dirty_since >= self.sync_interval:
            self.sync()
        return len(entries)

    def sync_due(self) -> Optional[float]:
        """Seconds until a pending periodic sync is due (0: now), or None."""
        if self.dirty_since is None or self.sync_interval is None:
            return None
        return max(0.0, self.dirty_since + self.sync_interval - time.monotonic())

    def sync(self) -> None:
        if self.dirty_since is not None:
            os.fdatasync(self._fd)
            self.syncs += 1
            self.dirty_since = None

    def _roll(self) -> Segment:
        # The sealed segment is made durable before the next one exists,
        # whatever the fsync policy: recovery trusts every segment but the last.
        os.fsync(self._fd)
        self.dirty_since = None
        seg = self._create(self.next_seq)
        os.close(self._fd)
        self._fd = os.open(seg.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self.segments.append(seg)
        return seg

    def close(self) -> None:
        if self._fd >= 0:
            if self.fsync != FSYNC_NEVER:
                self.sync()
            os.close(self._fd)
            self._fd = -1
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()

    # -- retention --------------------------------------------------------------

    def expire(self, max_bytes: Optional[int], max_age_s: Optional[float],
               now_ns: Optional[int] = None) -> Tuple[int, int, int]:
        """Remove the oldest sealed segments while the log is over
        ``max_bytes`` or their newest record is older than ``max_age_s``.
        Returns (segments, records, bytes) removed."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        removed = [0, 0, 0]
        while len(self.segments) > 1:
            oldest = self.segments[0]
            over_size = max_bytes is not None and self.bytes > max_bytes
            too_old = (max_age_s is not None and oldest.records
                       and oldest.last_time < now_ns - int(max_age_s * 1e9))
            if not (over_size or too_old):
                break
            self.segments.pop(0)
            fd = self._readers.pop(oldest.first_seq, None)
            if fd is not None:
                os.close(fd)
            os.unlink(oldest.path)
            removed[0] += 1
            removed[1] += oldest.records
            removed[2] += oldest.size
        if removed[0]:
            self._sync_directory()
            first = self.segments[0].first_seq
            self.last_values = {k: v for k, v in self.last_values.items() if v[1] >= first}
        return removed[0], removed[1], removed[2]

    def roll_if_over(self, max_bytes: Optional[int]) -> None:
        """Seal the active segment when it alone keeps the log over max_bytes,
        so that retention can remove it."""
        seg = self.segments[-1]
        if max_bytes is not None and seg.records and self.bytes > max_bytes and len(self.segments) == 1:
            self._roll()

    # -- reading ----------------------------------------------------------------

    def _reader(self, seg: Segment) -> int:
        fd = self._readers.get(seg.first_seq)
        if fd is None:
            fd = self._readers[seg.first_seq] = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def _segment(self, first_seq: int) -> Optional[Segment]:
        firsts = [s.first_seq for s in self.segments]
        i = bisect.bisect_left(firsts, first_seq)
        return self.segments[i] if i < len(firsts) and firsts[i] == first_seq else None

    def _walk(self, position: Tuple[int, int], stop: Callable[[int, int], bool]
              ) -> Tuple[Tuple[int, int], int]:
        """From ``position``, the position of the first record for which
        ``stop(seq, time_ns)`` is true, and its seq (the end of the log and
        next_seq if none is)."""
        while True:
            data, following, _ = self.read(position, READ_CHUNK)
            if not data:
                return position, self.next_seq
            pos = 0
            while pos < len(data):
                size, _, seq, time_ns, _ = RECORD.unpack_from(data, pos)
                if stop(seq, time_ns):
                    return (position[0], position[1] + pos), seq
                pos += size
            position = following

    def seek(self, after: int = 0, since_ns: Optional[int] = None
             ) -> Tuple[Tuple[int, int], int]:
        """The position and seq of the first record with seq > after and
        time >= since_ns (the end of the log and next_seq if none)."""
        segs = self.segments
        position = (segs[-1].first_seq, segs[-1].size)
        for seg in segs:
            if seg.records and seg.last_seq > after and (since_ns is None
                                                         or seg.last_time >= since_ns):
                offset = seg.offset_for_seq(after + 1)
                if since_ns is not None:
                    offset = max(offset, seg.offset_for_time(since_ns))
                position = (seg.first_seq, offset)
                break
        return self._walk(position, lambda seq, t: seq > after and (
            since_ns is None or t >= since_ns))

    def seek_after_time(self, start: Tuple[int, int], until_ns: int
                        ) -> Tuple[Tuple[int, int], int]:
        """The position and seq of the first record at or after ``start``
        received later than ``until_ns``."""
        position = start
        for seg in self.segments:
            if seg.first_seq >= start[0] and seg.records and seg.last_time > until_ns:
                if seg.first_seq > start[0]:
                    position = (seg.first_seq, seg.offset_for_time(until_ns))
                else:
                    position = (seg.first_seq, max(start[1], seg.offset_for_time(until_ns)))
                break
        else:
            return (self.segments[-1].first_seq, self.segments[-1].size), self.next_seq
        return self._walk(position, lambda seq, t: t > until_ns)

    def expired(self, position: Tuple[int, int]) -> bool:
        """Has retention removed the segment ``position`` is in?"""
        return position[0] < self.segments[0].first_seq

    def start(self) -> Tuple[int, int]:
        return self.segments[0].first_seq, 0

    def end(self) -> Tuple[int, int]:
        return self.segments[-1].first_seq, self.segments[-1].size

    def read(self, position: Tuple[int, int], max_bytes: int,
             stop: Optional[Tuple[Tuple[int, int], int]] = None
             ) -> Tuple[bytes, Tuple[int, int], int]:
        """Whole records from ``position``, up to about ``max_bytes`` (at
        least one record), the position after them and the seq of the last;
        no data at the end of the log, or at ``stop`` (a position and the seq
        of the record there). The chunk ends where the segment does or at a
        sparse index entry, so no record is parsed unless a single record
        is larger than that. ``position`` must not be :meth:`expired`."""
        seg = self._segment(position[0])
        offset = position[1]
        while seg is not None:
            if stop is not None and stop[0][0] == seg.first_seq:
                seg_end, seg_last = stop[0][1], stop[1] - 1
            else:
                seg_end, seg_last = seg.size, seg.last_seq
            if offset < seg_end:
                fd = self._reader(seg)
                if seg_end - offset <= max_bytes:
                    return os.pread(fd, seg_end - offset, offset), (seg.first_seq, seg_end), seg_last
                i = bisect.bisect_right(seg.idx_off, offset + max_bytes) - 1
                if i >= 0 and seg.idx_off[i] > offset:
                    end = seg.idx_off[i]
                    return os.pread(fd, end - offset, offset), (seg.first_seq, end), seg.idx_seq[i] - 1
                data = os.pread(fd, max_bytes, offset)
                end = last = 0
                while end + HEADER <= len(data):
                    size, _, seq, _, _ = RECORD.unpack_from(data, end)
                    if end + size > len(data):
                        break
                    end, last = end + size, seq
                if end == 0:        # one record larger than max_bytes
                    size, _, last, _, _ = RECORD.unpack_from(os.pread(fd, HEADER, offset))
                    data, end = os.pread(fd, size, offset), size
                return data[:end], (seg.first_seq, offset + end), last
            if stop is not None and stop[0][0] == seg.first_seq:
                break
            i = self.segments.index(seg) + 1
            if i == len(self.segments):
                break
            seg, offset = self.segments[i], 0
        return b"", position, 0

    def record_at(self, first_seq: int, offset: int) -> bytes:
        for seg in self.segments:
            if seg.first_seq == first_seq:
                fd = self._reader(seg)
                size = RECORD.unpack_from(os.pread(fd, HEADER, offset))[0]
                return os.pread(fd, size, offset)
        raise KeyError(first_seq)


def iter_records(data: bytes) -> Iterator[Tuple[int, int, bytes, bytes, int, int]]:
    """(seq, time_ns, key, payload, offset, size) of each whole record in
    data, up to the first partial one (a reader of the store's answers keeps
    that for the next answer: it starts at the last offset + size)."""
    pos, end = 0, len(data)
    unpack = RECORD.unpack_from
    while end - pos >= HEADER:
        size, _, seq, time_ns, key_len = unpack(data, pos)
        if end - pos < size:
            return
        k = pos + HEADER
        yield seq, time_ns, data[k:k + key_len], data[k + key_len:pos + size], pos, size
        pos += size
