# cython: language_level=3
"""The sbus broker: the per-message path (receive, parse, match, fan out,
send) and the loop's turn that drives it, in C over C structs; broker.pxd
tells the life of a message. Everything slower is Hub's (hub.pyx), which
Broker extends: the rooms, acting on their decisions, teardown and the Python
surface. Connections that misbehave are only *marked* closing, and torn down
at the end of the loop turn; a callback that raises does not cut a batch
short: the turn finishes, and ``run()`` raises it once afterwards.
"""
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport errno, EAGAIN, EINTR, ECONNRESET, EPIPE
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memchr, memcmp, memset
from posix.unistd cimport read

from sbus._core.acl cimport ACL_ALLOW, ACL_MISS, acl_flags, acl_memo_get
from sbus._core.conn cimport Conn, MODE_BLOCK, R_EOF, R_ERROR, R_PROTOCOL, R_BANG, R_FLOOD, R_OVERSIZE
from sbus._core.flood cimport on_full, any_could_block, start_blocking
from sbus._core.frames cimport (FRAME_HEAD, FRAME_ENTRY_HEAD, FRAME_MSGS, FRAME_BYTES, is_frame,
                                frame_next, frame_packets, frame_put, frame_start)
from sbus._core.hub cimport Hub
from sbus._core.subs cimport match_canonical
from sbus._core.includes.sys cimport (
    monotonic, recv, recvmmsg, sendmmsg, MSG_DONTWAIT, MSG_NOSIGNAL, MSG_TRUNC, MSG_PEEK, mmap, munmap,
    madvise, MAP_FAILED, PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE, MADV_DONTNEED)
from sbus._core.index cimport Sub, index_match
from sbus._core.loop cimport EV_READ, EV_WRITE, EV_HUP, only_thread
from sbus._core.policy cimport FLOOD_QUEUE_BLOCK, FLOOD_DROP_SOFT, FLOOD_DROP_HARD, FLOOD_CLOSE_SOFT, FLOOD_CLOSE_HARD
from sbus._core.reads cimport read_want, note_read
from sbus._core.protocol cimport (
    ParsedPacket, parse_packet, VERB_MSG, VERB_SUB, VERB_UNSUB, VERB_CMSG,
    CredForm, parse_cred_form, is_cred_key, check_rest, KEY_OK, CRED_EMPTY)
from sbus._core.report cimport text
from sbus._core.sendq cimport (Packet, get_packet_stats, packet_new, packet_release,
                               sq_push, sq_select, sq_consume, sq_clear)

import os


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


