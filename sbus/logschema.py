"""The broker's structured-log schema: event names and their fields.

This module is the single source of truth shared by the broker's logger
(which emits the records) and ``sbus.analytics`` (which reads them with a
declared Spark schema).  It is plain Python with no third-party imports so
the broker can use it on hosts without Java or PySpark.  The human-readable
version lives in ``docs/logging.md``; keep the two in step and bump
``SCHEMA_VERSION`` when a change would break an existing reader (renaming or
retyping a field, changing a field's meaning).  Adding an event or a field
is not a breaking change: readers must ignore what they do not know.

Every record is one JSON object per line carrying the ``COMMON_FIELDS`` plus
the fields listed for its event in ``EVENT_FIELDS``.  Field types are given
as the tags below so that each consumer can map them to its own type system.
A field name has the same type in every event that uses it; the analytics
job relies on that to read all events through one schema.
"""
from __future__ import annotations

SCHEMA_VERSION = 2

# --- field type tags -------------------------------------------------------
INT = "int"            # JSON integer, fits in a signed 64-bit integer
FLOAT = "float"        # JSON number
STR = "str"            # JSON string
BOOL = "bool"          # JSON true/false
TIMESTAMP = "timestamp"  # ISO-8601 UTC string, e.g. "2026-11-21T00:19:50.123456Z"
CONFIG = "config"      # JSON object, string -> scalar
TOTALS = "totals"      # JSON object with TOTALS_FIELDS
DELTA = "delta"        # JSON object with DELTA_FIELDS
COUNTERS = "counters"  # JSON object with CLIENT_COUNTER_FIELDS
COUNTERS_LIST = "counters[]"  # JSON array of COUNTERS objects
USERS_LIST = "users[]"  # JSON array of objects with USER_FIELDS

# --- event names (stable; analytics and dashboards match on them) -----------
BROKER_START = "broker_start"
BROKER_STOP = "broker_stop"
CLIENT_CONNECT = "client_connect"
CLIENT_DISCONNECT = "client_disconnect"
SUBSCRIBE = "subscribe"
UNSUBSCRIBE = "unsubscribe"
FLOOD = "flood"
STATS = "stats"
MESSAGE = "message"
# Operational events that carry no counters the analytics job aggregates.
# Their fields are not part of the schema and may clash with it (e.g.
# accept_paused carries `connected` as a number); readers skip them.
CMSG_IGNORED = "cmsg_ignored"      # client, pid, uid, gid, key
LOG_REOPENED = "log_reopened"      # path
FD_EXHAUSTED = "fd_exhausted"      # errno, connected: accept ran out of descriptors
ACCEPT_PAUSED = "accept_paused"    # connected: even the spare descriptor is gone
ACCEPT_ERROR = "accept_error"      # errno: accept failed for another reason
CONFIG_WARNING = "config_warning"  # detail: an option that will not do what it seems to
# The access policy (sbusd --policy; docs/policy.md).
PUBLISH_DENIED = "publish_denied"  # client, pid, uid, gid, key, rule (0: the default),
#                                    action (drop or disconnect), suppressed (records
#                                    left out since the last one: at most
#                                    PUBLISH_DENIED_PER_S are written a second)
POLICY_LOADED = "policy_loaded"    # path, rules, default, reload, identities, revoked
POLICY_REFUSED = "policy_refused"  # path, reason: a reload's file did not load; the old stays
PUBLISH_DENIED_PER_S = 10
# A leaf broker's upstream link (sbusd --upstream; docs/hierarchy.md).
UPSTREAM_CONNECTED = "upstream_connected"        # address, identity, patterns, held
UPSTREAM_DISCONNECTED = "upstream_disconnected"  # address, reason, held
UPSTREAM_RETRY = "upstream_retry"                # address, reason, in_s: a new reason to wait
UPSTREAM_OVERFLOW = "upstream_overflow"          # dropped, buffer_max: at 1, 2, 4, 8, ... drops
UPSTREAM_LINK_EXIT = "upstream_link_exit"        # returncode: the link process ended
# The link process died or could not start (reason, returncode, restarts) and
# is started again in_s seconds (null: sbusd exits, the first link could not start).
UPSTREAM_LINK_FAILED = "upstream_link_failed"
UPSTREAM_LINK_RESTARTED = "upstream_link_restarted"  # pid, restarts: a new link process
# Every service, once what it serves is in place (sbus.runner.ready; `sbus ready`
# waits for it): service (store, queue, serve, bridge, fds, link), pid, and what it serves.
SERVICE_READY = "service_ready"
# A live upgrade (SIGUSR2, sbusd --upgrade; docs/upgrade.md).
UPGRADE_STARTED = "upgrade_started"          # new_pid: the old process started the new one
UPGRADE_FAILED = "upgrade_failed"            # step, reason, new_pid: the old one serves on
UPGRADE_HANDED_OVER = "upgrade_handed_over"  # new_pid, clients, state_bytes, pause_ms,
#                                              export_ms: the old one leaves
UPGRADE_DONE = "upgrade_done"                # version, old_pid, old_version, clients,
#                                              restore_ms, prebuild_ms, transfer_ms,
#                                              rebuild_ms: the new one serves
UPGRADE_EVENTS = (UPGRADE_STARTED, UPGRADE_FAILED, UPGRADE_HANDED_OVER, UPGRADE_DONE)
# What the link reports for the broker to log (sbus/sbusd/link.py); the broker
# logs no other name it is sent.
UPSTREAM_EVENTS = (UPSTREAM_CONNECTED, UPSTREAM_DISCONNECTED, UPSTREAM_RETRY, UPSTREAM_OVERFLOW,
                   SERVICE_READY)
