"""Both sides of an fd hand-over, blocking (docs/fds.md).

The giver: ``ticket = give("!/cred/G/U/P", [fd, ...], note)``, or a
``Giver`` kept open for many. The receiver: ``Receiver(bus)`` subscribes to
its inbox on the bus (``<its !/cred/ address>/fds/``) and ``take()`` waits
for a notification and claims its fds; a program with a loop of its own
passes the messages it reads to ``notice()`` and ``claim()``. Fds received
are close-on-exec and the caller's to close (``Handed`` is a context manager
that closes those not taken out with ``detach()``).

Only the bus client's public calls are used (whoami, subscribe, receive).
"""
from __future__ import annotations

import os
import socket
import time
from typing import List, NamedTuple, Optional, Sequence, Union

from ..address import from_environment
from ..errors import SbusError
from . import wire

Text = Union[str, bytes]
TIMEOUT = 10.0


class FdsError(SbusError):
    """The service said no: ``code`` is the ERR code (``wire.E_*``), ``text`` why."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"sbus fds: {code}: {text}")
        self.code = code
        self.text = text


class Notice(NamedTuple):
    """A notification read on the bus. Anyone may publish to a private key,
    so it is only a hint: the claim's answer is what the service vouches for."""
    ticket: str
    count: int
    giver: str
    note: bytes


class Handed:
    """Fds passed by the service: ``fds``, who gave them (``giver``, from the
    kernel's SO_PEERCRED of the giver's connection) and the giver's ``note``."""

    __slots__ = ("fds", "giver", "note", "ticket")

    def __init__(self, fds: List[int], giver: str, note: bytes, ticket: str) -> None:
        self.fds, self.giver, self.note, self.ticket = fds, giver, note, ticket

    def detach(self) -> List[int]:
        """The fds, now the caller's alone: ``close()`` leaves them open."""
        fds, self.fds = self.fds, []
        return fds

    def close(self) -> None:
        fds = self.detach()
        wire.close_all(fds)

    def __enter__(self) -> "Handed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Handed(fds={self.fds}, giver={self.giver!r}, note={self.note!r})"


def socket_path(address: Optional[str] = None) -> str:
    """The service's socket for the bus at ``address`` (default: $SBUS_ADDRESS)."""
    return wire.default_socket(address or from_environment())


def _connect(path: str, timeout: Optional[float]) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


CLOSED = "closed"       # FdsError.code: the service closed the connection


def _request(sock: socket.socket, packet: bytes, fds: Sequence[int], timeout: Optional[float]):
    """Send one request and read the service's answer: (packet, fds)."""
    sock.settimeout(timeout)
    try:
        wire.send_fds(sock, packet, fds)
        return _answer(sock, timeout)
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise FdsError(CLOSED, f"the service closed the connection ({exc.strerror}): "
                       f"too many connections, or silent too long") from None


def _answer(sock: socket.socket, timeout: Optional[float]):
    """The service's answer: (packet, fds). EOF means it refused the connection."""
    sock.settimeout(timeout)
    packet, fds, cut = wire.recv_fds(sock)
    if not packet:
        wire.close_all(fds)
        raise FdsError(CLOSED, "the service closed the connection: too many connections, "
                       "or silent too long")
    if packet.startswith(wire.ERR):
        wire.close_all(fds)
        raise FdsError(*wire.parse_error(packet))
    if cut:
        wire.close_all(fds)
        raise FdsError(wire.E_MALFORMED, "the answer or its fds were cut")
    return packet, fds


def _receiver_of(receiver) -> bytes:
    raw = str(receiver).encode()
    if wire.parse_cred(raw) is None:
        raise ValueError(f"fds go to a local !/cred/GID/UID/PID address, not {receiver!r}")
    return raw


def _handed(packet: bytes, fds: List[int]) -> Handed:
    parsed = wire.parse_fds(packet)
    if parsed is None:
        wire.close_all(fds)
        raise FdsError(wire.E_MALFORMED, f"unexpected answer {packet[:40]!r}")
    ticket, giver, note = parsed
    return Handed(fds, giver, note, ticket)


class Giver:
    """A connection to the service for offering fds, one ``give`` at a time."""

    def __init__(self, path: Optional[str] = None, *, address: Optional[str] = None,
                 timeout: Optional[float] = TIMEOUT) -> None:
        self.timeout = timeout
        self.path = path or socket_path(address)
        self.sock: Optional[socket.socket] = _connect(self.path, timeout)

    def give(self, receiver, fds: Sequence[int], note: bytes = b"") -> str:
        """Offer ``fds`` (1 to 253; they stay open here too) to the process
        ``receiver`` (``!/cred/G/U/P``, its ``whoami``); the ticket."""
        if not 1 <= len(fds) <= wire.MAX_FDS:
            raise ValueError(f"1 to {wire.MAX_FDS} fds, not {len(fds)}")
        if len(note) > wire.MAX_NOTE:
            raise ValueError(f"a note is at most {wire.MAX_NOTE} bytes")
        request = wire.OFFER + _receiver_of(receiver) + b"\0" + note
        if self.sock is None:
            self.sock = _connect(self.path, self.timeout)
        try:
            packet, extra = _request(self.sock, request, fds, self.timeout)
        except OSError:
            self.close()               # a late answer must not be taken for the next one
            raise
        except FdsError as exc:
            if exc.code == CLOSED:
                self.close()
            raise
        wire.close_all(extra)
        if not packet.startswith(wire.TICKET):
            raise FdsError(wire.E_MALFORMED, f"unexpected answer {packet[:40]!r}")
        return packet[len(wire.TICKET):].decode("ascii")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self) -> "Giver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def give(receiver, fds: Sequence[int], note: bytes = b"", *, path: Optional[str] = None,
         address: Optional[str] = None, timeout: Optional[float] = TIMEOUT) -> str:
    """Offer ``fds`` to ``receiver`` through a connection of its own; the ticket."""
    with Giver(path, address=address, timeout=timeout) as giver:
        return giver.give(receiver, fds, note)


