"""A raw client: a SOCK_SEQPACKET socket that also speaks the protocol's
barriers (whoami), its stats request and its packets, for tests that must
send exactly the bytes they choose."""
from __future__ import annotations

import json
import os
import re
import socket

WHOAMI = b"CMSG !/cred/whoami"
STATS = b"CMSG stats"
CREDENTIALS = re.compile(r"(?:!/cred/[0-9]+/[0-9]+/[0-9]+/)*!/cred/[0-9]+/[0-9]+/[0-9]+")  # whoami (nested on a leaf)
SO_SNDBUFFORCE = 32     # Linux; root may raise a socket's send buffer past wmem_max


def _b(x) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


class Conn(socket.socket):
    """A connected socket (every ``socket.socket`` method works on it).

    ``whoami()`` is the exact barrier: the broker replies after it has handled
    everything sent before, and the reply is queued behind every delivery the
    broker made to us meanwhile. Deliveries read while waiting for a reply are
    kept in ``got``."""

    def __init__(self, timeout=5.0):
        super().__init__(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.settimeout(timeout)
        self.got: list = []
        self.closed_by_broker = False

    @classmethod
    def to(cls, address, timeout=5.0, sndbuf=None) -> "Conn":
        """Connect to ``address``; ``sndbuf`` forces the send buffer (as root)
        or asks for it (otherwise)."""
        c = cls(timeout)
        try:
            c.connect(address if isinstance(address, (str, bytes)) else str(address))
        except BaseException:
            c.close()
            raise
        if sndbuf:
            c.set_sndbuf(sndbuf)
        return c

    def set_sndbuf(self, size: int) -> None:
        try:
            self.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, size)
        except OSError:
            self.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)

    # -- packets; each returns False if the broker had closed the connection --

    def packet(self, packet: bytes) -> bool:
        try:
            self.send(packet)
            return True
        except (BrokenPipeError, ConnectionResetError):
            self.closed_by_broker = True
            return False

    def sub(self, pattern) -> bool:
        return self.packet(b"SUB " + _b(pattern))

    def unsub(self, pattern) -> bool:
        return self.packet(b"UNSUB " + _b(pattern))

    def pub(self, key, payload=b"") -> bool:
        return self.packet(b"MSG " + _b(key) + b"\0" + _b(payload))

    def cmsg(self, key, payload=None) -> bool:
        return self.packet(b"CMSG " + _b(key) + (b"" if payload is None else b"\0" + _b(payload)))

    def next_packet(self, timeout=None):
        """The next packet; b"" once the broker has closed the connection;
        None if nothing arrives within ``timeout`` (default: the socket's)."""
        old = self.gettimeout()
        if timeout is not None:
            self.settimeout(timeout)
        try:
            packet = self.recv(1 << 20)
        except socket.timeout:
            return None
        except (ConnectionResetError, BrokenPipeError):
            packet = b""
        finally:
            self.settimeout(old)
        if packet == b"":
            self.closed_by_broker = True
        return packet

    # -- barriers and requests --------------------------------------------------

    def whoami(self, timeout=None):
        """Our credentials as the broker reports them ('!/cred/G/U/P'), or
        None if the broker has closed the connection. Packets that arrive
        before the reply are appended to ``got``."""
        if not self.packet(WHOAMI):
            return None
        while True:
            packet = self.next_packet(timeout)
            if packet is None:
                raise TimeoutError("no whoami reply")
            if packet == b"":
                return None
            if packet.startswith(WHOAMI + b"\0"):
                who = packet[len(WHOAMI) + 1:].decode()
                assert CREDENTIALS.fullmatch(who), packet
                return who
            self.got.append(packet)

    def sub_ok(self, pattern) -> bool:
        """Subscribe; True if the broker kept the connection."""
        self.sub(pattern)
        return self.whoami() is not None

    def sync(self, timeout=None) -> str:
        """The barrier for a client that expects nothing else: fails if the
        broker closed the connection or delivered anything before the reply.
        Returns the credentials, like ``whoami``."""
        before = len(self.got)
        who = self.whoami(timeout)
        if who is None:
            raise ConnectionResetError("the broker closed the connection while syncing")
        assert len(self.got) == before, f"unexpected packets while syncing: {self.got[before:]!r}"
        return who

    def stats(self) -> dict:
        """The broker's stats snapshot; the reply must be the next packet."""
        self.send(STATS)
        packet = self.recv(1 << 22)
        assert packet.startswith(STATS + b"\0"), packet[:40]
        return json.loads(packet[len(STATS) + 1:])

    def stats_after(self) -> dict:
        """Stats once everything sent before has been delivered or dropped (a
        stats request read in the same batch as MSG packets is answered before
        that batch's deliveries are made)."""
        self.sync()
        return self.stats()

    @property
    def me(self) -> str:
        return f"!/cred/{os.getegid()}/{os.geteuid()}/{os.getpid()}"

    def collect(self) -> list:
        """Everything the broker delivered to us before now (a whoami round
        trip is the barrier). Raises if the reply carries someone else's
        credentials."""
        who = self.whoami()
        if who is not None and who != self.me:
            raise AssertionError(f"got a whoami reply for {who}")
        out, self.got = self.got, []
        return out

    def drain(self, quiet=0.3) -> list:
        """Everything received so far and until ``quiet`` seconds pass without a packet."""
        out, self.got = self.got, []
        while not self.closed_by_broker:
            packet = self.next_packet(quiet)
            if not packet:
                break
            out.append(packet)
        return out

    def until_closed(self, timeout=5.0) -> list:
        """Every packet until the broker closes the connection (EOF or a
        reset); socket.timeout if no packet and no close comes within ``timeout``."""
        out = []
        while True:
            packet = self.next_packet(timeout)
            if packet is None:
                raise socket.timeout(f"the connection is still open after {timeout}s")
            if packet == b"":
                return out
            out.append(packet)

    def assert_closed(self, timeout=5.0) -> None:
        """The broker closes the connection next: EOF (or a reset) and no packet before it."""
        packets = self.until_closed(timeout)
        assert packets == [], f"expected EOF, got {packets[0][:60]!r}"


def recv_or_none(sock: socket.socket, timeout=0.2, size=1 << 20):
    """The next packet, or None if none arrives within ``timeout``."""
    old = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        return sock.recv(size)
    except (socket.timeout, BlockingIOError):
        return None
    finally:
        sock.settimeout(old)