OPERATIONAL_EVENTS = (CMSG_IGNORED, LOG_REOPENED, FD_EXHAUSTED, ACCEPT_PAUSED, ACCEPT_ERROR,
                      CONFIG_WARNING, *UPSTREAM_EVENTS, UPSTREAM_LINK_EXIT, UPSTREAM_LINK_FAILED,
                      UPSTREAM_LINK_RESTARTED, *UPGRADE_EVENTS,
                      POLICY_LOADED, POLICY_REFUSED)

LEVELS = ("debug", "info", "warning", "error")

# --- disconnect reasons ----------------------------------------------------
DISCONNECT_EOF = "eof"                        # the client closed its end
DISCONNECT_ERROR = "error"                    # a socket error other than those below
DISCONNECT_PROTOCOL_ERROR = "protocol_error"  # a packet that matches no message type
DISCONNECT_CRED_REFUSED = "cred_refused"      # subscribed to someone else's !/cred/ key
DISCONNECT_BANG_MISUSE = "bang_misuse"        # used '!' in a way the spec reserves
DISCONNECT_USER_REFUSED = "user_refused"      # uid not allowed; never got a client_connect
DISCONNECT_FLOOD_ERROR = "flood_error"        # blocked while its flood mode was "error"
DISCONNECT_OVERSIZE = "oversize"              # packet larger than the broker accepts
DISCONNECT_LIMIT = "limit"                    # pattern too long or too many subscriptions
DISCONNECT_SHUTDOWN = "shutdown"              # the broker stopped
DISCONNECT_FD_LIMIT = "fd_limit"              # its fd is beyond what the loop backend can watch
DISCONNECT_SUB_BUDGET = "subscription_budget"     # a SUB over a subscription-bytes budget
DISCONNECT_CONNECTION_BUDGET = "connection_budget"  # its uid's connection budget was full;
#                                                    never got a client_connect
DISCONNECT_POLICY_DENIED = "policy_denied"    # published a key a rule with on_deny =
#                                               "disconnect" denies
DISCONNECT_POLICY_REFUSED = "policy_refused"  # subscribed to a pattern the policy refuses
DISCONNECT_POLICY_REVOKED = "policy_revoked"  # held a pattern a reloaded policy refuses

DISCONNECT_REASONS = (
    DISCONNECT_EOF,
    DISCONNECT_ERROR,
    DISCONNECT_PROTOCOL_ERROR,
    DISCONNECT_CRED_REFUSED,
    DISCONNECT_BANG_MISUSE,
    DISCONNECT_USER_REFUSED,
    DISCONNECT_FLOOD_ERROR,
    DISCONNECT_OVERSIZE,
    DISCONNECT_LIMIT,
    DISCONNECT_SHUTDOWN,
    DISCONNECT_FD_LIMIT,
    DISCONNECT_SUB_BUDGET,
    DISCONNECT_CONNECTION_BUDGET,
    DISCONNECT_POLICY_DENIED,
    DISCONNECT_POLICY_REFUSED,
    DISCONNECT_POLICY_REVOKED,
)

