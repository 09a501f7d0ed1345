"""The queue service's defaults, one home for the CLI, the service and the consumers."""
PREFETCH = 16           # unacknowledged jobs one consumer may hold
CLI_PREFETCH = 1        # sbus consume's: a job not yet printed is never held from others
CLI_WAIT = 10.0         # seconds sbus consume waits for its service to answer (-W; 0: for ever)
ACK_TIMEOUT = 60.0      # seconds a job may stay unacknowledged before its consumer is dropped
LEASE = 5.0             # seconds a consumer stays known without a word from it
MAX_HELD = 100_000      # jobs waiting for a consumer before the oldest is dropped
STATS_INTERVAL = 10.0   # seconds between queue_stats records (only when something changed)
# A consumer renews its lease this many times per lease.
RENEWALS_PER_LEASE = 3
