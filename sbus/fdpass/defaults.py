"""``sbus fds`` defaults, shared by its options and the service (nothing imported)."""
# Seconds an offer waits for its claim before its fds are closed.
TIMEOUT = 60.0
# Fds one uid's offers may hold in the service at once.
MAX_FDS_PER_UID = 1024
# Connections to the service's socket at once, and of one uid.
MAX_CONNECTIONS = 512
MAX_CONNECTIONS_PER_UID = 64
