"""``sbus store``: the persistence service the spec leaves outside the broker (docs/store.md).

A client of sbusd that records every message matching its ``--record``
patterns into append-only segment files, and answers replay, last-value and
stats requests sent as ordinary messages, privately and flow-controlled.

- ``patterns``: routing-key patterns compiled once, and whether one pattern
  covers another (a replay must ask for what is recorded).
- ``segments``: the log on disk: segments of checksummed records, the sparse
  index and last-value table rebuilt from them, recovery, fsync, retention.
- ``wire``: the request and answer formats (shared with the client side,
  :mod:`sbus.client.store`).
- ``service``: the loop: recording, sessions, gaps, disk full, counters.
- ``cli``: ``sbus store``, ``sbus replay`` and ``sbus last``.
"""