# Reasons a SUB/UNSUB is refused (``accepted`` false).  Open-ended: readers
# must accept reasons not listed here.
REFUSE_NOT_SUBSCRIBED = "not_subscribed"   # UNSUB of a pattern the client does not hold
REFUSE_CRED_MISMATCH = "cred_mismatch"     # !/cred/ pattern for other credentials
REFUSE_CRED_MALFORMED = "cred_malformed"   # !/cred/ pattern with a bad field, or truncated
REFUSE_BANG_MISUSE = "bang_misuse"         # the reserved '!' outside a !/cred/ form
REFUSE_PATTERN_TOO_LONG = "pattern_too_long"          # over --max-pattern
REFUSE_TOO_MANY = "too_many_subscriptions"            # over --max-subscriptions
# Over a subscription-bytes budget; the reason names the budget.
REFUSE_SUB_BUDGET_CONNECTION = "sub_budget_connection"  # --sub-max-bytes
REFUSE_SUB_BUDGET_USER = "sub_budget_user"              # --user-sub-max-bytes
REFUSE_SUB_BUDGET_TOTAL = "sub_budget_total"            # --total-sub-max-bytes
REFUSE_POLICY_DENIED = "policy_denied"     # the access policy refuses the pattern
REFUSE_REASONS = (REFUSE_NOT_SUBSCRIBED, REFUSE_CRED_MISMATCH, REFUSE_CRED_MALFORMED,
                  REFUSE_BANG_MISUSE, REFUSE_PATTERN_TOO_LONG, REFUSE_TOO_MANY,
                  REFUSE_SUB_BUDGET_CONNECTION, REFUSE_SUB_BUDGET_USER, REFUSE_SUB_BUDGET_TOTAL,
                  REFUSE_POLICY_DENIED)

# --- nested records ---------------------------------------------------------
# Broker-wide counters.  In ``stats`` and ``broker_stop`` they are cumulative
# since the broker started, except clients/queued_*/subscriptions which are
# the current values and queued_bytes_peak which is the high-water mark.
TOTALS_FIELDS = (
    "clients",            # connected now
    "connects",           # admitted connections since start (not user_refused/fd_limit)
    "disconnects",        # admitted connections closed since start
    "msgs_in",            # MSG packets received
    "bytes_in",           # bytes of those packets
    "msgs_out",           # MSG deliveries (one per recipient)
    "bytes_out",          # bytes of those deliveries
    "replies_out",        # control replies the broker wrote (whoami, stats), not deliveries
    "drops_soft",         # deliveries discarded by a soft "discard" mode
    "drops_hard",         # deliveries discarded by a hard "discard" mode
    "drops_disconnect",   # deliveries lost because the recipient was disconnected
    "queued_msgs",        # deliveries waiting in send queues now
    "queued_bytes",       # bytes waiting in send queues now
    "queued_bytes_peak",  # highest queued_bytes seen
    "subscriptions",      # patterns registered now
    "sub_bytes",          # subscription bytes charged to budgets now (pattern and index)
    "budget_conns_refused",   # connections refused at accept for a uid's connection budget
    "budget_subs_refused",    # SUBs refused for a subscription-bytes budget
    "denied",             # publishes the access policy denied (delivered to no one)
    "policy_subs_refused",    # SUBs the access policy refused
)

# The traffic fields of ``stats.delta``: same meaning as in TOTALS_FIELDS,
# counted since the previous ``stats`` record (since start for the first).
DELTA_FIELDS = (
    "msgs_in",
    "bytes_in",
    "msgs_out",
    "bytes_out",
    "drops_soft",
    "drops_hard",
    "drops_disconnect",
)

