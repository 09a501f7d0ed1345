"""What both client drivers share: the socket they open and the methods written once.

:func:`open_socket` turns an address into a connected socket whose buffers
hold the largest packet, or an error that says what was tried and what to
check (:class:`sbus.errors.ConnectError`).

:class:`Driver` is the base of :class:`sbus.client.sync.Client` and
:class:`sbus.client.aio.Client`. Each holds a
:class:`~sbus.client.connection.Connection` (the protocol state, no I/O) and
runs its plans with ``_run``: the blocking driver returns the plan's result,
the asyncio one a coroutine. So each method here is written once and is a
plain call on one client and awaited on the other.
"""
from __future__ import annotations

import errno
import functools
import os
import socket
import stat
import struct
from typing import Any, Callable, Iterable, Optional, Tuple

from .. import address as _address
from .._core.linkpath import LinkInbox
from ..errors import (
    AddressError,
    BrokerPermissionError,
    BrokerRefusedError,
    ConnectError,
    NoBrokerError,
)
from . import barrier as _barrier
from . import chunks as _chunks
from . import connection as c
from . import proof as _proof
from .connection import Connection
from .protocol import ControlMessage, Message, Text, pack_control, pack_subscribe, pack_unsubscribe
from .requests import REQUEST_TIMEOUT

__all__ = ["Driver", "grow_buffers", "open_socket", "retrieve"]

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
        grow_buffers(sock, max_message)
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


def grow_buffers(sock: socket.socket, size: int) -> None:
    """Make both buffers of ``sock`` hold a ``size``-byte packet (see _grow_buffer)."""
    _grow_buffer(sock, _SO_SNDBUFFORCE, socket.SO_SNDBUF, size)
    _grow_buffer(sock, _SO_RCVBUFFORCE, socket.SO_RCVBUF, size)


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


