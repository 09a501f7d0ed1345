"""The processed-ack barrier: the spec's "send yourself a message and wait for it to return".

:func:`sync` is the plan behind ``Client.sync()`` (awaited on the asyncio
client). It publishes an empty message to a key in the client's reply inbox
(:class:`sbus.client.requests.Replies`: ``<credentials>/reply/<id>/<n>``,
private.py's one form, subscribed on first use) and waits for the broker to
deliver it back. The broker reads one connection's packets in order and
delivers to one connection in order, so when the message returns the broker
has read everything this client sent before it (buffered packets are sent
first), matched each publish and queued it for its subscribers, and put in
place each SUB and UNSUB. What it does not prove is said in docs/clients.md
("A barrier").

The key goes out in its local form (``!/cred/G/U/P/...``, even where whoami
answers a nested one), which the client's own broker delivers itself. Behind
a leaf the nested form goes round through the leaf's link, which is not
there while it is restarting, and no longer answers to the identity whoami
named once a new link process has replaced it: the barrier, about this
client's broker alone, needs none of that.

The returning message is routed to its waiter like a reply
(:meth:`sbus.client.connection.Connection.triage`); whatever else arrives
meanwhile stays queued for ``receive()``, in order. A client that turned echo
off would never see its own message: the barrier then goes out between
``echo/on`` and ``echo/off`` in one batch, so no other send of the client
falls between them.
"""
from __future__ import annotations

import time

from .._core.batch import Outbox, pack_publish
from .connection import WAIT, Connection, Plan
from .private import local_form

__all__ = ["SYNC_TIMEOUT", "sync"]

# Seconds a barrier waits by default: a broker held up by flood control
# (blocking/soft/block and a slow reader) reads its clients late.
SYNC_TIMEOUT = 30.0

_ECHO_ON, _ECHO_OFF = b"CMSG echo/on", b"CMSG echo/off"


def sync(conn: Connection, timeout: float) -> Plan:
    """Return once a message to this client's own private key came back;
    TimeoutError after ``timeout`` seconds (the broker is stalled, or it
    went away and a reconnecting client did not find it again)."""
    deadline = time.monotonic() + timeout
    replies = yield from conn.open_replies(timeout, deadline)
    waiter = conn.new_waiter()
    key = replies.expect(waiter)
    packet = pack_publish(local_form(key), b"", conn.max_message)
    box = Outbox(conn.max_message)
    for p in ((packet,) if conn.echo else (_ECHO_ON, packet, _ECHO_OFF)):
        box.add_packet(p)
    # Noted as a request at once: it is read for (the asyncio client reads
    # only while someone waits), and a lost connection fails it.
    request = conn.ask(key, None, waiter)
    try:
        # Sent, or kept behind the backlog while the broker is away, so it
        # returns after the backlog. Once sent, a reconnecting client sends
        # it again ahead of what was published after it.
        yield from conn.publish_packed(box, 0)
        if conn.live:
            request.packet = packet
        try:
            yield (WAIT, waiter, deadline, 0)
        except TimeoutError:
            raise TimeoutError(f"the barrier's message did not come back within {timeout:g} s"
                               ) from None
        waiter.result()
    finally:
        replies.forget(key)
        conn.unask(request)
