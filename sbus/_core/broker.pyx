# cython: language_level=3
"""The sbus broker: accept, receive, parse, match, fan out, send.

The per-message path is C over C structs: a batch of packets is read with
recvmmsg into fixed slots, each MSG is matched through the first-segment
index, and every recipient gets a ``Pending`` entry pointing at the slot. At
the end of the batch each recipient's deliveries go out in one sendmmsg,
straight from the receive buffers. Only what cannot be sent without blocking
is copied, once per message, into a refcounted Packet that every recipient's
queue shares. Python is called only for lifecycle events, sampled message
records, the periodic tick and control replies.

Clients that misbehave are only *marked* closing; they are torn down at the
end of the loop turn, never while a batch or the fired-event array still
points at them.
"""
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport (errno, EAGAIN, EINTR, ECONNABORTED, ECONNRESET, EPIPE,
                         EMFILE, ENFILE, ENOBUFS, ENOMEM)
from libc.stdint cimport uint8_t, int32_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memchr, memcmp, memcpy, memset
from posix.fcntl cimport open as c_open, O_RDONLY, O_CLOEXEC
from posix.unistd cimport close, read

from sbus._core.includes.sys cimport (
    accept4, getsockopt, setsockopt, recv, recvmmsg, sendmmsg, socklen_t, ucred,
    mmsghdr, iovec, SOL_SOCKET, SO_PEERCRED, SO_SNDBUF, SO_SNDBUFFORCE,
    MSG_DONTWAIT, MSG_NOSIGNAL, MSG_TRUNC, MSG_PEEK, SOCK_NONBLOCK, SOCK_CLOEXEC,
    clock_gettime, timespec, CLOCK_MONOTONIC, malloc_trim,
    mmap, munmap, madvise, MAP_FAILED, PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS,
    MADV_DONTNEED,
)
from sbus._core.index cimport (Index, Sub, index_init, index_free, index_add,
                               index_remove, index_match)
from sbus._core.loop cimport Poller, Fired, EV_READ, EV_WRITE, EV_HUP
from sbus._core.loop import make_poller
from sbus._core.protocol cimport (
    ParsedPacket, parse_packet, VERB_MSG, VERB_SUB, VERB_UNSUB, VERB_CMSG,
    CredForm, parse_cred_form, is_cred_key, check_rest, KEY_OK, KEY_BANG_MISUSE,
    CRED_EMPTY, CRED_CANONICAL_MAX, cred_canonical_prefix,
)
from sbus._core.sendq cimport (Packet, SendQueue, PacketStats, get_packet_stats,
                               packet_new, packet_release, sq_push, sq_select,
                               sq_consume, sq_clear, ORDER_QUEUE, ORDER_STACK,
                               ORDER_RANDOM)

import json

REASONS = ("none", "eof", "error", "protocol_error", "cred_refused", "bang_misuse",
           "user_refused", "flood_error", "oversize", "limit", "shutdown", "fd_limit")
MODES = ("queue", "discard", "block", "error")
ORDERS = ("queue", "stack", "random")
COUNTER_FIELDS = ("msgs_in", "bytes_in", "msgs_out", "bytes_out",
                  "drops_soft", "drops_hard", "drops_disconnect")

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
    """index_match callback: pick each eligible client once per message."""
    cdef FanOut *f = <FanOut *>ctx
    cdef Client *c = <Client *>sub.owner
    if c.stamp == f.seq:
        return
    c.stamp = f.seq
    if c.closing:
        return
    if c == f.sender and not c.echo:
        return
    # A !/cred/G/U/P/ key reaches only G/U/P, whatever pattern matched it.
    # An empty field names no one, so it restricts nothing.
    if f.is_cred and ((f.gid != CRED_EMPTY and c.gid != f.gid) or
                      (f.uid != CRED_EMPTY and c.uid != f.uid) or
                      (f.pid != CRED_EMPTY and c.pid != f.pid)):
        return
    f.recips[f.n] = c
    f.n += 1


cdef str text(const char *s, size_t n):
    return s[:n].decode("utf-8", "backslashreplace")


