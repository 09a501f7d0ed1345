"""A blocking sbus client: one connected ``SOCK_SEQPACKET`` socket, one packet per call.

The client keeps no state beyond the socket and a queue of messages that
arrived while it waited for a control reply (see :meth:`Client.query`).
Every call takes the send(2)/recv(2) flags and passes them to the kernel, so
``MSG_DONTWAIT``, ``MSG_PEEK`` and friends behave as they do on a bare
socket; :meth:`Client.fileno` makes the client usable with select, poll,
epoll, :mod:`selectors` and asyncio.

Keys, patterns and payloads may be ``str`` (encoded as UTF-8, with lone
surrogates from ``surrogateescape`` mapped back to their bytes) or bytes-like.
"""
from __future__ import annotations

import collections
import errno
import json
import select
import socket
import time
from typing import Any, Deque, Dict, Iterator, NamedTuple, Optional, Union

from . import address as _address
from .config import MAX_MESSAGE  # the largest packet sbusd accepts by default (--max-message)
from .errors import AddressError, BusClosedError, MessageTooLargeError, ProtocolError

__all__ = [
    "Client",
    "ControlMessage",
    "Credentials",
    "Message",
    "MAX_MESSAGE",
    "WHOAMI",
    "encode",
    "pack_control",
    "pack_publish",
    "pack_subscribe",
    "pack_unsubscribe",
    "parse_packet",
    "parse_stats",
]

WHOAMI = b"!/cred/whoami"

Text = Union[str, bytes, bytearray, memoryview]

# Linux socket options that Python's socket module does not name (asm-generic/socket.h).
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
# unix_dgram_sendmsg() refuses a packet longer than sk_sndbuf - 32 with EMSGSIZE.
_KERNEL_PACKET_OVERHEAD = 32


def encode(text: Text) -> bytes:
    """``text`` as bytes: str is encoded as UTF-8 (surrogateescape), bytes-like is copied."""
    if isinstance(text, str):
        return text.encode("utf-8", "surrogateescape")
    return bytes(text)


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _routing_key(key: Text, what: str) -> bytes:
    raw = encode(key)
    if b"\0" in raw:
        raise ValueError(f"a routing {what} cannot contain NUL: {raw!r}")
    return raw


class Message(NamedTuple):
    """A published message, exactly as the publisher sent it."""

    key: bytes
    payload: bytes

    @property
    def key_str(self) -> str:
        return _decode(self.key)

    @property
    def text(self) -> str:
        """The payload decoded as UTF-8 (surrogateescape)."""
        return _decode(self.payload)

    # Tuple equality would make Message(k, p) == ControlMessage(k, p).
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(self)))


class ControlMessage(NamedTuple):
    """A control message from the broker (``CMSG key\\0payload``); never from another client."""

    key: bytes
    payload: bytes

    @property
    def key_str(self) -> str:
        return _decode(self.key)

    @property
    def text(self) -> str:
        return _decode(self.payload)

    __eq__ = Message.__eq__
    __ne__ = Message.__ne__
    __hash__ = Message.__hash__


class Credentials(NamedTuple):
    """The reply to ``!/cred/whoami``: ``str()`` is the prefix for this client's secret keys.

    ``gid``, ``uid`` and ``pid`` come from the first ``!/cred/GID/UID/PID``
    triple; a broker behind other brokers may append more, which only
    ``text`` keeps.
    """

    text: str
    gid: int
    uid: int
    pid: int

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str) -> "Credentials":
        parts = text.split("/")
        if len(parts) < 5 or parts[0] != "!" or parts[1] != "cred" or not all(
                p.isdigit() for p in parts[2:5]):
            raise ProtocolError(f"malformed credentials from the broker: {text!r}")
        return cls(text, int(parts[2]), int(parts[3]), int(parts[4]))


def pack_subscribe(pattern: Text) -> bytes:
    return b"SUB " + _routing_key(pattern, "key pattern")


def pack_unsubscribe(pattern: Text) -> bytes:
    return b"UNSUB " + _routing_key(pattern, "key pattern")


def pack_publish(key: Text, payload: Text = b"") -> bytes:
    return b"".join((b"MSG ", _routing_key(key, "key"), b"\0", encode(payload)))


def pack_control(key: Text, payload: Optional[Text] = None) -> bytes:
    """``CMSG key``, or ``CMSG key\\0payload`` when a payload is given."""
    raw = _routing_key(key, "key")
    if payload is None:
        return b"CMSG " + raw
    return b"".join((b"CMSG ", raw, b"\0", encode(payload)))


