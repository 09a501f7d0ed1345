"""The bridge's defaults, one home for the CLI and the bridge (no heavy imports)."""
DEFAULT_MAX_PENDING = 8 << 20          # bytes held for NATS while it is slow or away
DEFAULT_STATS_KEY = "sbus/bridge/stats"
DEFAULT_STATS_INTERVAL = 5.0           # seconds
DROP_OLDEST, DROP_NEWEST = "oldest", "newest"