cdef class Broker:
    """Serve the sbus protocol on an already listening socket.

    ``run()`` loops until ``stop()`` is called (from a signal handler or a
    callback) or, with auto_close, until the last client leaves; it returns
    the stop reason. ``close()`` disconnects every client.
    """

    def __cinit__(self):
        self.listen_fd = -1
        self.wakeup_fd = -1
        self.spare_fd = -1
        self.recv_area = NULL
        self.clients = NULL
        self.pend = NULL
        self.scratch = NULL
        self.allowed_uids = NULL
        if index_init(&self.index) < 0:
            raise MemoryError()

    def __init__(self, int listen_fd, *, str backend="epoll", size_t max_message=409600,
                 allowed_uids=(), bint auto_close=False, str soft="queue",
                 str hard="discard", str order="queue",
                 uint64_t queue_max_bytes=8 << 20, uint64_t queue_max_msgs=65536,
                 uint64_t total_max_bytes=256 << 20, double block_timeout=10.0,
                 uint32_t max_subs=65536, uint32_t max_pattern=4096,
                 double sample_rate=0.0, on_event=None, on_message=None,
                 on_tick=None, double tick_interval=0.0, int wakeup_fd=-1,
                 int access_mode=-1):
        cdef int i
        cdef void *area
        self.poller = make_poller(backend)
        self.listen_fd = listen_fd
        self.wakeup_fd = wakeup_fd
        self.max_message = max_message
        self.sndbuf = <int>(2 * max_message + 65536)
        self.soft_default = MODES.index(soft)
        self.hard_default = MODES.index(hard)
        if self.hard_default == MODE_QUEUE:
            raise ValueError("the hard mode is discard, block or error")
        self.order_default = ORDERS.index(order)
        self.q_max_bytes = queue_max_bytes
        self.q_max_msgs = queue_max_msgs
        self.total_max_bytes = total_max_bytes
        self.block_timeout = block_timeout
        self.max_subs = max_subs
        self.max_pattern = max_pattern
        self.auto_close = auto_close
        self.sample_rate = sample_rate
        self.rng = 0x9E3779B97F4A7C15 ^ <uint64_t>(<size_t><void *>self)
        self.on_event = on_event
        self.on_message = on_message
        self.on_tick = on_tick
        self.tick_interval = tick_interval
        self.close_details = {}
        self.last_totals = None
        self.next_id = 1
        self.access_mode = access_mode
        import os
        self.own_uid = os.getuid()
        self.own_gid = os.getgid()
        self.n_allowed = len(allowed_uids)
        if self.n_allowed:
            self.allowed_uids = <int64_t *>malloc(self.n_allowed * sizeof(int64_t))
            if self.allowed_uids == NULL:
                raise MemoryError()
            for i, uid in enumerate(allowed_uids):
                self.allowed_uids[i] = uid

        # One slot per batched packet, each big enough for the largest packet
        # plus one byte so MSG_TRUNC can tell an oversized one apart.
        # Mapped, not malloc'd, so the pages a burst of large packets touched
        # can be handed back (release_recv_area) without freeing the area.
        self.recv_area_size = RECV_BATCH * (max_message + 1)
        area = mmap(NULL, self.recv_area_size, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if area == MAP_FAILED:
            raise MemoryError()
        self.recv_area = <char *>area
        memset(self.rhdrs, 0, sizeof(self.rhdrs))
        memset(self.shdrs, 0, sizeof(self.shdrs))
        for i in range(RECV_BATCH):
            self.riov[i].iov_base = self.recv_area + i * (max_message + 1)
            self.riov[i].iov_len = max_message + 1
            self.rhdrs[i].msg_hdr.msg_iov = &self.riov[i]
            self.rhdrs[i].msg_hdr.msg_iovlen = 1
            self.batch_pkts[i] = NULL
        for i in range(SEND_BATCH):
            self.shdrs[i].msg_hdr.msg_iov = &self.siov[i]
            self.shdrs[i].msg_hdr.msg_iovlen = 1
        self.scratch_cap = max_pattern + 128
        if self.scratch_cap < 4096:
            self.scratch_cap = 4096
        self.scratch = <char *>malloc(self.scratch_cap)
        if self.scratch == NULL:
            raise MemoryError()
        self.grow_lists(64)
        self.pend_cap = 1024
        self.pend = <Pending *>malloc(self.pend_cap * sizeof(Pending))
        if self.pend == NULL:
            raise MemoryError()
        # A spare descriptor to give up when accept hits EMFILE (see fd_exhausted).
        self.spare_fd = c_open(b"/dev/null", O_RDONLY | O_CLOEXEC)
        self.poller.set(listen_fd, EV_READ)
        if wakeup_fd >= 0:
            self.poller.set(wakeup_fd, EV_READ)
        self.started = self.now = monotonic()
        self.running = True

    def __dealloc__(self):
        cdef int fd
        cdef Client *c
        if self.clients != NULL:
            for fd in range(self.clients_cap):
                c = self.clients[fd]
                if c != NULL:
                    close(c.fd)
                    sq_clear(&c.q)
                    free(c.subs)
                    free(c)
            free(self.clients)
        index_free(&self.index)
        free(self.recips)
        free(self.touched)
        free(self.closing)
        free(self.paused)
        free(self.pend)
        if self.recv_area != NULL:
            munmap(self.recv_area, self.recv_area_size)
        free(self.scratch)
        free(self.allowed_uids)
        if self.spare_fd >= 0:
            close(self.spare_fd)

    # ---- the loop ----------------------------------------------------------

    def run(self):
        """Serve until stopped; returns the stop reason."""
        cdef int n, i, fd, mask, timeout
        cdef Client *c
        cdef double wait
        cdef char drain[64]
        # running is set at construction, not here: a stop() from a signal
        # handler that ran before run() must not be forgotten.
        if self.tick_interval > 0:
            self.next_tick = monotonic() + self.tick_interval
        while self.running:
            timeout = -1
            if self.tick_interval > 0:
                wait = self.next_tick - monotonic()
                timeout = 0 if wait <= 0 else <int>(wait * 1000) + 1
            if self.nblocking and (timeout < 0 or timeout > 100):
                timeout = 100       # re-check block timeouts
            n = self.poller.poll(timeout)
            if n == 0:
                PyErr_CheckSignals()    # EINTR, or a signal raced the poll
            self.now = monotonic()
            for i in range(n):
                fd = self.poller.fired[i].fd
                mask = self.poller.fired[i].mask
                if fd == self.listen_fd:
                    self.accept_clients()
                    continue
                if fd == self.wakeup_fd:
                    while read(fd, drain, sizeof(drain)) > 0:
                        pass
                    PyErr_CheckSignals()
                    continue
                if fd >= self.clients_cap:
                    continue
                c = self.clients[fd]
                if c == NULL or c.closing:
                    continue
                if mask & EV_WRITE:
                    self.drain(c)
                if mask & EV_READ and not c.closing:
                    self.on_readable(c, mask)
            if self.nclosing:
                self.finalize_closing()
            if self.nblocking:
                self.check_block_timeouts()
                if self.nclosing:
                    self.finalize_closing()
            if self.tick_interval > 0 and self.now >= self.next_tick:
                self.next_tick = self.now + self.tick_interval
                if self.disconnects != self.trimmed_at:
                    # Clients left: hand the memory they used back to the
                    # system, so RSS follows the load down after a churn.
                    self.trimmed_at = self.disconnects
                    malloc_trim(0)
                if self.recv_high > 65536:
                    # Large packets touched many receive pages: let them go
                    # (they read back as zeros, and are written before use).
                    madvise(self.recv_area, self.recv_area_size, MADV_DONTNEED)
                    self.recv_high = 0
                if self.on_tick is not None:
                    self.on_tick()
        return self.stop_reason

    def stop(self, reason="stopped"):
        """Make run() return after the current loop turn."""
        self.running = False
        if self.stop_reason is None:
            self.stop_reason = reason

    def close(self):
        """Disconnect every client (reason 'shutdown'), logging each."""
        cdef int fd
        cdef Client *c
        for fd in range(self.clients_cap):
            c = self.clients[fd]
            if c != NULL:
                self.mark_closing(c, R_SHUTDOWN, None)
        self.finalize_closing()

    # ---- accepting ---------------------------------------------------------

    cdef int accept_clients(self) except -1:
        cdef int fd, i, k
        cdef ucred cred
        cdef socklen_t len_
        cdef Client *c
        for i in range(64):
            fd = accept4(self.listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)
            if fd < 0:
                if errno == EAGAIN:
                    return 0
                if errno == EINTR or errno == ECONNABORTED:
                    continue
                if errno == EMFILE or errno == ENFILE or errno == ENOBUFS or errno == ENOMEM:
                    return self.fd_exhausted(errno)
                self.emit("accept_error", {"errno": errno})
                return 0
            len_ = sizeof(cred)
            if getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len_) < 0:
                close(fd)
                continue
            ident = {"client": self.next_id, "pid": cred.pid, "uid": cred.uid, "gid": cred.gid}
            refusal = self.refuse_peer(&cred)
            if refusal is not None:
                self.next_id += 1
                close(fd)
                self.emit("client_disconnect", dict(
                    ident, reason="user_refused", detail=refusal,
                    duration_s=0.0, counters=self.zero_counters(ident)))
                continue
            if fd >= self.poller.fd_limit():
                self.next_id += 1
                close(fd)
                self.emit("client_disconnect", dict(
                    ident, reason="fd_limit",
                    detail=f"fd {fd} is beyond what the {self.poller.name} backend can watch",
                    duration_s=0.0, counters=self.zero_counters(ident)))
                continue
            # Big enough to deliver the largest packet the bus accepts.
            if setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &self.sndbuf, sizeof(int)) < 0:
                setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &self.sndbuf, sizeof(int))
            if fd >= self.clients_cap:
                k = self.clients_cap * 2 if self.clients_cap else 1024
                while k <= fd:
                    k *= 2
                grown = <Client **>realloc(self.clients, k * sizeof(Client *))
                if grown == NULL:
                    close(fd)
                    raise MemoryError()
                memset(grown + self.clients_cap, 0, (k - self.clients_cap) * sizeof(Client *))
                self.clients = grown
                self.clients_cap = k
            self.grow_lists(self.nclients + 1)
            c = <Client *>calloc(1, sizeof(Client))
            if c == NULL:
                close(fd)
                raise MemoryError()
            c.fd = fd
            c.id = self.next_id
            self.next_id += 1
            c.pid = cred.pid
            c.uid = cred.uid
            c.gid = cred.gid
            c.soft = self.soft_default
            c.hard = self.hard_default
            c.order = self.order_default
            c.echo = 1
            c.connected_at = self.now
            c.pend_head = -1
            c.pend_tail = -1
            self.clients[fd] = c
            self.nclients += 1
            self.connects += 1
            self.had_client = True
            if self.nblocking:
                c.paused = 1
                self.paused[self.npaused] = c
                self.npaused += 1
            self.update_interest(c)
            self.emit("client_connect", ident)
        return 0

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
            self.emit("fd_exhausted", {"errno": err, "connected": self.nclients})
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
            self.emit("accept_paused", {"connected": self.nclients})
        return 0

    cdef int grow_lists(self, uint32_t need) except -1:
        """Scratch lists hold at most one entry per client; size them so the
        hot path never has to check."""
        cdef uint32_t cap = self.list_cap
        if need <= cap:
            return 0
        while cap < need:
            cap = cap * 2 if cap else 64
        self.recips = <Client **>realloc(self.recips, cap * sizeof(Client *))
        self.touched = <Client **>realloc(self.touched, cap * sizeof(Client *))
        self.closing = <Client **>realloc(self.closing, cap * sizeof(Client *))
        self.paused = <Client **>realloc(self.paused, cap * sizeof(Client *))
        if self.recips == NULL or self.touched == NULL or self.closing == NULL or self.paused == NULL:
            raise MemoryError()
        self.list_cap = cap
        return 0

    # ---- receiving ---------------------------------------------------------

    cdef int on_readable(self, Client *c, int mask) except -1:
        cdef int n, i
        cdef unsigned int length
        cdef char probe
        cdef ssize_t r
        if self.nblocking:
            # A peer that hung up can never read its queue: drop it, so a dead
            # client cannot hold the bus. Its unread input waits, like every
            # publisher's, until the bus is released.
            if mask & EV_HUP and not c.write_dead:
                self.write_dead(c)
            if self.nblocking:
                return self.pause(c)
        n = recvmmsg(c.fd, self.rhdrs, RECV_BATCH, MSG_DONTWAIT, NULL)
        if n < 0:
            if errno == EAGAIN or errno == EINTR:
                return 0
            if errno == ECONNRESET:
                # The client closed with deliveries still unread in its
                # socket: an ordinary close, not a fault.
                return self.mark_closing(c, R_EOF, "closed with unread deliveries")
            import os
            return self.mark_closing(c, R_ERROR, f"recv: {os.strerror(errno)}")
        for i in range(n):
            length = self.rhdrs[i].msg_len
            if length > self.recv_high:
                self.recv_high = length
            if length > self.max_message or self.rhdrs[i].msg_hdr.msg_flags & MSG_TRUNC:
                self.mark_closing(c, R_OVERSIZE,
                                  f"packet larger than {self.max_message} bytes")
                break
            if length == 0:
                # EOF, or an empty packet: an empty packet from a live peer
                # leaves the socket without data (EAGAIN) or with more.
                r = recv(c.fd, &probe, 1, MSG_DONTWAIT | MSG_PEEK)
                if (mask & EV_HUP) or r == 0:
                    self.mark_closing(c, R_EOF, None)
                else:
                    self.mark_closing(c, R_PROTOCOL, "empty packet")
                break
            self.handle_packet(c, i, length)
            if c.closing:
                break
        return self.flush_pending()

    cdef int handle_packet(self, Client *c, int slot, size_t n) except -1:
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
            return self.control(c, p.key, p.key_len)
        head = buf[:n if n < 24 else 24]
        return self.mark_closing(c, R_PROTOCOL, f"malformed packet {head!r}")

    cdef int publish(self, Client *c, int slot, const char *key, size_t klen, size_t n) except -1:
        cdef FanOut f
        cdef CredForm form
        cdef int check = KEY_OK
        cdef uint32_t i
        cdef double draw
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
        c.c.msgs_in += 1
        c.c.bytes_in += n
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
        if self.sample_rate > 0:
            self.rng ^= self.rng << 13
            self.rng ^= self.rng >> 7
            self.rng ^= self.rng << 17
            draw = (self.rng >> 11) * (1.0 / 9007199254740992.0)
            if draw < self.sample_rate and self.on_message is not None:
                self.on_message(c.id, c.pid, c.uid, key[:klen], n, f.n)
        return 0

    # ---- subscriptions -----------------------------------------------------

    cdef Py_ssize_t normalise(self, Client *c, const char *pat, size_t n, bint refuse) except -2:
        """Validate a pattern and write its stored form to self.scratch.
        A !/cred/ prefix gets the client's own credentials in empty fields
        and canonical numbers. Returns the stored length, or -1 after marking
        the client closing (refuse) or logging nothing (not refuse)."""
        cdef CredForm form
        cdef int check
        cdef const char *rest = pat
        cdef size_t rest_len = n
        cdef char prefix[CRED_CANONICAL_MAX]
        cdef size_t plen = 0
        if is_cred_key(pat, n):
            if parse_cred_form(pat, n, False, &form) < 0:
                self.refusal = "cred_malformed"
                if refuse:
                    self.mark_closing(c, R_CRED, "malformed !/cred/ pattern")
                return -1
            if ((form.gid != CRED_EMPTY and form.gid != c.gid) or
                    (form.uid != CRED_EMPTY and form.uid != c.uid) or
                    (form.pid != CRED_EMPTY and form.pid != c.pid)):
                self.refusal = "cred_mismatch"
                if refuse:
                    self.mark_closing(c, R_CRED, "credentials do not match the client's")
                return -1
            form.gid, form.uid, form.pid = c.gid, c.uid, c.pid     # empty fields: its own
            plen = cred_canonical_prefix(&form, prefix)
            rest = pat + form.prefix_len
            rest_len = n - form.prefix_len
        check = check_rest(rest, rest_len, True)
        if check != KEY_OK:
            self.refusal = "bang_misuse" if check == KEY_BANG_MISUSE else "cred_malformed"
            if refuse:
                if check == KEY_BANG_MISUSE:
                    self.mark_closing(c, R_BANG, "reserved '!' in pattern")
                else:
                    self.mark_closing(c, R_CRED, "malformed nested !/cred/ pattern")
            return -1
        if plen + rest_len > self.scratch_cap:
            self.refusal = "pattern_too_long"
            if refuse:
                self.mark_closing(c, R_LIMIT, "pattern too long")
            return -1
        memcpy(self.scratch, prefix, plen)
        memcpy(self.scratch + plen, rest, rest_len)
        return plen + rest_len

    cdef int match_canonical(self, const char *key, size_t klen, CredForm *form, FanOut *f) except -1:
        """Subscriptions store !/cred/ numbers without leading zeros, so a
        key spelling them with zeros ("!/cred/007/...") is matched again in
        that form: both spellings name the same client. Clients already
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

    cdef int subscribe(self, Client *c, const char *pat, size_t n) except -1:
        cdef Py_ssize_t stored
        cdef Sub *sub
        cdef Sub **grown
        cdef uint32_t cap
        if n > self.max_pattern:
            self.emit("subscribe", dict(self.ident(c), pattern=text(pat, n if n < 256 else 256) + "...",
                                        accepted=False, reason="pattern_too_long"))
            return self.mark_closing(c, R_LIMIT, f"pattern longer than {self.max_pattern} bytes")
        if c.nsubs >= self.max_subs:
            self.emit("subscribe", dict(self.ident(c), pattern=text(pat, n),
                                        accepted=False, reason="too_many_subscriptions"))
            return self.mark_closing(c, R_LIMIT, f"more than {self.max_subs} subscriptions")
        stored = self.normalise(c, pat, n, True)
        if stored < 0:
            self.emit("subscribe", dict(self.ident(c), pattern=text(pat, n), accepted=False,
                                        reason=self.refusal))
            return 0
        if c.nsubs == c.subs_cap:
            cap = c.subs_cap * 2 if c.subs_cap else 4
            grown = <Sub **>realloc(c.subs, cap * sizeof(Sub *))
            if grown == NULL:
                return self.mark_closing(c, R_ERROR, "out of memory")
            c.subs = grown
            c.subs_cap = cap
        sub = index_add(&self.index, c, self.scratch, <size_t>stored)
        if sub == NULL:
            return self.mark_closing(c, R_ERROR, "out of memory")
        sub.owner_pos = c.nsubs
        c.subs[c.nsubs] = sub
        c.nsubs += 1
        self.emit("subscribe", dict(self.ident(c), pattern=text(self.scratch, stored),
                                    accepted=True, reason=None))
        return 0

    cdef int unsubscribe(self, Client *c, const char *pat, size_t n) except -1:
        cdef Py_ssize_t stored = self.normalise(c, pat, n, False)
        cdef uint32_t i
        cdef Sub *sub
        cdef Sub *last
        if stored < 0 and self.refusal == "bang_misuse":
            # as in SUB; a pattern refused for its credentials was simply
            # never stored, so it is not found
            return self.mark_closing(c, R_BANG, "reserved '!' in pattern")
        if stored >= 0:
            i = c.nsubs
            while i > 0:        # newest first: the usual case
                i -= 1
                sub = c.subs[i]
                if sub.len == <uint32_t>stored and memcmp(sub.pattern, self.scratch, stored) == 0:
                    c.nsubs -= 1
                    if i != c.nsubs:
                        last = c.subs[c.nsubs]
                        c.subs[i] = last
                        last.owner_pos = i
                    index_remove(&self.index, sub)
                    self.emit("unsubscribe", dict(self.ident(c), pattern=text(pat, n),
                                                  accepted=True, reason=None))
                    return 0
        self.emit("unsubscribe", dict(self.ident(c), pattern=text(pat, n),
                                      accepted=False, reason="not_subscribed"))
        return 0

    # ---- control messages --------------------------------------------------

    cdef int control(self, Client *c, const char *key, size_t n) except -1:
        if key_is(key, n, b"!/cred/whoami", 13):
            return self.reply(c, b"CMSG !/cred/whoami\0!/cred/%d/%d/%d" % (c.gid, c.uid, c.pid))
        if n > 14 and memcmp(key, b"blocking/soft/", 14) == 0:
            mode = key[14:n]
            if mode in (b"queue", b"discard", b"block", b"error"):
                return self.set_mode(c, WHICH_SOFT, MODES.index(mode.decode()))
        elif n > 14 and memcmp(key, b"blocking/hard/", 14) == 0:
            mode = key[14:n]
            if mode in (b"discard", b"block", b"error"):
                return self.set_mode(c, WHICH_HARD, MODES.index(mode.decode()))
        elif n > 6 and memcmp(key, b"order/", 6) == 0:
            mode = key[6:n]
            if mode in (b"queue", b"stack", b"random"):
                return self.set_mode(c, WHICH_ORDER, ORDERS.index(mode.decode()))
        elif key_is(key, n, b"echo/on", 7):
            return self.set_mode(c, WHICH_ECHO, 1)
        elif key_is(key, n, b"echo/off", 8):
            return self.set_mode(c, WHICH_ECHO, 0)
        elif key_is(key, n, b"stats", 5):
            self.flush_pending()    # count this batch's deliveries first
            snapshot = self.stats()
            body = json.dumps(snapshot, separators=(",", ":")).encode()
            if len(body) + 11 > self.max_message:
                snapshot["clients_omitted"] = len(snapshot.pop("clients"))
                body = json.dumps(snapshot, separators=(",", ":")).encode()
            return self.reply(c, b"CMSG stats\0" + body)
        self.cmsgs_ignored += 1
        self.emit("cmsg_ignored", dict(self.ident(c), key=text(key, n)))
        return 0

    cdef int reply(self, Client *c, bytes packet) except -1:
        """Queue a broker-made packet behind c's pending deliveries."""
        cdef Packet *p = packet_new(packet, len(packet), 0)
        if p == NULL:
            raise MemoryError()
        p.refs = 1          # released when the pending entry is consumed
        p.reply = 1
        return self.pend_add(c, -1, p)

    cdef int set_mode(self, Client *c, int which, int value) except -1:
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

    # ---- delivering --------------------------------------------------------

    cdef int pend_add(self, Client *c, int32_t slot, Packet *pkt) except -1:
        cdef Pending *e
        cdef Pending *grown
        cdef int32_t idx = self.npend
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
        else:
            self.pend[c.pend_tail].next = idx
        c.pend_tail = idx
        return 0

    cdef int flush_pending(self) except -1:
        """Send every delivery collected in this batch, one sendmmsg per
        recipient, then let go of the batch's packets."""
        cdef uint32_t i
        cdef Client *c
        for i in range(self.ntouched):
            c = self.touched[i]
            self.flush_client(c)
            c.pend_head = -1
            c.pend_tail = -1
        self.ntouched = 0
        self.npend = 0
        for i in range(RECV_BATCH):
            if self.batch_pkts[i] != NULL:
                packet_release(self.batch_pkts[i])
                self.batch_pkts[i] = NULL
        return 0

    cdef int flush_client(self, Client *c) except -1:
        cdef int32_t e = c.pend_head
        cdef int32_t k
        cdef int sent, i, replies
        cdef Pending *p
        cdef uint64_t nbytes
        if not c.closing and not c.write_dead and c.q.live == 0:
            # Nothing queued ahead: write straight from the receive buffers.
            while e >= 0:
                k = 0
                while e >= 0 and k < SEND_BATCH:
                    p = &self.pend[e]
                    if p.slot >= 0:
                        self.siov[k].iov_base = self.riov[p.slot].iov_base
                        self.siov[k].iov_len = self.rhdrs[p.slot].msg_len
                    else:
                        self.siov[k].iov_base = p.pkt.data
                        self.siov[k].iov_len = p.pkt.len
                    self.sent_entries[k] = e
                    k += 1
                    e = p.next
                sent = sendmmsg(c.fd, self.shdrs, k, MSG_DONTWAIT | MSG_NOSIGNAL)
                if sent < 0:
                    if errno != EAGAIN:
                        self.send_failed(c, errno)
                    sent = 0
                nbytes = 0
                replies = 0
                for i in range(sent):
                    p = &self.pend[self.sent_entries[i]]
                    if p.pkt != NULL:
                        if p.pkt.reply:
                            replies += 1
                        else:
                            nbytes += self.siov[i].iov_len
                        packet_release(p.pkt)
                        p.pkt = NULL
                    else:
                        nbytes += self.siov[i].iov_len
                self.count_sent(c, sent, nbytes, replies)
                if sent < k:
                    e = self.sent_entries[sent]     # the rest takes the queue path
                    break
        # Whatever could not be written now goes to the flood-control policy.
        while e >= 0:
            p = &self.pend[e]
            if c.closing or c.write_dead:
                c.c.drops_disconnect += 1
                self.tot.drops_disconnect += 1
            else:
                self.enqueue(c, p)
            if p.pkt != NULL:
                packet_release(p.pkt)
                p.pkt = NULL
            e = p.next
        return 0

    cdef int enqueue(self, Client *c, Pending *e) except -1:
        """Apply c's soft and hard modes to a delivery that would block."""
        cdef Packet *pkt = e.pkt
        cdef uint64_t length = pkt.len if pkt != NULL else self.rhdrs[e.slot].msg_len
        cdef PacketStats *ps = get_packet_stats()
        cdef bint over
        # The soft modes are about deliveries. The broker's own reply is what
        # a client waits for (whoami as a barrier): it is queued, and only
        # the hard limit can refuse it.
        cdef bint reply = pkt != NULL and pkt.reply
        if c.soft == MODE_DISCARD and not reply:
            c.c.drops_soft += 1
            self.tot.drops_soft += 1
            return 0
        if c.soft == MODE_ERROR and not reply:
            c.c.drops_disconnect += 1
            self.tot.drops_disconnect += 1
            return self.mark_closing(c, R_FLOOD, "would block (blocking/soft/error)")
        over = (c.q.bytes + length > self.q_max_bytes or c.q.live + 1 > self.q_max_msgs or
                (pkt == NULL and self.batch_pkts[e.slot] == NULL and
                 ps.bytes + length > self.total_max_bytes))
        # A client in a block mode has already stopped the bus: what the
        # current receive batch still holds is queued beyond the limit (at
        # most one batch), so blocking loses nothing.
        if over and not (c.blocking and (c.soft == MODE_BLOCK or c.hard == MODE_BLOCK)):
            if c.hard == MODE_DISCARD:
                c.c.drops_hard += 1
                self.tot.drops_hard += 1
                return 0
            if c.hard == MODE_ERROR:
                c.c.drops_disconnect += 1
                self.tot.drops_disconnect += 1
                return self.mark_closing(c, R_FLOOD, "queue limit reached (blocking/hard/error)")
            self.start_blocking(c)      # hard block: keep it, hold the bus
        elif over:
            self.start_blocking(c)
        if pkt == NULL:
            pkt = self.batch_pkts[e.slot]
            if pkt == NULL:
                pkt = packet_new(<const char *>self.riov[e.slot].iov_base, length,
                                 self.batch_seqs[e.slot])
                if pkt == NULL:
                    c.c.drops_hard += 1
                    self.tot.drops_hard += 1
                    return 0
                pkt.refs = 1    # the batch's own hold, released by flush_pending
                self.batch_pkts[e.slot] = pkt
        if sq_push(&c.q, pkt) < 0:
            c.c.drops_hard += 1
            self.tot.drops_hard += 1
            return 0
        if c.soft == MODE_BLOCK and not reply:
            self.start_blocking(c)
        if c.q.live == 1:
            self.update_interest(c)
        return 0

    cdef void count_sent(self, Client *c, int sent, uint64_t nbytes, int replies) noexcept:
        """Counts what one sendmmsg wrote: deliveries apart from control replies."""
        c.c.msgs_out += sent - replies
        c.c.bytes_out += nbytes
        c.c.replies_out += replies
        self.tot.msgs_out += sent - replies
        self.tot.bytes_out += nbytes
        self.tot.replies_out += replies

    cdef int drain(self, Client *c) except -1:
        """Write queued packets in c's order, SEND_BATCH per syscall."""
        cdef uint32_t k, i
        cdef int sent, replies
        cdef uint64_t nbytes
        while c.q.live:
            k = sq_select(&c.q, c.order, self.spos, self.ssel, SEND_BATCH)
            for i in range(k):
                self.siov[i].iov_base = self.ssel[i].data
                self.siov[i].iov_len = self.ssel[i].len
            sent = sendmmsg(c.fd, self.shdrs, k, MSG_DONTWAIT | MSG_NOSIGNAL)
            if sent < 0:
                if errno != EAGAIN:
                    self.send_failed(c, errno)
                break
            nbytes = 0
            replies = 0
            for i in range(<uint32_t>sent):
                if self.ssel[i].reply:
                    replies += 1
                else:
                    nbytes += self.ssel[i].len
            self.count_sent(c, sent, nbytes, replies)
            sq_consume(&c.q, self.spos, sent)
            if <uint32_t>sent < k:
                break
        self.update_interest(c)
        if c.blocking:
            self.maybe_unblock(c)
        return 0

    cdef int send_failed(self, Client *c, int err) except -1:
        """A peer that went away may still have unread packets for us: stop
        writing to it and read it to EOF; other errors close it now."""
        if err == EPIPE or err == ECONNRESET:
            return self.write_dead(c)
        import os
        return self.mark_closing(c, R_ERROR, f"send: {os.strerror(err)}")

    cdef int write_dead(self, Client *c) except -1:
        cdef uint32_t dropped
        c.write_dead = 1
        dropped = sq_clear(&c.q)
        c.c.drops_disconnect += dropped
        self.tot.drops_disconnect += dropped
        if c.blocking:
            self.maybe_unblock(c)
        return self.update_interest(c)

    # ---- blocking the bus --------------------------------------------------

    cdef int start_blocking(self, Client *c) except -1:
        if not c.blocking:
            c.blocking = 1
            c.block_since = self.now
            c.c.blocks += 1
            self.nblocking += 1
        return 0

    cdef int maybe_unblock(self, Client *c) except -1:
        cdef bint still = ((c.soft == MODE_BLOCK and c.q.live > 0) or
                           (c.hard == MODE_BLOCK and
                            (c.q.bytes >= self.q_max_bytes or c.q.live >= self.q_max_msgs)))
        if still:
            return 0
        c.blocking = 0
        self.nblocking -= 1
        if self.nblocking == 0:
            self.resume_all()
        return 0

    cdef int pause(self, Client *c) except -1:
        if not c.paused:
            c.paused = 1
            self.paused[self.npaused] = c
            self.npaused += 1
            self.update_interest(c)
        return 0

    cdef int resume_all(self) except -1:
        cdef uint32_t i
        cdef Client *c
        for i in range(self.npaused):
            c = self.paused[i]
            c.paused = 0
            if not c.closing:
                self.update_interest(c)
        self.npaused = 0
        return 0

    cdef int check_block_timeouts(self) except -1:
        cdef int fd
        cdef Client *c
        for fd in range(self.clients_cap):
            c = self.clients[fd]
            if c != NULL and c.blocking and not c.closing and \
                    self.now - c.block_since >= self.block_timeout:
                self.mark_closing(c, R_FLOOD,
                                  f"kept the bus blocked for {self.block_timeout:g}s")
        return 0

    cdef int update_interest(self, Client *c) except -1:
        cdef int mask = 0
        if not c.paused:
            mask |= EV_READ
        if c.q.live:
            mask |= EV_WRITE
        return self.poller.set(c.fd, mask)

    # ---- closing -----------------------------------------------------------

    cdef int mark_closing(self, Client *c, int reason, detail) except -1:
        if c.closing:
            return 0
        c.closing = 1
        c.reason = reason
        if detail is not None:
            self.close_details[c.id] = detail
        self.closing[self.nclosing] = c
        self.nclosing += 1
        return 0

    cdef int finalize_closing(self) except -1:
        cdef uint32_t i, j, dropped
        cdef Client *c
        for i in range(self.nclosing):
            c = self.closing[i]
            self.poller.set(c.fd, 0)
            close(c.fd)
            for j in range(c.nsubs):
                index_remove(&self.index, c.subs[j])
            free(c.subs)
            dropped = sq_clear(&c.q)
            c.c.drops_disconnect += dropped
            self.tot.drops_disconnect += dropped
            if c.paused:
                for j in range(self.npaused):
                    if self.paused[j] == c:
                        self.npaused -= 1
                        self.paused[j] = self.paused[self.npaused]
                        break
            self.clients[c.fd] = NULL
            self.nclients -= 1
            self.disconnects += 1
            fields = self.ident(c)
            fields["reason"] = REASONS[c.reason]
            fields["detail"] = self.close_details.pop(c.id, None)
            fields["duration_s"] = round(self.now - c.connected_at, 6)
            fields["counters"] = self.counters(c)
            if c.blocking:
                c.blocking = 0
                self.nblocking -= 1
                if self.nblocking == 0:
                    self.resume_all()
            free(c)
            self.emit("client_disconnect", fields)
        self.nclosing = 0
        self.fd_exhausted_logged = False
        if self.accept_paused:
            self.accept_paused = False
            self.poller.set(self.listen_fd, EV_READ)
        if self.auto_close and self.had_client and self.nclients == 0:
            self.stop("auto_close")
        return 0

    # ---- reporting ---------------------------------------------------------

    cdef int emit(self, str name, dict fields) except -1:
        if self.on_event is not None:
            self.on_event(name, fields)
        return 0

    cdef dict ident(self, Client *c):
        return {"client": c.id, "pid": c.pid, "uid": c.uid, "gid": c.gid}

    cdef dict counters(self, Client *c):
        d = self.ident(c)
        d.update(msgs_in=c.c.msgs_in, bytes_in=c.c.bytes_in, msgs_out=c.c.msgs_out,
                 bytes_out=c.c.bytes_out, replies_out=c.c.replies_out, drops_soft=c.c.drops_soft,
                 drops_hard=c.c.drops_hard, drops_disconnect=c.c.drops_disconnect,
                 queued_msgs=c.q.live, queued_bytes=c.q.bytes, subscriptions=c.nsubs)
        return d

    cdef dict zero_counters(self, dict ident):
        """Counters of a connection refused at accept: all zero."""
        d = dict(ident)
        for name in COUNTER_FIELDS + ("replies_out", "queued_msgs", "queued_bytes", "subscriptions"):
            d[name] = 0
        return d

    def totals(self):
        """Broker-wide counters (cumulative since start)."""
        cdef PacketStats *ps = get_packet_stats()
        cdef int fd
        cdef uint64_t queued_msgs = 0
        for fd in range(self.clients_cap):
            if self.clients[fd] != NULL:
                queued_msgs += self.clients[fd].q.live
        return {"clients": self.nclients, "connects": self.connects,
                "disconnects": self.disconnects,
                "msgs_in": self.tot.msgs_in, "bytes_in": self.tot.bytes_in,
                "msgs_out": self.tot.msgs_out, "bytes_out": self.tot.bytes_out,
                "replies_out": self.tot.replies_out,
                "drops_soft": self.tot.drops_soft, "drops_hard": self.tot.drops_hard,
                "drops_disconnect": self.tot.drops_disconnect,
                "queued_msgs": queued_msgs, "queued_bytes": ps.bytes,
                "queued_bytes_peak": ps.bytes_peak,
                "subscriptions": self.index.nsubs}

    def stats(self):
        """A snapshot: totals, and counters and modes per connected client."""
        cdef int fd
        cdef Client *c
        clients = []
        for fd in range(self.clients_cap):
            c = self.clients[fd]
            if c != NULL and not c.closing:
                clients.append(self.client_entry(c))
        return {"uptime_s": round(monotonic() - self.started, 3),
                "backend": self.poller.name, "totals": self.totals(), "clients": clients}

    def changed_clients(self):
        """Entries, as in stats(), for the clients that connected or changed
        (counters, queue, subscriptions or modes) since the last call. A
        periodic record lists these: an idle client is listed once, so ten
        thousand of them neither stall the loop nor fill the log every time."""
        cdef int fd
        cdef Client *c
        cdef uint8_t modes
        out = []
        for fd in range(self.clients_cap):
            c = self.clients[fd]
            if c == NULL or c.closing:
                continue
            modes = c.soft | (c.hard << 2) | (c.order << 4) | (c.echo << 6)
            if (c.listed.ever and c.listed.modes == modes and c.listed.nsubs == c.nsubs
                    and c.listed.queued_msgs == c.q.live and c.listed.queued_bytes == c.q.bytes
                    and memcmp(&c.listed.c, &c.c, sizeof(Counters)) == 0):
                continue
            c.listed.c = c.c
            c.listed.queued_msgs = c.q.live
            c.listed.queued_bytes = c.q.bytes
            c.listed.nsubs = c.nsubs
            c.listed.modes = modes
            c.listed.ever = 1
            out.append(self.client_entry(c))
        return out

    cdef dict client_entry(self, Client *c):
        d = self.counters(c)
        d.update(soft=MODES[c.soft], hard=MODES[c.hard], order=ORDERS[c.order], echo=bool(c.echo))
        return d

    def stats_delta(self):
        """Totals, plus the change of each traffic counter since the last call."""
        totals = self.totals()
        last = self.last_totals or {}
        delta = {k: totals[k] - last.get(k, 0) for k in COUNTER_FIELDS}
        self.last_totals = totals
        return totals, delta

    def flood_report(self):
        """Per client whose drops or blocks grew since the last call: the
        growth and its queue now. Rate-limits flood logging to one record per
        client per call."""
        cdef int fd
        cdef Client *c
        out = []
        for fd in range(self.clients_cap):
            c = self.clients[fd]
            if c == NULL:
                continue
            if (c.c.drops_soft != c.reported.drops_soft or
                    c.c.drops_hard != c.reported.drops_hard or
                    c.c.blocks != c.reported.blocks):
                d = self.ident(c)
                d.update(drops_soft=c.c.drops_soft - c.reported.drops_soft,
                         drops_hard=c.c.drops_hard - c.reported.drops_hard,
                         blocks=c.c.blocks - c.reported.blocks,
                         queued_msgs=c.q.live, queued_bytes=c.q.bytes,
                         soft=MODES[c.soft], hard=MODES[c.hard])
                out.append(d)
                c.reported = c.c
        return out

    @property
    def backend(self):
        return self.poller.name

    @property
    def client_count(self):
        return self.nclients
