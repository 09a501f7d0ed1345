"""The client library: what a program uses to talk to sbusd.

- ``protocol``: packet types (``Message``, ``ControlMessage``, ``Credentials``),
  packing and parsing; every side that speaks the protocol in Python uses it.
- ``connection``: ``Connection``, the protocol state of one connection and
  its plans, with no I/O (buffered mode, received queue, queries and requests
  and their reply routing, the reconnect state machine, error texts).
- ``driver``: ``open_socket`` and ``Driver``, what both clients share.
- ``sync``: ``Client``, the blocking client: a driver over ``Connection``.
- ``aio``: the asyncio client, a driver over ``Connection`` (also importable as
  ``sbus.aio``).
- ``reconnect``: ``Reconnect``, the policy for coming back after the broker
  went away; the session it replays and the backlog it delivers.
- ``requests``: requests and replies between clients (``Client.request``,
  ``Client.serve``; docs/requests.md); ``consume``: jobs of an ``sbus queue``
  (``Client.consume``; docs/queues.md); ``store``: replay and last values of
  an ``sbus store`` (``Client.replay``, ``Client.last``; docs/store.md);
  ``private``: the private inbox they use.
- ``services``: those methods, mixed into both clients as doors to the modules
  above.

``from sbus.client import Client`` and the protocol names work as before the
package was split; the clients are imported on first use, so a program that
only needs the protocol (sbusd's option table, for one) does not load them.
"""
from .protocol import (
    MAX_MESSAGE,
    WHOAMI,
    ControlMessage,
    Credentials,
    Message,
    encode,
    pack_control,
    pack_publish,
    pack_subscribe,
    pack_unsubscribe,
    parse,
    parse_stats,
)

__all__ = [
    "Client",
    "ControlMessage",
    "Credentials",
    "Message",
    "MAX_MESSAGE",
    "Reconnect",
    "WHOAMI",
    "encode",
    "pack_control",
    "pack_publish",
    "pack_subscribe",
    "pack_unsubscribe",
    "parse",
    "parse_stats",
]


def __getattr__(name):
    if name == "Client":
        from .sync import Client

        return Client
    if name == "Reconnect":
        from .reconnect import Reconnect

        return Reconnect
    raise AttributeError(f"module 'sbus.client' has no attribute {name!r}")