# One client's counters, cumulative since it connected.  msgs_in/bytes_in
# count MSG packets it published; msgs_out/bytes_out count MSG deliveries to
# it, replies_out the control replies it was sent; drops_* count packets
# meant for it that were discarded.
CLIENT_COUNTER_FIELDS = (
    "client",
    "pid",
    "uid",
    "gid",
    "msgs_in",
    "bytes_in",
    "msgs_out",
    "bytes_out",
    "replies_out",
    "drops_soft",
    "drops_hard",
    "drops_disconnect",
    "queued_msgs",
    "queued_bytes",
    "subscriptions",
    "denied",             # its publishes the access policy denied
)

# One uid's usage against its budgets (``stats.users``, and the stats reply).
# A ``max_*`` field is null for sbusd's own uid, which has no per-uid budgets.
USER_FIELDS = (
    "uid",
    "connections",
    "max_connections",
    "sub_bytes",
    "max_sub_bytes",
    "queued_bytes",       # bytes waiting in its connections' send queues
    "max_queued_bytes",
)

# One uid's denials under the access policy since the broker started, kept
# after its connections leave (``policy_uids`` in the stats reply, with a policy).
POLICY_UID_FIELDS = (
    "uid",
    "denied",             # its publishes the policy denied
    "subs_refused",       # its SUBs the policy refused
)

DROP_KINDS = ("drops_soft", "drops_hard", "drops_disconnect")

# --- records ----------------------------------------------------------------
COMMON_FIELDS = (
    ("timestamp", TIMESTAMP),
    ("level", STR),
    ("event", STR),
    ("schema", INT),
    ("broker_pid", INT),
)

_CLIENT_IDENTITY = (("client", INT), ("pid", INT), ("uid", INT))

EVENT_FIELDS = {
    BROKER_START: (("version", STR), ("address", STR), ("pid", INT), ("config", CONFIG)),
    BROKER_STOP: (("reason", STR), ("uptime_s", FLOAT), ("totals", TOTALS)),
    CLIENT_CONNECT: _CLIENT_IDENTITY + (("gid", INT),),
    CLIENT_DISCONNECT: _CLIENT_IDENTITY + (
        ("gid", INT), ("reason", STR), ("detail", STR), ("duration_s", FLOAT),
        ("counters", COUNTERS)),
    SUBSCRIBE: _CLIENT_IDENTITY + (("pattern", STR), ("accepted", BOOL), ("reason", STR)),
    UNSUBSCRIBE: _CLIENT_IDENTITY + (("pattern", STR), ("accepted", BOOL), ("reason", STR)),
    FLOOD: _CLIENT_IDENTITY + (
        ("interval_s", FLOAT), ("drops_soft", INT), ("drops_hard", INT), ("blocks", INT),
        ("queued_msgs", INT), ("queued_bytes", INT), ("soft", STR), ("hard", STR)),
    STATS: (("interval_s", FLOAT), ("totals", TOTALS), ("delta", DELTA),
            ("clients", COUNTERS_LIST), ("users", USERS_LIST)),
    MESSAGE: _CLIENT_IDENTITY + (
        ("key", STR), ("size", INT), ("fanout", INT), ("sample_rate", FLOAT)),
    # The access policy's denials: the analytics job's denials table.
    PUBLISH_DENIED: _CLIENT_IDENTITY + (
        ("gid", INT), ("key", STR), ("rule", INT), ("action", STR), ("suppressed", INT)),
}

# Fields that may be JSON null even though the event defines them.
NULLABLE = frozenset({("client_disconnect", "detail"), ("subscribe", "reason"),
                      ("unsubscribe", "reason")})


def all_fields() -> dict:
    """Every top-level field name mapped to its one type tag, common fields first.

    Raises ``ValueError`` if two events disagree on a field's type, which
    would make a single reader schema impossible.
    """
    out = dict(COMMON_FIELDS)
    for event, fields in EVENT_FIELDS.items():
        for name, tag in fields:
            if out.setdefault(name, tag) != tag:
                raise ValueError(f"field {name!r} of {event!r} is {tag}, elsewhere {out[name]}")
    return out

