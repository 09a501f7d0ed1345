"""Both sides of an fd hand-over, blocking and asyncio (docs/fds.md).

The giver: ``ticket = give("!/cred/G/U/P", [fd, ...], note)``, or a
``Giver`` kept open for many. The receiver: ``Receiver(bus)`` subscribes to
its inbox on the bus (``<its !/cred/ address>/fds/``) and ``take()`` waits
for a notification and claims its fds; a program with a loop of its own
passes the messages it reads to ``notice()`` and ``claim()``. Fds received
are close-on-exec and the caller's to close (``Handed`` is a context manager
that closes those not taken out with ``detach()``). The asyncio twins are
``agive``, ``aclaim``, ``AsyncGiver``, ``AsyncClaimer`` and ``AsyncReceiver``
(``await AsyncReceiver.open(bus)`` over an :class:`sbus.aio.Client`).

Each conversation with the service is written once, as a plan (as the bus
clients' are, :mod:`sbus.client.connection`): a generator that yields the
calls it needs, ``(name, timeout, *args)``, on a :class:`_Link` (connect,
send, recv to the service; whoami, subscribe, receive to the bus client),
is sent each call's result or thrown its error, and decides what answers
and errors mean. :func:`_run` makes the calls blocking, :func:`_arun`
awaits them on the event loop (:class:`_AsyncLink`), with the drivers'
loops of :mod:`sbus.client.steps`; the classes differ only in which of the
two runs a plan. Only the bus client's public calls
are used. asyncio is imported by the asyncio side only.
"""
from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional, Sequence, Union

from ..address import from_environment
from ..client.steps import Plan, adrive, drive
from ..errors import SbusError
from . import wire

Text = Union[str, bytes]
TIMEOUT = 10.0
if TYPE_CHECKING:
    import asyncio


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


CLOSED = "closed"       # FdsError.code: the service closed the connection


# -- the links: a plan's calls, made ------------------------------------------------

class _Link:
    """A connection to the service (opened by ``connect``, again after a
    ``close``) and, for a receiver, its bus client: the calls a plan makes,
    blocking (``timeout=`` seconds; none: for ever)."""

    def __init__(self, path: str, bus: Any = None) -> None:
        self.path = path
        self.bus = bus
        self.sock: Optional[socket.socket] = None
        self.waiting = False    # a WAIT stands on this connection
        self.timeout: Optional[float] = None    # the socket's, as last set

    def close(self) -> None:
        self.waiting = False
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # The bus client's calls, passed on as they are (coroutines on an asyncio client).
    def whoami(self, **timeout: Any) -> Any:
        return self.bus.whoami(**timeout)

    def subscribe(self, pattern: bytes, **timeout: Any) -> Any:
        return self.bus.subscribe(pattern)

    def receive(self, **timeout: Any) -> Any:
        return self.bus.receive(**timeout)

    def connect(self, timeout: Optional[float] = None) -> bool:
        """Open the connection if it is not; True if it was opened now."""
        if self.sock is not None:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.timeout = timeout
        return True

    def _set_timeout(self, timeout: Optional[float]) -> None:
        # settimeout is a system call (ioctl FIONBIO) each time: two of a
        # hand-over's, on each side, when made for a timeout already set.
        if timeout != self.timeout:
            self.sock.settimeout(timeout)   # type: ignore[union-attr]
            self.timeout = timeout

    def send(self, packet: bytes, fds: Sequence[int], timeout: Optional[float] = None) -> None:
        self._set_timeout(timeout)
        wire.send_fds(self.sock, packet, fds)

    def recv(self, timeout: Optional[float] = None):
        self._set_timeout(timeout)
        return wire.recv_fds(self.sock)


class _AsyncLink(_Link):
    """:class:`_Link` on the event loop: the socket is non-blocking and a
    call waits for readiness (a plan's timeout cancels the wait, and a
    cancelled wait loses nothing: nothing was read)."""

    async def connect(self) -> bool:    # type: ignore[override]
        import asyncio
        if self.sock is not None:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC
                             | socket.SOCK_NONBLOCK)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self.path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        return True

    async def send(self, packet: bytes, fds: Sequence[int]) -> None:  # type: ignore[override]
        while True:
            try:
                return wire.send_fds(self.sock, packet, fds)
            except BlockingIOError:
                await self._ready(True)

    async def recv(self):   # type: ignore[override]
        while True:
            try:
                return wire.recv_fds(self.sock)
            except BlockingIOError:
                await self._ready(False)

    async def _ready(self, writable: bool) -> None:
        import asyncio
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()     # type: ignore[union-attr]
        fut = loop.create_future()
        (loop.add_writer if writable else loop.add_reader)(fd, _settle, fut)
        try:
            await fut
        finally:
            (loop.remove_writer if writable else loop.remove_reader)(fd)


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


# -- the plans: each conversation, once -----------------------------------------------

