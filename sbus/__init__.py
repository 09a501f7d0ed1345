"""sbus: a fast local message bus over Unix-domain SOCK_SEQPACKET sockets."""
from ._version import __version__
from .errors import (
    AddressError,
    BacklogFullError,
    BatchInterruptedError,
    BusClosedError,
    KeyRefusedError,
    MessageRefusedError,
    MessageTooLargeError,
    ProtocolError,
    SbusError,
)

__all__ = [
    "__version__",
    "AddressError",
    "BacklogFullError",
    "BatchInterruptedError",
    "BusClosedError",
    "KeyRefusedError",
    "MessageRefusedError",
    "MessageTooLargeError",
    "ProtocolError",
    "SbusError",
    "Client",
    "Reconnect",
]


def __getattr__(name):  # the client library is imported lazily to keep sbusd start-up lean
    if name == "Client":
        from .client.sync import Client

        return Client
    if name == "Reconnect":
        from .client.reconnect import Reconnect

        return Reconnect
    if name == "aio":
        import importlib

        return importlib.import_module(".client.aio", __name__)
    raise AttributeError(name)
