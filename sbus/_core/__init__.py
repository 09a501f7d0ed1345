"""The compiled core: everything on the per-message path, in Cython (each ``.pxd`` is
its module's contract; other modules ``cimport`` from it only).

- ``protocol``: packet parsing, key and pattern checks, the ``!/cred/`` rules.
- ``index``: the pattern index, a segment trie (the first-segment index generalised).
- ``sendq``: per-client send queues (queue, stack, random order) of shared,
  refcounted packets.
- ``loop``: the event loop's backends (epoll and select), chosen at run time.
- ``conn.pxd``: the connection record; ``policy``: flood-control decisions;
  ``budget``: per-connection and per-user resource budgets.
- ``broker``: one class, ``Broker``: the loop, each connection's life and the
  per-message path (recv, parse, match, fan-out, send).
- ``report``: the broker's log records and stats, built from C state.
- ``batch``: the clients' packing, sendmmsg and recvmmsg; ``natswire``: the
  bridge's NATS framing in C; ``loadgen``: the load generator (csrc/loadgen/).
- ``includes/``: extern declarations the standard ``libc``/``posix`` ones lack.
"""
