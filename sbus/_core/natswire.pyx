# NATS wire frames for `sbus bridge`, both directions, with no Python
# object per message.
#
# Importer takes the bytes nats-py read from its socket (the fast path) or
# the messages its public API delivers (push(), the reference path). Each
# message of the bridge's own subscriptions is mapped to its sbus key (the
# Sbus-Key header, else the subject: the rules of sbus.bridge.mapping),
# checked as the broker checks it, and packed into Outboxes that sbus.aio
# sends with sendmmsg; drops are counted and described here for both paths.
# Every other frame (PING, INFO, -ERR, +OK, messages of other
# subscriptions) is handed back whole and in order for nats-py's own parser.
#
# Exporter, a batch.Sink, packs the HPUB frame of each local message
# sbus.aio's receive_into reads (or of a receive_many list) into one
# buffer bounded by max_pending, dropping at the chosen end; take() hands
# a run of whole frames to nats-py's writer as one bytes (the fast path),
# take_messages() the same run as (subject, header value, payload) for
# nats-py's publish() (the reference path).
#
# sbus.bridge.wire is the seam between these and nats-py.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.stdint cimport int64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memchr, memcmp, memmove

from .batch cimport Outbox, Sink
from .growbuf cimport Buf, buf_append, buf_reserve
from .protocol cimport KEY_OK, check_rest


cdef enum:
    MAX_SIDS = 64               # --import subjects, one subscription each
    DROP_RECORDS = 20           # drops described per take_drops(); the rest only counted
    HEADER_NAME_LEN = 8         # len("Sbus-Key")
    HEADER_VALUE_AT = 20        # len("NATS/1.0\r\nSbus-Key: "): the value in an HPUB frame's header

# Inbound drop reasons: indexes into Importer.drops, named as
# sbus.bridge.counters names them (a named enum cannot index an array).
cdef enum:
    IN_PRIVATE = 0
    IN_UNMAPPABLE = 1
    IN_OVERSIZE = 2
    IN_REFUSED = 3
    IN_FULL = 4
    IN_KINDS = 5

IN_DROP_NAMES = ("in_dropped_private", "in_dropped_unmappable", "in_dropped_oversize",
                 "in_dropped_refused", "in_dropped_full")
_IN_REASONS = ("private", "unmappable", "oversize", "refused", "full")

# What a failed mapping returns instead of a key length.
cdef enum MapError:
    MAP_BAD_ESCAPE = -1         # a '%' not followed by two hex digits
    MAP_BAD_BYTE = -2           # a space, control byte or non-ASCII byte
    MAP_NOT_UNDER = -3          # the subject is outside the prefix
    MAP_EMPTY_TOKEN = -4        # the subject has an empty token
    MAP_NUL = -5                # the key would hold a NUL

_MAP_ERRORS = {
    MAP_BAD_ESCAPE: "has a bad escape",
    MAP_BAD_BYTE: "holds a space, control or non-ASCII byte",
    MAP_NOT_UNDER: "is not under the subject prefix",
    MAP_EMPTY_TOKEN: "has an empty token",
    MAP_NUL: "decodes to a key with a NUL byte",
}


cdef inline bint is_space(char c) noexcept nogil:
    # bytes.strip()'s set: what nats-py strips from header names and values
    return c == b' ' or c == b'\t' or c == b'\r' or c == b'\n' or c == b'\x0b' or c == b'\x0c'


cdef inline int hex_value(char c) noexcept nogil:
    if b'0' <= c <= b'9':
        return c - c'0'
    if b'A' <= c <= b'F':
        return c - c'A' + 10
    if b'a' <= c <= b'f':
        return c - c'a' + 10
    return -1


cdef Py_ssize_t unescape(const char *s, size_t n, char *out) noexcept nogil:
    """Strict percent-decoding (mapping._unescape): bytes 0x21-0x7E, every
    '%' followed by two hex digits. The length written, or a MapError."""
    cdef size_t i = 0
    cdef Py_ssize_t o = 0
    cdef unsigned char c
    cdef int hi, lo
    while i < n:
        c = <unsigned char>s[i]
        if c == b'%':
            if i + 2 >= n:
                return MAP_BAD_ESCAPE
            hi = hex_value(s[i + 1])
            lo = hex_value(s[i + 2])
            if hi < 0 or lo < 0:
                return MAP_BAD_ESCAPE
            out[o] = <char>(hi * 16 + lo)
            o += 1
            i += 3
            continue
        if c < 0x21 or c > 0x7E:
            return MAP_BAD_BYTE
        out[o] = <char>c
        o += 1
        i += 1
    return o


