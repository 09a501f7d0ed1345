"""Exceptions raised by sbus; plain Python so every module can import them."""
import os
from typing import Optional, Tuple


class SbusError(Exception):
    """Base class of every error sbus raises on purpose."""


class AddressError(SbusError, ValueError):
    """An address string that names no usable socket."""


class BusClosedError(SbusError, ConnectionError):
    """The broker closed the connection, or the client was closed."""


class PatternRefusedError(BusClosedError):
    """A reconnecting client stopped: each new broker closed the connection
    when its subscriptions were replayed. ``patterns`` are the ones replayed
    (the broker refuses one of them; its log says which and why)."""

    def __init__(self, message: str, patterns: Tuple[bytes, ...]) -> None:
        super().__init__(message)
        self.patterns = patterns


class ServiceRefusedError(SbusError):
    """A service (``sbus queue``) will not serve this client: the access
    policy does not let it read every key the service would hand it. The
    message is the service's reason, naming the rule."""


class ConnectError(SbusError, OSError):
    """connect(2) to the broker failed. ``errno``, ``strerror`` and
    ``filename`` (the address) are connect's; ``message`` (the str) says what
    was tried and what to check. The subclasses are also the OSError subclass
    of their errno, so ``except FileNotFoundError`` still catches a missing broker."""

    def __init__(self, code: int, message: str, filename: str) -> None:
        super().__init__(code, os.strerror(code), filename)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple:
        return type(self), (self.errno, self.message, self.filename)


class NoBrokerError(ConnectError, FileNotFoundError):
    """No socket at the address: no broker was started there."""


class BrokerRefusedError(ConnectError, ConnectionRefusedError):
    """Nobody listens at the address: a stale socket, or a file that is not a socket."""


class BrokerPermissionError(ConnectError, PermissionError):
    """The socket's mode (or its directory's) does not let this user connect."""


class BatchInterruptedError(BusClosedError):
    """The connection failed in the middle of a batch.

    ``sent`` messages of the batch went out (the kernel took them; the broker
    may not have read the last of them before it went away); the rest did not.
    """

    def __init__(self, message: str, sent: int) -> None:
        super().__init__(message)
        self.sent = sent


class MessageRefusedError(SbusError, ValueError):
    """A message the client does not send because the broker would refuse it
    (and close the connection). In a batch, ``index`` is its position and
    ``sent`` how many of the batch went out before it; nothing after it was sent.
    """

    index: Optional[int] = None
    sent: int = 0


class MessageTooLargeError(MessageRefusedError):
    """A packet larger than the bus accepts (see ``sbusd --max-message``)."""


class KeyRefusedError(MessageRefusedError):
    """A routing key or pattern the broker refuses: a NUL, or a misused reserved '!'."""


class BacklogFullError(SbusError, BufferError):
    """A message published while the broker is away does not fit the
    reconnecting client's backlog (``max_backlog`` bytes); it was not kept."""


class ProtocolError(SbusError, ValueError):
    """A packet that is not a well-formed sbus message."""


class RequestTimeoutError(SbusError, TimeoutError):
    """No reply to a request (``Client.request``) within its timeout: nobody
    serves the key, or its server is slower than the timeout."""


class ProofError(SbusError):
    """The spec's four-step identity proof failed (docs/proof.md); ``step``
    (1 to 4) is the step that did not happen, and the text says why."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(f"identity proof, step {step}: {message}")
        self.step = step


class HandlerError(SbusError):
    """The server's handler raised while answering a request; the text is the
    server's (``ExceptionType: message``). The server goes on serving."""
