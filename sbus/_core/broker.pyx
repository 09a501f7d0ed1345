# cython: language_level=3
"""The sbus broker: accept, subscriptions, control messages and closing
around the per-message path (receive, parse, match, fan out, send), and the
loop that drives them.

The message path is C over C structs (broker.pxd tells the life of a
message): each readable connection's batch is read with recvmmsg into the
loop turn's next free slots, each MSG is matched through the segment trie,
every recipient gets a ``Pending`` entry, and once per turn each recipient's
deliveries from every publisher go out in one sendmmsg, straight from the
receive buffers. Only what cannot be sent without blocking is copied into a
shared Packet. Python is called only for sampled message
records, control replies and connection events.

Connections that misbehave are only *marked* closing; they are torn down at
the end of the loop turn, never while a batch or the fired-event array still
points at them. A callback that raises does not cut a batch short: the first
exception is kept, the turn finishes, and ``run()`` raises it once afterwards.
"""
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport (
    errno, EAGAIN, EINTR, ECONNABORTED, ECONNRESET, EMFILE, ENFILE, ENOBUFS, ENOMEM, EPIPE)
from libc.stdint cimport int32_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memchr, memcmp, memcpy, memset
from posix.fcntl cimport open as c_open, O_RDONLY, O_CLOEXEC
from posix.unistd cimport close, read

from sbus._core cimport report
from sbus._core.budget cimport (
    Account, UNLIMITED, accounts_init, accounts_free, account_get, account_drop_if_idle,
    pattern_cost)
from sbus._core.conn cimport (
    Conn, MODE_QUEUE, MODE_BLOCK, R_EOF, R_ERROR, R_PROTOCOL, R_CRED, R_BANG, R_USER, R_FLOOD, R_OVERSIZE,
    R_LIMIT, R_SHUTDOWN, R_FD_LIMIT, R_SUB_BUDGET, R_CONN_BUDGET)
from sbus._core.includes.sys cimport (
    accept4, getsockopt, setsockopt, socklen_t, ucred, SOL_SOCKET, SO_PEERCRED, SO_SNDBUF,
    SO_SNDBUFFORCE, SOCK_NONBLOCK, SOCK_CLOEXEC, clock_gettime, timespec, CLOCK_MONOTONIC,
    malloc_trim, recv, recvmmsg, sendmmsg, MSG_DONTWAIT, MSG_NOSIGNAL, MSG_TRUNC, MSG_PEEK,
    mmap, munmap, madvise, MAP_FAILED, PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS,
    MAP_NORESERVE, MADV_DONTNEED,
)
from sbus._core.index cimport (
    Sub, index_init, index_free, index_add, index_remove, index_match)
from sbus._core.loop cimport EV_READ, EV_WRITE, EV_HUP
from sbus._core.loop import make_poller
from sbus._core.policy cimport (
    holds_bus, flood_action, FLOOD_QUEUE_BLOCK, FLOOD_DROP_SOFT, FLOOD_DROP_HARD,
    FLOOD_CLOSE_SOFT, FLOOD_CLOSE_HARD)
from sbus._core.protocol cimport (
    ParsedPacket, parse_packet, VERB_MSG, VERB_SUB, VERB_UNSUB, VERB_CMSG,
    CredForm, parse_cred_form, is_cred_key, check_rest, KEY_OK, KEY_BANG_MISUSE, CRED_EMPTY,
    CRED_CANONICAL_MAX, cred_canonical_prefix,
    normalise_pattern, PATTERN_OK, PATTERN_CRED_MALFORMED, PATTERN_CRED_MISMATCH,
    PATTERN_NESTED_CRED_MALFORMED, PATTERN_BANG_MISUSE, PATTERN_TOO_LONG)
from sbus._core.report cimport text
from sbus._core.sendq cimport (Packet, PacketStats, get_packet_stats, packet_new,
                               packet_release, sq_push, sq_select, sq_consume, sq_clear)

import json
import os

from sbus.logschema import (
    ACCEPT_ERROR, ACCEPT_PAUSED, CLIENT_CONNECT, CLIENT_DISCONNECT, CMSG_IGNORED, UPSTREAM_EVENTS,
    DELTA_FIELDS, FD_EXHAUSTED, SUBSCRIBE, UNSUBSCRIBE, REFUSE_BANG_MISUSE,
    REFUSE_CRED_MALFORMED, REFUSE_CRED_MISMATCH, REFUSE_NOT_SUBSCRIBED,
    REFUSE_PATTERN_TOO_LONG, REFUSE_TOO_MANY, REFUSE_SUB_BUDGET_CONNECTION,
    REFUSE_SUB_BUDGET_USER, REFUSE_SUB_BUDGET_TOTAL)
from sbus._core.policy import MODE_NAMES, ORDER_NAMES

# A refused SUB: its logged reason, and the connection's Reason and detail.
_PATTERN_REFUSALS = {
    PATTERN_CRED_MALFORMED: (REFUSE_CRED_MALFORMED, R_CRED, "malformed !/cred/ pattern"),
    PATTERN_CRED_MISMATCH: (REFUSE_CRED_MISMATCH, R_CRED,
                            "credentials do not match the client's"),
    PATTERN_NESTED_CRED_MALFORMED: (REFUSE_CRED_MALFORMED, R_CRED,
                                    "malformed nested !/cred/ pattern"),
    PATTERN_BANG_MISUSE: (REFUSE_BANG_MISUSE, R_BANG, "reserved '!' in pattern"),
    PATTERN_TOO_LONG: (REFUSE_PATTERN_TOO_LONG, R_LIMIT, "pattern too long"),
}

cdef enum:
    WHICH_SOFT = 0
    WHICH_HARD = 1
    WHICH_ORDER = 2
    WHICH_ECHO = 3


cdef inline double monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline bint key_is(const char *key, size_t n, const char *lit, size_t litlen) noexcept nogil:
    return n == litlen and memcmp(key, lit, n) == 0


cdef void fan_one(void *ctx, Sub *sub) noexcept nogil:
    """index_match callback: pick each eligible connection once per message."""
    cdef FanOut *f = <FanOut *>ctx
    cdef Conn *c = <Conn *>sub.owner
    if c.stamp == f.seq:
        return
    c.stamp = f.seq
    if c.closing:
        return
    if c == f.sender and not c.echo:
        return
    # A !/cred/G/U/P/ key reaches only G/U/P, whatever pattern matched it.
    # An empty field names no one, so it restricts nothing. The upstream
    # link is the broker's own and forwards private keys for other servers;
    # it is asked only once a key is already refused, so public keys and a
    # broker without a link pay nothing for it.
    if f.is_cred and ((f.gid != CRED_EMPTY and c.gid != f.gid) or
                      (f.uid != CRED_EMPTY and c.uid != f.uid) or
                      (f.pid != CRED_EMPTY and c.pid != f.pid)) and not c.link:
        return
    f.recips[f.n] = c
    f.n += 1


cdef int link_pattern(const char *pat, size_t n, char *out, size_t cap,
                      size_t *out_len) noexcept nogil:
    """A !/cred/ pattern of the link, stored as written once well formed: the
    link receives private keys for others anyway, and a bridge subscribes to
    the host form of every other host with '*' for the host field
    (!/cred/*/4294967295/0/, docs/bridge.md)."""
    cdef int check = check_rest(pat, n, True)
    if check == KEY_BANG_MISUSE:
        return PATTERN_BANG_MISUSE
    if check != KEY_OK:
        return PATTERN_CRED_MALFORMED
    if n > cap:
        return PATTERN_TOO_LONG
    memcpy(out, pat, n)
    out_len[0] = n
    return PATTERN_OK


cdef inline uint32_t read_want(Conn *c, uint32_t room) noexcept:
    """How many packets to ask c for, with room slots free."""
    if c.recv_want == 0:
        c.recv_want = RECV_BATCH    # a new record: nothing known yet
    return c.recv_want if room > c.recv_want else room