cdef class Broker(Hub):
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
        self.recv_area = NULL
        self.readable = NULL
        # One slot per packet received in a loop turn, each big enough for
        # the largest packet plus one byte so MSG_TRUNC can tell an oversized
        # one apart; as many as TURN_AREA_BYTES holds, and never fewer than
        # one batch. Mapped, not malloc'd, so the pages a burst of large
        # packets touched can be handed back (release_buffers) without
        # freeing the area; only touched pages count. After them, the frames
        # for a link that takes them (frames.pxd), SEND_BATCH of FRAME_BYTES.
        self.turn_slots = TURN_SLOTS_MAX if fit > TURN_SLOTS_MAX else (
            RECV_BATCH if fit < RECV_BATCH else <uint32_t>fit)
        self.recv_area_size = self.turn_slots * slot
        area = mmap(NULL, self.recv_area_size + SEND_BATCH * FRAME_BYTES, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if area == MAP_FAILED:
            raise MemoryError()
        self.recv_area = <char *>area
        self.frame_area = self.recv_area + self.recv_area_size
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

    def __init__(self, int listen_fd, config, **options):
        Hub.__init__(self, listen_fd, config, **options)
        if self.poller.batch_recv:
            self.readable = <Fired *>malloc(self.poller.max_fired * sizeof(Fired))
            if self.readable == NULL:
                raise MemoryError()

    def __dealloc__(self):
        free(self.pend)
        free(self.readable)
        if self.recv_area != NULL:
            munmap(self.recv_area, self.recv_area_size + SEND_BATCH * FRAME_BYTES)

    # ---- the loop ----------------------------------------------------------

    def run(self):
        """Serve until stopped; returns the stop reason. An exception a
        callback raised is raised here, after the turn it was raised in."""
        cdef int n
        # running is set at construction, not here: a stop() from a signal
        # handler that ran before run() must not be forgotten.
        self.now = monotonic()
        if self.tick_interval > 0:
            self.next_tick = self.now + self.tick_interval
        # A turn stays in C unless it has Python work (a tick due, a signal,
        # a callback's exception); alone, it waits holding the GIL.
        while self.running:
            self.poller.keep_gil = only_thread()
            n = self.poller.poll(self.poll_timeout())
            if n == 0:
                self.signalled = True   # EINTR, or a signal raced the poll
            self.now = monotonic()
            self.dispatch(n)
            self.before_sleep()
            self.housekeeping()             # returns at once unless a tick is due
            self.raise_callback_error()
            if self.signalled:
                self.signalled = False
                PyErr_CheckSignals()
        return self.stop_reason

    cdef int dispatch(self, int n) except -1:
        cdef int i, fd, mask, nready = 0
        cdef Conn *c
        cdef char drain[64]
        self.turn_fired = n
        for i in range(n):
            fd = self.poller.fired[i].fd
            mask = self.poller.fired[i].mask
            if fd == self.peers.listen_fd:
                self.accept_clients()
                continue
            if fd == self.wakeup_fd:
                while read(fd, drain, sizeof(drain)) > 0:
                    pass
                self.signalled = True
                continue
            if fd >= self.peers.cap:
                continue
            c = self.peers.conns[fd]
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
        if self.flood.nblocking:
            self.check_block_timeouts()
            if self.nclosing:
                self.finalize_closing()
        return 0

    # ---- buffers -----------------------------------------------------------

    cdef bint at_safe_point(self) noexcept:
        return not (self.nslots or self.npend or self.nclosing)

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
        if self.flush_first(c.frames):
            self.flush_pending()
        if not self.before_read(c, mask):
            return 0
        base = self.nslots
        room = self.turn_slots - base
        if c.frames:
            room = min(room, (VIEW_SLOTS - self.nviews) // FRAME_MSGS)    # each may be a frame
        want = read_want(c, room, False)
        n = recvmmsg(c.fd, &self.rhdrs[base], want, MSG_DONTWAIT, NULL)
        if n < 0:
            if errno == EAGAIN or errno == EINTR:
                return 0
            return self.recv_failed(c, errno)
        note_read(c, want, n, False)
        self.nslots = base + n
        self.reads_held += 1
        self.batch_pend = self.npend
        for i in range(n):
            if not self.take_packet(c, mask, base + i, self.rhdrs[base + i].msg_len,
                                    self.rhdrs[base + i].msg_hdr.msg_flags & MSG_TRUNC):
                break
        self.batch_pend = -1
        return 0

    cdef bint before_read(self, Conn *c, int mask) except -1:
        if self.flood.nblocking:
            # A peer that hung up can never read its queue: drop it, so a dead
            # client cannot hold the bus. Its unread input waits, like every
            # publisher's, until the bus is released.
            if mask & EV_HUP and not c.write_dead:
                self.stop_writing(c)
            if self.flood.nblocking:
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
                self.mark_closing(c, R_EOF, "closed with unread deliveries" if c.write_dead else None)
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
        cdef uint32_t frames_room
        while i < n:
            if self.flush_first(True):
                self.flush_pending()
            base = self.nslots
            nops = 0
            nround = 0
            frames_room = (VIEW_SLOTS - self.nviews) // FRAME_MSGS
            while i < n and nops < RECV_BATCH:
                fd = self.readable[i].fd
                mask = self.readable[i].mask
                c = self.peers.conns[fd]
                if c == NULL or c.closing:
                    i += 1
                    continue
                room = self.turn_slots - base - nops
                if room < RECV_BATCH_MIN:
                    break           # the next round flushes first
                if not self.before_read(c, mask):
                    i += 1
                    continue
                if room > <uint32_t>(RECV_BATCH - nops):
                    room = RECV_BATCH - nops
                if c.frames:
                    if frames_room == 0:
                        break       # the next round flushes first
                    room = min(room, frames_room)
                want = read_want(c, room, True)
                if c.frames:
                    frames_room -= want
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
            self.reads_held += nround
            for k in range(nround):
                c = self.peers.conns[round_fd[k]]
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
        note_read(c, want, got, True)
        return 0

    cdef bint flush_first(self, bint frames) noexcept:
        """Whether the turn's deliveries go out before the next read: its slots (or a frame
        reader's views) run short, HOLD_READS reads are held or the turn is light, or the flush
        could make a recipient in a block mode stop the bus (where it did with a flush per batch)."""
        return (self.nslots + RECV_BATCH_MIN > self.turn_slots or self.reads_held >= HOLD_READS
                or (self.reads_held and self.turn_fired <= LIGHT_TURN)
                or (frames and self.nviews + FRAME_MSGS > VIEW_SLOTS) or (self.nblockers and any_could_block(
                    &self.flood, self.blockers, self.nblockers, self.pend_bytes, <uint64_t>self.npend,
                    get_packet_stats().bytes)))

    cdef int handle_packet(self, Conn *c, int slot, size_t n) except -1:
        cdef ParsedPacket p
        cdef const char *buf = <const char *>self.riov[slot].iov_base
        cdef int verb = parse_packet(buf, n, &p)
        if verb == VERB_MSG:
            return self.publish(c, slot, p.key, p.key_len, n)
        if c.frames and is_frame(buf, n) and slot < TURN_SLOTS_MAX:
            return self.take_frame(c, slot, n)
        if verb == VERB_SUB:
            return self.subscribe(c, p.key, p.key_len)
        if verb == VERB_UNSUB:
            return self.unsubscribe(c, p.key, p.key_len)
        if verb == VERB_CMSG:
            if c.link and p.key_len > 5 and memcmp(p.key, b"link/", 5) == 0:
                return self.act(c, self.ctl.from_link(p.key, p.key_len, p.payload, p.payload_len))
            return self.act(c, self.ctl.control(c, p.key, p.key_len))
        head = buf[:n if n < 24 else 24]
        return self.mark_closing(c, R_PROTOCOL, f"malformed packet {head!r}")

    cdef int take_frame(self, Conn *c, int slot, size_t n) except -1:
        """Each packet of c's frame (frames.pxd) in a view slot of its own,
        handled as if it came alone; reads leave FRAME_MSGS views a frame."""
        cdef const char *packet
        cdef size_t at = FRAME_HEAD
        cdef Py_ssize_t length
        cdef uint32_t view
        while not c.closing:
            length = frame_next(<const char *>self.riov[slot].iov_base, n, &at, &packet)
            if length == 0:
                return 0
            if length < 0 or self.nviews == VIEW_SLOTS:
                return self.mark_closing(c, R_PROTOCOL, "malformed frame" if length < 0 else "frame too long")
            view = TURN_SLOTS_MAX + self.nviews
            self.nviews += 1
            self.riov[view].iov_base = <void *>packet
            self.rhdrs[view].msg_len = <unsigned int>length
            self.handle_packet(c, view, <size_t>length)
        return 0

    cdef int publish(self, Conn *c, int slot, const char *key, size_t klen, size_t n) except -1:
        cdef FanOut f
        cdef CredForm form
        cdef int check = KEY_OK
        cdef int decided
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
        if c.access != NULL:
            # The access policy (sbusd --policy): without one, this branch is
            # all the message path pays; with one, a repeated key is a compare.
            decided = acl_memo_get(&c.memo, key, klen)
            if decided == ACL_MISS:
                decided = self.policy_decide(c, key, klen, &form if f.is_cred else NULL)
            if not acl_flags(c.access, decided) & ACL_ALLOW:
                return self.deny_publish(c, key, klen, decided)
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
        index_match(&self.subs.index, key, klen, fan_one, &f)
        if f.is_cred:
            match_canonical(&self.subs, key, klen, &form, fan_one, &f)
        for i in range(f.n):
            self.pend_add(f.recips[i], slot, NULL)
        if self.log_messages > 0:
            self.sample(c, key, klen, n, f.n)
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
        for i in range(TURN_SLOTS_MAX, TURN_SLOTS_MAX + self.nviews):
            if self.batch_pkts[i] != NULL:
                packet_release(self.batch_pkts[i])
                self.batch_pkts[i] = NULL
        self.nslots = 0
        self.nviews = 0
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
        self.reads_held = 0
        if self.batch_pend > 0:
            self.batch_pend = 0     # flushed in the middle of a batch (stats)
        return 0

    cdef int flush_conn(self, Conn *c) except -1:
        """Write c's pending chain; what cannot be written goes to enqueue."""
        cdef int32_t e = c.pend_head
        cdef uint32_t k
        cdef int sent, i
        cdef Pending *p
        cdef bint framed = c.frames     # in a register: the loop stores through self
        if not c.closing and not c.write_dead and c.q.live == 0:
            # Nothing queued ahead: write straight from the receive buffers.
            while e >= 0:
                k = 0
                while e >= 0 and k < SEND_BATCH:
                    p = &self.pend[e]
                    self.sent_entries[k] = e
                    if framed and self.pack_frame(&e, k):
                        k += 1
                        continue
                    if p.slot >= 0:
                        self.siov[k].iov_base = self.riov[p.slot].iov_base
                        self.siov[k].iov_len = self.rhdrs[p.slot].msg_len
                        self.sreply[k] = SENT_DELIVERY
                    else:
                        self.siov[k].iov_base = p.pkt.data
                        self.siov[k].iov_len = p.pkt.len
                        self.sreply[k] = SENT_REPLY if p.pkt.reply else SENT_DELIVERY
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

    cdef uint32_t pack_frame(self, int32_t *e, uint32_t k) noexcept:
        """siov[k]: a frame of the deliveries from *e on, copied (cheaper than the
        kernel's work per packet), *e moved past them; 0 (nothing done) unless two fit."""
        cdef char *out = self.frame_area + <size_t>k * FRAME_BYTES
        cdef size_t at = frame_start(out)
        cdef int32_t next = e[0], slot
        cdef uint32_t m = 0, length
        cdef uint64_t nbytes = 0
        while next >= 0 and m < FRAME_MSGS and self.pend[next].slot >= 0:
            slot = self.pend[next].slot
            length = self.rhdrs[slot].msg_len
            if at + FRAME_ENTRY_HEAD + length > FRAME_BYTES:
                break
            at = frame_put(out, at, <const char *>self.riov[slot].iov_base, length)
            nbytes += length
            m += 1
            next = self.pend[next].next
        if m < 2:
            return 0
        self.siov[k].iov_base = out
        self.siov[k].iov_len = at
        self.sreply[k] = SENT_FRAME
        self.fmsgs[k] = m
        self.fbytes[k] = nbytes
        e[0] = next
        return m

    cdef int send_prepared(self, Conn *c, uint32_t k) except -1:
        """One sendmmsg of siov[0:k] to c, counted (deliveries, the ones in
        frames too, apart from control replies). Returns how many were sent:
        0 when the socket is full, or after a failure was handled."""
        cdef int sent = sendmmsg(c.fd, self.shdrs, k, MSG_DONTWAIT | MSG_NOSIGNAL)
        cdef int i, replies = 0
        cdef uint64_t nbytes = 0, msgs = 0
        if sent < 0:
            if errno != EAGAIN:
                self.send_failed(c, errno)
            return 0
        for i in range(sent):
            if self.sreply[i] == SENT_DELIVERY:
                nbytes += self.siov[i].iov_len
            elif self.sreply[i] == SENT_REPLY:
                replies += 1
            else:
                msgs += self.fmsgs[i] - 1       # a frame's deliveries, the frame counted below
                nbytes += self.fbytes[i]
        msgs += sent - replies
        c.counts.msgs_out += msgs
        c.counts.bytes_out += nbytes
        c.counts.replies_out += replies
        self.tot.msgs_out += msgs
        self.tot.bytes_out += nbytes
        self.tot.replies_out += replies
        return sent

    cdef int enqueue(self, Conn *c, Pending *e) except -1:
        """Apply c's soft and hard modes (flood.on_full) to a delivery that
        would block."""
        cdef Packet *pkt = e.pkt
        cdef uint64_t length = pkt.len if pkt != NULL else self.rhdrs[e.slot].msg_len
        cdef int action = on_full(&self.flood, c, length, pkt != NULL and pkt.reply,
                                  pkt == NULL and self.batch_pkts[e.slot] == NULL, self.now)
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
        if pkt == NULL:
            pkt = self.shared_packet(e)
        if pkt == NULL or sq_push(&c.q, pkt) < 0:
            c.counts.drops_hard += 1
            self.tot.drops_hard += 1
            return 0
        c.acct.queued_bytes += pkt.len
        if action == FLOOD_QUEUE_BLOCK:
            start_blocking(&self.flood, c, self.now)
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
        cdef uint32_t k, i, m = 0
        cdef int sent
        cdef uint64_t queued
        while c.q.live:
            k = sq_select(&c.q, c.order, self.spos, self.ssel, SEND_BATCH)
            if c.frames and k > 1:      # a link's: as many as fit in one frame
                m = self.fmsgs[0] = frame_packets(self.frame_area, self.ssel, k, &self.siov[0].iov_len, &self.fbytes[0])
            if m:
                self.siov[0].iov_base = self.frame_area
                self.sreply[0] = SENT_FRAME
                sent = m if self.send_prepared(c, 1) else 0
            for i in range(0 if m else k):
                self.siov[i].iov_base = self.ssel[i].data
                self.siov[i].iov_len = self.ssel[i].len
                self.sreply[i] = self.ssel[i].reply
            if not m:
                sent = self.send_prepared(c, k)
            if sent == 0:
                break
            queued = c.q.bytes
            sq_consume(&c.q, self.spos, sent)
            c.acct.queued_bytes -= queued - c.q.bytes
            if <uint32_t>sent < k and not m:
                break
            m = 0
        self.update_interest(c)
        if c.blocking:
            self.release(c)
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
            self.release(c)
        return self.update_interest(c)

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
