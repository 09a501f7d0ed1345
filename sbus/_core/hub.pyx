# cython: language_level=3
"""The broker around its message path (see hub.pxd): the rooms' state, made
from the configuration; acting on what the rooms decide (accept and admit,
SUB and UNSUB, control messages and the link, holding the bus); tearing
closed connections down at the end of the turn; the records and the Python
surface. broker.pyx's Broker is a Hub with the message path and the loop.
"""
from libc.errno cimport errno
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcmp, memcpy
from posix.unistd cimport close

from sbus._core cimport report
from sbus._core.acl cimport (
    Table, ACL_DISCONNECT, ACL_MISS, acl_decide, acl_flags, acl_memo_put, acl_rule)
from sbus._core.conn cimport (
    Conn, MODE_QUEUE, R_FLOOD, R_SHUTDOWN, R_POLICY_DENIED, R_POLICY_REFUSED, R_POLICY_REVOKED)
from sbus._core.control cimport (
    Control, CTL_ANSWER, CTL_STATS, CTL_MODES, CTL_IGNORED, CTL_LOG, stats_reply)
from sbus._core.flood cimport (
    flood_init, flood_free, flood_reserve, stop_blocking, next_resumed, forget, timed_out,
    timeout_detail)
from sbus._core.flood cimport pause as flood_pause, release as flood_release
from sbus._core.includes.sys cimport (
    ucred, monotonic, malloc_trim, getsockopt, socklen_t,
    SOL_SOCKET)
from sbus._core.loop cimport EV_READ, EV_WRITE
from sbus._core.loop import make_poller
from sbus._core.peers cimport (
    peers_init, peers_free, accept_peer, fd_exhausted, after_closing, refusal, give_sndbuf,
    conn_open, conn_close, conn_free, ACCEPT_AGAIN, ACCEPT_EXHAUSTED, ACCEPT_FAILED,
    EXHAUSTED_LOG, EXHAUSTED_PAUSE)
from sbus._core.protocol cimport CredForm, CRED_CANONICAL_MAX, cred_canonical_prefix
from sbus._core.report cimport Budgets
from sbus._core.subs cimport subs_init, subs_free, drop_all, policy_refusal
from sbus._core.subs cimport subscribe as subs_subscribe, unsubscribe as subs_unsubscribe

import os
import pwd

from sbus.logschema import (
    ACCEPT_ERROR, ACCEPT_PAUSED, CLIENT_CONNECT, CLIENT_DISCONNECT, CMSG_IGNORED,
    DELTA_FIELDS, FD_EXHAUSTED, POLICY_UID_FIELDS, PUBLISH_DENIED, PUBLISH_DENIED_PER_S,
    SUBSCRIBE, UNSUBSCRIBE)
from sbus._core.policy import MODE_NAMES


cdef enum:
    SO_PEERGROUPS = 59      # Linux: the peer's supplementary groups at connect
    PEER_GROUPS_MAX = 1024


