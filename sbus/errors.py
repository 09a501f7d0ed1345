"""Exceptions raised by sbus; plain Python so every module can import them."""


class SbusError(Exception):
    """Base class of every error sbus raises on purpose."""


class AddressError(SbusError, ValueError):
    """An address string that names no usable socket."""


class BusClosedError(SbusError, ConnectionError):
    """The broker closed the connection, or the client was closed."""


class MessageTooLargeError(SbusError, ValueError):
    """A packet larger than the bus accepts (see ``sbusd --max-message``)."""


class ProtocolError(SbusError, ValueError):
    """A packet that is not a well-formed sbus message."""
