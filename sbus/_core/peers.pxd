# The connection table and who may join it: accepting, admitting or
# refusing a peer, the per-uid accounts and the one rule that charges them,
# the table's growth, and a connection's teardown. The broker embeds one
# Peers; it reads the table on the message path (conns[fd]) and changes it
# only through these functions. What to log and which interest to set stays
# the broker's: these return the decision.
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t

from sbus._core.budget cimport Account, Accounts
from sbus._core.conn cimport Conn, Counters, Listed
from sbus._core.includes.sys cimport ucred
from sbus._core.sendq cimport Packet


# What accept_peer returns when it has no descriptor (errno is kept).
cdef enum:
    ACCEPT_AGAIN = -1       # nothing more to accept now
    ACCEPT_RETRY = -2       # this one failed (EINTR, aborted, no credentials): go on
    ACCEPT_EXHAUSTED = -3   # out of descriptors or memory: fd_exhausted
    ACCEPT_FAILED = -4      # another error: log it, wait for the next event


# What fd_exhausted decided, as bits.
cdef enum:
    EXHAUSTED_LOG = 1       # the first time since a client left: log it
    EXHAUSTED_PAUSE = 2     # not even the spare helped: stop accepting (log it)


# The table's counters: kept as one struct so that the hand-over carries
# and restores them whole.
cdef struct PeerCounts:
    uint64_t connects
    uint64_t disconnects
    uint64_t next_id
    uint64_t refused        # refused at accept over a uid's connection budget
    bint had_client


cdef struct Peers:
    Conn **conns            # fd-indexed; NULL where no connection
    int cap
    uint32_t n
    PeerCounts counts
    Accounts accounts       # one per uid with a connection
    int fd_limit            # the poller watches descriptors below this
    int listen_fd
    int spare_fd            # given up when accept runs out of descriptors
    bint accept_paused
    bint exhausted_logged
    # Who may connect (-u, an abstract socket's mode) and what a uid may take.
    int64_t *allowed_uids
    int n_allowed
    int access_mode         # mode enforced at accept (abstract sockets), or -1
    int64_t own_uid
    int64_t own_gid
    uint64_t user_max_connections
    uint64_t user_sub_max_bytes
    uint64_t user_queue_max_bytes
    int sndbuf
    uint8_t soft            # the modes a connection starts in
    uint8_t hard
    uint8_t order


cdef int peers_init(Peers *t, int listen_fd, int fd_limit, config, allowed_uids,
                    int access_mode) except -1
cdef void peers_free(Peers *t) noexcept          # closes and frees every connection; all zeros: nothing

# accepting
cdef int accept_peer(Peers *t, ucred *cred) noexcept    # an fd with cred, or ACCEPT_*
cdef int fd_exhausted(Peers *t) noexcept                # EXHAUSTED_* bits
cdef bint after_closing(Peers *t) noexcept              # True: accept again
# None when the peer may connect; else fd is closed and this is its record.
cdef dict refusal(Peers *t, int fd, ucred *cred, str backend)
cdef int give_sndbuf(Peers *t, int fd) noexcept          # room for the largest packet

# The one charge-and-exemption rule: the uid's account, with its budgets
# unlimited for sbusd's own uid and for the link (docs/security.md).
cdef Account *account_for(Peers *t, int64_t uid, bint link) except NULL
# A record for fd in the table, in the default modes, charged to its account.
# Only through Hub.open_conn: the broker's per-connection lists must grow first.
cdef Conn *conn_open(Peers *t, int fd, ucred *cred, bint link, double now) except NULL
# Out of the table: fd closed, queue dropped (returns how many packets),
# account uncharged. Its subscriptions must be gone already; conn_free frees it.
cdef uint64_t conn_close(Peers *t, Conn *c) noexcept
cdef void conn_free(Conn *c) noexcept

# Every connection: fd = 0, then while (c := next_conn(t, &fd)) != NULL.
cdef Conn *next_conn(Peers *t, int *fd) noexcept nogil  # at *fd or after, *fd past it


# ---- the hand-over (handover.pyx)

# A connection's record as it crosses: who it is, whether its peer stopped
# reading (the message path's write_dead), what it counted. Its modes
# (control), the bus (flood), its subscriptions (subs) and its queue cross
# through their own rooms.
cdef struct ConnRecord:
    uint64_t id
    int64_t pid
    int64_t uid
    int64_t gid
    uint8_t link
    uint8_t frames
    uint8_t write_dead
    double connected_at
    Counters counts
    Counters reported
    Listed listed


cdef inline int listener(const Peers *t) noexcept nogil:
    return t.listen_fd

cdef inline bint watchable(const Peers *t, int fd) noexcept nogil:
    return fd < t.fd_limit

cdef inline uint32_t conn_count(const Peers *t) noexcept nogil:
    return t.n

cdef void carry_counts(const Peers *t, PeerCounts *out) noexcept
cdef void restore_counts(Peers *t, const PeerCounts *k) noexcept
cdef void conn_carry(const Conn *c, ConnRecord *out) noexcept
# Onto a record conn_open made with k's credentials (Hub.open_conn).
cdef void conn_restore(Conn *c, const ConnRecord *k) noexcept
cdef int restore_queued(Conn *c, Packet *p) except -1   # p queued for c, charged to its uid