class Claimer:
    """A connection to the service for claiming, kept for many claims (the
    service closes it after --timeout of silence; it is then opened again)."""

    def __init__(self, path: Optional[str] = None, *, address: Optional[str] = None,
                 timeout: Optional[float] = TIMEOUT) -> None:
        self.path = path or socket_path(address)
        self.timeout = timeout
        self.sock: Optional[socket.socket] = None
        self.waiting = False

    def claim(self, ticket: str) -> Handed:
        """The fds of ``ticket``, if this process is the one they were offered to."""
        request = wire.CLAIM + ticket.encode("ascii", "replace")
        if self.waiting:
            self.close()               # a standing WAIT would take the answer
        for attempt in (1, 2):
            fresh = self.sock is None
            if self.sock is None:
                self.sock = _connect(self.path, self.timeout)
            try:
                packet, fds = _request(self.sock, request, (), self.timeout)
                break
            except OSError:
                self.close()           # a late answer must not be taken for the next one
                raise
            except FdsError as exc:
                if exc.code != CLOSED:
                    raise
                self.close()
                # A kept connection the service had closed: once more on a new one.
                if fresh or attempt == 2:
                    raise
        return _handed(packet, fds)

    def wait(self, timeout: Optional[float] = None) -> Handed:
        """The next offer for this process, as soon as the service has it
        (an offer already waiting first): no bus, no ticket to claim, and two
        process wake-ups fewer than a notification and a claim. TimeoutError
        leaves the wait standing; the next ``wait`` goes on with it. Fds that
        arrive as the connection is closed are lost, as on any socket."""
        if self.sock is None:
            self.sock = _connect(self.path, self.timeout)
        try:
            if not self.waiting:
                self.sock.settimeout(self.timeout)
                wire.send_fds(self.sock, wire.WAIT)
                self.waiting = True
            packet, fds = _answer(self.sock, timeout)
        except (ConnectionResetError, BrokenPipeError) as exc:
            self.close()
            raise FdsError(CLOSED, f"the service closed the connection ({exc.strerror})") \
                from None
        except socket.timeout:     # TimeoutError since 3.10; the wait stands
            raise
        except (OSError, FdsError):
            self.close()
            raise
        self.waiting = False
        return _handed(packet, fds)

    def close(self) -> None:
        self.waiting = False
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self) -> "Claimer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def claim(ticket: str, *, path: Optional[str] = None, address: Optional[str] = None,
          timeout: Optional[float] = TIMEOUT) -> Handed:
    """The fds of ``ticket`` through a connection of its own."""
    with Claimer(path, address=address, timeout=timeout) as claimer:
        return claimer.claim(ticket)


class Receiver:
    """The receiving side on a bus client: ``address`` is what givers name."""

    def __init__(self, bus, path: Optional[str] = None) -> None:
        self.bus = bus
        creds = bus.whoami(timeout=TIMEOUT)
        self.address = str(creds)
        if wire.parse_cred(self.address.encode()) is None:
            raise FdsError(wire.E_ADDRESS, f"{self.address} is behind another broker: fds "
                           f"pass between processes of one host's broker only")
        self.path = path or socket_path(getattr(bus, "address", None))
        self.claimer = Claimer(self.path)
        self._inbox = f"{self.address}/{wire.INBOX}/".encode()
        # What take() read that was no notification, for the caller, in order.
        self.others: List = []
        bus.subscribe(self._inbox)

    def notice(self, message) -> Optional[Notice]:
        """The notification ``message`` is, or None for any other message."""
        key = getattr(message, "key", None)
        if not isinstance(key, bytes) or not key.startswith(self._inbox):
            return None
        ticket = key[len(self._inbox):]
        parsed = wire.parse_notification(message.payload)
        if parsed is None or not wire.TICKET_RE.fullmatch(ticket):
            return None
        count, giver, note = parsed
        return Notice(ticket.decode(), count, giver.decode(), note)

    def claim(self, ticket: Union[str, Notice]) -> Handed:
        return self.claimer.claim(ticket.ticket if isinstance(ticket, Notice) else ticket)

    def close(self) -> None:
        """Close the connection to the service (not the bus client: the caller's)."""
        self.claimer.close()

    def take(self, timeout: Optional[float] = None) -> Handed:
        """Wait for the next notification and claim its fds. Other messages
        read meanwhile go to ``others``; a notification whose claim fails
        (a forgery, an expired ticket) is skipped. TimeoutError if none came."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            message = self.bus.receive(timeout=left)
            found = self.notice(message)
            if found is None:
                self.others.append(message)
                continue
            try:
                return self.claim(found)
            except FdsError as exc:
                if exc.code != wire.E_UNKNOWN:
                    raise


def memfd_payload(data: bytes, name: str = "sbus-payload") -> int:
    """A sealed memfd holding ``data``: nobody can change, grow or shrink it
    once handed over, so the receiver may map it and trust what it reads."""
    import fcntl
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK
                    | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_sealed(fd: int) -> bool:
    """``fd`` is a memfd no one can write, grow or shrink any more."""
    import fcntl
    want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & want == want
    except OSError:
        return False