cdef class Hub:
    """The broker's state and slow paths; see Broker (broker.pyx)."""

    def __cinit__(self, *args, **kwargs):
        self.wakeup_fd = -1
        self.rng = 0x9E3779B97F4A7C15 ^ <uint64_t>(<size_t><void *>self)

    def __init__(self, int listen_fd, config, *, allowed_uids=(), int access_mode=-1,
                 int wakeup_fd=-1, on_event=None, on_message=None, on_tick=None,
                 double tick_interval=0.0):
        if MODE_NAMES.index(config.hard) == MODE_QUEUE:
            raise ValueError("the hard mode is discard, block or error")
        self.poller = make_poller(config.backend)
        peers_init(&self.peers, listen_fd, self.poller.fd_limit(), config, allowed_uids,
                   access_mode)
        subs_init(&self.subs, config)
        flood_init(&self.flood, config)
        self.ctl = Control(self.peers.own_uid)
        self.wakeup_fd = wakeup_fd
        self.max_message = config.max_message
        self.auto_close = config.auto_close
        self.log_messages = config.log_messages
        self.on_event = on_event
        self.on_message = on_message
        self.on_tick = on_tick
        self.tick_interval = tick_interval
        self.close_details = {}
        self.last_totals = None
        self.tables = {}
        self.user_names = {}
        self.policy_uids = {}
        self.grow_lists(64)
        self.poller.set(listen_fd, EV_READ)
        if wakeup_fd >= 0:
            self.poller.set(wakeup_fd, EV_READ)
        self.started = self.now = monotonic()
        self.running = True

    def __dealloc__(self):
        peers_free(&self.peers)
        subs_free(&self.subs)
        flood_free(&self.flood)
        free(self.recips)
        free(self.touched)
        free(self.blockers)
        free(self.closing)

    # ---- the message path's: Broker defines them ---------------------------

    cdef int flush_pending(self) except -1:
        raise NotImplementedError

    cdef int flush_deliveries(self) except -1:
        raise NotImplementedError

    cdef int reply(self, Conn *c, bytes packet) except -1:
        raise NotImplementedError

    cdef int mark_closing(self, Conn *c, int reason, detail) except -1:
        raise NotImplementedError

    cdef int release_buffers(self) except -1:
        raise NotImplementedError

    cdef bint at_safe_point(self) noexcept:
        return False

    # ---- the loop's slow side ----------------------------------------------

    def stop(self, reason="stopped"):
        """Make run() return after the current loop turn."""
        self.running = False
        if self.stop_reason is None:
            self.stop_reason = reason

    def close(self):
        """Disconnect every client (reason 'shutdown'), logging each."""
        cdef int fd
        self.flush_pending()
        for fd in range(self.peers.cap):
            if self.peers.conns[fd] != NULL:
                self.mark_closing(self.peers.conns[fd], R_SHUTDOWN, None)
        self.finalize_closing()
        self.raise_callback_error()

    cdef int poll_timeout(self) noexcept:
        cdef int timeout = -1
        cdef double wait
        if self.tick_interval > 0:
            # From the turn's own clock, read after the last wait: a tick
            # comes at most that turn's work late, for a clock read a turn.
            wait = self.next_tick - self.now
            timeout = 0 if wait <= 0 else <int>(wait * 1000) + 1
        if self.flood.nblocking and (timeout < 0 or timeout > 100):
            timeout = 100       # re-check block timeouts
        return timeout

    cdef int housekeeping(self) except -1:
        if not (self.tick_interval > 0 and self.now >= self.next_tick):
            return 0
        self.next_tick = self.now + self.tick_interval
        if self.peers.counts.disconnects != self.trimmed_at:
            # Clients left: hand the memory they used back to the system,
            # so RSS follows the load down after a churn.
            self.trimmed_at = self.peers.counts.disconnects
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

    # ---- accepting (the decisions: peers.pxd) ------------------------------

    cdef int accept_clients(self) except -1:
        cdef int fd, _attempt, decided, err
        cdef ucred cred
        for _attempt in range(ACCEPT_BATCH):
            fd = accept_peer(&self.peers, &cred)
            if fd >= 0:
                self.admit(fd, &cred)
            elif fd == ACCEPT_AGAIN:
                return 0
            elif fd == ACCEPT_EXHAUSTED:
                err = errno     # before fd_exhausted's own calls
                decided = fd_exhausted(&self.peers)
                if decided & EXHAUSTED_LOG:
                    self.emit(FD_EXHAUSTED, {"errno": err, "connected": self.peers.n})
                if decided & EXHAUSTED_PAUSE:
                    self.poller.set(self.peers.listen_fd, 0)
                    self.emit(ACCEPT_PAUSED, {"connected": self.peers.n})
                return 0
            elif fd == ACCEPT_FAILED:
                self.emit(ACCEPT_ERROR, {"errno": errno})
                return 0
        return 0

    cdef int admit(self, int fd, ucred *cred) except -1:
        """Take fd on as a connection, or close it with a disconnect record."""
        cdef Conn *c
        record = refusal(&self.peers, fd, cred, self.poller.name)
        if record is not None:
            return self.emit(CLIENT_DISCONNECT, record)
        give_sndbuf(&self.peers, fd)
        c = self.open_conn(fd, cred, False)
        if self.policy is not None:
            self.give_access(c)
        if self.flood.nblocking:
            self.pause(c)
        else:
            self.update_interest(c)
        self.emit(CLIENT_CONNECT, report.ident(c))
        if self.ctl.link != NULL:
            self.link_note(b"CMSG link/conn\0%d/%d/%d" % (c.gid, c.uid, c.pid))
        return 0

    cdef Conn *open_conn(self, int fd, ucred *cred, bint link) except NULL:
        """The message path writes a message's recipients, the turn's touched
        and closing connections and the paused into lists it never bounds
        (grow_lists): every connection in the table must have its entry."""
        try:
            self.grow_lists(self.peers.n + 1)
        except MemoryError:
            close(fd)
            raise
        return conn_open(&self.peers, fd, cred, link, self.now)

    # ---- the access policy (sbus.access; the decisions are its own) -------

    cdef int give_access(self, Conn *c) except -1:
        """Point c at its identity's publish table, compiling it the first
        time the identity connects. The user name and the supplementary
        groups are looked up only if some rule needs them (NSS can block)."""
        cdef uint32_t groups[PEER_GROUPS_MAX]
        cdef socklen_t size = sizeof(groups)
        cdef uint32_t i
        cdef Table table
        policy = self.policy
        user = None
        gids = ()
        if policy.uses_user_name:
            if c.uid not in self.user_names:
                try:
                    self.user_names[c.uid] = pwd.getpwuid(c.uid).pw_name
                except KeyError:
                    self.user_names[c.uid] = None
            user = self.user_names[c.uid]
        if policy.uses_groups and getsockopt(c.fd, SOL_SOCKET, SO_PEERGROUPS, groups,
                                             &size) == 0:
            gids = tuple(groups[i] for i in range(size // sizeof(uint32_t)))
        access = policy.compile_for(c.uid, c.gid, gids, user)
        table = self.tables.get(access)
        if table is None:
            table = self.tables[access] = Table(access)
        c.access = &table.t
        c.memo.len = 0          # decided by the table it had, if any
        return 0

    cdef int policy_decide(self, Conn *c, const char *key, size_t klen,
                           const CredForm *form) except? -2:
        """acl_decide by c's table for key, a !/cred/ key (form) judged in its
        canonical form as delivery reads it (sbus.access.compiled's contract);
        remembered in c.memo for the key as sent."""
        cdef char canon[CRED_CANONICAL_MAX]
        cdef size_t clen
        cdef size_t rest
        cdef char *alt
        cdef int decided = ACL_MISS
        if form != NULL:
            clen = cred_canonical_prefix(form, canon)
            if not (clen == form.prefix_len and memcmp(canon, key, clen) == 0):
                rest = klen - form.prefix_len
                alt = <char *>malloc(clen + rest)
                if alt == NULL:
                    raise MemoryError()
                memcpy(alt, canon, clen)
                memcpy(alt + clen, key + form.prefix_len, rest)
                decided = acl_decide(c.access, alt, clen + rest)
                free(alt)
        if decided == ACL_MISS:
            decided = acl_decide(c.access, key, klen)
        acl_memo_put(&c.memo, key, klen, decided)
        return decided

    cdef int deny_publish(self, Conn *c, const char *key, size_t klen, int decided) except -1:
        """A publish the policy denies: delivered to no one, counted, logged
        (at most PUBLISH_DENIED_PER_S records a second; the next one written
        says how many were left out), then dropped or c closed."""
        cdef uint8_t flags = acl_flags(c.access, decided)
        cdef uint32_t rule = acl_rule(c.access, decided)
        c.denied += 1
        self.denied += 1
        self.count_for_uid(c.uid, 0)
        action = "disconnect" if flags & ACL_DISCONNECT else "drop"
        if self.now - self.deny_window >= 1.0:
            self.deny_window = self.now
            self.deny_logged = 0
        if self.deny_logged < PUBLISH_DENIED_PER_S:
            self.deny_logged += 1
            record = report.ident(c)
            record.update(key=report.text(key, klen), rule=rule, action=action,
                          suppressed=self.deny_suppressed)
            self.deny_suppressed = 0
            self.emit(PUBLISH_DENIED, record)
        else:
            self.deny_suppressed += 1
        if flags & ACL_DISCONNECT:
            return self.mark_closing(c, R_POLICY_DENIED, (
                f"publish of {report.text(key, klen)!r} denied by "
                + (f"rule {rule}" if rule else "the default")))
        return 0

    def set_policy(self, policy):
        """Enforce policy (an sbus.access Policy, or None for none) from the
        next message on: every connection's identity is compiled again, and
        a connection holding a pattern the new policy refuses is closed
        (policy_revoked), before the next turn reads anything. Call it
        between turns. Returns (identities, revoked)."""
        cdef int fd
        cdef uint32_t j
        cdef Conn *c
        cdef int revoked = 0
        old = self.tables         # the old tables live until every connection moved
        decided = {}              # (Access, pattern) -> refusal: many hold the same
        self.policy = policy
        self.tables = {}
        self.user_names = {}
        for fd in range(self.peers.cap):
            c = self.peers.conns[fd]
            if c == NULL or c.link:
                continue
            if policy is None:
                c.access = NULL
                continue
            self.give_access(c)
            if c.closing:
                continue
            access = <object>c.access.access
            for j in range(c.nsubs):
                pattern = c.subs[j].pattern[:c.subs[j].len]
                key = (access, pattern)
                if key not in decided:
                    decided[key] = policy_refusal(access, pattern)
                refused = decided[key]
                if refused is not None:
                    revoked += 1
                    self.mark_closing(c, R_POLICY_REVOKED, refused[1])
                    break
        if self.nclosing:
            self.finalize_closing()
        del old
        return len(self.tables), revoked

    cdef int count_for_uid(self, uint32_t uid, int which) except -1:
        """One more denial (0: a publish, 1: a SUB) for uid: on the denial
        paths only, never on a delivered message's."""
        counts = self.policy_uids.get(uid)
        if counts is None:
            counts = self.policy_uids[uid] = [0, 0]
        counts[which] += 1
        return 0

    def policy_by_uid(self):
        """Each uid the policy denied something since the broker started
        (``logschema.POLICY_UID_FIELDS``), by uid."""
        return [dict(zip(POLICY_UID_FIELDS, (uid, *counts)))
                for uid, counts in sorted(self.policy_uids.items())]

    def policy_counts(self):
        """The policy's counters, for a live upgrade (handover.pyx)."""
        cdef int fd
        cdef Conn *c
        conns = {}
        for fd in range(self.peers.cap):
            c = self.peers.conns[fd]
            if c != NULL and c.denied:
                conns[str(c.id)] = c.denied
        return {"denied": self.denied, "subs_refused": self.subs.policy_refused,
                "conns": conns,
                "uids": {str(uid): counts for uid, counts in self.policy_uids.items()}}

    def restore_policy_counts(self, counts):
        """policy_counts() of the old process, once its connections are restored."""
        cdef int fd
        cdef Conn *c
        if not counts:
            return
        self.denied = counts["denied"]
        self.subs.policy_refused = counts["subs_refused"]
        # Absent from an sbusd before the per-uid counters.
        self.policy_uids = {int(uid): list(n) for uid, n in counts.get("uids", {}).items()}
        conns = counts["conns"]
        for fd in range(self.peers.cap):
            c = self.peers.conns[fd]
            if c != NULL:
                c.denied = conns.get(str(c.id), 0)

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
        if (self.recips == NULL or self.touched == NULL or self.blockers == NULL or
                self.closing == NULL):
            raise MemoryError()
        flood_reserve(&self.flood, cap)
        self.list_cap = cap
        return 0

    # ---- subscriptions (the decisions: subs.pxd) ----------------------------

    cdef int subscribe(self, Conn *c, const char *pat, size_t n) except -1:
        record, reason, detail, stored = subs_subscribe(
            &self.subs, c, pat, n, self.ctl.nested_prefix(pat, n),
            <object>c.access.access if c.access != NULL else None)
        if record is not None:
            self.emit(SUBSCRIBE, record)
        if reason:
            if reason == R_POLICY_REFUSED:
                self.count_for_uid(c.uid, 1)
            return self.mark_closing(c, reason, detail)
        if self.ctl.link != NULL and c != self.ctl.link:
            self.link_note(b"CMSG link/sub\0" + stored)
        return 0

    cdef int unsubscribe(self, Conn *c, const char *pat, size_t n) except -1:
        record, reason, detail, stored = subs_unsubscribe(
            &self.subs, c, pat, n, self.ctl.nested_prefix(pat, n))
        if reason:
            return self.mark_closing(c, reason, detail)
        self.emit(UNSUBSCRIBE, record)
        if stored is not None and self.ctl.link != NULL and c != self.ctl.link:
            self.link_note(b"CMSG link/unsub\0" + stored)
        return 0

    # ---- control messages and the upstream link (control.pxd) --------------

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
        if self.ctl.link != NULL:
            raise ValueError("the broker has an upstream link already")
        cred.pid = os.getpid()
        cred.uid = self.peers.own_uid
        cred.gid = self.peers.own_gid
        give_sndbuf(&self.peers, fd)
        c = self.open_conn(fd, &cred, True)
        self.ctl.attach(c)
        self.update_interest(c)
        self.emit(CLIENT_CONNECT, report.ident(c))
        for k in range(self.peers.cap):
            other = self.peers.conns[k]
            if other == NULL or other == c or other.closing:
                continue
            self.link_note(b"CMSG link/conn\0%d/%d/%d" % (other.gid, other.uid, other.pid))
            for j in range(other.nsubs):
                self.link_note(b"CMSG link/sub\0" +
                               other.subs[j].pattern[:other.subs[j].len])
        self.flush_pending()
        return None

    cdef int link_note(self, bytes packet) except -1:
        if self.ctl.notes and not self.ctl.link.closing:
            self.reply(self.ctl.link, packet)
        return 0

    cdef int act(self, Conn *c, int action) except -1:
        if action == CTL_ANSWER:
            return self.reply(c, self.ctl.answer)
        if action == CTL_MODES:
            return self.release(c) if c.blocking else 0
        if action == CTL_STATS:
            # Count the deliveries so far first; the batch being read still
            # points into its receive slots, so they stay.
            self.flush_deliveries()
            return self.reply(c, stats_reply(self.stats(), self.max_message))
        if action == CTL_IGNORED:
            return self.emit(CMSG_IGNORED, self.ctl.answer)
        if action == CTL_LOG:
            event, fields = self.ctl.answer
            return self.emit(event, fields)
        return 0

    # ---- blocking the bus (flood.pxd) ---------------------------------------

    cdef int release(self, Conn *c) except -1:
        if flood_release(&self.flood, c):
            self.resume_all()
        return 0

    cdef int pause(self, Conn *c) except -1:
        if flood_pause(&self.flood, c):
            self.update_interest(c)
        return 0

    cdef int resume_all(self) except -1:
        cdef Conn *c = next_resumed(&self.flood)
        while c != NULL:
            if not c.closing:
                self.update_interest(c)
            c = next_resumed(&self.flood)
        return 0

    cdef int check_block_timeouts(self) except -1:
        cdef int fd
        cdef Conn *c
        for fd in range(self.peers.cap):
            c = self.peers.conns[fd]
            if c != NULL and timed_out(&self.flood, c, self.now):
                self.mark_closing(c, R_FLOOD, timeout_detail(&self.flood))
        return 0

    cdef int update_interest(self, Conn *c) except -1:
        cdef int mask = 0
        if not c.paused:
            mask |= EV_READ
        if c.q.live:
            mask |= EV_WRITE
        return self.poller.set(c.fd, mask)

    # ---- closing -------------------------------------------------------------

    cdef int finalize_closing(self) except -1:
        cdef uint32_t i, j
        cdef Conn *c
        for i in range(self.nclosing):
            c = self.closing[i]
            self.poller.set(c.fd, 0)
            if not self.ctl.detach(c) and self.ctl.link != NULL:
                for j in range(c.nsubs):
                    self.link_note(b"CMSG link/unsub\0" + c.subs[j].pattern[:c.subs[j].len])
                self.link_note(b"CMSG link/gone\0%d/%d/%d" % (c.gid, c.uid, c.pid))
            drop_all(&self.subs, c)
            self.count_drops_disconnect(c, conn_close(&self.peers, c))
            if c.paused:
                forget(&self.flood, c)
            record = report.disconnect(c, self.close_details.pop(c.id, None), self.now)
            if c.blocking and stop_blocking(&self.flood, c):
                self.resume_all()
            conn_free(c)
            self.emit(CLIENT_DISCONNECT, record)
        self.nclosing = 0
        if after_closing(&self.peers):
            self.poller.set(self.peers.listen_fd, EV_READ)
        if self.auto_close and self.peers.counts.had_client and self.peers.n == 0:
            self.stop("auto_close")
        return 0

    cdef void count_drops_disconnect(self, Conn *c, uint64_t n) noexcept:
        c.counts.drops_disconnect += n
        self.tot.drops_disconnect += n

    # ---- reporting -----------------------------------------------------------

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

    def totals(self):
        """Broker-wide counters (cumulative since start)."""
        cdef Budgets budgets
        budgets.sub_bytes = self.subs.bytes
        budgets.conns_refused = self.peers.counts.refused
        budgets.subs_refused = self.subs.refused
        budgets.denied = self.denied
        budgets.policy_subs_refused = self.subs.policy_refused
        return report.totals(self.peers.conns, self.peers.cap, self.peers.n,
                             self.peers.counts.connects, self.peers.counts.disconnects, &self.tot,
                             self.subs.index.nsubs, &budgets)

    def stats(self):
        """A snapshot: totals, and counters and modes per connected client."""
        upstream = self.ctl.upstream_state
        return {"uptime_s": round(monotonic() - self.started, 3), "backend": self.poller.name,
                "totals": self.totals(),
                "clients": report.entries(self.peers.conns, self.peers.cap),
                "users": self.users(),
                **({"policy_uids": self.policy_by_uid()} if self.policy is not None
                   or self.policy_uids else {}),
                **({"upstream": upstream} if upstream is not None else {})}

    def users(self):
        """Each connected uid's usage against its budgets."""
        return report.users(&self.peers.accounts)

    def take_changed_clients(self):
        """Entries, as in stats(), for the clients that connected or changed
        since the last call (see report.take_changed_entries)."""
        return report.take_changed_entries(self.peers.conns, self.peers.cap)

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
        return report.take_flood_records(self.peers.conns, self.peers.cap)

    @property
    def backend(self):
        return self.poller.name

    @property
    def backend_fallback(self):
        """Why the backend asked for is not the one running, or None."""
        return self.poller.fallback

    @property
    def client_count(self):
        return self.peers.n

    # ---- the live upgrade ------------------------------------------------------

    cdef int quiesce(self) except -1:
        """Bring a broker whose run() has returned to the hand-over's safe
        point: every delivery of the last turn written or queued, every
        connection marked closing torn down, nothing pending. Nothing is read."""
        while not self.at_safe_point() or self.ntouched:
            self.flush_pending()
            if self.nclosing:
                self.finalize_closing()
        return self.raise_callback_error()

    cdef int resume(self) except -1:
        self.running = True
        self.stop_reason = None
        return 0

    cdef dict carry(self, Carried *out):
        out.tot = self.tot
        out.seq = self.seq
        out.trimmed_at = self.trimmed_at
        out.started = self.started
        return self.last_totals

    cdef int restore_carried(self, const Carried *c, object last_totals) except -1:
        self.tot = c.tot
        self.seq = c.seq
        self.trimmed_at = c.trimmed_at
        self.started = c.started
        self.last_totals = last_totals
        return 0
