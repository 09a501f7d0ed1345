"""The client core: the state both clients keep and what they decide, with no I/O.

:class:`Core` is the base of :class:`sbus.client.sync.Client` (blocking)
and :class:`sbus.client.aio.Client` (asyncio); they make the syscalls and
wait in their own way, the core decides what to send, keep or raise:

- buffered mode: the outbox (:class:`sbus._core.batch.Outbox`) and the
  send flags of what it holds (:meth:`Core._pack`);
- the queue of what was received ahead of the caller, errors included in
  their turn;
- the requests to other clients (:mod:`sbus.client.requests`): the reply
  inbox and the requests waiting on it;
- the requests: queries sent and not yet answered, oldest first (the broker
  answers in order). One whose caller gave up is abandoned and still owns
  its reply, which is dropped when it comes (:meth:`Core._late`);
- with a reconnect policy (:mod:`sbus.client.reconnect`): the session, the
  backlog and the reconnect state machine, lost (:meth:`Core._lose`) ->
  attempts (:meth:`Core._pause`, :meth:`Core._attempt_failed`) -> replay
  and whoami (:meth:`Core._replay`) -> restored (:meth:`Core._restored`),
  after which the driver delivers the backlog;
- the errors the clients raise themselves, each worded once (the compiled
  batch code words its own).

:func:`open_socket` turns an address into a connected socket whose buffers
hold the largest packet, or an error that says what was tried and what to
check (:class:`sbus.errors.ConnectError`).
"""
from __future__ import annotations

import collections
import errno
import os
import socket
import stat
import struct
import time
from typing import Any, Deque, List, Optional, Tuple, Union

from .. import address as _address
from .._core.batch import Inbox, Outbox, check_pattern
from .._core.protocol import cred_form
from ..errors import (
    AddressError,
    BacklogFullError,
    BatchInterruptedError,
    BrokerPermissionError,
    BrokerRefusedError,
    BusClosedError,
    ConnectError,
    KeyRefusedError,
    MessageTooLargeError,
    NoBrokerError,
    PatternRefusedError,
)
from . import reconnect as _reconnect
from .protocol import WHOAMI, ControlMessage, Message, pack_control
from .reconnect import Reconnect

__all__ = ["Core", "GONE", "Request", "open_socket"]

# send(2)/recv(2) errors that mean the broker is gone (EBADF: the client
# already knows, and keeps fd -1 until it reconnects).
GONE = frozenset((errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF))

# Linux socket options that Python's socket module does not name (asm-generic/socket.h).
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
# unix_dgram_sendmsg() refuses a packet longer than sk_sndbuf - 32 with EMSGSIZE.
_KERNEL_PACKET_OVERHEAD = 32


def open_socket(address: str, max_message: int) -> socket.socket:
    """A blocking socket connected to ``address`` (sbusd syntax; ``/dev/fd/N``
    adopts descriptor N), its buffers grown to hold a ``max_message``-byte
    packet. AddressError for an address a client cannot use; the OSError
    of connect(2) otherwise."""
    addr = _address.parse(address)
    if addr.fd is not None:
        try:
            sock = socket.socket(fileno=addr.fd)
        except OSError as exc:
            raise AddressError(f"{addr.text}: {exc.strerror or exc}") from exc
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
            sock.detach()  # not ours to close: the caller still owns a wrong fd
            raise AddressError(f"{addr.text} is not a unix-domain SOCK_SEQPACKET socket")
    elif addr.random:
        raise AddressError(f"{addr.text} is for sbusd only; connect to /dev/unix/abstract/HEX")
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        if addr.fd is None:
            try:
                sock.connect(addr.sun_path)
            except OSError as exc:
                raise _connect_error(addr, exc) from exc
        _grow_buffer(sock, _SO_SNDBUFFORCE, socket.SO_SNDBUF, max_message)
        _grow_buffer(sock, _SO_RCVBUFFORCE, socket.SO_RCVBUF, max_message)
    except BaseException:
        sock.close()
        raise
    return sock


_UCRED = struct.Struct("3i")     # struct ucred: pid, uid, gid
_CHECK = "check -a / SBUS_ADDRESS"


