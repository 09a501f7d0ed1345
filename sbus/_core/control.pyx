# cython: language_level=3
"""Control messages and the upstream link (see control.pxd)."""
from libc.stdint cimport uint64_t, int64_t
from libc.string cimport memcmp

from sbus._core cimport report
from sbus._core.conn cimport MODE_QUEUE, MODE_BLOCK, MODE_ERROR
from sbus._core.report cimport text
from sbus._core.sendq cimport ORDER_RANDOM

import json

from sbus.logschema import UPSTREAM_EVENTS
from sbus._core.policy import MODE_NAMES, ORDER_NAMES


cdef inline bint key_is(const char *key, size_t n, const char *lit, size_t litlen) noexcept nogil:
    return n == litlen and memcmp(key, lit, n) == 0


cdef class Control:

    def __init__(self, int64_t own_uid):
        self.own_uid = own_uid

    cdef int control(self, Conn *c, const char *key, size_t n) except -1:
        if key_is(key, n, b"link/attach", 11):
            return self.claim(c)
        if key_is(key, n, b"link/frames", 11):
            return self.grant_frames(c)
        if key_is(key, n, b"!/cred/whoami", 13):
            if self.upstream_cred is not None:
                self.answer = b"CMSG !/cred/whoami\0%s/!/cred/%d/%d/%d" % (
                    self.upstream_cred, c.gid, c.uid, c.pid)
            else:
                self.answer = b"CMSG !/cred/whoami\0!/cred/%d/%d/%d" % (c.gid, c.uid, c.pid)
            return CTL_ANSWER
        if n > 14 and memcmp(key, b"blocking/soft/", 14) == 0:
            mode = key[14:n].decode("latin-1")
            if mode in MODE_NAMES:
                c.soft = MODE_NAMES.index(mode)
                return CTL_MODES
        elif n > 14 and memcmp(key, b"blocking/hard/", 14) == 0:
            mode = key[14:n].decode("latin-1")
            if mode in MODE_NAMES and mode != MODE_NAMES[MODE_QUEUE]:
                c.hard = MODE_NAMES.index(mode)
                return CTL_MODES
        elif n > 6 and memcmp(key, b"order/", 6) == 0:
            mode = key[6:n].decode("latin-1")
            if mode in ORDER_NAMES:
                c.order = ORDER_NAMES.index(mode)
                return CTL_MODES
        elif key_is(key, n, b"echo/on", 7):
            c.echo = 1
            return CTL_MODES
        elif key_is(key, n, b"echo/off", 8):
            c.echo = 0
            return CTL_MODES
        elif key_is(key, n, b"stats", 5):
            return CTL_STATS
        self.ignored += 1
        d = report.ident(c)
        d["key"] = text(key, n)
        self.answer = d
        return CTL_IGNORED

    cdef int from_link(self, const char *key, size_t n, const char *payload,
                       size_t plen) except -1:
        """What the link tells the broker: its credentials upstream
        (link/identity), a record for the log (link/log: JSON with "event"),
        its state for stats (link/state: JSON), and that it takes frames
        (link/frames: answered "ok", and frames go both ways from then on)."""
        body = payload[:plen] if payload != NULL else b""
        if key_is(key, n, b"link/attach", 11):
            return self.claim(self.link)
        if key_is(key, n, b"link/frames", 11):
            return self.grant_frames(self.link)
        if key_is(key, n, b"link/identity", 13):
            self.upstream_cred = body if body.startswith(b"!/cred/") else None
            return CTL_DONE
        try:
            fields = json.loads(body)
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            return CTL_DONE     # the link is ours; a bad report is ignored, never fatal
        if key_is(key, n, b"link/log", 8):
            event = fields.pop("event", None)
            if event in UPSTREAM_EVENTS:    # only the link's own events, by name
                self.answer = (event, fields)
                return CTL_LOG
        elif key_is(key, n, b"link/state", 10):
            self.upstream_state = fields
        return CTL_DONE

    cdef int claim(self, Conn *c) except -1:
        """CMSG link/attach: a client of the broker's own uid (or root) takes
        the link place, free on a broker without --upstream. Like the leaf's
        link it then receives every private key its patterns match and may set
        the nesting prefix (link/identity); it keeps its own flood modes and is
        told nothing of the others (sbus bridge --private, docs/bridge.md).
        Answered "ok" or "refused: why"."""
        if c.link:
            self.answer = b"CMSG link/attach\0ok"
        elif c.uid != 0 and c.uid != self.own_uid:
            self.answer = (b"CMSG link/attach\0refused: only the broker's own uid "
                           b"or root may take the link place")
        elif self.link != NULL:
            self.answer = (b"CMSG link/attach\0refused: the broker has a link already "
                           b"(an upstream, or another bridge)")
        else:
            c.link = 1
            self.link = c
            self.notes = False
            self.answer = b"CMSG link/attach\0ok"
        return CTL_ANSWER

    cdef int grant_frames(self, Conn *c) except -1:
        """CMSG link/frames: from then on c's deliveries go to it in frames
        and it may send frames (frames.pxd). Frames are a transport between
        sbus's own processes (a leaf's link, a bridge), so the trust is
        link/attach's: the link place, the broker's own uid or root. Answered
        "ok" or "refused: why"; anyone else's frame stays a malformed packet."""
        if c.link or c.uid == 0 or c.uid == self.own_uid:
            c.frames = 1
            self.answer = b"CMSG link/frames\0ok"
        else:
            self.answer = (b"CMSG link/frames\0refused: only the broker's own uid "
                           b"or root may take frames")
        return CTL_ANSWER

    cdef int attach(self, Conn *c) except -1:
        """The upstream link receives every publish its patterns match, never
        its own publishes back, and waits for no one: soft queue, hard block.
        The broker has no link yet (Broker.attach_link checks)."""
        c.echo = 0
        c.soft = MODE_QUEUE
        c.hard = MODE_BLOCK
        self.link = c
        self.notes = True
        self.upstream_state = {"state": "starting"}
        return 0

    cdef bint detach(self, Conn *c) noexcept:
        if c != self.link:
            return False
        # Nothing forwards for the prefix any more: whoami answers the local
        # form again until a link says who it is.
        self.link = NULL
        self.upstream_cred = None
        return True

    cdef size_t nested_prefix(self, const char *pat, size_t n) noexcept:
        """The rest of a nested pattern is checked against the client as a
        local pattern."""
        cdef const char *own
        cdef size_t olen
        if self.upstream_cred is None:
            return 0
        own = self.upstream_cred
        olen = len(self.upstream_cred)
        if n > olen + 7 and memcmp(pat, own, olen) == 0 and pat[olen] == b'/' \
                and memcmp(pat + olen + 1, b"!/cred/", 7) == 0:
            return olen + 1
        return 0

    cdef tuple carry(self):
        return self.upstream_cred, self.upstream_state, self.ignored

    cdef int restore(self, bytes upstream_cred, dict upstream_state, uint64_t ignored) except -1:
        self.upstream_cred = upstream_cred
        self.upstream_state = upstream_state
        self.ignored = ignored
        return 0

    cdef bint restore_link(self, Conn *c) noexcept:
        if self.link != NULL:
            return False
        self.link = c
        return True


cdef bytes stats_reply(dict snapshot, size_t max_message):
    body = json.dumps(snapshot, separators=(",", ":")).encode()
    if <size_t>len(body) + 11 > max_message:
        snapshot["clients_omitted"] = len(snapshot.pop("clients"))
        body = json.dumps(snapshot, separators=(",", ":")).encode()
    return b"CMSG stats\0" + body


cdef void modes_of(const Conn *c, Modes *out) noexcept:
    out.soft = c.soft
    out.hard = c.hard
    out.order = c.order
    out.echo = c.echo


cdef bint restore_modes(Conn *c, const Modes *m) noexcept:
    if not (m.soft <= MODE_ERROR and MODE_QUEUE < m.hard <= MODE_ERROR and
            m.order <= ORDER_RANDOM):
        return False
    c.soft = m.soft
    c.hard = m.hard
    c.order = m.order
    c.echo = m.echo
    return True
