# Budgets: what each uid may take from everyone (connections, subscription
# bytes, queued bytes), kept in one Account per uid that has a connection.
# A Conn points at its uid's Account, so the message path reaches it in O(1).
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t


cdef enum:
    UNLIMITED = 0xFFFFFFFFFFFFFFFF     # the budget of the exempt uid (sbusd's own)


cdef struct Account:
    Account *next               # hash chain in Accounts.table
    int64_t uid
    uint32_t conns
    uint64_t sub_bytes          # pattern_cost of every pattern its connections hold
    uint64_t queued_bytes       # bytes in its connections' send queues
    uint64_t max_conns          # its budgets: UNLIMITED if exempt
    uint64_t max_sub_bytes
    uint64_t max_queued_bytes


cdef struct Accounts:
    Account **table             # chained, keyed by uid
    uint32_t size               # power of two
    uint32_t n


cdef int accounts_init(Accounts *a) noexcept nogil        # -1: no memory
cdef void accounts_free(Accounts *a) noexcept nogil
# The uid's account, made with the given budgets if it has none; NULL: no memory.
cdef Account *account_get(Accounts *a, int64_t uid, uint64_t max_conns,
                          uint64_t max_sub_bytes, uint64_t max_queued_bytes) noexcept nogil
cdef void account_drop_if_idle(Accounts *a, Account *acct) noexcept nogil  # no conns: free

# The bytes one stored pattern costs the broker: its copy, its Sub, the slots
# that point at it, and a node (with its segment copy and table slot) for
# every segment, as if none were shared. An upper bound of what it allocates.
cdef size_t pattern_cost(const char *pat, size_t n) noexcept nogil