def _connect_error(addr: _address.Address, exc: OSError) -> OSError:
    """What a failed connect(2) to ``addr`` means, worded with what to check;
    an error of the same OSError subclass (see sbus.errors.ConnectError)."""
    text, code = addr.text, exc.errno
    no_broker = f"no sbus broker at {text}: start sbusd, or {_CHECK}"
    if code in (errno.EACCES, errno.EPERM):
        return BrokerPermissionError(code, (
            f"permission denied connecting to {text} (uid {os.geteuid()}): the socket's "
            f"mode or its directory's keeps this user out (sbusd -g, -o); {_CHECK}"), text)
    if code == errno.EPROTOTYPE:
        return ConnectError(code, f"{text} is not a SOCK_SEQPACKET socket, so not sbusd's: "
                                  f"{_CHECK}", text)
    if code == errno.ENOENT:
        if text.startswith(_address.ABSTRACT_PREFIX + "/"):
            return NoBrokerError(code, (
                f"no sbus broker at {text}: no such file, and not an abstract address "
                f"({_address.ABSTRACT_PREFIX}/ then an even number of hex digits, "
                f"beginning 00); {_CHECK}"), text)
        return NoBrokerError(code, no_broker, text)
    if code not in (errno.ECONNREFUSED, errno.ENOTSOCK):
        return exc
    refused = BrokerRefusedError if code == errno.ECONNREFUSED else ConnectError
    if addr.is_abstract:
        return refused(code, no_broker, text)
    try:
        mode = os.stat(addr.sun_path).st_mode
    except OSError:
        return NoBrokerError(errno.ENOENT, no_broker, text)
    if stat.S_ISSOCK(mode):
        return refused(code, (
            f"nobody listens on {text}: a broker that died left its socket behind; start "
            f"sbusd (-r replaces a stale socket), or {_CHECK}"), text)
    kind = ("a directory" if stat.S_ISDIR(mode) else
            "a regular file" if stat.S_ISREG(mode) else "not a socket")
    return refused(code, f"{text} is {kind}, not an sbus socket: {_CHECK}", text)