def parse_packet(packet: bytes) -> Union[Message, ControlMessage]:
    """A packet the broker sent, as a Message or ControlMessage; ProtocolError otherwise."""
    if packet.startswith(b"MSG "):
        key, sep, payload = packet[4:].partition(b"\0")
        if not sep:
            raise ProtocolError(f"MSG packet without NUL after the key: {packet[:64]!r}")
        return Message(key, payload)
    if packet.startswith(b"CMSG "):
        key, _, payload = packet[5:].partition(b"\0")
        return ControlMessage(key, payload)
    raise ProtocolError(f"unknown packet type: {packet[:64]!r}")


def parse_stats(payload: bytes) -> Dict[str, Any]:
    """The payload of the broker's ``CMSG stats`` reply, as a dict."""
    try:
        stats = json.loads(payload)
    except ValueError as exc:
        raise ProtocolError(f"the broker's stats reply is not JSON: {payload[:64]!r}") from exc
    if not isinstance(stats, dict):
        raise ProtocolError(f"the broker's stats reply is not a JSON object: {payload[:64]!r}")
    return stats


def _open_socket(addr: _address.Address) -> socket.socket:
    if addr.fd is not None:
        try:
            sock = socket.socket(fileno=addr.fd)
        except OSError as exc:
            raise AddressError(f"{addr.text}: {exc.strerror or exc}") from exc
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
            sock.detach()  # not ours to close: the caller still owns a wrong fd
            raise AddressError(f"{addr.text} is not a unix-domain SOCK_SEQPACKET socket")
        return sock
    if addr.random:
        raise AddressError(f"{addr.text} is for sbusd only; connect to /dev/unix/abstract/HEX")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(addr.sun_path)
    except BaseException:
        sock.close()
        raise
    return sock


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


