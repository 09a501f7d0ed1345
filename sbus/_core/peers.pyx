# cython: language_level=3
"""The connection table and who may join it (see peers.pxd): accept, the
admission checks (-u, the socket mode, the descriptor limit, the uid's
connection budget), the one rule that charges a connection to its uid's
account, table growth, and teardown."""
from libc.errno cimport errno, EAGAIN, EINTR, ECONNABORTED, EMFILE, ENFILE, ENOBUFS, ENOMEM
from libc.stdint cimport uint64_t, int64_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memset
from posix.fcntl cimport open as c_open, O_RDONLY, O_CLOEXEC
from posix.unistd cimport close

from sbus._core cimport report
from sbus._core.budget cimport (
    UNLIMITED, accounts_init, accounts_free, account_get, account_drop_if_idle)
from sbus._core.conn cimport R_USER, R_FD_LIMIT, R_CONN_BUDGET
from sbus._core.includes.sys cimport (
    accept4, getsockopt, setsockopt, socklen_t, SOL_SOCKET, SO_PEERCRED, SO_SNDBUF,
    SO_SNDBUFFORCE, SOCK_NONBLOCK, SOCK_CLOEXEC)
from sbus._core.sendq cimport sq_clear, sq_push

import os

from sbus._core.policy import MODE_NAMES, ORDER_NAMES


cdef int peers_init(Peers *t, int listen_fd, int fd_limit, config, allowed_uids,
                    int access_mode) except -1:
    cdef int i
    memset(t, 0, sizeof(Peers))
    t.spare_fd = -1
    if accounts_init(&t.accounts) < 0:
        raise MemoryError()
    t.listen_fd = listen_fd
    t.fd_limit = fd_limit
    t.counts.next_id = 1
    t.soft = MODE_NAMES.index(config.soft)
    t.hard = MODE_NAMES.index(config.hard)
    t.order = ORDER_NAMES.index(config.order)
    t.sndbuf = <int>(2 * config.max_message + 65536)
    t.user_max_connections = config.user_max_connections
    t.user_sub_max_bytes = config.user_sub_max_bytes
    t.user_queue_max_bytes = config.user_queue_max_bytes
    t.access_mode = access_mode
    t.own_uid = os.getuid()
    t.own_gid = os.getgid()
    t.n_allowed = len(allowed_uids)
    if t.n_allowed:
        t.allowed_uids = <int64_t *>malloc(t.n_allowed * sizeof(int64_t))
        if t.allowed_uids == NULL:
            raise MemoryError()
        for i, uid in enumerate(allowed_uids):
            t.allowed_uids[i] = uid
    # A spare descriptor to give up when accept hits EMFILE (see fd_exhausted).
    t.spare_fd = c_open(b"/dev/null", O_RDONLY | O_CLOEXEC)
    return 0


cdef void peers_free(Peers *t) noexcept:
    cdef int fd
    cdef Conn *c
    if t.accounts.table == NULL:
        return      # peers_init never ran (or failed first): t is all zeros
    if t.conns != NULL:
        for fd in range(t.cap):
            c = t.conns[fd]
            if c != NULL:
                close(c.fd)
                sq_clear(&c.q)
                conn_free(c)
        free(t.conns)
        t.conns = NULL
    accounts_free(&t.accounts)
    free(t.allowed_uids)
    t.allowed_uids = NULL
    if t.spare_fd >= 0:
        close(t.spare_fd)
        t.spare_fd = -1


# ---- accepting ---------------------------------------------------------------

cdef int accept_peer(Peers *t, ucred *cred) noexcept:
    cdef socklen_t len_ = sizeof(ucred)
    cdef int fd = accept4(t.listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)
    if fd < 0:
        if errno == EAGAIN:
            return ACCEPT_AGAIN
        if errno == EINTR or errno == ECONNABORTED:
            return ACCEPT_RETRY
        if errno == EMFILE or errno == ENFILE or errno == ENOBUFS or errno == ENOMEM:
            return ACCEPT_EXHAUSTED
        return ACCEPT_FAILED
    if getsockopt(fd, SOL_SOCKET, SO_PEERCRED, cred, &len_) < 0:
        close(fd)
        return ACCEPT_RETRY
    return fd


cdef int fd_exhausted(Peers *t) noexcept:
    """Out of descriptors: give up the spare one to accept and drop the
    waiting connection, so a storm neither spins the loop nor stalls it;
    if even that fails, stop accepting until a client leaves."""
    cdef int fd, decided = 0
    if not t.exhausted_logged:
        t.exhausted_logged = True
        decided |= EXHAUSTED_LOG
    if t.spare_fd >= 0:
        close(t.spare_fd)
        t.spare_fd = -1
        fd = accept4(t.listen_fd, NULL, NULL, SOCK_CLOEXEC)
        if fd >= 0:
            close(fd)
        t.spare_fd = c_open(b"/dev/null", O_RDONLY | O_CLOEXEC)
        if t.spare_fd >= 0:
            return decided
    if not t.accept_paused:
        t.accept_paused = True
        decided |= EXHAUSTED_PAUSE
    return decided


cdef bint after_closing(Peers *t) noexcept:
    """Descriptors were just freed: take the spare again if fd_exhausted
    could not, and accept again if it had stopped."""
    t.exhausted_logged = False
    if t.spare_fd < 0:
        t.spare_fd = c_open(b"/dev/null", O_RDONLY | O_CLOEXEC)
    if t.accept_paused:
        t.accept_paused = False
        return True
    return False


