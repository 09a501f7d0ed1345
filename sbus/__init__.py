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
        return _client_module(".client.sync").Client
    if name == "Reconnect":
        from .client.reconnect import Reconnect

        return Reconnect
    if name == "aio":
        return _client_module(".client.aio")
    raise AttributeError(name)


def _client_module(name):
    """The client module ``name``; without the compiled core (a source folder,
    say, found before the installed sbus), an ImportError that says so."""
    import importlib

    try:
        return importlib.import_module(name, __name__)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith(__name__ + "._core."):
            raise
        import os

        raise ImportError(
            f"sbus's compiled core ({exc.name}) is not built in {os.path.dirname(__file__)}: "
            "this is sbus's source folder, not an installed sbus; build it (make build, then "
            "use .venv/bin/python) or run Python from elsewhere") from exc