# --- the bridge (``sbus bridge``, docs/bridge.md) ----------------------------
# A separate process with its own records: the common fields (``broker_pid``
# is the bridge's own pid) plus those below. Not read by the analytics job.
BRIDGE_START = "bridge_start"
BRIDGE_STOP = "bridge_stop"
BRIDGE_CONNECTED = "bridge_connected"        # to NATS, the first time or again
BRIDGE_DISCONNECTED = "bridge_disconnected"  # from NATS; it reconnects with back-off
BRIDGE_LOCAL_LOST = "bridge_local_lost"      # the local broker went away
BRIDGE_LOCAL_BACK = "bridge_local_back"      # ... and is back, subscriptions restored
BRIDGE_STATS = "bridge_stats"                # every --stats-interval seconds
BRIDGE_DROP = "bridge_drop"                  # one message dropped for bad input (rate-limited)
BRIDGE_REFUSED = "bridge_refused"            # NATS refused a subscription or publication
                                             # (its authorization: permissions violation)

# Why a message was dropped (``bridge_drop.reason``; counters in sbus.bridge.counters).
BRIDGE_DROP_REASONS = ("full", "unmappable", "private", "oversize", "refused", "local")

_BRIDGE_COUNTERS = tuple((name, INT) for name in (
    "out_forwarded", "out_forwarded_bytes", "out_private", "out_dropped_full",
    "out_dropped_unmappable", "out_dropped", "in_forwarded", "in_forwarded_bytes",
    "in_dropped_private", "in_dropped_unmappable", "in_dropped_oversize", "in_dropped_refused",
    "in_dropped_local", "in_dropped_full", "in_dropped", "private_out", "private_in",
    "private_local", "nats_connects", "nats_disconnects"))

BRIDGE_EVENT_FIELDS = {
    BRIDGE_START: (("version", STR), ("path", STR), ("nats_py", STR), ("address", STR),
                   ("nats", STR), ("exports", STR), ("imports", STR), ("subject_prefix", STR),
                   ("max_pending", INT), ("drop", STR), ("stats_key", STR), ("identity", STR),
                   ("frames", STR)),
    BRIDGE_STOP: (("reason", STR), ("uptime_s", FLOAT)) + _BRIDGE_COUNTERS,
    BRIDGE_CONNECTED: (("server", STR), ("nats_connects", INT), ("pending_msgs", INT)),
    BRIDGE_DISCONNECTED: (("server", STR), ("error", STR), ("pending_msgs", INT)),
    BRIDGE_LOCAL_LOST: (("address", STR), ("error", STR)),
    BRIDGE_LOCAL_BACK: (("address", STR),),
    BRIDGE_STATS: (("connected", BOOL), ("server", STR), ("pending_msgs", INT),
                   ("pending_bytes", INT), ("max_pending", INT), ("frames_in", INT),
                   ("frames_out", INT)) + _BRIDGE_COUNTERS,
    BRIDGE_DROP: (("direction", STR), ("reason", STR), ("subject", STR), ("key", STR),
                  ("size", INT), ("detail", STR), ("suppressed", INT)),
    BRIDGE_REFUSED: (("server", STR), ("error", STR)),
    SERVICE_READY: (("service", STR), ("pid", INT), ("exports", STR)),
}

# --- the queue service (``sbus queue``, docs/queues.md) ---------------------
# A separate process with its own records, as the bridge's: the common fields
# (``broker_pid`` is the service's own pid) plus those below. Not read by the
# analytics job; a field that shares a name with a broker field has its type.
QUEUE_START = "queue_start"
QUEUE_STOP = "queue_stop"
QUEUE_CONSUMER_JOIN = "queue_consumer_join"
QUEUE_CONSUMER_LEAVE = "queue_consumer_leave"    # reason: bye, lease, ack_timeout or policy
# The access policy (--policy) refused a consumer the jobs: inbox, uid (of the
# identity refused; null: the inbox names none), rule (0: the default), reason.
QUEUE_CONSUMER_REFUSED = "queue_consumer_refused"
QUEUE_DROP = "queue_drop"        # jobs dropped: --max-held were waiting, or too large
QUEUE_STATS = "queue_stats"      # every --stats-interval seconds, when something changed
QUEUE_BUS_LOST = "queue_bus_lost"  # the broker went away
QUEUE_BUS_BACK = "queue_bus_back"  # ... and is back, subscriptions restored
QUEUE_BAD_REQUEST = "queue_bad_request"  # (debug) a payload off the convention, counted
QUEUE_CONSUMERS_LIST = "queue_consumers[]"  # JSON array: inbox, prefetch, in_flight,
#                                             delivered, acked per consumer