class Client:
    """A connection to an sbus broker.

    ``address`` uses the sbusd syntax (a path, ``/dev/unix/abstract/HEX`` or
    ``/dev/fd/N``, which adopts descriptor N); None means ``$SBUS_ADDRESS``,
    else ``/run/sbus.socket``. ``max_message`` must match the broker's limit.

    Messages received while :meth:`query` or :meth:`whoami` wait for their
    reply are queued for :meth:`receive`; ``pending`` counts them. A poller
    watching :meth:`fileno` does not see that queue, so drain it first.
    """

    def __init__(self, address: Optional[str] = None, *, max_message: int = MAX_MESSAGE) -> None:
        self.address = _address.from_environment(address)
        self.max_message = max_message
        self._sock: Optional[socket.socket] = _open_socket(_address.parse(self.address))
        try:
            _grow_buffer(self._sock, _SO_SNDBUFFORCE, socket.SO_SNDBUF, max_message)
            _grow_buffer(self._sock, _SO_RCVBUFFORCE, socket.SO_RCVBUF, max_message)
        except BaseException:
            self.close()
            raise
        # One byte more than the limit, so that an oversized packet is detected
        # even if a kernel does not report MSG_TRUNC.
        self._buffer = bytearray(max_message + 1)
        self._view = memoryview(self._buffer)
        self._inbox: Deque[Union[Message, ControlMessage]] = collections.deque()
        # Replies still owed to query() calls that gave up (timeout, EAGAIN,
        # signal): the broker answers each request once, and such a reply
        # must not be mistaken for the answer to a later request.
        self._abandoned: Dict[bytes, int] = {}

    # -- the socket ----------------------------------------------------------

    def fileno(self) -> int:
        return self._socket().fileno()

    @property
    def socket(self) -> socket.socket:
        """The underlying socket, for setsockopt/fcntl/ioctl."""
        return self._socket()

    @property
    def closed(self) -> bool:
        return self._sock is None

    @property
    def pending(self) -> int:
        """How many received messages wait in the client (not in the socket)."""
        return len(self._inbox)

    def close(self) -> None:
        """Close the connection; idempotent. Later calls raise BusClosedError."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._sock is None else f"fd={self._sock.fileno()}"
        return f"<sbus.Client {self.address!r} {state}>"

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise BusClosedError("the client is closed")
        return self._sock

    # -- sending ---------------------------------------------------------------

    def send_packet(self, packet: bytes, flags: int = 0) -> None:
        """Send one raw protocol packet with send(2) ``flags`` (MSG_NOSIGNAL is always added)."""
        if len(packet) > self.max_message:
            raise MessageTooLargeError(
                f"packet of {len(packet)} bytes exceeds the bus limit of {self.max_message}")
        try:
            self._socket().send(packet, flags | socket.MSG_NOSIGNAL)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise BusClosedError("the broker closed the connection") from exc
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                raise MessageTooLargeError(
                    f"the kernel refused a {len(packet)}-byte packet (socket send buffer "
                    f"too small; see net.core.wmem_max)") from exc
            raise

    def subscribe(self, pattern: Text, flags: int = 0) -> None:
        """Receive messages whose key matches ``pattern`` ('' matches everything)."""
        self.send_packet(pack_subscribe(pattern), flags)

    def unsubscribe(self, pattern: Text, flags: int = 0) -> None:
        """Drop one earlier subscription to exactly ``pattern``."""
        self.send_packet(pack_unsubscribe(pattern), flags)

    def publish(self, key: Text, payload: Text = b"", flags: int = 0) -> None:
        self.send_packet(pack_publish(key, payload), flags)

    def send_cmsg(self, key: Text, payload: Optional[Text] = None, flags: int = 0) -> None:
        """Send a control message to the broker (``CMSG key`` or ``CMSG key\\0payload``)."""
        self.send_packet(pack_control(key, payload), flags)

    # -- receiving -------------------------------------------------------------

    def receive(self, flags: int = 0, *, timeout: Optional[float] = None
                ) -> Union[Message, ControlMessage]:
        """The next message, from the client's queue or else recv(2) with ``flags``.

        ``MSG_PEEK`` leaves the message to be received again; ``MSG_DONTWAIT``
        raises BlockingIOError if none is ready. ``timeout`` (seconds) raises
        TimeoutError. BusClosedError means the broker closed the connection;
        MessageTooLargeError means an oversized packet was received and dropped.
        """
        if self._inbox:
            self._socket()
            return self._inbox[0] if flags & socket.MSG_PEEK else self._inbox.popleft()
        while True:
            packet = self._recv_packet(flags, timeout)
            if not (type(packet) is ControlMessage and self._abandoned.get(packet.key)):
                return packet
            if flags & socket.MSG_PEEK:
                # Consume the late reply, so that peeking can see past it.
                self._recv_packet(flags & ~socket.MSG_PEEK, None)
            self._forget(packet.key)

    def __iter__(self) -> Iterator[Union[Message, ControlMessage]]:
        """Receive messages until the broker closes the connection."""
        while True:
            try:
                yield self.receive()
            except BusClosedError:
                return

    def _wait_readable(self, timeout: float) -> None:
        poller = select.poll()
        poller.register(self._socket(), select.POLLIN)
        if not poller.poll(max(0, int(timeout * 1000 + 0.999))):
            raise TimeoutError(f"no message within {timeout} s")

    def _recv_packet(self, flags: int, timeout: Optional[float]) -> Union[Message, ControlMessage]:
        sock = self._socket()
        if timeout is not None:
            self._wait_readable(timeout)
        try:
            size, _, msg_flags, _ = sock.recvmsg_into([self._view], 0, flags)
        except ConnectionResetError as exc:
            raise BusClosedError("the broker closed the connection") from exc
        if size == 0:
            raise BusClosedError("the broker closed the connection")
        if msg_flags & socket.MSG_TRUNC or size > self.max_message:
            raise MessageTooLargeError(
                f"received a packet larger than {self.max_message} bytes; it was dropped")
        return parse_packet(bytes(self._view[:size]))

    def _forget(self, key: bytes) -> None:
        left = self._abandoned[key] - 1
        if left:
            self._abandoned[key] = left
        else:
            del self._abandoned[key]

    # -- requests to the broker --------------------------------------------------

    def query(self, key: Text, payload: Optional[Text] = None, flags: int = 0, *,
              timeout: Optional[float] = None) -> bytes:
        """Send a control message and return the payload of the broker's reply.

        The reply is the next control message with the same key; other
        messages that arrive meanwhile are queued for :meth:`receive`.
        ``flags`` go to the send(2) and every recv(2) (MSG_PEEK excepted).
        If the wait ends in an exception, the late reply is discarded when it
        arrives.
        """
        raw_key = _routing_key(key, "key")
        self.send_packet(pack_control(raw_key, payload), flags)
        flags &= ~socket.MSG_PEEK
        # The broker answers requests in order, so the first replies
        # belong to requests that were abandoned earlier.
        stale = self._abandoned.pop(raw_key, 0)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                packet = self._recv_packet(flags, left)
                if type(packet) is ControlMessage and packet.key == raw_key:
                    if stale:
                        stale -= 1
                        continue
                    return packet.payload
                self._inbox.append(packet)
        except BaseException:
            self._abandoned[raw_key] = stale + 1
            raise

    def whoami(self, flags: int = 0, *, timeout: Optional[float] = None) -> Credentials:
        """Ask the broker for this client's credentials (``!/cred/GID/UID/PID...``)."""
        reply = self.query(WHOAMI, None, flags, timeout=timeout)
        return Credentials.parse(reply.decode("ascii", "replace"))

    def stats(self, flags: int = 0, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """The broker's counters: the JSON reply to ``CMSG stats``."""
        return parse_stats(self.query(b"stats", None, flags, timeout=timeout))