cdef inline void note_read(Conn *c, uint32_t want, int got) noexcept:
    """Adjusts c.recv_want after a read that asked for want packets and got
    got: a read that asks for more than there is pays for a failed receive."""
    if got == <int>want:
        # Full: there may be more. Ask for more only once it keeps filling,
        # so one packet a turn settles at one without a failed read; a
        # backlog still doubles its way to RECV_BATCH.
        c.recv_full += 1
        if c.recv_full >= RECV_GROW_AFTER and want == c.recv_want:
            c.recv_want = RECV_BATCH if want * 2 > RECV_BATCH else <uint8_t>(want * 2)
            c.recv_full = 0
    elif got > 0:
        # Drained: shrink slowly, so a stream whose turns vary keeps its
        # large reads.
        c.recv_full = 0
        if c.recv_want > 1:
            c.recv_want = <uint8_t>(got if got > c.recv_want - 1 else c.recv_want - 1)


cdef class Broker:
    """Serve the sbus protocol on an already listening socket.

    ``config`` is any object with the attributes of the configuration's
    broker options (backend, max_message, auto_close, soft, hard, order,
    queue_max_bytes, queue_max_msgs, total_max_bytes, block_timeout,
    max_subscriptions, max_pattern, log_messages); the broker has no defaults
    of its own. ``run()`` loops until ``stop()`` is called (from a signal
    handler or a callback) or, with auto_close, until the last client leaves;
    it returns the stop reason. ``close()`` disconnects every client.
    """

    def __cinit__(self, int listen_fd, config, *args, **kwargs):
        cdef int i
        cdef void *area
        cdef size_t slot = <size_t>config.max_message + 1
        cdef size_t fit = TURN_AREA_BYTES // slot
        self.listen_fd = -1
        self.wakeup_fd = -1
        self.spare_fd = -1
        self.conns = NULL
        self.scratch = NULL
        self.allowed_uids = NULL
        self.recv_area = NULL
        self.readable = NULL
        if index_init(&self.index) < 0 or accounts_init(&self.accounts) < 0:
            raise MemoryError()
        self.rng = 0x9E3779B97F4A7C15 ^ <uint64_t>(<size_t><void *>self)
        # One slot per packet received in a loop turn, each big enough for
        # the largest packet plus one byte so MSG_TRUNC can tell an oversized
        # one apart; as many as TURN_AREA_BYTES holds, and never fewer than
        # one batch. Mapped, not malloc'd, so the pages a burst of large
        # packets touched can be handed back (release_buffers) without
        # freeing the area; only touched pages count.
        self.turn_slots = TURN_SLOTS_MAX if fit > TURN_SLOTS_MAX else (
            RECV_BATCH if fit < RECV_BATCH else <uint32_t>fit)
        self.recv_area_size = self.turn_slots * slot
        area = mmap(NULL, self.recv_area_size, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if area == MAP_FAILED:
            raise MemoryError()
        self.recv_area = <char *>area
        memset(self.rhdrs, 0, sizeof(self.rhdrs))
        for i in range(self.turn_slots):
            self.riov[i].iov_base = self.recv_area + i * slot
            self.riov[i].iov_len = slot
            self.rhdrs[i].msg_hdr.msg_iov = &self.riov[i]
            self.rhdrs[i].msg_hdr.msg_iovlen = 1
            self.batch_pkts[i] = NULL
        for i in range(SEND_BATCH):
            self.shdrs[i].msg_hdr.msg_iov = &self.siov[i]
            self.shdrs[i].msg_hdr.msg_iovlen = 1
        self.batch_pend = -1
        self.pend_cap = 1024
        self.pend = <Pending *>malloc(self.pend_cap * sizeof(Pending))
        if self.pend == NULL:
            raise MemoryError()

    def __init__(self, int listen_fd, config, *, allowed_uids=(), int access_mode=-1,
                 int wakeup_fd=-1, on_event=None, on_message=None, on_tick=None,
                 double tick_interval=0.0):
        cdef int i
        self.poller = make_poller(config.backend)
        if self.poller.batch_recv:
            self.readable = <Fired *>malloc(self.poller.max_fired * sizeof(Fired))
            if self.readable == NULL:
                raise MemoryError()
        self.listen_fd = listen_fd
        self.wakeup_fd = wakeup_fd
        self.max_message = config.max_message
        self.sndbuf = <int>(2 * self.max_message + 65536)
        self.soft = MODE_NAMES.index(config.soft)
        self.hard = MODE_NAMES.index(config.hard)
        if self.hard == MODE_QUEUE:
            raise ValueError("the hard mode is discard, block or error")
        self.order = ORDER_NAMES.index(config.order)
        self.queue_max_bytes = config.queue_max_bytes
        self.queue_max_msgs = config.queue_max_msgs
        self.total_max_bytes = config.total_max_bytes
        self.block_timeout = config.block_timeout
        self.max_subscriptions = config.max_subscriptions
        # 0: no limit of its own; a pattern is as long as a packet allows.
        self.max_pattern = config.max_pattern or config.max_message
        self.sub_max_bytes = config.sub_max_bytes
        self.user_sub_max_bytes = config.user_sub_max_bytes
        self.total_sub_max_bytes = config.total_sub_max_bytes
        self.user_max_connections = config.user_max_connections
        self.user_queue_max_bytes = config.user_queue_max_bytes
        self.auto_close = config.auto_close
        self.log_messages = config.log_messages
        self.on_event = on_event
        self.on_message = on_message
        self.on_tick = on_tick
        self.tick_interval = tick_interval
        self.close_details = {}
        self.last_totals = None
        self.next_id = 1
        self.access_mode = access_mode
        self.own_uid = os.getuid()
        self.own_gid = os.getgid()
        self.n_allowed = len(allowed_uids)
        if self.n_allowed:
            self.allowed_uids = <int64_t *>malloc(self.n_allowed * sizeof(int64_t))
            if self.allowed_uids == NULL:
                raise MemoryError()
            for i, uid in enumerate(allowed_uids):
                self.allowed_uids[i] = uid
        self.scratch_cap = self.max_pattern + 128
        if self.scratch_cap < 4096:
            self.scratch_cap = 4096
        self.scratch = <char *>malloc(self.scratch_cap)
        if self.scratch == NULL:
            raise MemoryError()
        self.grow_lists(64)
        # A spare descriptor to give up when accept hits EMFILE (see fd_exhausted).
        self.spare_fd = c_open(b"/dev/null", O_RDONLY | O_CLOEXEC)
        self.poller.set(listen_fd, EV_READ)
        if wakeup_fd >= 0:
            self.poller.set(wakeup_fd, EV_READ)
        self.started = self.now = monotonic()
        self.running = True

    def __dealloc__(self):
        cdef int fd
        cdef Conn *c
        free(self.pend)
        free(self.readable)
        if self.recv_area != NULL:
            munmap(self.recv_area, self.recv_area_size)
        if self.conns != NULL:
            for fd in range(self.conns_cap):
                c = self.conns[fd]
                if c != NULL:
                    close(c.fd)
                    sq_clear(&c.q)
                    free(c.subs)
                    free(c)
            free(self.conns)
        index_free(&self.index)
        accounts_free(&self.accounts)
        free(self.recips)
        free(self.touched)
        free(self.blockers)
        free(self.closing)
        free(self.paused)
        free(self.scratch)
        free(self.allowed_uids)
        if self.spare_fd >= 0:
            close(self.spare_fd)

    # ---- the loop ----------------------------------------------------------

    def run(self):
        """Serve until stopped; returns the stop reason. An exception a
        callback raised is raised here, after the turn it was raised in."""
        cdef int n
        # running is set at construction, not here: a stop() from a signal
        # handler that ran before run() must not be forgotten.
        if self.tick_interval > 0:
            self.next_tick = monotonic() + self.tick_interval
        while self.running:
            n = self.poller.poll(self.poll_timeout())
            if n == 0:
                self.signalled = True   # EINTR, or a signal raced the poll
            self.now = monotonic()
            self.dispatch(n)
            self.before_sleep()
            self.housekeeping()
            self.raise_callback_error()
            if self.signalled:
                self.signalled = False
                PyErr_CheckSignals()
        return self.stop_reason

    def stop(self, reason="stopped"):
        """Make run() return after the current loop turn."""
        self.running = False
        if self.stop_reason is None:
            self.stop_reason = reason

    def close(self):
        """Disconnect every client (reason 'shutdown'), logging each."""
        cdef int fd
        self.flush_pending()
        for fd in range(self.conns_cap):
            if self.conns[fd] != NULL:
                self.mark_closing(self.conns[fd], R_SHUTDOWN, None)
        self.finalize_closing()
        self.raise_callback_error()

    cdef int poll_timeout(self) noexcept:
        cdef int timeout = -1
        cdef double wait
        if self.tick_interval > 0:
            wait = self.next_tick - monotonic()
            timeout = 0 if wait <= 0 else <int>(wait * 1000) + 1
        if self.nblocking and (timeout < 0 or timeout > 100):
            timeout = 100       # re-check block timeouts
        return timeout

    cdef int dispatch(self, int n) except -1:
        cdef int i, fd, mask, nready = 0
        cdef Conn *c
        cdef char drain[64]
        for i in range(n):
            fd = self.poller.fired[i].fd
            mask = self.poller.fired[i].mask
            if fd == self.listen_fd:
                self.accept_clients()
                continue
            if fd == self.wakeup_fd:
                while read(fd, drain, sizeof(drain)) > 0:
                    pass
                self.signalled = True
                continue
            if fd >= self.conns_cap:
                continue
            c = self.conns[fd]
            if c == NULL or c.closing:
                continue
            if mask & EV_WRITE:
                self.drain(c)
            if mask & EV_READ and not c.closing:
                if self.readable != NULL:
                    self.readable[nready].fd = fd
                    self.readable[nready].mask = mask
                    nready += 1
                else:
                    self.on_readable(c, mask)
        if nready:
            self.read_rounds(nready)
        return 0

    cdef int before_sleep(self) except -1:
        # The turn's deliveries, from every connection read, go out now:
        # one sendmmsg per recipient per turn.
        if self.ntouched or self.nslots:
            self.flush_pending()
        if self.nclosing:
            self.finalize_closing()
        if self.nblocking:
            self.check_block_timeouts()
            if self.nclosing:
                self.finalize_closing()
        return 0

    cdef int housekeeping(self) except -1:
        if not (self.tick_interval > 0 and self.now >= self.next_tick):
            return 0
        self.next_tick = self.now + self.tick_interval
        if self.disconnects != self.trimmed_at:
            # Clients left: hand the memory they used back to the system,
            # so RSS follows the load down after a churn.
            self.trimmed_at = self.disconnects
            malloc_trim(0)
        self.release_buffers()
        if self.on_tick is not None:
            try:
                self.on_tick()
            except BaseException as err:
                self.keep_callback_error(err)
        return 0

    cdef int raise_callback_error(self) except -1:
        err = self.callback_error
        if err is not None:
            self.callback_error = None
            raise err
        return 0

    # ---- buffers -----------------------------------------------------------

    cdef int release_buffers(self) except -1:
        if self.recv_high > 65536:
            # Large packets touched many receive pages: let them go (they
            # read back as zeros, and are written before use).
            madvise(self.recv_area, self.recv_area_size, MADV_DONTNEED)
            self.recv_high = 0
        return 0

    # ---- receiving ---------------------------------------------------------

    cdef int on_readable(self, Conn *c, int mask) except -1:
        cdef int n, i
        cdef uint32_t base, room, want
        if self.nslots + RECV_BATCH_MIN > self.turn_slots or (
                self.nblockers and self.may_block_bus()):
            self.flush_pending()
        if not self.before_read(c, mask):
            return 0
        base = self.nslots
        room = self.turn_slots - base
        want = read_want(c, room)
        n = recvmmsg(c.fd, &self.rhdrs[base], want, MSG_DONTWAIT, NULL)
        if n < 0:
            if errno == EAGAIN or errno == EINTR:
                return 0
            return self.recv_failed(c, errno)
        note_read(c, want, n)
        self.nslots = base + n
        self.batch_pend = self.npend
        for i in range(n):
            if not self.take_packet(c, mask, base + i, self.rhdrs[base + i].msg_len,
                                    self.rhdrs[base + i].msg_hdr.msg_flags & MSG_TRUNC):
                break
        self.batch_pend = -1
        return 0

    cdef bint before_read(self, Conn *c, int mask) except -1:
        if self.nblocking:
            # A peer that hung up can never read its queue: drop it, so a dead
            # client cannot hold the bus. Its unread input waits, like every
            # publisher's, until the bus is released.
            if mask & EV_HUP and not c.write_dead:
                self.stop_writing(c)
            if self.nblocking:
                self.pause(c)
                return False
        return True

    cdef int recv_failed(self, Conn *c, int err) except -1:
        if err == ECONNRESET:
            # The client closed with deliveries still unread in its socket.
            # The kernel says so before the packets it sent that are still
            # queued here, and forgets it once said: those were sent, so
            # they are read and delivered up to the EOF. Nothing can be
            # written to it any more.
            if not c.write_dead:
                self.stop_writing(c)
            return 0
        return self.mark_closing(c, R_ERROR, f"recv: {os.strerror(err)}")

    cdef bint take_packet(self, Conn *c, int mask, int slot, size_t length,
                          bint truncated) except -1:
        cdef char probe
        cdef ssize_t r
        if length > self.recv_high:
            self.recv_high = length
        if length > self.max_message or truncated:
            self.mark_closing(c, R_OVERSIZE, f"packet larger than {self.max_message} bytes")
            return False
        if length == 0:
            # EOF, or an empty packet: an empty packet from a live peer
            # leaves the socket without data (EAGAIN) or with more.
            r = recv(c.fd, &probe, 1, MSG_DONTWAIT | MSG_PEEK)
            if (mask & EV_HUP) or r == 0:
                self.mark_closing(c, R_EOF,
                                  "closed with unread deliveries" if c.write_dead else None)
            else:
                self.mark_closing(c, R_PROTOCOL, "empty packet")
            return False
        self.handle_packet(c, slot, length)
        return not c.closing

    cdef int read_rounds(self, int n) except -1:
        """Reads readable[0:n] as on_readable reads one connection, in
        rounds of at most RECV_BATCH packets, one recv_batch each. The flush
        on_readable may make before a read comes before each round, so a
        reader in a block mode still passes its limit by at most
        RECV_BATCH packets."""
        cdef int i = 0, k, j, nops, nround, fd, mask
        cdef uint32_t base, room, want
        cdef Conn *c
        cdef int round_fd[RECV_BATCH]
        cdef int round_mask[RECV_BATCH]
        cdef int round_first[RECV_BATCH]
        cdef int round_want[RECV_BATCH]
        while i < n:
            if self.nslots + RECV_BATCH_MIN > self.turn_slots or (
                    self.nblockers and self.may_block_bus()):
                self.flush_pending()
            base = self.nslots
            nops = 0
            nround = 0
            while i < n and nops < RECV_BATCH:
                fd = self.readable[i].fd
                mask = self.readable[i].mask
                c = self.conns[fd]
                if c == NULL or c.closing:
                    i += 1
                    continue
                room = self.turn_slots - base - nops
                if room < RECV_BATCH_MIN:
                    break           # the next round flushes first
                if not self.before_read(c, mask):
                    i += 1
                    continue
                want = read_want(c, room if room < <uint32_t>(RECV_BATCH - nops)
                                 else <uint32_t>(RECV_BATCH - nops))
                for j in range(nops, nops + <int>want):
                    self.rops[j].fd = fd
                    self.rops[j].buf = <char *>self.riov[base + j].iov_base
                    self.rops[j].len = <uint32_t>self.riov[base + j].iov_len
                round_fd[nround] = fd
                round_mask[nround] = mask
                round_first[nround] = nops
                round_want[nround] = want
                nround += 1
                nops += want
                i += 1
            if nops == 0:
                continue
            self.poller.recv_batch(self.rops, nops)
            # Slots a receive left empty stay unused until the flush.
            self.nslots = base + nops
            for k in range(nround):
                c = self.conns[round_fd[k]]
                if c != NULL:
                    self.take_batch(c, round_mask[k], base, round_first[k], round_want[k])
        return 0

    cdef int take_batch(self, Conn *c, int mask, uint32_t base, int first, int want) except -1:
        """c's receives rops[first:first + want], into the slots from base + first."""
        cdef int j, res, got = 0
        self.batch_pend = self.npend
        for j in range(first, first + want):
            if c.closing:
                # What a closing connection sent goes with it, read or not.
                break
            res = self.rops[j].res
            if res < 0:
                if res == -EAGAIN or res == -EINTR:
                    continue
                self.recv_failed(c, -res)
                if c.closing:
                    break
                continue        # ECONNRESET: the receives after it read on
            got += 1
            self.rhdrs[base + j].msg_len = <unsigned int>res
            if not self.take_packet(c, mask, base + j, <size_t>res, False):
                break
        self.batch_pend = -1
        note_read(c, want, got)
        return 0

    cdef bint may_block_bus(self) noexcept:
        """Whether flushing the turn could make a recipient in a block mode
        stop the bus: then the flush comes before another connection is
        read, so the bus stops where it did with a flush per batch. pend_bytes
        bounds what the flush can add to any queue, account or the total."""
        cdef uint32_t i
        cdef Conn *c
        cdef PacketStats *ps = get_packet_stats()
        for i in range(self.nblockers):
            c = self.blockers[i]
            if c.soft == MODE_BLOCK or (
                    c.q.bytes + self.pend_bytes > self.queue_max_bytes or
                    c.q.live + <uint64_t>self.npend > self.queue_max_msgs or
                    c.acct.queued_bytes + self.pend_bytes > c.acct.max_queued_bytes or
                    ps.bytes + self.pend_bytes > self.total_max_bytes):
                return True
        return False

    cdef int handle_packet(self, Conn *c, int slot, size_t n) except -1:
        cdef ParsedPacket p
        cdef const char *buf = <const char *>self.riov[slot].iov_base
        cdef int verb = parse_packet(buf, n, &p)
        if verb == VERB_MSG:
            return self.publish(c, slot, p.key, p.key_len, n)
        if verb == VERB_SUB:
            return self.subscribe(c, p.key, p.key_len)
        if verb == VERB_UNSUB:
            return self.unsubscribe(c, p.key, p.key_len)
        if verb == VERB_CMSG:
            if c.link and p.key_len > 5 and memcmp(p.key, b"link/", 5) == 0:
                return self.link_control(p.key, p.key_len, p.payload, p.payload_len)
            return self.control(c, p.key, p.key_len)
        head = buf[:n if n < 24 else 24]
        return self.mark_closing(c, R_PROTOCOL, f"malformed packet {head!r}")

    cdef int publish(self, Conn *c, int slot, const char *key, size_t klen, size_t n) except -1:
        cdef FanOut f
        cdef CredForm form
        cdef int check = KEY_OK
        cdef uint32_t i
        f.is_cred = False
        if klen and memchr(key, b'!', klen) != NULL:
            if is_cred_key(key, klen):
                if parse_cred_form(key, klen, False, &form) < 0:
                    return self.mark_closing(c, R_BANG, f"malformed !/cred/ key {text(key, klen)!r}")
                f.is_cred = True
                f.gid = form.gid
                f.uid = form.uid
                f.pid = form.pid
                check = check_rest(key + form.prefix_len, klen - form.prefix_len, False)
            else:
                check = check_rest(key, klen, False)
            if check != KEY_OK:
                return self.mark_closing(c, R_BANG, f"reserved '!' in key {text(key, klen)!r}")
        c.counts.msgs_in += 1
        c.counts.bytes_in += n
        self.tot.msgs_in += 1
        self.tot.bytes_in += n
        self.seq += 1
        self.batch_seqs[slot] = self.seq
        f.seq = self.seq
        f.sender = c
        f.recips = self.recips
        f.n = 0
        index_match(&self.index, key, klen, fan_one, &f)
        if f.is_cred:
            self.match_canonical(key, klen, &form, &f)
        for i in range(f.n):
            self.pend_add(f.recips[i], slot, NULL)
        if self.log_messages > 0:
            self.sample(c, key, klen, n, f.n)
        return 0

    cdef int match_canonical(self, const char *key, size_t klen, CredForm *form,
                             FanOut *f) except -1:
        """Subscriptions store !/cred/ numbers without leading zeros, so a
        key spelling them with zeros ("!/cred/007/...") is matched again in
        that form: both spellings name the same client. Connections already
        picked are not picked twice."""
        cdef char canon[CRED_CANONICAL_MAX]
        cdef size_t clen = cred_canonical_prefix(form, canon)
        cdef size_t rest = klen - form.prefix_len
        cdef char *alt
        if clen == form.prefix_len and memcmp(canon, key, clen) == 0:
            return 0
        alt = <char *>malloc(clen + rest)
        if alt == NULL:
            raise MemoryError()
        memcpy(alt, canon, clen)
        memcpy(alt + clen, key + form.prefix_len, rest)
        index_match(&self.index, alt, clen + rest, fan_one, f)
        free(alt)
        return 0

    cdef int sample(self, Conn *c, const char *key, size_t klen, size_t n,
                    uint32_t fanout) except -1:
        """Hand one message in 1/log_messages to on_message (xorshift draw)."""
        cdef double draw
        self.rng ^= self.rng << 13
        self.rng ^= self.rng >> 7
        self.rng ^= self.rng << 17
        draw = (self.rng >> 11) * (1.0 / 9007199254740992.0)
        if draw < self.log_messages and self.on_message is not None:
            try:
                self.on_message(c.id, c.pid, c.uid, key[:klen], n, fanout)
            except BaseException as err:
                self.keep_callback_error(err)
        return 0

    # ---- delivering --------------------------------------------------------

    cdef int reply(self, Conn *c, bytes packet) except -1:
        """Queue a broker-made packet behind c's pending deliveries."""
        cdef Packet *p = packet_new(packet, len(packet), 0)
        if p == NULL:
            raise MemoryError()
        p.refs = 1          # released when the pending entry is consumed
        p.reply = 1
        return self.pend_add(c, -1, p)

    cdef int pend_add(self, Conn *c, int32_t slot, Packet *pkt) except -1:
        cdef Pending *e
        cdef Pending *grown
        cdef int32_t idx = self.npend
        self.pend_bytes += pkt.len if pkt != NULL else self.rhdrs[slot].msg_len
        if idx == self.pend_cap:
            grown = <Pending *>realloc(self.pend, 2 * self.pend_cap * sizeof(Pending))
            if grown == NULL:
                raise MemoryError()
            self.pend = grown
            self.pend_cap *= 2
        e = &self.pend[idx]
        e.next = -1
        e.slot = slot
        e.pkt = pkt
        self.npend += 1
        if c.pend_head < 0:
            c.pend_head = idx
            self.touched[self.ntouched] = c
            self.ntouched += 1
            if c.soft == MODE_BLOCK or c.hard == MODE_BLOCK:
                self.blockers[self.nblockers] = c
                self.nblockers += 1
        else:
            self.pend[c.pend_tail].next = idx
        c.pend_tail = idx
        return 0

    cdef int flush_pending(self) except -1:
        """Send every delivery collected since the last flush, one sendmmsg
        per recipient, then let go of the receive slots and their packets."""
        cdef uint32_t i
        self.flush_deliveries()
        for i in range(self.nslots):
            if self.batch_pkts[i] != NULL:
                packet_release(self.batch_pkts[i])
                self.batch_pkts[i] = NULL
        self.nslots = 0
        return 0

    cdef int flush_deliveries(self) except -1:
        """Send every pending delivery, one sendmmsg per recipient; the
        receive slots stay as they are."""
        cdef uint32_t i
        cdef Conn *c
        self.flushing = True
        try:
            for i in range(self.ntouched):
                c = self.touched[i]
                self.flush_conn(c)
                c.pend_head = -1
                c.pend_tail = -1
        finally:
            self.flushing = False
        self.ntouched = 0
        self.nblockers = 0
        self.npend = 0
        self.pend_bytes = 0
        if self.batch_pend > 0:
            self.batch_pend = 0     # flushed in the middle of a batch (stats)
        return 0

    cdef int flush_conn(self, Conn *c) except -1:
        """Write c's pending chain; what cannot be written goes to enqueue."""
        cdef int32_t e = c.pend_head
        cdef uint32_t k
        cdef int sent, i
        cdef Pending *p
        if not c.closing and not c.write_dead and c.q.live == 0:
            # Nothing queued ahead: write straight from the receive buffers.
            while e >= 0:
                k = 0
                while e >= 0 and k < SEND_BATCH:
                    p = &self.pend[e]
                    if p.slot >= 0:
                        self.siov[k].iov_base = self.riov[p.slot].iov_base
                        self.siov[k].iov_len = self.rhdrs[p.slot].msg_len
                        self.sreply[k] = 0
                    else:
                        self.siov[k].iov_base = p.pkt.data
                        self.siov[k].iov_len = p.pkt.len
                        self.sreply[k] = p.pkt.reply
                    self.sent_entries[k] = e
                    k += 1
                    e = p.next
                sent = self.send_prepared(c, k)
                for i in range(sent):
                    p = &self.pend[self.sent_entries[i]]
                    if p.pkt != NULL:
                        packet_release(p.pkt)
                        p.pkt = NULL
                if <uint32_t>sent < k:
                    e = self.sent_entries[sent]     # the rest takes the queue path
                    break
        # Whatever could not be written now goes to the flood-control policy.
        while e >= 0:
            p = &self.pend[e]
            if c.closing or c.write_dead:
                self.count_drops_disconnect(c, 1)
            else:
                self.enqueue(c, p)
            if p.pkt != NULL:
                packet_release(p.pkt)
                p.pkt = NULL
            e = p.next
        return 0

    cdef int send_prepared(self, Conn *c, uint32_t k) except -1:
        """One sendmmsg of siov[0:k] to c, counted (deliveries apart from
        the sreply-flagged control replies). Returns how many were sent: 0
        when the socket is full, or after a failure was handled."""
        cdef int sent = sendmmsg(c.fd, self.shdrs, k, MSG_DONTWAIT | MSG_NOSIGNAL)
        cdef int i, replies = 0
        cdef uint64_t nbytes = 0
        if sent < 0:
            if errno != EAGAIN:
                self.send_failed(c, errno)
            return 0
        for i in range(sent):
            if self.sreply[i]:
                replies += 1
            else:
                nbytes += self.siov[i].iov_len
        c.counts.msgs_out += sent - replies
        c.counts.bytes_out += nbytes
        c.counts.replies_out += replies
        self.tot.msgs_out += sent - replies
        self.tot.bytes_out += nbytes
        self.tot.replies_out += replies
        return sent

    cdef int enqueue(self, Conn *c, Pending *e) except -1:
        """Apply c's soft and hard modes (policy.flood_action) to a delivery
        that would block."""
        cdef Packet *pkt = e.pkt
        cdef uint64_t length = pkt.len if pkt != NULL else self.rhdrs[e.slot].msg_len
        cdef PacketStats *ps = get_packet_stats()
        cdef bint over = (c.q.bytes + length > self.queue_max_bytes or
                          c.q.live + 1 > self.queue_max_msgs or
                          c.acct.queued_bytes + length > c.acct.max_queued_bytes or
                          (pkt == NULL and self.batch_pkts[e.slot] == NULL and
                           ps.bytes + length > self.total_max_bytes))
        cdef int action = flood_action(c.soft, c.hard, c.blocking,
                                       pkt != NULL and pkt.reply, over)
        if action == FLOOD_DROP_SOFT:
            c.counts.drops_soft += 1
            self.tot.drops_soft += 1
            return 0
        if action == FLOOD_CLOSE_SOFT or action == FLOOD_CLOSE_HARD:
            self.count_drops_disconnect(c, 1)
            return self.mark_closing(c, R_FLOOD, "would block (blocking/soft/error)"
                                     if action == FLOOD_CLOSE_SOFT else
                                     "queue limit reached (blocking/hard/error)")
        if action == FLOOD_DROP_HARD:
            c.counts.drops_hard += 1
            self.tot.drops_hard += 1
            return 0
        if over and action == FLOOD_QUEUE_BLOCK:
            self.start_blocking(c)      # over a limit: hold the bus first
        if pkt == NULL:
            pkt = self.shared_packet(e)
        if pkt == NULL or sq_push(&c.q, pkt) < 0:
            c.counts.drops_hard += 1
            self.tot.drops_hard += 1
            return 0
        c.acct.queued_bytes += pkt.len
        if action == FLOOD_QUEUE_BLOCK:
            self.start_blocking(c)
        if c.q.live == 1:
            self.update_interest(c)
        return 0

    cdef Packet *shared_packet(self, Pending *e) noexcept:
        """The refcounted copy of e's receive slot, made once per message
        and shared by every recipient that queues it."""
        cdef Packet *pkt = self.batch_pkts[e.slot]
        if pkt == NULL:
            pkt = packet_new(<const char *>self.riov[e.slot].iov_base,
                             self.rhdrs[e.slot].msg_len, self.batch_seqs[e.slot])
            if pkt != NULL:
                pkt.refs = 1    # the batch's own hold, released by flush_pending
                self.batch_pkts[e.slot] = pkt
        return pkt

    cdef int drain(self, Conn *c) except -1:
        """Write queued packets in c's order, SEND_BATCH per syscall."""
        cdef uint32_t k, i
        cdef int sent
        cdef uint64_t queued
        while c.q.live:
            k = sq_select(&c.q, c.order, self.spos, self.ssel, SEND_BATCH)
            for i in range(k):
                self.siov[i].iov_base = self.ssel[i].data
                self.siov[i].iov_len = self.ssel[i].len
                self.sreply[i] = self.ssel[i].reply
            sent = self.send_prepared(c, k)
            if sent == 0:
                break
            queued = c.q.bytes
            sq_consume(&c.q, self.spos, sent)
            c.acct.queued_bytes -= queued - c.q.bytes
            if <uint32_t>sent < k:
                break
        self.update_interest(c)
        if c.blocking:
            self.maybe_unblock(c)
        return 0

    cdef int send_failed(self, Conn *c, int err) except -1:
        """A peer that went away may still have unread packets for us: stop
        writing to it and read it to EOF; other errors close it now."""
        if err == EPIPE or err == ECONNRESET:
            return self.stop_writing(c)
        return self.mark_closing(c, R_ERROR, f"send: {os.strerror(err)}")

    cdef int stop_writing(self, Conn *c) except -1:
        """Mark c write_dead: its queue is dropped, and so is every later delivery."""
        c.write_dead = 1
        c.acct.queued_bytes -= c.q.bytes
        self.count_drops_disconnect(c, sq_clear(&c.q))
        if c.blocking:
            self.maybe_unblock(c)
        return self.update_interest(c)

    # ---- accepting ---------------------------------------------------------

    cdef int accept_clients(self) except -1:
        cdef int fd, _attempt
        cdef ucred cred
        cdef socklen_t len_
        for _attempt in range(ACCEPT_BATCH):
            fd = accept4(self.listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)
            if fd < 0:
                if errno == EAGAIN:
                    return 0
                if errno == EINTR or errno == ECONNABORTED:
                    continue
                if errno == EMFILE or errno == ENFILE or errno == ENOBUFS or errno == ENOMEM:
                    return self.fd_exhausted(errno)
                self.emit(ACCEPT_ERROR, {"errno": errno})
                return 0
            len_ = sizeof(cred)
            if getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len_) < 0:
                close(fd)
                continue
            self.admit(fd, &cred)
        return 0

    cdef int admit(self, int fd, ucred *cred) except -1:
        """Take fd on as a connection, or close it with a disconnect record."""
        cdef Conn *c
        cdef Account *acct = NULL
        cdef int reason = R_USER
        detail = self.refuse_peer(cred)
        if detail is None and fd >= self.poller.fd_limit():
            reason = R_FD_LIMIT
            detail = f"fd {fd} is beyond what the {self.poller.name} backend can watch"
        if detail is None:
            # sbusd's own uid has no per-uid budgets (docs/security.md).
            exempt = cred.uid == self.own_uid
            acct = account_get(&self.accounts, cred.uid,
                               UNLIMITED if exempt else self.user_max_connections,
                               UNLIMITED if exempt else self.user_sub_max_bytes,
                               UNLIMITED if exempt else self.user_queue_max_bytes)
            if acct == NULL:
                close(fd)
                raise MemoryError()
            if acct.conns >= acct.max_conns:
                reason = R_CONN_BUDGET
                detail = (f"uid {cred.uid} has {acct.conns} connections "
                          f"(--user-max-connections {acct.max_conns})")
                self.budgets.conns_refused += 1
                account_drop_if_idle(&self.accounts, acct)
        if detail is not None:
            close(fd)
            self.emit(CLIENT_DISCONNECT, report.refused(
                self.next_id, cred.pid, cred.uid, cred.gid, reason, detail))
            self.next_id += 1
            return 0
        # Big enough to deliver the largest packet the bus accepts.
        if setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &self.sndbuf, sizeof(int)) < 0:
            setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &self.sndbuf, sizeof(int))
        c = self.add_conn(fd, cred)
        c.acct = acct
        acct.conns += 1
        if self.nblocking:
            self.pause(c)
        else:
            self.update_interest(c)
        self.emit(CLIENT_CONNECT, report.ident(c))
        if self.link != NULL:
            self.link_note(b"CMSG link/conn\0%d/%d/%d" % (c.gid, c.uid, c.pid))
        return 0

    cdef Conn *add_conn(self, int fd, ucred *cred) except NULL:
        """A new record for fd in the table, in the broker's default modes."""
        cdef Conn *c
        if fd >= self.conns_cap:
            self.grow_table(fd)
        self.grow_lists(self.nconns + 1)
        c = <Conn *>calloc(1, sizeof(Conn))
        if c == NULL:
            close(fd)
            raise MemoryError()
        c.fd = fd
        c.id = self.next_id
        self.next_id += 1
        c.pid = cred.pid
        c.uid = cred.uid
        c.gid = cred.gid
        c.soft = self.soft
        c.hard = self.hard
        c.order = self.order
        c.echo = 1
        c.connected_at = self.now
        c.pend_head = -1
        c.pend_tail = -1
        self.conns[fd] = c
        self.nconns += 1
        self.connects += 1
        self.had_client = True
        return c

    cdef str refuse_peer(self, ucred *cred):
        """Why this peer may not connect, or None. -u lists the uids allowed;
        an abstract socket has no file mode, so the mode's meaning is
        enforced here: owner (and root), then group, then others."""
        cdef int k
        cdef int bits
        if self.n_allowed:
            for k in range(self.n_allowed):
                if self.allowed_uids[k] == cred.uid:
                    break
            else:
                return f"uid {cred.uid} is not allowed (-u)"
        if self.access_mode >= 0 and cred.uid != 0 and cred.uid != self.own_uid:
            bits = (self.access_mode >> 3) & 7 if cred.gid == self.own_gid else self.access_mode & 7
            if not bits:
                return (f"uid {cred.uid} gid {cred.gid} may not connect to a socket "
                        f"of mode {self.access_mode:04o}")
        return None

    cdef int fd_exhausted(self, int err) except -1:
        """Out of descriptors: give up the spare one to accept and drop the
        waiting connection, so a storm neither spins the loop nor stalls it;
        if even that fails, stop accepting until a client leaves."""
        cdef int fd
        if not self.fd_exhausted_logged:
            self.fd_exhausted_logged = True
            self.emit(FD_EXHAUSTED, {"errno": err, "connected": self.nconns})
        if self.spare_fd >= 0:
            close(self.spare_fd)
            self.spare_fd = -1
            fd = accept4(self.listen_fd, NULL, NULL, SOCK_CLOEXEC)
            if fd >= 0:
                close(fd)
            self.spare_fd = c_open(b"/dev/null", O_RDONLY | O_CLOEXEC)
            if self.spare_fd >= 0:
                return 0
        if not self.accept_paused:
            self.accept_paused = True
            self.poller.set(self.listen_fd, 0)
            self.emit(ACCEPT_PAUSED, {"connected": self.nconns})
        return 0

    cdef int grow_table(self, int fd) except -1:
        cdef int k = self.conns_cap * 2 if self.conns_cap else 1024
        cdef Conn **grown
        while k <= fd:
            k *= 2
        grown = <Conn **>realloc(self.conns, k * sizeof(Conn *))
        if grown == NULL:
            close(fd)
            raise MemoryError()
        memset(grown + self.conns_cap, 0, (k - self.conns_cap) * sizeof(Conn *))
        self.conns = grown
        self.conns_cap = k
        return 0

    cdef int grow_lists(self, uint32_t need) except -1:
        """Scratch lists hold at most one entry per connection; size them so
        the hot path never has to check."""
        cdef uint32_t cap = self.list_cap
        if need <= cap:
            return 0
        while cap < need:
            cap = cap * 2 if cap else 64
        self.recips = <Conn **>realloc(self.recips, cap * sizeof(Conn *))
        self.touched = <Conn **>realloc(self.touched, cap * sizeof(Conn *))
        self.blockers = <Conn **>realloc(self.blockers, cap * sizeof(Conn *))
        self.closing = <Conn **>realloc(self.closing, cap * sizeof(Conn *))
        self.paused = <Conn **>realloc(self.paused, cap * sizeof(Conn *))
        if (self.recips == NULL or self.touched == NULL or self.blockers == NULL or
                self.closing == NULL or self.paused == NULL):
            raise MemoryError()
        self.list_cap = cap
        return 0

    # ---- subscriptions -----------------------------------------------------

    cdef int subscribe(self, Conn *c, const char *pat, size_t n) except -1:
        cdef size_t stored = 0
        cdef size_t cost
        cdef int refusal
        cdef Sub *sub
        cdef Sub **grown
        cdef uint32_t cap
        if n > self.max_pattern:
            return self.refuse_pattern(c, REFUSE_PATTERN_TOO_LONG, pat, n, R_LIMIT,
                                       f"pattern longer than {self.max_pattern} bytes")
        if c.nsubs >= self.max_subscriptions:
            return self.refuse_pattern(c, REFUSE_TOO_MANY, pat, n, R_LIMIT,
                                       f"more than {self.max_subscriptions} subscriptions")
        if self.upstream_cred is not None:
            stored = self.nested_prefix(pat, n)
            pat += stored
            n -= stored
        if c.link and is_cred_key(pat, n):
            refusal = link_pattern(pat, n, self.scratch, self.scratch_cap, &stored)
        else:
            refusal = normalise_pattern(pat, n, c.gid, c.uid, c.pid, self.scratch,
                                        self.scratch_cap, &stored)
        if refusal != PATTERN_OK:
            logged, reason, detail = _PATTERN_REFUSALS[refusal]
            return self.refuse_pattern(c, logged, pat, n, reason, detail)
        cost = pattern_cost(self.scratch, stored)
        if self.over_sub_budget(c, cost, pat, n):
            return 0
        if c.nsubs == c.subs_cap:
            cap = c.subs_cap * 2 if c.subs_cap else 4
            grown = <Sub **>realloc(c.subs, cap * sizeof(Sub *))
            if grown == NULL:
                return self.mark_closing(c, R_ERROR, "out of memory")
            c.subs = grown
            c.subs_cap = cap
        sub = index_add(&self.index, c, self.scratch, stored)
        if sub == NULL:
            return self.mark_closing(c, R_ERROR, "out of memory")
        sub.owner_pos = c.nsubs
        c.subs[c.nsubs] = sub
        c.nsubs += 1
        c.sub_bytes += cost
        c.acct.sub_bytes += cost
        self.budgets.sub_bytes += cost
        self.emit(SUBSCRIBE, report.subscription(c, self.scratch, stored, None))
        if self.link != NULL and c != self.link:
            self.link_note(b"CMSG link/sub\0" + self.scratch[:stored])
        return 0

    cdef int refuse_pattern(self, Conn *c, str refusal, const char *pat, size_t n,
                            int reason, str detail) except -1:
        """Log a SUB refused for ``refusal`` (logschema's word) and close the
        connection that sent it for ``reason``."""
        self.emit(SUBSCRIBE, report.subscription(c, pat, n, refusal))
        return self.mark_closing(c, reason, detail)

    cdef int over_sub_budget(self, Conn *c, size_t cost, const char *pat,
                             size_t n) except -1:
        """Refuse a SUB whose pattern would take c, its uid or the broker past
        a subscription-bytes budget: log it, count it, close c."""
        if c.sub_bytes + cost > self.sub_max_bytes:
            logged, used, limit, flag = (REFUSE_SUB_BUDGET_CONNECTION, c.sub_bytes,
                                         self.sub_max_bytes, "--sub-max-bytes")
        elif c.acct.sub_bytes + cost > c.acct.max_sub_bytes:
            logged, used, limit, flag = (REFUSE_SUB_BUDGET_USER, c.acct.sub_bytes,
                                         c.acct.max_sub_bytes, "--user-sub-max-bytes")
        elif self.budgets.sub_bytes + cost > self.total_sub_max_bytes:
            logged, used, limit, flag = (REFUSE_SUB_BUDGET_TOTAL, self.budgets.sub_bytes,
                                         self.total_sub_max_bytes, "--total-sub-max-bytes")
        else:
            return 0
        self.budgets.subs_refused += 1
        self.refuse_pattern(c, logged, pat, n, R_SUB_BUDGET,
                            f"pattern of {cost} bytes over {flag} {limit} ({used} in use)")
        return 1

    cdef void drop_sub(self, Conn *c, Sub *sub) noexcept:
        cdef size_t cost = pattern_cost(sub.pattern, sub.len)
        c.sub_bytes -= cost
        c.acct.sub_bytes -= cost
        self.budgets.sub_bytes -= cost
        index_remove(&self.index, sub)

    cdef int unsubscribe(self, Conn *c, const char *pat, size_t n) except -1:
        cdef size_t stored = 0
        cdef int refusal
        cdef uint32_t i
        cdef Sub *sub
        cdef Sub *last
        if self.upstream_cred is not None:
            stored = self.nested_prefix(pat, n)
            pat += stored
            n -= stored
        if c.link and is_cred_key(pat, n):
            refusal = link_pattern(pat, n, self.scratch, self.scratch_cap, &stored)
        else:
            refusal = normalise_pattern(pat, n, c.gid, c.uid, c.pid, self.scratch,
                                        self.scratch_cap, &stored)
        if refusal == PATTERN_BANG_MISUSE:
            # as in SUB; a pattern refused for its credentials was simply
            # never stored, so it is not found
            return self.mark_closing(c, R_BANG, "reserved '!' in pattern")
        if refusal == PATTERN_OK:
            i = c.nsubs
            while i > 0:        # newest first: the usual case
                i -= 1
                sub = c.subs[i]
                if sub.len == stored and memcmp(sub.pattern, self.scratch, stored) == 0:
                    c.nsubs -= 1
                    if i != c.nsubs:
                        last = c.subs[c.nsubs]
                        c.subs[i] = last
                        last.owner_pos = i
                    self.drop_sub(c, sub)
                    self.emit(UNSUBSCRIBE, report.subscription(c, pat, n, None))
                    if self.link != NULL and c != self.link:
                        self.link_note(b"CMSG link/unsub\0" + self.scratch[:stored])
                    return 0
        self.emit(UNSUBSCRIBE, report.subscription(c, pat, n, REFUSE_NOT_SUBSCRIBED))
        return 0

    # ---- the upstream link --------------------------------------------------

    def attach_link(self, int fd):
        """Take fd (one end of a socketpair) on as the upstream link: it
        receives every publish its patterns match, private keys included,
        never its own publishes back, and a control message for every
        connection, disconnection, subscription and unsubscription of the
        others (link/conn, link/gone, link/sub, link/unsub), starting with
        those that exist now. It waits for no one: soft queue, hard block."""
        cdef ucred cred
        cdef Conn *c
        cdef Conn *other
        cdef int k
        cdef uint32_t j
        if self.link != NULL:
            raise ValueError("the broker has an upstream link already")
        cred.pid = os.getpid()
        cred.uid = self.own_uid
        cred.gid = self.own_gid
        if setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &self.sndbuf, sizeof(int)) < 0:
            setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &self.sndbuf, sizeof(int))
        c = self.add_conn(fd, &cred)
        c.acct = account_get(&self.accounts, cred.uid, UNLIMITED, UNLIMITED, UNLIMITED)
        if c.acct == NULL:
            raise MemoryError()
        c.acct.conns += 1
        c.link = 1
        c.echo = 0
        c.soft = MODE_QUEUE
        c.hard = MODE_BLOCK
        self.link = c
        self.link_notes = True
        self.upstream_state = {"state": "starting"}
        self.update_interest(c)
        self.emit(CLIENT_CONNECT, report.ident(c))
        for k in range(self.conns_cap):
            other = self.conns[k]
            if other == NULL or other == c or other.closing:
                continue
            self.link_note(b"CMSG link/conn\0%d/%d/%d" % (other.gid, other.uid, other.pid))
            for j in range(other.nsubs):
                self.link_note(b"CMSG link/sub\0" +
                               other.subs[j].pattern[:other.subs[j].len])
        self.flush_pending()
        return None

    cdef int link_note(self, bytes packet) except -1:
        if self.link_notes and not self.link.closing:
            self.reply(self.link, packet)
        return 0

    cdef int claim_link(self, Conn *c) except -1:
        """CMSG link/attach: a client of the broker's own uid (or root) takes
        the link place, free on a broker without --upstream. Like the leaf's
        link it then receives every private key its patterns match and may set
        the nesting prefix (link/identity); it keeps its own flood modes and is
        told nothing of the others (sbus bridge --private, docs/bridge.md).
        Answered "ok" or "refused: why"."""
        if c.link:
            return self.reply(c, b"CMSG link/attach\0ok")
        if c.uid != 0 and c.uid != self.own_uid:
            return self.reply(c, b"CMSG link/attach\0refused: only the broker's own uid "
                                 b"or root may take the link place")
        if self.link != NULL:
            return self.reply(c, b"CMSG link/attach\0refused: the broker has a link already "
                                 b"(an upstream, or another bridge)")
        c.link = 1
        self.link = c
        self.link_notes = False
        return self.reply(c, b"CMSG link/attach\0ok")

    cdef int link_control(self, const char *key, size_t n, const char *payload,
                          size_t plen) except -1:
        """What the link tells the broker: its credentials upstream
        (link/identity), a record for the log (link/log: JSON with "event"),
        its state for stats (link/state: JSON)."""
        body = payload[:plen] if payload != NULL else b""
        if key_is(key, n, b"link/attach", 11):
            return self.claim_link(self.link)
        if key_is(key, n, b"link/identity", 13):
            self.upstream_cred = body if body.startswith(b"!/cred/") else None
            return 0
        try:
            fields = json.loads(body)
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            return 0    # the link is ours; a bad report is ignored, never fatal
        if key_is(key, n, b"link/log", 8):
            event = fields.pop("event", None)
            if event in UPSTREAM_EVENTS:    # only the link's own events, by name
                self.emit(event, fields)
        elif key_is(key, n, b"link/state", 10):
            self.upstream_state = fields
        return 0

    cdef size_t nested_prefix(self, const char *pat, size_t n) noexcept:
        """The length of "<upstream credentials>/" when a pattern is in the
        nested form under this leaf's own upstream identity, else 0: the rest
        is then checked against the client as a local pattern."""
        cdef const char *own = self.upstream_cred
        cdef size_t olen = len(self.upstream_cred)
        if n > olen + 7 and memcmp(pat, own, olen) == 0 and pat[olen] == b'/' \
                and memcmp(pat + olen + 1, b"!/cred/", 7) == 0:
            return olen + 1
        return 0

    # ---- control messages --------------------------------------------------

    cdef int control(self, Conn *c, const char *key, size_t n) except -1:
        if key_is(key, n, b"link/attach", 11):
            return self.claim_link(c)
        if key_is(key, n, b"!/cred/whoami", 13):
            if self.upstream_cred is not None:
                return self.reply(c, b"CMSG !/cred/whoami\0%s/!/cred/%d/%d/%d" % (
                    self.upstream_cred, c.gid, c.uid, c.pid))
            return self.reply(c, b"CMSG !/cred/whoami\0!/cred/%d/%d/%d" % (c.gid, c.uid, c.pid))
        if n > 14 and memcmp(key, b"blocking/soft/", 14) == 0:
            mode = key[14:n].decode("latin-1")
            if mode in MODE_NAMES:
                return self.set_mode(c, WHICH_SOFT, MODE_NAMES.index(mode))
        elif n > 14 and memcmp(key, b"blocking/hard/", 14) == 0:
            mode = key[14:n].decode("latin-1")
            if mode in MODE_NAMES and mode != MODE_NAMES[MODE_QUEUE]:
                return self.set_mode(c, WHICH_HARD, MODE_NAMES.index(mode))
        elif n > 6 and memcmp(key, b"order/", 6) == 0:
            mode = key[6:n].decode("latin-1")
            if mode in ORDER_NAMES:
                return self.set_mode(c, WHICH_ORDER, ORDER_NAMES.index(mode))
        elif key_is(key, n, b"echo/on", 7):
            return self.set_mode(c, WHICH_ECHO, 1)
        elif key_is(key, n, b"echo/off", 8):
            return self.set_mode(c, WHICH_ECHO, 0)
        elif key_is(key, n, b"stats", 5):
            # Count the deliveries so far first; the batch being read still
            # points into its receive slots, so they stay.
            self.flush_deliveries()
            snapshot = self.stats()
            body = json.dumps(snapshot, separators=(",", ":")).encode()
            if <size_t>len(body) + 11 > self.max_message:
                snapshot["clients_omitted"] = len(snapshot.pop("clients"))
                body = json.dumps(snapshot, separators=(",", ":")).encode()
            return self.reply(c, b"CMSG stats\0" + body)
        self.cmsgs_ignored += 1
        d = report.ident(c)
        d["key"] = text(key, n)
        self.emit(CMSG_IGNORED, d)
        return 0

    cdef int set_mode(self, Conn *c, int which, int value) except -1:
        if which == WHICH_SOFT:
            c.soft = value
        elif which == WHICH_HARD:
            c.hard = value
        elif which == WHICH_ORDER:
            c.order = value
        else:
            c.echo = value
        if c.blocking:
            self.maybe_unblock(c)
        return 0

    # ---- blocking the bus --------------------------------------------------

    cdef int start_blocking(self, Conn *c) except -1:
        if not c.blocking:
            c.blocking = 1
            c.block_since = self.now
            c.counts.blocks += 1
            self.nblocking += 1
        return 0

    cdef int maybe_unblock(self, Conn *c) except -1:
        if holds_bus(c.soft, c.hard, c.q.live, c.q.bytes, self.queue_max_bytes,
                     self.queue_max_msgs):
            return 0
        return self.stop_blocking(c)

    cdef int stop_blocking(self, Conn *c) except -1:
        c.blocking = 0
        self.nblocking -= 1
        if self.nblocking == 0:
            self.resume_all()
        return 0

    cdef int pause(self, Conn *c) except -1:
        if not c.paused:
            c.paused = 1
            self.paused[self.npaused] = c
            self.npaused += 1
            self.update_interest(c)
        return 0

    cdef int resume_all(self) except -1:
        cdef uint32_t i
        cdef Conn *c
        for i in range(self.npaused):
            c = self.paused[i]
            c.paused = 0
            if not c.closing:
                self.update_interest(c)
        self.npaused = 0
        return 0

    cdef int check_block_timeouts(self) except -1:
        cdef int fd
        cdef Conn *c
        for fd in range(self.conns_cap):
            c = self.conns[fd]
            if c != NULL and c.blocking and not c.closing and \
                    self.now - c.block_since >= self.block_timeout:
                self.mark_closing(c, R_FLOOD,
                                  f"kept the bus blocked for {self.block_timeout:g}s")
        return 0

    cdef int update_interest(self, Conn *c) except -1:
        cdef int mask = 0
        if not c.paused:
            mask |= EV_READ
        if c.q.live:
            mask |= EV_WRITE
        return self.poller.set(c.fd, mask)

    # ---- closing -----------------------------------------------------------

    cdef int mark_closing(self, Conn *c, int reason, detail) except -1:
        if c.closing:
            return 0
        if c.pend_head >= 0 and not self.flushing:
            self.flush_before_close(c)
            if c.closing:
                # The flush closed it (a send failed, or its flood mode
                # closes it when its queue is full): listed once already,
                # it keeps the reason given first.
                c.reason = reason
                if detail is None:
                    self.close_details.pop(c.id, None)
                else:
                    self.close_details[c.id] = detail
                return 0
        c.closing = 1
        c.reason = reason
        if detail is not None:
            self.close_details[c.id] = detail
        self.closing[self.nclosing] = c
        self.nclosing += 1
        return 0

    cdef int flush_before_close(self, Conn *c) except -1:
        """Send c what is pending for it from batches read before the one
        being read now: with a flush after every batch it had those already.
        What the current batch holds for it goes with c, as it always did."""
        cdef int32_t cut = self.batch_pend if self.batch_pend >= 0 else self.npend
        cdef int32_t e = c.pend_head
        cdef int32_t last = -1
        cdef int32_t tail = c.pend_tail
        while e >= 0 and e < cut:     # entries are numbered in the order added
            last = e
            e = self.pend[e].next
        if last < 0:
            return 0
        self.pend[last].next = -1
        self.flushing = True
        try:
            self.flush_conn(c)
        finally:
            self.flushing = False
        c.pend_head = e
        c.pend_tail = tail if e >= 0 else -1
        return 0

    cdef int finalize_closing(self) except -1:
        cdef uint32_t i, j
        cdef Conn *c
        for i in range(self.nclosing):
            c = self.closing[i]
            self.poller.set(c.fd, 0)
            close(c.fd)
            if c == self.link:
                # Nothing forwards for the prefix any more: whoami answers
                # the local form again until a link says who it is.
                self.link = NULL
                self.upstream_cred = None
            elif self.link != NULL:
                for j in range(c.nsubs):
                    self.link_note(b"CMSG link/unsub\0" + c.subs[j].pattern[:c.subs[j].len])
                self.link_note(b"CMSG link/gone\0%d/%d/%d" % (c.gid, c.uid, c.pid))
            for j in range(c.nsubs):
                self.drop_sub(c, c.subs[j])
            free(c.subs)
            c.acct.queued_bytes -= c.q.bytes
            self.count_drops_disconnect(c, sq_clear(&c.q))
            c.acct.conns -= 1
            account_drop_if_idle(&self.accounts, c.acct)
            if c.paused:
                for j in range(self.npaused):
                    if self.paused[j] == c:
                        self.npaused -= 1
                        self.paused[j] = self.paused[self.npaused]
                        break
            self.conns[c.fd] = NULL
            self.nconns -= 1
            self.disconnects += 1
            record = report.disconnect(c, self.close_details.pop(c.id, None), self.now)
            if c.blocking:
                self.stop_blocking(c)
            free(c)
            self.emit(CLIENT_DISCONNECT, record)
        self.nclosing = 0
        self.fd_exhausted_logged = False
        if self.spare_fd < 0:
            # fd_exhausted could not get its spare back while the table was
            # full; descriptors were just freed, so take it again now.
            self.spare_fd = c_open(b"/dev/null", O_RDONLY | O_CLOEXEC)
        if self.accept_paused:
            self.accept_paused = False
            self.poller.set(self.listen_fd, EV_READ)
        if self.auto_close and self.had_client and self.nconns == 0:
            self.stop("auto_close")
        return 0

    cdef void count_drops_disconnect(self, Conn *c, uint64_t n) noexcept:
        c.counts.drops_disconnect += n
        self.tot.drops_disconnect += n

    # ---- reporting ---------------------------------------------------------

    cdef int emit(self, str name, dict fields) except -1:
        if self.on_event is not None:
            try:
                self.on_event(name, fields)
            except BaseException as err:
                self.keep_callback_error(err)
        return 0

    cdef int keep_callback_error(self, object err) except -1:
        """Keep the first exception of the turn; run() raises it after the
        turn, so no batch is left half processed."""
        if self.callback_error is None:
            self.callback_error = err
        return 0

    def totals(self):
        """Broker-wide counters (cumulative since start)."""
        return report.totals(self.conns, self.conns_cap, self.nconns, self.connects,
                             self.disconnects, &self.tot, self.index.nsubs, &self.budgets)

    def stats(self):
        """A snapshot: totals, and counters and modes per connected client."""
        return {"uptime_s": round(monotonic() - self.started, 3), "backend": self.poller.name,
                "totals": self.totals(), "clients": report.entries(self.conns, self.conns_cap),
                "users": self.users(),
                **({"upstream": self.upstream_state} if self.upstream_state is not None else {})}

    def users(self):
        """Each connected uid's usage against its budgets."""
        return report.users(&self.accounts)

    def take_changed_clients(self):
        """Entries, as in stats(), for the clients that connected or changed
        since the last call (see report.take_changed_entries)."""
        return report.take_changed_entries(self.conns, self.conns_cap)

    def take_stats_delta(self):
        """Totals, plus the change of each traffic counter since the last call."""
        totals = self.totals()
        last = self.last_totals or {}
        delta = {k: totals[k] - last.get(k, 0) for k in DELTA_FIELDS}
        self.last_totals = totals
        return totals, delta

    def take_flood_report(self):
        """A flood record per client whose drops or blocks grew since the last
        call (see report.take_flood_records)."""
        return report.take_flood_records(self.conns, self.conns_cap)

    @property
    def backend(self):
        return self.poller.name

    @property
    def backend_fallback(self):
        """Why the backend asked for is not the one running, or None."""
        return self.poller.fallback

    @property
    def client_count(self):
        return self.nconns