def _peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end, as this pid namespace sees it."""
    cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(cred)[0]


def _grow_buffer(sock: socket.socket, force: int, option: int, size: int) -> None:
    """Make the socket buffer hold a ``size``-byte packet; never shrink it.

    The kernel doubles the value it is given; SO_*BUFFORCE (root or
    CAP_NET_ADMIN) ignores net.core.[wr]mem_max, the plain option is capped by it.
    """
    if sock.getsockopt(socket.SOL_SOCKET, option) >= size + _KERNEL_PACKET_OVERHEAD:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, force, size)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, option, size)


class Request:
    """A query sent and not yet answered; ``waiter`` is None once its caller gave up."""

    __slots__ = ("key", "packet", "waiter")

    def __init__(self, key: bytes, packet: bytes, waiter: Any) -> None:
        self.key, self.packet, self.waiter = key, packet, waiter


class Core:
    """What a client is, apart from its I/O; see the module docstring.

    A driver sets ``_sock``/``_fd`` (None and -1 while disconnected or
    closed: a syscall on -1 fails EBADF) and implements ``_unbuffer()``.
    """

    _NAME = "sbus.Client"

    def __init__(self, address: Optional[str], max_message: int, buffered: bool,
                 reconnect: Union[None, bool, Reconnect]) -> None:
        self.address = _address.from_environment(address)
        self.max_message = max_message
        self._buffered = buffered
        self._policy = _reconnect.policy(reconnect)
        self._session = _reconnect.Session() if self._policy else None
        self._backlog = _reconnect.Backlog(self._policy.max_backlog) if self._policy else None
        self._sock: Optional[socket.socket] = None
        self._fd = -1
        self._closed = False
        self._out = Outbox(max_message)
        self._out_flags = 0
        self._in = Inbox(max_message, Message, ControlMessage)
        # Received and not yet taken: messages, or the exception to raise in that place.
        self._inbox: Deque[Any] = collections.deque()
        self._requests: Deque[Request] = collections.deque()    # oldest first
        # Requests to other clients and their reply inbox (sbus.client.requests.Replies),
        # made on the first one.
        self._replies: Any = None
        self._failures = 0          # failed reconnect attempts in a row
        self._last_failure: Optional[BaseException] = None
        self._refusals = 0          # new connections in a row closed during the replay
        self._closed_by: Optional[BusClosedError] = None     # raised once closed, if set
        # (gid, uid, pid) the broker read with SO_PEERCRED; None: unknown.
        self._credentials: Optional[Tuple[int, int, int]] = None
        self._down_since = 0.0
        self._next_attempt = 0.0

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        """False while a reconnecting client waits for the broker."""
        return self._sock is not None

    @property
    def buffered(self) -> bool:
        """Whether publish() packs instead of sending; turning it off sends what is packed."""
        return self._buffered

    @buffered.setter
    def buffered(self, on: bool) -> None:
        if not on and len(self._out):
            self._unbuffer()
        self._buffered = on

    def _unbuffer(self) -> None:
        """Buffered mode was turned off: send what is packed (each driver its way)."""
        raise NotImplementedError

    @property
    def pending(self) -> int:
        """How many received messages wait in the client (not in the socket)."""
        return len(self._inbox)

    @property
    def backlog(self) -> int:
        """Bytes published while the broker was away and not yet sent."""
        return self._backlog.nbytes if self._backlog is not None else 0

    def __repr__(self) -> str:
        state = ("closed" if self._closed else "disconnected" if self._sock is None
                 else f"fd={self._fd}")
        return f"<{self._NAME} {self.address!r} {state}>"

    # -- the errors a client raises ------------------------------------------------

    def _gone(self) -> BusClosedError:
        if self._closed:
            return self._closed_by or BusClosedError("the client is closed")
        return BusClosedError("the broker closed the connection")

    def _gave_up(self) -> BusClosedError:
        """The policy gave up; the last attempt's error is the cause, and worded."""
        last = self._last_failure
        error = BusClosedError(f"{self.address}: no broker after {self._failures} attempts "
                               f"to reconnect" + (f"; the last: {last}" if last else ""))
        error.__cause__ = last
        self._closed_by = error
        return error

    def _too_large(self, packet: bytes) -> None:
        if len(packet) > self.max_message:
            raise MessageTooLargeError(
                f"packet of {len(packet)} bytes exceeds the bus limit of {self.max_message}")

    def _interrupted(self, sent: int, total: int) -> BatchInterruptedError:
        return BatchInterruptedError(f"the broker closed the connection after {sent} of "
                                     f"{total} messages of the batch were sent", sent)

    def _send_failed(self, exc: OSError, packet: Optional[bytes]) -> None:
        """Raise what a failed send(2) of ``packet`` means, unless the broker
        went away and the policy rides it out (then the driver calls its ``_lost``)."""
        if self._closed:
            raise self._gone() from None
        if exc.errno == errno.EMSGSIZE:
            raise MessageTooLargeError(
                f"the kernel refused a {len(packet or b'')}-byte packet (socket send buffer "
                f"too small; see net.core.wmem_max)") from exc
        if exc.errno not in GONE:
            raise exc
        if self._policy is None:
            raise self._gone() from exc

    # -- what is sent --------------------------------------------------------------

    def _admit(self, packet: bytes) -> bool:
        """Check a raw packet before it is sent or packed and note it in the
        session; True if a reconnect replays it (a SUB, UNSUB or setting)."""
        self._too_large(packet)
        if packet.startswith(b"SUB !"):
            self._check_private(packet[4:])
        if self._session is None:
            return False
        if packet.startswith(b"SUB "):
            check_pattern(packet[4:])   # replayed on every reconnect: never a refused one
        return self._session.note(packet)

    def _connect(self) -> socket.socket:
        """A new connection (see open_socket), the credentials the broker reads noted."""
        sock = open_socket(self.address, self.max_message)
        self._credentials = None
        if _address.parse(self.address).fd is None:
            # The broker's pid reads 0 from another pid namespace, where ours differs.
            if _peer_pid(sock) != 0:
                self._credentials = (os.getegid(), os.geteuid(), os.getpid())
        return sock

    def _check_private(self, pattern: bytes) -> None:
        """KeyRefusedError for a ``!/cred/GID/UID/PID/`` pattern naming other
        credentials than this connection's: the broker would close the connection.
        In the nested form a whoami answers behind a leaf broker or a private
        bridge (``<prefix>/!/cred/GID/UID/PID/...``) the last form of the chain
        is this client's; the prefix before it is the broker's to check."""
        if self._credentials is None or not pattern.startswith(b"!/cred/"):
            return
        form = cred_form(pattern)
        while form is not None and pattern[form[3]:].startswith(b"!/cred/"):
            nested = cred_form(pattern[form[3]:])
            if nested is None:
                break
            pattern = pattern[form[3]:]
            form = nested
        if form is None or all(f is None or f == own for f, own in zip(form, self._credentials)):
            return
        ours = "!/cred/{}/{}/{}/".format(*self._credentials)
        raise KeyRefusedError(
            f"private pattern {pattern.decode('utf-8', 'replace')!r} names other credentials "
            f"than this client's, {ours}: only they may subscribe to it (the broker would "
            f"close the connection); leave a field empty to mean this client's")

    def _pack(self, packet: bytes, flags: int) -> bool:
        """Pack for buffered mode; False if what is packed must be sent first
        (the outbox is full, or holds packets for other send flags)."""
        if flags != self._out_flags and len(self._out):
            return False
        self._out_flags = flags
        return self._out.add_packet(packet)

    def _keep(self, packet: bytes) -> None:
        """The broker is away: keep ``packet`` for the next one (BacklogFullError if it does not fit)."""
        if not self._session.covers(packet):
            self._backlog.add(packet)

    def _keep_outbox(self, out: Outbox, done: int) -> None:
        """What ``out`` holds goes behind the backlog, in order. BacklogFullError
        at the first packet that does not fit (``index`` and ``sent``: ``done``
        plus the packets kept before it; it and the rest are not kept)."""
        kept = 0
        try:
            for packet in out.unsent():
                self._keep(packet)
                kept += 1
        except BacklogFullError as exc:
            exc.index = exc.sent = done + kept
            raise
        finally:
            out.clear()

    def _keep_owed(self, out: Outbox) -> None:
        """What ``out`` still owes was packed before the backlog: it goes in front."""
        self._backlog.add_front(p for p in out.unsent() if not self._session.covers(p))
        out.clear()

    # -- requests and their replies ------------------------------------------------

    def _asked(self, key: bytes, packet: bytes, waiter: Any) -> Request:
        request = Request(key, packet, waiter)
        self._requests.append(request)
        return request

    @staticmethod
    def _abandon(request: Request) -> None:
        """Its caller gave up: the reply, when it comes, is dropped."""
        request.waiter = None

    def _unask(self, request: Request) -> None:
        """The request was never sent: no reply will come."""
        if request in self._requests:
            self._requests.remove(request)

    def _answer(self, reply: ControlMessage) -> Optional[Request]:
        """The oldest request with the reply's key, taken off the list; None if there is none."""
        for request in self._requests:
            if request.key == reply.key:
                self._requests.remove(request)
                return request
        return None

    def _late(self, reply: ControlMessage) -> bool:
        """True (and it is forgotten) if ``reply`` answers an abandoned request."""
        request = next((r for r in self._requests if r.key == reply.key), None)
        if request is None or request.waiter is not None:
            return False
        self._requests.remove(request)
        return True

    def _requeue(self, items: List[Any]) -> None:
        """Put items taken off the front of the received queue back there, in order."""
        self._inbox.extendleft(reversed(items))

    # -- losing and finding the broker ---------------------------------------------

    def _lose(self, exc: BaseException) -> None:
        """The connection failed and the driver closed its socket: what the
        outbox owes goes in front of the backlog, abandoned requests are
        forgotten (a new broker owes no old replies) and the clock starts."""
        self._keep_owed(self._out)
        self._requests = collections.deque(r for r in self._requests if r.waiter is not None)
        self._failures = 0
        self._down_since = time.monotonic()
        self._next_attempt = 0.0
        if self._policy.on_disconnect is not None:
            self._policy.on_disconnect(exc)

    def _pause(self) -> Optional[float]:
        """Seconds until the next attempt is due (0: now); None once the policy gives up."""
        now = time.monotonic()
        if self._policy.exhausted(self._failures, now - self._down_since):
            return None
        return max(0.0, self._next_attempt - now)

    def _attempt_failed(self, exc: BaseException) -> None:
        self._failures += 1
        self._last_failure = exc
        self._next_attempt = time.monotonic() + self._policy.delay(self._failures)

    def _replay(self) -> List[bytes]:
        """What a new connection is sent first: the session, then a whoami
        whose answer says that the broker has taken it."""
        return self._session.replay() + [pack_control(WHOAMI)]

    def _refused_replay(self, exc: BaseException) -> Optional[BusClosedError]:
        """A reconnect attempt failed with ``exc`` after connecting. A new broker
        that closes the connection before answering the replay's whoami, twice
        in a row (once may be a broker stopping), refuses the replay: the error
        the client stops with (later calls raise it too); None to try again."""
        closed = isinstance(exc, BusClosedError) or getattr(exc, "errno", None) in GONE
        self._refusals = self._refusals + 1 if closed else 0
        if self._refusals < 2:
            return None
        patterns = tuple(self._session.subscriptions)
        shown = ", ".join(repr(p.decode("utf-8", "replace")) for p in patterns)
        if not patterns:
            error = BusClosedError(f"{self.address}: the broker closes every new connection "
                                   f"at once: it refuses this client (its log says why)")
        elif len(patterns) == 1:
            error = PatternRefusedError(
                f"{self.address}: the broker closed the connection twice when the "
                f"subscription to {shown} was replayed: it refuses the pattern (its log "
                f"says why); the client stopped", patterns)
        else:
            error = PatternRefusedError(
                f"{self.address}: the broker closed the connection twice when the "
                f"subscriptions to {shown} were replayed: it refuses one of them (its log "
                f"says which and why); the client stopped", patterns)
        error.__cause__ = exc
        self._closed_by = error
        return error

    def _restored(self) -> None:
        """The new broker answered the whoami: the requests the old one left
        unanswered are asked again, first in the backlog."""
        self._failures = self._refusals = 0
        self._last_failure = None
        self._requests = collections.deque(r for r in self._requests if r.waiter is not None)
        self._backlog.add_front(r.packet for r in self._requests)
        if self._policy.on_reconnect is not None:
            self._policy.on_reconnect()