def _request(packet: bytes, fds: Sequence[int], timeout: Optional[float]) -> Plan:
    """Send one request and read the service's answer: (packet, fds)."""
    try:
        yield ("send", timeout, packet, fds)
        return (yield from _answer(timeout))
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise FdsError(CLOSED, f"the service closed the connection ({exc.strerror}): "
                       f"too many connections, or silent too long") from None


def _answer(timeout: Optional[float]) -> Plan:
    """The service's answer: (packet, fds). EOF means it refused the connection."""
    packet, fds, cut = yield ("recv", timeout)
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


def _giving(link: _Link, timeout: Optional[float], receiver, fds: Sequence[int],
            note: bytes) -> Plan:
    """Offer ``fds`` to ``receiver``; returns the ticket."""
    if not 1 <= len(fds) <= wire.MAX_FDS:
        raise ValueError(f"1 to {wire.MAX_FDS} fds, not {len(fds)}")
    if len(note) > wire.MAX_NOTE:
        raise ValueError(f"a note is at most {wire.MAX_NOTE} bytes")
    request = wire.OFFER + _receiver_of(receiver) + b"\0" + note
    yield ("connect", timeout)
    try:
        packet, extra = yield from _request(request, fds, timeout)
    except OSError:
        link.close()               # a late answer must not be taken for the next one
        raise
    except FdsError as exc:
        if exc.code == CLOSED:
            link.close()
        raise
    wire.close_all(extra)
    if not packet.startswith(wire.TICKET):
        raise FdsError(wire.E_MALFORMED, f"unexpected answer {packet[:40]!r}")
    return packet[len(wire.TICKET):].decode("ascii")


def _claiming(link: _Link, timeout: Optional[float], ticket: str) -> Plan:
    """Claim ``ticket``'s fds (a Handed). A kept connection the
    service closed for silence is opened again, once."""
    request = wire.CLAIM + ticket.encode("ascii", "replace")
    if link.waiting:
        link.close()               # a standing WAIT would take the answer
    for attempt in (1, 2):
        fresh = yield ("connect", timeout)
        try:
            packet, fds = yield from _request(request, (), timeout)
            break
        except OSError:
            link.close()           # a late answer must not be taken for the next one
            raise
        except FdsError as exc:
            if exc.code != CLOSED:
                raise
            link.close()
            if fresh or attempt == 2:
                raise
    return _handed(packet, fds)


def _waiting(link: _Link, timeout: Optional[float], wait: Optional[float]) -> Plan:
    """The next offer for this process (WAIT); TimeoutError after ``wait``
    seconds leaves the WAIT standing."""
    yield ("connect", timeout)
    try:
        if not link.waiting:
            yield ("send", timeout, wire.WAIT, ())
            link.waiting = True
        packet, fds = yield from _answer(wait)
    except (ConnectionResetError, BrokenPipeError) as exc:
        link.close()
        raise FdsError(CLOSED, f"the service closed the connection ({exc.strerror})") \
            from None
    except TimeoutError:           # socket.timeout and asyncio's: the wait stands
        raise
    except (OSError, FdsError):
        link.close()
        raise
    link.waiting = False
    return _handed(packet, fds)


def _opening(receiver: "Receiver") -> Plan:
    """A receiver's address and inbox subscription."""
    creds = yield ("whoami", TIMEOUT)
    receiver.address = str(creds)
    if wire.parse_cred(receiver.address.encode()) is None:
        raise FdsError(wire.E_ADDRESS, f"{receiver.address} is behind another broker: fds "
                       f"pass between processes of one host's broker only")
    receiver._inbox = f"{receiver.address}/{wire.INBOX}/".encode()
    yield ("subscribe", None, receiver._inbox)


