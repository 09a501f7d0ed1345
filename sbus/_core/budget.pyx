# cython: language_level=3
"""Per-uid accounts for the budgets (see budget.pxd), and pattern_cost."""
from libc.stdint cimport uint32_t, uint64_t, int64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memchr

from sbus._core.index cimport Sub, Node

cdef enum:
    INITIAL_SIZE = 64


cdef inline size_t chunk(size_t n) noexcept nogil:
    """What glibc malloc takes for n bytes: n plus its 8-byte header, in
    16-byte steps, at least 32."""
    n = (n + 8 + 15) & ~(<size_t>15)
    return n if n > 32 else 32


cdef size_t pattern_cost(const char *pat, size_t n) noexcept nogil:
    cdef size_t segments = 1
    cdef const char *p = pat
    cdef const char *end = pat + n
    cdef const char *slash
    while p < end:
        slash = <const char *>memchr(p, b'/', end - p)
        if slash == NULL:
            break
        segments += 1
        p = slash + 1
    # The Sub and its pattern copy; its slot in the owner's list and in its
    # node's list, each list up to twice its size after doubling.
    # Per segment: a Node, its segment copy (the bytes themselves are counted
    # in n once more), and up to two slots of the index's hash table.
    return (chunk(sizeof(Sub)) + chunk(n) + 4 * sizeof(void *) +
            n + segments * (chunk(sizeof(Node)) + 32 + 2 * sizeof(void *)))


cdef inline uint32_t slot_of(int64_t uid, uint32_t size) noexcept nogil:
    return <uint32_t>((<uint64_t>uid * 0x9E3779B97F4A7C15ULL) >> 32) & (size - 1)


cdef int accounts_init(Accounts *a) noexcept nogil:
    a.size = INITIAL_SIZE
    a.n = 0
    a.table = <Account **>calloc(a.size, sizeof(Account *))
    return 0 if a.table != NULL else -1


cdef void accounts_free(Accounts *a) noexcept nogil:
    cdef uint32_t i
    cdef Account *acct
    cdef Account *nxt
    if a.table == NULL:
        return
    for i in range(a.size):
        acct = a.table[i]
        while acct != NULL:
            nxt = acct.next
            free(acct)
            acct = nxt
    free(a.table)
    a.table = NULL
    a.n = 0


cdef void grow(Accounts *a) noexcept nogil:
    cdef uint32_t size = a.size * 2
    cdef Account **table = <Account **>calloc(size, sizeof(Account *))
    cdef uint32_t i, k
    cdef Account *acct
    cdef Account *nxt
    if table == NULL:
        return                  # longer chains, still correct
    for i in range(a.size):
        acct = a.table[i]
        while acct != NULL:
            nxt = acct.next
            k = slot_of(acct.uid, size)
            acct.next = table[k]
            table[k] = acct
            acct = nxt
    free(a.table)
    a.table = table
    a.size = size


cdef Account *account_get(Accounts *a, int64_t uid, uint64_t max_conns,
                          uint64_t max_sub_bytes, uint64_t max_queued_bytes) noexcept nogil:
    cdef uint32_t k = slot_of(uid, a.size)
    cdef Account *acct = a.table[k]
    while acct != NULL:
        if acct.uid == uid:
            return acct
        acct = acct.next
    acct = <Account *>calloc(1, sizeof(Account))
    if acct == NULL:
        return NULL
    acct.uid = uid
    acct.max_conns = max_conns
    acct.max_sub_bytes = max_sub_bytes
    acct.max_queued_bytes = max_queued_bytes
    acct.next = a.table[k]
    a.table[k] = acct
    a.n += 1
    if a.n > a.size:
        grow(a)
    return acct


cdef void account_drop_if_idle(Accounts *a, Account *acct) noexcept nogil:
    """Free an account whose uid has no connection left (its subscriptions
    and queues went with them)."""
    cdef Account **link
    if acct.conns:
        return
    link = &a.table[slot_of(acct.uid, a.size)]
    while link[0] != NULL:
        if link[0] == acct:
            link[0] = acct.next
            a.n -= 1
            free(acct)
            return
        link = &link[0].next


def cost(bytes pattern):
    """pattern_cost of a stored pattern, for tests and docs."""
    return pattern_cost(pattern, len(pattern))
