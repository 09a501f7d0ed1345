# cython: language_level=3
"""The per-message path of the sbus broker: receive, parse, match, fan out,
send, and the flood policy for what cannot be sent now.

The path is C over C structs (broker.pxd tells the life of a message): a
batch is read with recvmmsg into fixed slots, each MSG is matched through the
segment trie, every recipient gets a ``Pending`` entry, and at the end of the
batch each recipient's deliveries go out in one sendmmsg, straight from the
receive buffers. Only what cannot be sent without blocking is copied into a
shared Packet. Python is called only for sampled message records and control
replies; everything around the path (accept, subscriptions, closing, the
loop) is server.Server's.
"""
from libc.errno cimport errno, EAGAIN, EINTR, ECONNRESET, EPIPE
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memchr, memcmp, memcpy, memset

from sbus._core.conn cimport Conn, R_EOF, R_ERROR, R_PROTOCOL, R_BANG, R_FLOOD, R_OVERSIZE
from sbus._core.includes.sys cimport (
    recv, recvmmsg, sendmmsg, MSG_DONTWAIT, MSG_NOSIGNAL, MSG_TRUNC, MSG_PEEK,
    mmap, munmap, madvise, MAP_FAILED, PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS,
    MADV_DONTNEED,
)
from sbus._core.index cimport Sub, index_match
from sbus._core.loop cimport EV_HUP
from sbus._core.policy cimport (
    flood_action, FLOOD_QUEUE_BLOCK, FLOOD_DROP_SOFT, FLOOD_DROP_HARD, FLOOD_CLOSE_SOFT,
    FLOOD_CLOSE_HARD)
from sbus._core.protocol cimport (
    ParsedPacket, parse_packet, VERB_MSG, VERB_SUB, VERB_UNSUB, VERB_CMSG,
    CredForm, parse_cred_form, is_cred_key, check_rest, KEY_OK, CRED_EMPTY,
    CRED_CANONICAL_MAX, cred_canonical_prefix)
from sbus._core.sendq cimport (Packet, PacketStats, get_packet_stats, packet_new,
                               packet_release, sq_push, sq_select, sq_consume, sq_clear)

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
    # An empty field names no one, so it restricts nothing.
    if f.is_cred and ((f.gid != CRED_EMPTY and c.gid != f.gid) or
                      (f.uid != CRED_EMPTY and c.uid != f.uid) or
                      (f.pid != CRED_EMPTY and c.pid != f.pid)):
        return
    f.recips[f.n] = c
    f.n += 1


cdef str text(const char *s, size_t n):
    return s[:n].decode("utf-8", "backslashreplace")


cdef class Broker(Server):
    """The sbus broker: ``Broker(listen_fd, config, ...)`` as ``Server``
    takes it, serving the protocol with the per-message path below."""

    def __cinit__(self, int listen_fd, config, *args, **kwargs):
        cdef int i
        cdef void *area
        cdef size_t slot = <size_t>config.max_message + 1
        self.recv_area = NULL
        self.rng = 0x9E3779B97F4A7C15 ^ <uint64_t>(<size_t><void *>self)
        # One slot per batched packet, each big enough for the largest packet
        # plus one byte so MSG_TRUNC can tell an oversized one apart.
        # Mapped, not malloc'd, so the pages a burst of large packets touched
        # can be handed back (release_buffers) without freeing the area.
        self.recv_area_size = RECV_BATCH * slot
        area = mmap(NULL, self.recv_area_size, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if area == MAP_FAILED:
            raise MemoryError()
        self.recv_area = <char *>area
        memset(self.rhdrs, 0, sizeof(self.rhdrs))
        for i in range(RECV_BATCH):
            self.riov[i].iov_base = self.recv_area + i * slot
            self.riov[i].iov_len = slot
            self.rhdrs[i].msg_hdr.msg_iov = &self.riov[i]
            self.rhdrs[i].msg_hdr.msg_iovlen = 1
            self.batch_pkts[i] = NULL
        for i in range(SEND_BATCH):
            self.shdrs[i].msg_hdr.msg_iov = &self.siov[i]
            self.shdrs[i].msg_hdr.msg_iovlen = 1
        self.pend_cap = 1024
        self.pend = <Pending *>malloc(self.pend_cap * sizeof(Pending))
        if self.pend == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.pend)
        if self.recv_area != NULL:
            munmap(self.recv_area, self.recv_area_size)

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
        cdef unsigned int length
        cdef char probe
        cdef ssize_t r
        if self.nblocking:
            # A peer that hung up can never read its queue: drop it, so a dead
            # client cannot hold the bus. Its unread input waits, like every
            # publisher's, until the bus is released.
            if mask & EV_HUP and not c.write_dead:
                self.stop_writing(c)
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
        cdef int j
        cdef Conn *c
        for i in range(self.ntouched):
            c = self.touched[i]
            self.flush_conn(c)
            c.pend_head = -1
            c.pend_tail = -1
        self.ntouched = 0
        self.npend = 0
        for j in range(RECV_BATCH):
            if self.batch_pkts[j] != NULL:
                packet_release(self.batch_pkts[j])
                self.batch_pkts[j] = NULL
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
