"""The asyncio client's reading (:class:`sbus.client.aio.Client`): an
``add_reader`` callback that reads with recvmmsg(2) until the socket is
empty, only while someone waits (a receiver, or a query awaiting its
reply), into the queue receivers take from; an unread socket is the
broker's back-pressure. Each batch that is not plain messages is triaged
(:meth:`sbus.client.connection.Connection.triage`) on the way.
"""
from __future__ import annotations

import asyncio
from typing import Any, List, Optional

from .._core.batch import Sink
from ..errors import BusClosedError
from . import connection as c
from .connection import GONE

__all__ = ["INBOX_HIGH", "Reader"]

# Received messages queued before the reader callback stops reading: the
# rest waits in the socket, where it is the broker's back-pressure.
INBOX_HIGH = 4096


class Reader:
    """The reading half of the asyncio Client, a mixin over its state
    (``_loop``, ``_conn``, ``_inbox``, ``_in``, ``_sock``, ``_fd``,
    ``_receivers``, ``_sink_waiters``, ``_reading``) and the Driver's
    ``_lost`` and ``_triage``."""

    _loop: asyncio.AbstractEventLoop
    _receivers: List[asyncio.Future]
    _sink_waiters: int     # of the receivers, those in receive_into
    _reading: bool         # the reader callback is on

    async def _wait_readable(self, sink: bool) -> None:
        fut = self._loop.create_future()
        self._receivers.append(fut)
        self._sink_waiters += sink
        self._start_reading()
        try:
            await fut
        finally:
            self._sink_waiters -= sink
            if fut in self._receivers:
                self._receivers.remove(fut)
            self._update_reading()

    def _start_reading(self) -> None:
        if not self._reading and self._sock is not None:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def _update_reading(self) -> None:
        """Read only while someone waits: an unread socket is the broker's back-pressure."""
        if not self._receivers and not self._conn.querying():
            self._stop_reading()

    def _wake(self, stop: bool = True) -> None:
        """Receivers look again: something came, or (``stop`` reading) the
        connection ended, or only receive_into waits (it reads for itself)."""
        if stop:
            self._stop_reading()
        for fut in self._receivers:
            c.settle(fut)

    def _on_readable(self) -> None:
        if self._sink_waiters == len(self._receivers) > 0 and not self._conn.querying():
            return self._wake()
        self._read_until_empty()
        if self._inbox:
            self._wake(False)
        self._update_reading()

    def _read_until_empty(self, limit: int = 64, sink: Optional[Sink] = None) -> int:
        """recvmmsg until EAGAIN (or the queue is long), each batch triaged.
        With a ``sink``, plain messages go to it until something is queued or
        ``limit`` went to it; returns how many it took."""
        conn, inbox = self._conn, self._inbox
        taken = 0
        most = INBOX_HIGH if sink is None else limit
        batch = self._in.held()     # read by Inbox.take_batch, not plain messages
        while self._sock is not None and len(inbox) < INBOX_HIGH and taken < most:
            try:
                if batch is None:
                    batch = self._in.receive(self._fd, min(limit, most - taken), 0, -1.0, sink)
            except BlockingIOError:
                return taken
            except OSError as exc:
                return self._failed(exc) or taken
            taken += self._in.taken
            if self._triage(batch) or conn.eof and conn.policy is None or sink is not None and inbox:
                return taken
            batch = None
        return taken

    def _failed(self, exc: OSError) -> List[Any]:
        if exc.errno in GONE and self._conn.policy is not None:
            self._lost(exc)
        else:
            self._inbox.append(exc)
            self._conn.fail(BusClosedError(f"the connection failed: {exc}"))
        return []
