"""The running broker's Python side: what the Cython broker calls back.

``Service`` logs the broker's events, writes sampled ``message`` records, and
on each tick flushes the log, summarises floods and writes ``stats``. It is
whole once constructed: it builds its broker from the factory it is given,
handing it these callbacks, so nothing is assigned to it from outside.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from .. import logschema as schema
from ..log import emit

FLOOD_INTERVAL = 1.0    # seconds between flood summaries of one client


class Service:
    """Callbacks and periodic records of one broker run.

    ``make_broker(on_event=, on_message=, on_tick=, tick_interval=)`` returns
    the broker; ``log`` takes events, ``message_log`` the sampled messages,
    and ``stream`` is the sink both write to (flushed each tick);
    ``also_on_tick`` (the upstream link's watcher) is called each tick too.
    """

    def __init__(self, cfg, *, log, message_log, stream, make_broker: Callable,
                 also_on_tick: Optional[Callable[[], None]] = None):
        self.cfg = cfg
        self.also_on_tick = also_on_tick
        self.log = log
        self.message_log = message_log
        self.stream = stream
        self.next_flood = 0.0
        self.next_stats = time.monotonic() + cfg.stats_interval
        self.broker = make_broker(on_event=self.on_event, on_message=self.on_message,
                                  on_tick=self.on_tick, tick_interval=self.tick_interval)

    @property
    def tick_interval(self) -> float:
        """Often enough for both the flood summaries and the stats records."""
        if self.cfg.stats_interval > 0:
            return min(FLOOD_INTERVAL, self.cfg.stats_interval)
        return FLOOD_INTERVAL

    def on_event(self, name: str, fields: dict) -> None:
        emit(self.log, name, fields)

    def on_message(self, client, pid, uid, key: bytes, size: int, fanout: int) -> None:
        self.message_log.info(schema.MESSAGE, client=client, pid=pid, uid=uid,
                              key=key.decode("utf-8", "backslashreplace"), size=size,
                              fanout=fanout, sample_rate=self.cfg.log_messages)

    def on_tick(self) -> None:
        self.stream.flush()     # sampled message records since the last tick
        if self.also_on_tick is not None:
            self.also_on_tick()
        now = time.monotonic()
        if now >= self.next_flood:
            self.next_flood = now + FLOOD_INTERVAL
            for record in self.broker.take_flood_report():
                self.log.warning(schema.FLOOD, interval_s=FLOOD_INTERVAL, **record)
        if self.cfg.stats_interval > 0 and now >= self.next_stats:
            self.next_stats = now + self.cfg.stats_interval
            self.write_stats()

    def write_stats(self) -> None:
        totals, delta = self.broker.take_stats_delta()
        self.log.info(schema.STATS, interval_s=self.cfg.stats_interval, totals=totals,
                      delta=delta, clients=self.broker.take_changed_clients(),
                      users=self.broker.users())