cdef Py_ssize_t subject_to_key(const char *s, size_t n, const char *prefix, size_t plen,
                               char *out) noexcept nogil:
    """mapping.subject_to_key: ``prefix`` (with its trailing '.') then tokens,
    '%' alone for an empty segment. The key length, or a MapError."""
    cdef size_t i, start
    cdef Py_ssize_t o = 0, k
    cdef const char *dot
    if n < plen or memcmp(s, prefix, plen) != 0:
        return MAP_NOT_UNDER
    i = plen
    while True:
        start = i
        dot = <const char *>memchr(s + i, b'.', n - i)
        i = (dot - s) if dot != NULL else n
        if i == start:
            return MAP_EMPTY_TOKEN
        if start > plen:        # not the first token
            out[o] = b'/'
            o += 1
        if not (i - start == 1 and s[start] == b'%'):
            k = unescape(s + start, i - start, out + o)
            if k < 0:
                return k
            o += k
        if dot == NULL:
            return o
        i += 1


cdef bint header_key(const char *h, size_t n, const char **value, size_t *vlen) noexcept nogil:
    """The last ``Sbus-Key:`` line of a header block, as nats-py reads
    header lines (name and value stripped, CRLF-separated, after the
    NATS/1.0 line); False when there is none."""
    cdef const char *end = h + n
    cdef const char *line
    cdef const char *eol
    cdef const char *colon
    cdef const char *a
    cdef const char *z
    cdef bint found = False
    line = <const char *>memchr(h, b'\n', n)
    if line == NULL:
        return False
    line += 1
    while line < end:
        eol = <const char *>memchr(line, b'\n', end - line)
        if eol == NULL:
            eol = end
        colon = <const char *>memchr(line, b':', eol - line)
        if colon != NULL:
            a = line
            z = colon
            while a < z and is_space(a[0]):
                a += 1
            while z > a and is_space((z - 1)[0]):
                z -= 1
            if z - a == HEADER_NAME_LEN and memcmp(a, b"Sbus-Key", HEADER_NAME_LEN) == 0:
                a = colon + 1
                z = eol
                while a < z and is_space(a[0]):
                    a += 1
                while z > a and is_space((z - 1)[0]):
                    z -= 1
                value[0] = a
                vlen[0] = z - a
                found = True
        line = eol + 1
    return found


cdef inline bint is_op(const char *s, size_t n, const char *op, size_t oplen) noexcept nogil:
    """Whether s[:n] starts with the protocol verb ``op`` and a blank."""
    return n > oplen and memcmp(s, op, oplen) == 0 and (s[oplen] == b' ' or s[oplen] == b'\t')


cdef int parse_uint(const char *s, size_t n, size_t *out) noexcept nogil:
    cdef size_t v = 0, i
    if n == 0 or n > 18:
        return -1
    for i in range(n):
        if not b'0' <= s[i] <= b'9':
            return -1
        v = v * 10 + <size_t>(s[i] - c'0')
    out[0] = v
    return 0


