"""``sbus queue``: jobs on a pattern shared among consumers, at least once (docs/queues.md).

- ``wire``: the convention on the bus (keys, payloads), packed and parsed; the
  consumers in ``sbus.client.consume`` speak it too.
- ``state``: held jobs, consumers, credit, leases and counters, without I/O.
- ``service``: the process's I/O: one asyncio sbusd client, reader, sender, clock.
- ``cli``: the ``sbus queue`` options and main.
- ``defaults``: every default, one home for all of the above.

Answers to one consumer go to its private inbox (``sbus.client.private``).
"""