class Driver:
    """The public methods both clients share, over ``self._conn``; see the module docstring.

    A driver sets ``_conn``, ``_sock`` and ``_fd`` (None and -1 while
    disconnected or closed: a syscall on -1 fails EBADF) and implements
    ``_attach(sock)`` and ``_run(plan)``.
    """

    _NAME = "sbus.Client"
    _conn: Connection
    _sock: Optional[socket.socket]
    _fd: int

    def _start(self, conn: Connection) -> None:
        self._conn = conn
        self.address, self.max_message = conn.address, conn.max_message
        self._inbox, self._out, self._in = conn.inbox, conn.out, conn.parser
        self._sock, self._fd = None, -1
        self._connect()
        conn.live = True

    def _connect(self) -> None:
        """A new connection (see open_socket), the credentials the broker reads noted."""
        sock = open_socket(self.address, self.max_message)
        conn = self._conn
        conn.credentials = None
        if _address.parse(self.address).fd is None:
            # The broker's pid reads 0 from another pid namespace, where ours differs.
            if _peer_pid(sock) != 0:
                conn.credentials = (os.getegid(), os.geteuid(), os.getpid())
        self._attach(sock)
        self._in.fd = self._fd      # Inbox.take_batch reads it
        conn.up = True

    def _run(self, plan: Any) -> Any:
        raise NotImplementedError

    def _act_now(self, action: tuple) -> None:
        """The actions both drivers take alike: none of them waits."""
        op = action[0]
        if op == c.CONNECT:
            self._connect()
        elif op == c.DETACH:
            self._detach()
        elif op == c.LOST:
            self._lost(action[1])
        elif op == c.SHUT:
            self._shut(action[1])

    def _send_box(self, box: Any, flags: int) -> int:
        """SEND as the asyncio client makes it: ``box.send``, or in frames
        once the broker granted them (take_frames)."""
        framer = self._conn.framer
        return box.send(self._fd, flags) if framer is None else framer.send(box, self._fd)

    def _send_one(self, packet: bytes, flags: int) -> int:
        if self._sock is None:
            raise OSError(errno.EBADF, "disconnected")
        return self._sock.send(packet, flags | socket.MSG_NOSIGNAL)

    def _lost(self, exc: BaseException) -> None:
        """The broker went away: keep what was not sent, and reconnect (the
        blocking driver in the call that needs the broker, the asyncio one in
        a task)."""
        if self._sock is not None and self._conn.lost(exc):
            self._detach()
            self._conn.lose(exc)
            self._reconnect_later()

    def _reconnect_later(self) -> None:
        pass

    def _triage(self, batch: Optional[list]) -> bool:
        """A batch that is not plain messages (or None) into the queue; True
        if it ended a connection a policy rides out (then lost)."""
        end = None if batch is None else self._conn.triage(batch)
        if end is not None:
            self._lost(end)
        return end is not None

    def _detach(self) -> None:
        self._unwatch()
        sock, self._sock, self._fd = self._sock, None, -1
        self._in.fd = -1
        self._conn.up = self._conn.live = False
        if sock is not None:
            sock.close()

    def _unwatch(self) -> None:
        pass

    def _shut(self, error: Any) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._conn.closed

    @property
    def connected(self) -> bool:
        """False while a reconnecting client waits for the broker."""
        return self._sock is not None

    @property
    def buffered(self) -> bool:
        """Whether publish() packs instead of sending; turning it off sends what is packed."""
        return self._conn.buffered

    @buffered.setter
    def buffered(self, on: bool) -> None:
        if not on and len(self._out):
            self._unbuffer()
        self._conn.buffered = on

    def _unbuffer(self) -> None:
        raise NotImplementedError

    @property
    def chunks(self) -> _chunks.Reassembler:
        """The reassembly of chunked messages (docs/chunks.md): its bounds,
        ``on_lost`` and counters (``stats()``)."""
        return self._conn.chunks

    @property
    def reassemble(self) -> bool:
        """Whether chunks come back as whole messages; off (a relay: the store,
        the bridge), they are received as the packets they are."""
        return self._conn.parser.chunks

    @reassemble.setter
    def reassemble(self, on: bool) -> None:
        self._conn.parser.chunks = on

    @property
    def frames(self) -> Tuple[int, int]:
        """(frames received and taken apart, frames sent) since
        :meth:`take_frames` was first called."""
        sender = self._conn.sent_frames
        return getattr(self._in, "frames", 0), 0 if sender is None else sender.frames

    @property
    def pending(self) -> int:
        """How many received messages wait in the client (not in the socket)."""
        return len(self._inbox)

    @property
    def backlog(self) -> int:
        """Bytes published while the broker was away and not yet sent."""
        backlog = self._conn.backlog
        return backlog.nbytes if backlog is not None else 0

    def __repr__(self) -> str:
        state = ("closed" if self._conn.closed else "disconnected" if self._sock is None
                 else f"fd={self._fd}")
        return f"<{self._NAME} {self.address!r} {state}>"

    # -- written once: the blocking client returns what the plan returns, the
    # -- asyncio one has them as coroutine functions (see awaited)

    PLANNED = ("send_packet", "subscribe", "unsubscribe", "send_cmsg", "publish_many", "query",
               "whoami", "stats", "request", "sync",
               "prove", "take_frames")

    def send_packet(self, packet: bytes, flags: int = 0) -> Any:
        """Send one raw protocol packet with send(2) ``flags`` (MSG_NOSIGNAL is
        always added); buffered, pack it behind the buffered messages."""
        return self._run(self._conn.send_packet(packet, flags))

    def subscribe(self, pattern: Text, flags: int = 0) -> Any:
        """Receive messages whose key matches ``pattern`` ('' matches everything);
        a pattern that does not bring chunks itself is followed by the one
        that does (docs/chunks.md)."""
        return self._run(_chunks.subscribing(self._conn, pack_subscribe(pattern), flags))

    def unsubscribe(self, pattern: Text, flags: int = 0) -> Any:
        """Drop one earlier subscription to exactly ``pattern`` (and its chunk pattern's)."""
        return self._run(_chunks.subscribing(self._conn, pack_unsubscribe(pattern), flags))

    def send_cmsg(self, key: Text, payload: Optional[Text] = None, flags: int = 0) -> Any:
        """Send a control message to the broker (``CMSG key`` or ``CMSG key\\0payload``)."""
        return self.send_packet(pack_control(key, payload), flags)

    def publish_many(self, messages: Iterable[Tuple[Text, Text]], flags: int = 0) -> Any:
        """Publish (key, payload) pairs in order, packed into batches sent with
        sendmmsg(2) (the asyncio client waits while the socket is full);
        returns how many were published.

        A pair the broker would refuse raises KeyRefusedError or
        MessageTooLargeError with ``index`` (its position) and ``sent`` (how
        many before it went out); nothing after it is sent. A connection
        failing mid-batch raises BatchInterruptedError with ``sent``; so does
        BlockingIOError (a full socket and MSG_DONTWAIT), and the rest is dropped.
        Buffered packets go out first; all of the batch is sent on return.
        """
        return self._run(self._conn.publish_many(messages, flags))

    def query(self, key: Text, payload: Optional[Text] = None, flags: int = 0, *,
              timeout: Optional[float] = None) -> Any:
        """Send a control message and return the payload of the broker's reply.

        The reply is the next control message with the same key; other
        messages that arrive meanwhile are queued for ``receive()``.
        ``flags`` go to the send(2) and every recv(2) (MSG_PEEK excepted).
        If the wait ends in an exception (or is cancelled), the late reply is
        discarded when it arrives. Buffered packets are sent first; a
        reconnecting client asks the new broker again if the connection is
        lost meanwhile.
        """
        return self._run(self._conn.query(key, payload, flags, timeout))

    def take_frames(self, *, timeout: Optional[float] = None) -> Any:
        """Ask the broker for frames: many packets in one, both ways, a
        transport between sbus's own processes (``sbus bridge``), which the
        broker grants to its own uid or root (docs/bridge.md, "Speed").
        Returns the answer, b"ok" or b"refused: why" (a broker that predates
        them does not answer: ``timeout``). From then on frames received are
        taken apart, and both clients send their batches in frames (a batch
        read by receive_many still holds at most ``max``); a reconnecting
        client asks the new broker again in its replay."""
        if not isinstance(self._in, LinkInbox):
            old, inbox = self._in, LinkInbox(self.max_message, Message, ControlMessage)
            inbox.chunks, inbox.route = old.chunks, old.route
            inbox.fd, inbox.queue, inbox.outbox = old.fd, old.queue, old.outbox  # take_batch's
            self._in = self._conn.parser = inbox
        return self._run(self._conn.take_frames(timeout))

    def whoami(self, flags: int = 0, *, timeout: Optional[float] = None) -> Any:
        """Ask the broker for this client's credentials (``!/cred/GID/UID/PID...``): Credentials."""
        return self._run(self._conn.whoami(flags, timeout))

    def stats(self, flags: int = 0, *, timeout: Optional[float] = None) -> Any:
        """The broker's counters: the JSON reply to ``CMSG stats``, as a dict."""
        return self._run(self._conn.stats(flags, timeout))

    def request(self, key: Text, payload: Text = b"", timeout: float = REQUEST_TIMEOUT) -> Any:
        """The reply's body to a request on ``key`` (docs/requests.md); many
        may be in flight on the asyncio client. RequestTimeoutError once
        ``timeout`` seconds pass unanswered; HandlerError (the server's text)
        if the server's handler raised."""
        return self._run(self._conn.request(key, payload, timeout))

    def sync(self, timeout: float = _barrier.SYNC_TIMEOUT) -> Any:
        """A barrier: return once the broker has handled everything this
        client sent before (publishes matched and queued, SUB and UNSUB in
        place); buffered packets are sent first, and messages received
        meanwhile stay queued. TimeoutError after ``timeout`` seconds.
        What it proves and what not: docs/clients.md, "A barrier"."""
        return self._run(_barrier.sync(self._conn, timeout))

    def prove(self, key: Text, timeout: float = _proof.PROOF_TIMEOUT) -> Any:
        """The spec's four-step identity proof with whoever serves ``key``
        (:func:`sbus.client.proof.serve_proofs`): their verified Credentials,
        or ProofError naming the step that failed (docs/proof.md)."""
        return self._run(_proof.prove(self._conn, key, timeout))


def retrieve(task: Any) -> None:
    """Mark a background task's exception as seen; the next call reports the state."""
    if not task.cancelled():
        task.exception()


def awaited(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of :class:`Driver` as a coroutine function, for a driver
    whose ``_run`` returns an awaitable (so ``inspect`` sees it as one)."""
    @functools.wraps(method)
    async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await method(self, *args, **kwargs)
    return call