cdef str refuse_peer(Peers *t, ucred *cred):
    """Why this peer may not connect, or None. -u lists the uids allowed;
    an abstract socket has no file mode, so the mode's meaning is
    enforced here: owner (and root), then group, then others."""
    cdef int k
    cdef int bits
    if t.n_allowed:
        for k in range(t.n_allowed):
            if t.allowed_uids[k] == cred.uid:
                break
        else:
            return f"uid {cred.uid} is not allowed (-u)"
    if t.access_mode >= 0 and cred.uid != 0 and cred.uid != t.own_uid:
        bits = (t.access_mode >> 3) & 7 if cred.gid == t.own_gid else t.access_mode & 7
        if not bits:
            return (f"uid {cred.uid} gid {cred.gid} may not connect to a socket "
                    f"of mode {t.access_mode:04o}")
    return None


cdef dict refusal(Peers *t, int fd, ucred *cred, str backend):
    cdef Account *acct
    cdef int reason = R_USER
    detail = refuse_peer(t, cred)
    if detail is None and fd >= t.fd_limit:
        reason = R_FD_LIMIT
        detail = f"fd {fd} is beyond what the {backend} backend can watch"
    if detail is None:
        try:
            acct = account_for(t, cred.uid, False)
        except MemoryError:
            close(fd)
            raise
        if acct.conns < acct.max_conns:
            return None
        reason = R_CONN_BUDGET
        detail = (f"uid {cred.uid} has {acct.conns} connections "
                  f"(--user-max-connections {acct.max_conns})")
        t.counts.refused += 1
        account_drop_if_idle(&t.accounts, acct)
    close(fd)
    record = report.refused(t.counts.next_id, cred.pid, cred.uid, cred.gid, reason, detail)
    t.counts.next_id += 1
    return record


cdef int give_sndbuf(Peers *t, int fd) noexcept:
    if setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &t.sndbuf, sizeof(int)) < 0:
        return setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &t.sndbuf, sizeof(int))
    return 0


# ---- the table -----------------------------------------------------------------

cdef Account *account_for(Peers *t, int64_t uid, bint link) except NULL:
    cdef bint exempt = link or uid == t.own_uid
    cdef Account *acct = account_get(&t.accounts, uid,
                                     UNLIMITED if exempt else t.user_max_connections,
                                     UNLIMITED if exempt else t.user_sub_max_bytes,
                                     UNLIMITED if exempt else t.user_queue_max_bytes)
    if acct == NULL:
        raise MemoryError()
    return acct


cdef int grow_table(Peers *t, int fd) except -1:
    cdef int k = t.cap * 2 if t.cap else 1024
    cdef Conn **grown
    while k <= fd:
        k *= 2
    grown = <Conn **>realloc(t.conns, k * sizeof(Conn *))
    if grown == NULL:
        raise MemoryError()
    memset(grown + t.cap, 0, (k - t.cap) * sizeof(Conn *))
    t.conns = grown
    t.cap = k
    return 0


cdef Conn *conn_open(Peers *t, int fd, ucred *cred, bint link, double now) except NULL:
    cdef Conn *c = NULL
    try:
        if fd >= t.cap:
            grow_table(t, fd)
        c = <Conn *>calloc(1, sizeof(Conn))
        if c == NULL:
            raise MemoryError()
        c.acct = account_for(t, cred.uid, link)
    except MemoryError:
        free(c)
        close(fd)
        raise
    c.acct.conns += 1
    c.fd = fd
    c.id = t.counts.next_id
    t.counts.next_id += 1
    c.pid = cred.pid
    c.uid = cred.uid
    c.gid = cred.gid
    c.soft = t.soft
    c.hard = t.hard
    c.order = t.order
    c.echo = 1
    c.link = link
    c.connected_at = now
    c.pend_head = -1
    c.pend_tail = -1
    t.conns[fd] = c
    t.n += 1
    t.counts.connects += 1
    t.counts.had_client = True
    return c


cdef uint64_t conn_close(Peers *t, Conn *c) noexcept:
    cdef uint64_t dropped
    close(c.fd)
    c.acct.queued_bytes -= c.q.bytes
    dropped = sq_clear(&c.q)
    c.acct.conns -= 1
    account_drop_if_idle(&t.accounts, c.acct)
    c.acct = NULL
    t.conns[c.fd] = NULL
    t.n -= 1
    t.counts.disconnects += 1
    return dropped


cdef void conn_free(Conn *c) noexcept:
    free(c.subs)
    free(c)


cdef Conn *next_conn(Peers *t, int *fd) noexcept nogil:
    cdef Conn *c
    while fd[0] < t.cap:
        c = t.conns[fd[0]]
        fd[0] += 1
        if c != NULL:
            return c
    return NULL


# ---- the hand-over -------------------------------------------------------------

cdef void carry_counts(const Peers *t, PeerCounts *out) noexcept:
    out[0] = t.counts


cdef void restore_counts(Peers *t, const PeerCounts *k) noexcept:
    cdef bint had_client = t.counts.had_client
    t.counts = k[0]
    t.counts.had_client = k.had_client or had_client


cdef void conn_carry(const Conn *c, ConnRecord *out) noexcept:
    out.id = c.id
    out.pid = c.pid
    out.uid = c.uid
    out.gid = c.gid
    out.link = c.link
    out.frames = c.frames
    out.write_dead = c.write_dead
    out.connected_at = c.connected_at
    out.counts = c.counts
    out.reported = c.reported
    out.listed = c.listed


cdef void conn_restore(Conn *c, const ConnRecord *k) noexcept:
    # Identity, credentials and link are conn_open's, from k.
    c.id = k.id
    c.frames = k.frames
    c.write_dead = k.write_dead
    c.connected_at = k.connected_at
    c.counts = k.counts
    c.reported = k.reported
    c.listed = k.listed


cdef int restore_queued(Conn *c, Packet *p) except -1:
    if sq_push(&c.q, p) < 0:
        raise MemoryError()
    c.acct.queued_bytes += p.len
    return 0