# What a service's policy_loaded and policy_refused records carry (sbusd's
# are operational events, outside the schema).
_POLICY_LOADED = (("path", STR), ("rules", INT), ("default", STR), ("reload", BOOL),
                  ("identities", INT), ("revoked", INT))
_POLICY_REFUSED = (("path", STR), ("reason", STR))

_QUEUE_COUNTERS = tuple((name, INT) for name in (
    "received", "delivered", "redelivered", "acked", "nacked", "rejected", "dropped",
    "oversize", "undelivered", "late_acks", "consumers_joined", "consumers_lost", "bad_requests",
    "policy_refused"))
_QUEUE_LEVELS = (("held", INT), ("in_flight", INT))

QUEUE_EVENT_FIELDS = {
    QUEUE_START: (("version", STR), ("address", STR), ("pattern", STR), ("control", STR),
                  ("prefetch", INT), ("ack_timeout_s", FLOAT), ("lease_s", FLOAT),
                  ("max_held", INT)),
    QUEUE_STOP: (("reason", STR), ("uptime_s", FLOAT)) + _QUEUE_LEVELS + _QUEUE_COUNTERS,
    QUEUE_CONSUMER_JOIN: (("inbox", STR), ("prefetch", INT)),
    QUEUE_CONSUMER_LEAVE: (("inbox", STR), ("reason", STR), ("requeued", INT),
                           ("delivered", INT), ("acked", INT)),
    QUEUE_DROP: (("reason", STR), ("count", INT), ("key", STR), ("size", INT), ("held", INT),
                 ("dropped", INT), ("oversize", INT)),
    QUEUE_STATS: (("pattern", STR),) + _QUEUE_LEVELS + (("consumers", QUEUE_CONSUMERS_LIST),)
    + _QUEUE_COUNTERS,
    QUEUE_BUS_LOST: (("address", STR), ("error", STR)),
    QUEUE_BUS_BACK: (("address", STR),),
    QUEUE_BAD_REQUEST: (("key", STR), ("detail", STR)),
    QUEUE_CONSUMER_REFUSED: (("inbox", STR), ("uid", INT), ("rule", INT), ("reason", STR)),
    POLICY_LOADED: _POLICY_LOADED,
    POLICY_REFUSED: _POLICY_REFUSED,
    SERVICE_READY: (("service", STR), ("pid", INT), ("pattern", STR)),
}

# --- request/reply from the shell (``sbus serve``, docs/requests.md) ---------
# It writes only its readiness (the common fields, ``broker_pid`` its own pid).
SERVE_EVENT_FIELDS = {
    SERVICE_READY: (("service", STR), ("pid", INT), ("pattern", STR)),
}

# --- the store (``sbus store``, docs/store.md) --------------------------------
# A separate process with its own records: the common fields (``broker_pid``
# is the store's own pid) plus those below. The analytics job reads only the
# events in EVENT_FIELDS and passes these over.
STORE_START = "store_start"
STORE_STOP = "store_stop"
STORE_RECOVER = "store_recover"            # the log opened: what was found, what was cut
STORE_STATS = "store_stats"                # every --stats-interval seconds
STORE_GAP = "store_gap"                    # messages lost (a !gap record was written)
STORE_DISK_FULL = "store_disk_full"        # a write failed for lack of space; recording paused
STORE_DISK_RESUMED = "store_disk_resumed"  # ... and succeeded again
STORE_RETENTION = "store_retention"        # the oldest segments were removed
STORE_REQUEST_REFUSED = "store_request_refused"  # a malformed or unanswerable request
STORE_BROKER_LOST = "store_broker_lost"    # the broker went away; the store reconnects
STORE_BROKER_BACK = "store_broker_back"

# Why messages are missing from the log (``store_gap.reason``, ``!gap`` records).
STORE_GAP_REASONS = ("flood", "disconnected", "disk_full", "retention")

