# One connection as the broker keeps it: its record, its counters, and the
# enums that describe its state. Declarations only; peers.pyx owns the
# records (one calloc'd Conn per accepted socket, freed at teardown). Each
# room writes its own fields: subs the subscriptions (subs, nsubs, sub_bytes),
# flood the bus (blocking, block_since, paused), control the modes and link;
# the message path (broker.pyx) the pending chain, queue and counters.
from libc.stdint cimport uint8_t, int32_t, uint32_t, uint64_t, int64_t

from sbus._core.acl cimport AclTable, AclMemo
from sbus._core.budget cimport Account
from sbus._core.index cimport Sub
from sbus._core.sendq cimport SendQueue


# What a connection does with a delivery it cannot take now (CMSG blocking/...).
cdef enum Mode:
    MODE_QUEUE = 0
    MODE_DISCARD = 1
    MODE_BLOCK = 2
    MODE_ERROR = 3


# Why a connection was closed; named by report.REASON_NAMES (logschema's words).
cdef enum Reason:
    R_NONE = 0
    R_EOF
    R_ERROR
    R_PROTOCOL
    R_CRED
    R_BANG
    R_USER
    R_FLOOD
    R_OVERSIZE
    R_LIMIT
    R_SHUTDOWN
    R_FD_LIMIT
    R_SUB_BUDGET            # a SUB over a subscription-bytes budget
    R_CONN_BUDGET           # refused at accept: its uid's connection budget is full
    R_POLICY_DENIED         # a publish the access policy denies with on_deny = "disconnect"
    R_POLICY_REFUSED        # a SUB of a pattern the access policy refuses
    R_POLICY_REVOKED        # a policy reload refuses a pattern it holds
    R_COUNT                 # not a reason: one past the last


cdef struct Counters:
    uint64_t msgs_in        # MSG packets published
    uint64_t bytes_in
    uint64_t msgs_out       # MSG deliveries
    uint64_t bytes_out
    uint64_t replies_out    # control replies the broker wrote (whoami, stats)
    uint64_t drops_soft
    uint64_t drops_hard
    uint64_t drops_disconnect
    uint64_t blocks         # times this connection started holding the bus


# A connection's state as a periodic stats record last listed it: an idle
# connection is listed once, not in every record.
cdef struct Listed:
    Counters counts
    uint64_t queued_bytes
    uint32_t queued_msgs
    uint32_t nsubs
    uint8_t modes           # soft, hard, order and echo packed
    uint8_t ever


cdef struct Conn:
    int fd
    uint64_t id
    int64_t pid
    int64_t uid
    int64_t gid
    uint8_t soft            # Mode
    uint8_t hard            # Mode, never MODE_QUEUE
    uint8_t order           # sendq Order
    uint8_t echo
    uint8_t closing         # marked; torn down at the end of the loop turn
    uint8_t paused          # not read while the bus is blocked
    uint8_t blocking        # counted in Flood.nblocking
    uint8_t write_dead      # peer gone: deliveries are dropped, input read to EOF
    uint8_t link            # the upstream link (sbusd --upstream): sees private keys too
    uint8_t frames          # granted frames (link/frames, frames.pxd): sent to and taken from it so
    uint8_t recv_want       # packets its next read asks for (broker.read_want); 0: not read yet
    uint8_t recv_full       # its reads since recv_want last grew that filled it
    int reason              # Reason, once closing
    double connected_at
    double block_since
    SendQueue q
    Sub **subs
    uint32_t nsubs
    uint32_t subs_cap
    uint64_t sub_bytes      # budget.pattern_cost of its patterns
    Account *acct           # its uid's account (budgets)
    AclTable *access        # its identity's publish decisions (Hub.tables); NULL: no policy
    AclMemo memo            # its last publish decision from access (Hub.give_access forgets it)
    uint64_t denied         # its publishes the access policy denied
    uint64_t stamp          # seq of the last message it was picked for
    int32_t pend_head       # its deliveries pending in this batch
    int32_t pend_tail
    Counters counts
    Counters reported       # counts at the last flood summary
    Listed listed           # what the last periodic stats listing showed