cdef class Importer:
    """NATS -> local bus. ``feed()`` every read of the NATS socket."""

    cdef bytes prefix               # the subject prefix and its '.'
    cdef int64_t sids[MAX_SIDS]
    cdef int nsids
    cdef Buf carry                  # an incomplete frame from the last read
    cdef Buf other                  # frames for nats-py's parser, this read
    cdef Buf scratch                # one decoded key
    cdef readonly size_t max_message
    cdef readonly size_t max_pending
    cdef readonly size_t pending_bytes  # keys and payloads packed and not taken
    cdef readonly Py_ssize_t pending_msgs
    cdef Outbox box                 # being packed
    cdef size_t box_payload
    cdef size_t box_size
    cdef list ready                 # [(Outbox, payload bytes)] packed, oldest first
    cdef list spare                 # sent Outboxes for reuse
    cdef long long drops[IN_KINDS]
    cdef list records               # described drops, at most DROP_RECORDS
    cdef readonly long long undescribed

    def __cinit__(self, str prefix, size_t max_message, size_t max_pending):
        self.prefix = prefix.encode("ascii") + b"."
        self.max_message = max_message
        self.max_pending = max_pending
        self.box_size = max_message
        self.ready = []
        self.spare = []
        self.records = []

    def __dealloc__(self):
        free(self.carry.p)
        free(self.other.p)
        free(self.scratch.p)

    def add_sid(self, int64_t sid):
        """Take the frames of subscription ``sid`` (one per --import subject)."""
        if self.nsids == MAX_SIDS:
            raise ValueError(f"at most {MAX_SIDS} subscriptions")
        self.sids[self.nsids] = sid
        self.nsids += 1

    def reset(self):
        """Forget a partial frame (a new connection starts afresh)."""
        self.carry.len = 0
        self.other.len = 0

    @property
    def drops_pending(self):
        """Whether take_drops() has something to report."""
        return bool(self.records) or self.undescribed > 0

    def counts(self):
        """The inbound drop counters, by sbus.bridge.counters name."""
        return {IN_DROP_NAMES[i]: self.drops[i] for i in range(IN_KINDS)}

    def take_drops(self):
        """(reason, key or None, size, detail, subject) of the drops described
        since the last call, and how many more were only counted."""
        out, self.records = self.records, []
        n, self.undescribed = self.undescribed, 0
        return out, n

    def feed(self, bytes data):
        """Take the frames of the bridge's subscriptions out of ``data``; the
        other complete frames, in order, as bytes for nats-py's parser (or None)."""
        cdef const char *b
        cdef size_t n, used
        self.other.len = 0
        if self.carry.len:
            buf_append(&self.carry, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
            b = self.carry.p
            n = self.carry.len
        else:
            b = PyBytes_AS_STRING(data)
            n = PyBytes_GET_SIZE(data)
        used = self.parse(b, n)
        if self.carry.len:
            memmove(self.carry.p, self.carry.p + used, n - used)
            self.carry.len = n - used
        elif used < n:
            buf_append(&self.carry, b + used, n - used)
        if self.other.len:
            return PyBytes_FromStringAndSize(self.other.p, self.other.len)
        return None

    cdef size_t parse(self, const char *b, size_t n) except? 0:
        """Consume the complete frames of b[:n]; the bytes consumed."""
        cdef size_t p = 0, line_end, le, frame_end
        cdef const char *nl
        cdef const char *tok[6]
        cdef size_t tlen[6]
        cdef int ntok, i
        cdef size_t off
        cdef size_t sid, hlen, total
        cdef bint hmsg, own
        while p < n:
            nl = <const char *>memchr(b + p, b'\n', n - p)
            if nl == NULL:
                break       # an incomplete line: nats-py's parser waits as well
            line_end = nl - b + 1
            hmsg = is_op(b + p, n - p, b"HMSG", 4)
            if not hmsg and not is_op(b + p, n - p, b"MSG", 3):
                buf_append(&self.other, b + p, line_end - p)
                p = line_end
                continue
            # MSG <subject> <sid> [reply] <size>\r\n
            # HMSG <subject> <sid> [reply] <header size> <total size>\r\n
            le = line_end - 1
            if le <= p or b[le - 1] != b'\r':
                return self.give_up(b, p, n)
            le -= 1
            off = p + (4 if hmsg else 3)
            ntok = 0
            while off < le:
                while off < le and (b[off] == b' ' or b[off] == b'\t'):
                    off += 1
                if off == le:
                    break
                if ntok == 6:
                    return self.give_up(b, p, n)
                tok[ntok] = b + off
                while off < le and b[off] != b' ' and b[off] != b'\t':
                    off += 1
                tlen[ntok] = b + off - tok[ntok]
                ntok += 1
            if ntok != (4 if hmsg else 3) and ntok != (5 if hmsg else 4):
                return self.give_up(b, p, n)
            hlen = 0
            if parse_uint(tok[1], tlen[1], &sid) < 0 or parse_uint(
                    tok[ntok - 1], tlen[ntok - 1], &total) < 0:
                return self.give_up(b, p, n)
            if hmsg and (parse_uint(tok[ntok - 2], tlen[ntok - 2], &hlen) < 0 or hlen > total):
                return self.give_up(b, p, n)
            frame_end = line_end + total + 2
            if frame_end > n:
                break
            own = False
            for i in range(self.nsids):
                if <size_t>self.sids[i] == sid:
                    own = True
                    break
            if own:
                self.take_message(tok[0], tlen[0], b + line_end, hlen,
                                  b + line_end + hlen, total - hlen)
            else:
                buf_append(&self.other, b + p, frame_end - p)
            p = frame_end
        return p

    cdef size_t give_up(self, const char *b, size_t p, size_t n) except? 0:
        """A malformed MSG line: the rest goes to nats-py's parser, which
        reports it (and nats-py reconnects), as without the fast path."""
        buf_append(&self.other, b + p, n - p)
        return n

    cdef int take_message(self, const char *subject, size_t slen, const char *hdr, size_t hlen,
                          const char *payload, size_t plen) except -1:
        cdef const char *value = NULL
        cdef size_t vlen = 0
        cdef bint by_header = hlen > 0 and header_key(hdr, hlen, &value, &vlen)
        return self.map_message(subject, slen, value if by_header else NULL, vlen, payload, plen)

    cdef int map_message(self, const char *subject, size_t slen, const char *value, size_t vlen,
                         const char *payload, size_t plen) except -1:
        """Map one message to its key (the Sbus-Key ``value``, else the
        subject), check it and pack it, or drop and count it."""
        cdef bint by_header = value != NULL
        cdef size_t need = vlen if by_header else slen
        cdef Py_ssize_t klen
        cdef const char *key
        if need + 1 > self.scratch.cap:
            buf_reserve(&self.scratch, need + 1)
        key = self.scratch.p
        if by_header:
            klen = unescape(value, vlen, self.scratch.p)
        else:
            klen = subject_to_key(subject, slen, PyBytes_AS_STRING(self.prefix),
                                  PyBytes_GET_SIZE(self.prefix), self.scratch.p)
        if klen >= 0 and memchr(key, 0, klen) != NULL:
            klen = MAP_NUL
        if klen < 0:
            what = "the Sbus-Key header" if by_header else "the subject"
            return self.drop(IN_UNMAPPABLE, NULL, 0, plen, f"{what} {_MAP_ERRORS[klen]}",
                             subject, slen)
        if klen and key[0] == b'!':
            return self.drop(IN_PRIVATE, key, klen, plen, "", subject, slen)
        if 5 + <size_t>klen + plen > self.max_message:
            return self.drop(IN_OVERSIZE, key, klen, plen,
                             f"over the broker's --max-message {self.max_message}", subject, slen)
        if memchr(key, b'!', klen) != NULL and check_rest(key, klen, False) != KEY_OK:
            return self.drop(IN_REFUSED, key, klen, plen, "reserved '!' misused in the key",
                             subject, slen)
        return self.pack(key, klen, payload, plen, subject, slen)

    def push(self, str subject, value, bytes payload):
        """One message as nats-py's public API delivers it (its subject, its
        Sbus-Key header value, str or bytes, or None, its payload): mapped,
        checked and packed as a frame of ``feed()`` is; False if it was dropped."""
        cdef bytes s = subject.encode("utf-8", "surrogateescape")
        cdef bytes v = None
        cdef const char *vp = NULL
        cdef Py_ssize_t vlen = 0
        if value is not None:
            v = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
            vp = v
            vlen = len(v)
        before = self.pending_msgs
        self.map_message(s, len(s), vp, vlen, payload, len(payload))
        return self.pending_msgs > before

    def deliver(self, bytes key, bytes payload, str subject=""):
        """A private message for a process of this host (``sbus bridge
        --private``; the bridge has checked that ``key`` names one): checked as
        the broker checks a key, and against --max-message, then packed as is;
        False if it was dropped."""
        cdef bytes s = subject.encode("utf-8", "surrogateescape")
        cdef size_t klen = len(key), plen = len(payload)
        if 5 + klen + plen > self.max_message:
            self.drop(IN_OVERSIZE, key, klen, plen,
                      f"over the broker's --max-message {self.max_message}", s, len(s))
            return False
        if check_rest(key, klen, False) != KEY_OK:
            self.drop(IN_REFUSED, key, klen, plen, "a malformed private key", s, len(s))
            return False
        before = self.pending_msgs
        self.pack(key, klen, payload, plen, s, len(s))
        return self.pending_msgs > before

    def refuse(self, bytes key, bytes payload, str detail, str subject=""):
        """Count and describe a private message the bridge will not deliver."""
        cdef bytes s = subject.encode("utf-8", "surrogateescape")
        self.drop(IN_REFUSED, key, len(key), len(payload), detail, s, len(s))

    cdef int pack(self, const char *key, size_t klen, const char *payload, size_t plen,
                  const char *subject, size_t slen) except -1:
        if self.pending_bytes + klen + plen > self.max_pending:
            # The local broker is slower than NATS (or away): bounded by
            # --max-pending, losing the newest, as the reference path.
            return self.drop(IN_FULL, key, klen, plen, "", subject, slen)
        if self.box is None or not self.box.pack_message(key, klen, payload, plen):
            self.close_box()
            self.box = self.spare.pop() if self.spare else Outbox(self.box_size)
            self.box.pack_message(key, klen, payload, plen)
        self.box_payload += plen
        self.pending_bytes += klen + plen
        self.pending_msgs += 1
        return 0

    cdef int close_box(self) except -1:
        if self.box is not None and len(self.box):
            self.ready.append((self.box, self.box_payload))
        elif self.box is not None:
            self.spare.append(self.box)
        self.box = None
        self.box_payload = 0
        return 0

    def take(self):
        """Everything packed, as [(Outbox, payload bytes)] oldest first; the
        pending count starts again from zero."""
        self.close_box()
        out, self.ready = self.ready, []
        self.pending_bytes = 0
        self.pending_msgs = 0
        return out

    def recycle(self, Outbox box):
        """Keep a sent (empty) Outbox for the next batch."""
        box.clear()
        if len(self.spare) < 8:
            self.spare.append(box)

    cdef int drop(self, int reason, const char *key, Py_ssize_t klen, size_t size, str detail,
                  const char *subject, size_t slen) except -1:
        self.drops[reason] += 1
        if len(self.records) >= DROP_RECORDS:
            self.undescribed += 1
            return 0
        self.records.append((
            _IN_REASONS[reason], None if key == NULL else key[:klen], size, detail,
            subject[:slen].decode("utf-8", "replace")))
        return 0


# -- local bus -> NATS -------------------------------------------------------------

cdef tuple frame_parts(tuple mapped):
    """(b"HPUB subject hlen ", header block, what it counts beyond the
    payload) of a (subject, Sbus-Key value) mapping."""
    subject, value = mapped
    hdr = b"NATS/1.0\r\nSbus-Key: " + value.encode("ascii") + b"\r\n\r\n"
    head = b"HPUB " + subject.encode("ascii") + b" %d " % len(hdr)
    return head, hdr, len(subject) + len(value)


# Outbound counts: indexes into Exporter.counts_.
cdef enum:
    OUT_PRIVATE = 0             # not a drop: kept home
    OUT_FULL = 1
    OUT_UNMAPPABLE = 2
    OUT_KINDS = 3

OUT_COUNT_NAMES = ("out_private", "out_dropped_full", "out_dropped_unmappable")


cdef struct Entry:
    size_t frame                # bytes of its HPUB frame
    size_t size                 # what it counts against max_pending
    size_t payload


cdef class Exporter(Sink):
    """Local bus -> NATS: a Sink for sbus.aio's receive_into (or ``add()`` a
    receive_many list); ``take()`` frames."""

    cdef object mapper              # key -> (subject, Sbus-Key value) or None
    # None: '!' keys stay home; else (key, payload) -> (subject, Sbus-Key
    # value) to send, None to keep home, False to drop as unmappable
    cdef public object private
    cdef bytes last_key             # the key of the last message, and its mapping:
    cdef object last_mapped         # a run of one key makes no object per message
    cdef object message_type
    cdef dict cache                 # key -> (b"HPUB subject hlen ", header block, size extra)
    cdef Py_ssize_t cache_size
    cdef Buf frames
    cdef size_t frames_head         # frames before it were taken or dropped
    cdef Entry *entries
    cdef Py_ssize_t entries_cap
    cdef Py_ssize_t head            # first pending entry
    cdef Py_ssize_t tail
    cdef readonly size_t max_pending
    cdef readonly bint drop_newest
    cdef public size_t max_payload  # the server's, from its INFO
    cdef readonly size_t pending_bytes
    cdef long long counts_[OUT_KINDS]
    cdef list records
    cdef readonly long long undescribed

    def __cinit__(self, object mapper, object message_type, size_t max_pending,
                  bint drop_newest, size_t max_payload=1 << 20, Py_ssize_t cache_size=4096):
        self.mapper = mapper
        self.message_type = message_type
        self.cache = {}
        self.cache_size = cache_size
        self.max_pending = max_pending
        self.drop_newest = drop_newest
        self.max_payload = max_payload
        self.records = []

    def __dealloc__(self):
        free(self.frames.p)
        free(self.entries)

    @property
    def pending_msgs(self):
        return self.tail - self.head

    @property
    def drops_pending(self):
        return bool(self.records) or self.undescribed > 0

    def counts(self):
        return {OUT_COUNT_NAMES[i]: self.counts_[i] for i in range(OUT_KINDS)}

    def take_drops(self):
        out, self.records = self.records, []
        n, self.undescribed = self.undescribed, 0
        return out, n

    cdef object mapped(self, object key):
        cdef PyObject *hit = PyDict_GetItem(self.cache, key)
        if hit != NULL:
            return <object>hit
        m = self.mapper(key)
        if m is None:
            return None
        if len(self.cache) >= self.cache_size:
            self.cache.clear()
        out = self.cache[key] = frame_parts(m)
        return out

    def add(self, list batch):
        """Pack the messages of a receive_many list (control messages are
        skipped), as put() packs each."""
        cdef Py_ssize_t i, n = PyList_GET_SIZE(batch)
        cdef object item, key, payload
        for i in range(n):
            item = <object>PyList_GET_ITEM(batch, i)
            if type(item) is not self.message_type:
                continue
            key = <object>PyTuple_GET_ITEM(item, 0)
            payload = <object>PyTuple_GET_ITEM(item, 1)
            self.put(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                     PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload))

    cdef int put(self, const char *key, size_t klen,
                 const char *payload, size_t plen) except -1:
        """Pack one message's HPUB frame, dropping at the chosen end past max_pending."""
        cdef object m
        cdef size_t size
        if klen and key[0] == b'!':
            # Rare and addressed to one process: no cache, one call each.
            m = None if self.private is None else self.private(key[:klen], payload[:plen])
            if m is None:
                self.counts_[OUT_PRIVATE] += 1
                return 0
            if m is False:
                return self.drop(key[:klen], plen, "the subject would be longer than NATS accepts")
            m = frame_parts(m)
        elif (self.last_key is not None and <size_t>PyBytes_GET_SIZE(self.last_key) == klen
                and memcmp(PyBytes_AS_STRING(self.last_key), key, klen) == 0):
            m = self.last_mapped
        else:
            self.last_key = key[:klen]
            m = self.last_mapped = self.mapped(self.last_key)
        if m is None:
            return self.drop(key[:klen], plen, "the subject would be longer than NATS accepts")
        if plen > self.max_payload:
            return self.drop(key[:klen], plen, "larger than NATS's max_payload")
        size = plen + <size_t>(<tuple>m)[2]
        if self.pending_bytes + size > self.max_pending:
            if self.drop_newest or size > self.max_pending:
                self.counts_[OUT_FULL] += 1
                return 0
            while self.tail > self.head and self.pending_bytes + size > self.max_pending:
                self.frames_head += self.entries[self.head].frame
                self.pending_bytes -= self.entries[self.head].size
                self.head += 1
                self.counts_[OUT_FULL] += 1
        return self.append(<bytes>(<tuple>m)[0], <bytes>(<tuple>m)[1], payload, plen, size)

    cdef int append(self, bytes head, bytes hdr, const char *payload, size_t plen,
                    size_t size) except -1:
        cdef char digits[24]
        cdef size_t hlen = PyBytes_GET_SIZE(hdr)
        cdef size_t total = hlen + plen, v = total
        cdef int nd = 0
        cdef size_t frame, start
        cdef Entry *e
        while True:
            digits[23 - nd] = <char>(c'0' + v % 10)
            nd += 1
            v //= 10
            if v == 0:
                break
        frame = PyBytes_GET_SIZE(head) + nd + 2 + total + 2
        if self.head == self.tail:
            self.head = self.tail = 0
            self.frames.len = self.frames_head = 0
        elif self.frames_head > self.frames.cap // 2 and self.frames.len + frame > self.frames.cap:
            memmove(self.frames.p, self.frames.p + self.frames_head,
                    self.frames.len - self.frames_head)
            self.frames.len -= self.frames_head
            self.frames_head = 0
            memmove(self.entries, self.entries + self.head, (self.tail - self.head) * sizeof(Entry))
            self.tail -= self.head
            self.head = 0
        buf_reserve(&self.frames, frame)
        start = self.frames.len
        buf_append(&self.frames, PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head))
        buf_append(&self.frames, digits + 24 - nd, nd)
        buf_append(&self.frames, b"\r\n", 2)
        buf_append(&self.frames, PyBytes_AS_STRING(hdr), hlen)
        buf_append(&self.frames, payload, plen)
        buf_append(&self.frames, b"\r\n", 2)
        if self.tail == self.entries_cap:
            if self.head > 0:
                memmove(self.entries, self.entries + self.head,
                        (self.tail - self.head) * sizeof(Entry))
                self.tail -= self.head
                self.head = 0
            else:
                e = <Entry *>realloc(self.entries,
                                     (self.entries_cap * 2 + 256) * sizeof(Entry))
                if e == NULL:
                    raise MemoryError()
                self.entries = e
                self.entries_cap = self.entries_cap * 2 + 256
        e = &self.entries[self.tail]
        e.frame = self.frames.len - start
        e.size = size
        e.payload = plen
        self.tail += 1
        self.pending_bytes += size
        return 0

    def take(self, size_t max_bytes):
        """The oldest pending frames, whole, up to ``max_bytes`` (at least
        one): (bytes, messages, payload bytes); None when nothing is pending."""
        cdef Py_ssize_t i = self.head
        cdef size_t nbytes = 0, payload = 0
        if self.head == self.tail:
            return None
        while i < self.tail and (i == self.head or nbytes + self.entries[i].frame <= max_bytes):
            nbytes += self.entries[i].frame
            payload += self.entries[i].payload
            self.pending_bytes -= self.entries[i].size
            i += 1
        out = PyBytes_FromStringAndSize(self.frames.p + self.frames_head, nbytes)
        count = i - self.head
        self.frames_head += nbytes
        self.head = i
        return out, count, payload

    def take_messages(self, size_t max_bytes):
        """As ``take()``, for nats-py's public ``publish()``: ([(subject, Sbus-Key
        value, payload)], payload bytes), read back from the same frames;
        None when nothing is pending."""
        cdef Py_ssize_t i = self.head
        cdef size_t nbytes = 0, payload = 0
        cdef const char *f
        cdef const char *space
        cdef const char *block
        cdef const char *data
        if self.head == self.tail:
            return None
        out = []
        f = self.frames.p + self.frames_head
        while i < self.tail and (i == self.head or nbytes + self.entries[i].frame <= max_bytes):
            # HPUB <subject> <hlen> <total>\r\nNATS/1.0\r\nSbus-Key: <value>\r\n\r\n<payload>\r\n
            space = <const char *>memchr(f + 5, b' ', self.entries[i].frame - 5)
            block = <const char *>memchr(space, b'\n', self.entries[i].frame - (space - f)) + 1
            data = f + self.entries[i].frame - 2 - self.entries[i].payload
            out.append((f[5:space - f].decode("ascii"),
                        block[HEADER_VALUE_AT:data - 4 - block].decode("ascii"),
                        data[:self.entries[i].payload]))
            nbytes += self.entries[i].frame
            payload += self.entries[i].payload
            self.pending_bytes -= self.entries[i].size
            f += self.entries[i].frame
            i += 1
        self.frames_head += nbytes
        self.head = i
        return out, payload

    cdef int drop(self, bytes key, size_t size, str detail) except -1:
        self.counts_[OUT_UNMAPPABLE] += 1
        if len(self.records) >= DROP_RECORDS:
            self.undescribed += 1
            return 0
        self.records.append(("unmappable", key, size, detail, ""))
        return 0