_STORE_COUNTERS = tuple((name, INT) for name in (
    "recorded", "recorded_bytes", "gaps", "lost_flood", "lost_unknown", "missed_disk_full",
    "requests", "requests_refused", "sessions_opened", "sessions_expired", "answers",
    "replayed", "retention_segments", "retention_records", "retention_bytes",
    "private_skipped", "policy_refused", "segments", "bytes", "records", "first_seq", "last_seq", "keys",
    "sessions", "syncs")) + (("disk_full", BOOL), ("missed_by_pattern", CONFIG),
                             ("uptime_s", FLOAT))

STORE_EVENT_FIELDS = {
    STORE_START: (("version", STR), ("path", STR), ("address", STR), ("record", STR),
                  ("request_key", STR), ("fsync", STR), ("segment_bytes", INT),
                  ("max_bytes", INT), ("max_age_s", FLOAT), ("flood", STR)),
    STORE_STOP: (("reason", STR),) + _STORE_COUNTERS,
    STORE_RECOVER: (("segments", INT), ("records", INT), ("bytes", INT), ("torn", BOOL),
                    ("cut_bytes", INT), ("cut_segment", STR), ("first_seq", INT),
                    ("last_seq", INT), ("keys", INT)),
    STORE_STATS: _STORE_COUNTERS,
    STORE_GAP: (("lost", INT), ("reason", STR), ("seq", INT)),
    STORE_DISK_FULL: (("error", STR), ("path", STR)),
    STORE_DISK_RESUMED: (("missed", INT), ("full_s", FLOAT), ("missed_by_pattern", CONFIG)),
    STORE_RETENTION: (("segments", INT), ("records", INT), ("bytes", INT), ("first_seq", INT)),
    STORE_REQUEST_REFUSED: (("error", STR), ("reply", STR)),
    STORE_BROKER_LOST: (("address", STR), ("error", STR)),
    STORE_BROKER_BACK: (("address", STR),),
    POLICY_LOADED: _POLICY_LOADED,
    POLICY_REFUSED: _POLICY_REFUSED,
    SERVICE_READY: (("service", STR), ("pid", INT), ("request_key", STR)),
}

# --- the fd hand-over service (``sbus fds``, docs/fds.md) ---------------------
# A separate process with its own records, as the store's: the common fields
# plus those below. Tickets are logged by their first 8 hex digits only.
FDS_START = "fds_start"
FDS_STOP = "fds_stop"
FDS_OFFER = "fds_offer"          # (debug) fds taken in, a ticket issued
FDS_CLAIM = "fds_claim"          # (debug) fds passed to their receiver
FDS_EXPIRED = "fds_expired"      # nobody claimed them within --timeout: closed
FDS_REFUSED = "fds_refused"      # an OFFER or a connection refused (reason: the ERR code)
FDS_DENIED = "fds_denied"        # a CLAIM of a real ticket by another process
FDS_BUS_LOST = "fds_bus_lost"    # a notification could not be published
FDS_BUS_BACK = "fds_bus_back"

FDS_COUNTERS = ("connections_accepted", "connections_refused", "connections_idle", "accept_failed",
                "offers", "offers_refused", "claims", "claims_refused", "claims_unsent",
                "expired", "notifications_failed", "pushed")
_FDS_COUNTERS = tuple((name, INT) for name in FDS_COUNTERS + ("pending", "held", "connections")) \
    + (("uptime_s", FLOAT),)

FDS_EVENT_FIELDS = {
    FDS_START: (("version", STR), ("address", STR), ("socket", STR), ("timeout_s", FLOAT),
                ("max_fds_per_uid", INT), ("max_fds", INT), ("max_connections", INT)),
    FDS_STOP: (("reason", STR),) + _FDS_COUNTERS,
    FDS_OFFER: (("giver", STR), ("receiver", STR), ("count", INT), ("ticket", STR)),
    FDS_CLAIM: (("receiver", STR), ("count", INT), ("ticket", STR)),
    FDS_EXPIRED: (("giver", STR), ("receiver", STR), ("count", INT), ("ticket", STR)),
    FDS_REFUSED: (("reason", STR), ("peer", STR), ("detail", STR)),
    FDS_DENIED: (("peer", STR), ("receiver", STR), ("ticket", STR)),
    FDS_BUS_LOST: (("address", STR), ("error", STR)),
    FDS_BUS_BACK: (("address", STR),),
}