def _taking(receiver: "Receiver", timeout: Optional[float]) -> Plan:
    """The next notification's fds, claimed; see :meth:`Receiver.take`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        message = yield ("receive", left)
        found = receiver.notice(message)
        if found is None:
            receiver.others.append(message)
            continue
        try:
            return (yield from _claiming(receiver.claimer.link, receiver.claimer.timeout,
                                         found.ticket))
        except FdsError as exc:
            if exc.code != wire.E_UNKNOWN:
                raise


def _run(link: _Link, plan: Plan) -> Any:
    """Run ``plan``, making its calls on ``link`` blocking; its result."""
    return drive(plan, lambda action: getattr(link, action[0])(*action[2:], timeout=action[1]))


async def _arun(link: _Link, plan: Plan) -> Any:
    """:func:`_run` on the event loop: each call awaited, within its timeout."""
    import asyncio
    return await adrive(plan, lambda action: asyncio.wait_for(
        getattr(link, action[0])(*action[2:]), action[1]))


# -- blocking ---------------------------------------------------------------------------

class Giver:
    """A connection to the service for offering fds, one ``give`` at a time."""

    _link_type = _Link

    def __init__(self, path: Optional[str] = None, *, address: Optional[str] = None,
                 timeout: Optional[float] = TIMEOUT) -> None:
        self.timeout = timeout
        self.path = path or socket_path(address)
        self.link = self._link_type(self.path)
        self._connect()

    def _connect(self) -> None:
        self.link.connect(timeout=self.timeout)

    @property
    def sock(self) -> Optional[socket.socket]:
        return self.link.sock

    def give(self, receiver, fds: Sequence[int], note: bytes = b"") -> str:
        """Offer ``fds`` (1 to 253; they stay open here too) to the process
        ``receiver`` (``!/cred/G/U/P``, its ``whoami``); the ticket."""
        return _run(self.link, _giving(self.link, self.timeout, receiver, fds, note))

    def close(self) -> None:
        self.link.close()

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

    _link_type = _Link

    def __init__(self, path: Optional[str] = None, *, address: Optional[str] = None,
                 timeout: Optional[float] = TIMEOUT) -> None:
        self.path = path or socket_path(address)
        self.timeout = timeout
        self.link = self._link_type(self.path)

    @property
    def sock(self) -> Optional[socket.socket]:
        return self.link.sock

    @property
    def waiting(self) -> bool:
        return self.link.waiting

    def claim(self, ticket: str) -> Handed:
        """The fds of ``ticket``, if this process is the one they were offered to."""
        return _run(self.link, _claiming(self.link, self.timeout, ticket))

    def wait(self, timeout: Optional[float] = None) -> Handed:
        """The next offer for this process, as soon as the service has it
        (an offer already waiting first): no bus, no ticket to claim, and two
        process wake-ups fewer than a notification and a claim. TimeoutError
        leaves the wait standing; the next ``wait`` goes on with it. Fds that
        arrive as the connection is closed are lost, as on any socket."""
        return _run(self.link, _waiting(self.link, self.timeout, timeout))

    def close(self) -> None:
        self.link.close()

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

    _Claimer = Claimer

    def __init__(self, bus, path: Optional[str] = None, *, _open: bool = True) -> None:
        self.bus = bus
        self.address = ""
        self._inbox = b""
        self.path = path or socket_path(getattr(bus, "address", None))
        self.claimer = self._Claimer(self.path)
        self.claimer.link.bus = bus
        # What take() read that was no notification, for the caller, in order.
        self.others: List = []
        if _open:
            _run(self.claimer.link, _opening(self))

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
        return _run(self.claimer.link, _taking(self, timeout))


# -- asyncio: the same plans, awaited ----------------------------------------------

class AsyncGiver(Giver):
    """:class:`Giver` on the event loop: ``await giver.give(...)``. The
    constructor does not connect; the first ``give`` does."""

    _link_type = _AsyncLink

    def _connect(self) -> None:
        pass

    async def give(self, receiver, fds: Sequence[int],   # type: ignore[override]
                   note: bytes = b"") -> str:
        return await _arun(self.link, _giving(self.link, self.timeout, receiver, fds, note))

    async def __aenter__(self) -> "AsyncGiver":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


async def agive(receiver, fds: Sequence[int], note: bytes = b"", *,
                path: Optional[str] = None, address: Optional[str] = None,
                timeout: Optional[float] = TIMEOUT) -> str:
    """:func:`give` on the event loop."""
    async with AsyncGiver(path, address=address, timeout=timeout) as giver:
        return await giver.give(receiver, fds, note)


class AsyncClaimer(Claimer):
    """:class:`Claimer` on the event loop: ``await claimer.claim(ticket)``,
    ``await claimer.wait(timeout)`` (a TimeoutError, or a cancelled wait,
    leaves the WAIT standing)."""

    _link_type = _AsyncLink

    async def claim(self, ticket: str) -> Handed:   # type: ignore[override]
        return await _arun(self.link, _claiming(self.link, self.timeout, ticket))

    async def wait(self, timeout: Optional[float] = None) -> Handed:  # type: ignore[override]
        return await _arun(self.link, _waiting(self.link, self.timeout, timeout))

    async def __aenter__(self) -> "AsyncClaimer":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


async def aclaim(ticket: str, *, path: Optional[str] = None, address: Optional[str] = None,
                 timeout: Optional[float] = TIMEOUT) -> Handed:
    """:func:`claim` on the event loop."""
    async with AsyncClaimer(path, address=address, timeout=timeout) as claimer:
        return await claimer.claim(ticket)


class AsyncReceiver(Receiver):
    """:class:`Receiver` on an :class:`sbus.aio.Client`: made by ``await
    AsyncReceiver.open(bus)``; ``await take()``, ``await claim()``."""

    _Claimer = AsyncClaimer

    @classmethod
    async def open(cls, bus, path: Optional[str] = None) -> "AsyncReceiver":
        self = cls(bus, path, _open=False)
        await _arun(self.claimer.link, _opening(self))
        return self

    async def claim(self, ticket: Union[str, Notice]) -> Handed:  # type: ignore[override]
        return await self.claimer.claim(ticket.ticket if isinstance(ticket, Notice) else ticket)

    async def take(self, timeout: Optional[float] = None) -> Handed:  # type: ignore[override]
        return await _arun(self.claimer.link, _taking(self, timeout))


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
