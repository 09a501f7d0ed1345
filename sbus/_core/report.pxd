# Records about connections and the broker, as the log and the stats reply
# carry them: Python dicts keyed by sbus.logschema's field names, built only
# for events, ticks and control replies, never per message.
from libc.stdint cimport uint32_t, uint64_t, int64_t

from sbus._core.budget cimport Accounts
from sbus._core.conn cimport Conn, Counters


cdef enum:
    REFUSED_PATTERN_LOGGED = 256    # bytes of a refused pattern a record carries


# The broker-wide budget figures the totals carry.
cdef struct Budgets:
    uint64_t sub_bytes          # charged now
    uint64_t conns_refused      # since start
    uint64_t subs_refused
    uint64_t denied             # publishes the access policy denied
    uint64_t policy_subs_refused    # SUBs it refused


cdef str text(const char *s, size_t n)           # wire bytes as a log string
cdef dict ident(const Conn *c)                   # client, pid, uid, gid
cdef dict counters(const Conn *c)                # CLIENT_COUNTER_FIELDS
cdef dict entry(const Conn *c)                   # counters plus its modes (stats)
# A subscribe/unsubscribe record; refusal is logschema's reason, None when
# accepted. A refused pattern is logged cut to its first REFUSED_PATTERN_LOGGED
# bytes, then "...": it may be as long as a packet, and the client sent it to
# be refused.
cdef dict subscription(const Conn *c, const char *pattern, size_t n, str refusal)
cdef dict disconnect(const Conn *c, object detail, double now)
cdef dict refused(uint64_t id, int64_t pid, int64_t uid, int64_t gid, int reason, str detail)

# Over the broker's fd-indexed table (cap slots, NULL where no connection).
cdef list entries(Conn **table, int cap)                 # every open connection
cdef list take_changed_entries(Conn **table, int cap)    # changed since the last call
cdef list take_flood_records(Conn **table, int cap)      # drops/blocks grew since the last call
cdef list users(const Accounts *accounts)              # USER_FIELDS per uid, by uid
cdef dict totals(Conn **table, int cap, uint32_t nclients, uint64_t connects,
                 uint64_t disconnects, const Counters *tot, uint64_t subscriptions,
                 const Budgets *budgets)
