"""The ``sbus fds`` process: one poll loop over its listening socket, its
connections and the runner's wakeup fd, with one blocking bus client that
only publishes notifications.

Every fd the service holds belongs to exactly one of: the listener, a
connection, an offer. Each is closed when its owner goes (a connection at
EOF or error, an offer when claimed, expired, or at stop), so churn cannot
leak one; tests/test_fds.py counts /proc/PID/fd to check it.
"""
from __future__ import annotations

import errno
import os
import resource
import select
import socket
import stat
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from .. import __version__
from .. import logschema as schema
from ..errors import SbusError
from ..runner import STOPPED, ready
from . import wire
from .defaults import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID, MAX_FDS_PER_UID, TIMEOUT

# Descriptors kept for the listener, the bus, the log and Python's own.
RESERVED_FDS = 64
SD_LISTEN_FDS_START = 3
# After accept(2) ran out of descriptors: seconds before it is tried again.
ACCEPT_PAUSE = 0.1
TICK = 1.0


class StartupError(Exception):
    """Why the service cannot start; the message says it."""


@dataclass
class Settings:
    address: str
    socket_path: str
    timeout: float = TIMEOUT
    max_fds_per_uid: int = MAX_FDS_PER_UID
    max_fds: Optional[int] = None       # None: what RLIMIT_NOFILE leaves
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_uid: int = MAX_CONNECTIONS_PER_UID
    max_message: int = 400 * 1024     # the broker's default --max-message


@dataclass
class Offer:
    ticket: str
    receiver: wire.Peer
    giver: wire.Peer
    fds: List[int]
    note: bytes
    deadline: float


class Conn:
    __slots__ = ("sock", "peer", "idle_since", "waiting")

    def __init__(self, sock: socket.socket, peer: wire.Peer) -> None:
        self.sock = sock
        self.peer = peer
        self.idle_since = time.monotonic()
        self.waiting = False        # sent WAIT: the next offer for its peer goes here


def _systemd_socket() -> Optional[socket.socket]:
    """The socket systemd passed as fd 3 (sbus-fds.socket), if LISTEN_PID is us."""
    fds, pid = os.environ.get("LISTEN_FDS"), os.environ.get("LISTEN_PID")
    if not fds or not pid or pid != str(os.getpid()):
        return None
    for name in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if fds != "1":
        raise StartupError(f"systemd passed {fds} sockets; sbus fds takes exactly one")
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
        raise StartupError("the socket systemd passed is not AF_UNIX SOCK_SEQPACKET")
    return sock


def _bind(path: str) -> socket.socket:
    """A listener at ``path``, mode 0666: any local user may offer or claim
    (the kernel's SO_PEERCRED, not the file mode, decides who takes what).
    A stale socket nobody serves is replaced; anything else at ``path`` is not."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(f"{path}: exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)
        except OSError as exc:
            raise StartupError(f"{path}: {exc.strerror}") from None
        else:
            raise StartupError(f"{path}: another process serves it")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise StartupError(f"{path}: {exc.strerror}") from None
    return sock


def _fd_room(settings: Settings) -> int:
    """The most fds offers may hold: RLIMIT_NOFILE (raised to its hard limit)
    less the connections and a reserve, or --max-fds if lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    room = max(0, soft - settings.max_connections - RESERVED_FDS)
    if settings.max_fds is not None:
        room = min(room, settings.max_fds)
    return room


class FdService:
    def __init__(self, settings: Settings, logger) -> None:
        self.s = settings
        self.log = logger
        self.listener: Optional[socket.socket] = None
        self.own_path: Optional[tuple] = None     # (path, st_ino) of the socket file we made
        self.bus = None                           # an sbus.Client once open
        self.conns: Dict[int, Conn] = {}
        self.conns_by_uid: Counter = Counter()
        self.waiters: Dict[wire.Peer, List[Conn]] = {}   # oldest WAIT first
        self.offers: Dict[str, Offer] = {}        # in deadline order: one timeout for all
        self.held_by_uid: Counter = Counter()
        self.held = 0
        self.max_fds = 0
        self.accept_paused_until = 0.0
        self.started = time.monotonic()
        self.counters: Counter = Counter()

    def emit(self, event: str, level: str = "info", **fields) -> None:
        getattr(self.log, level)(event, **fields)

    # -- start and stop ------------------------------------------------------------

    def open(self) -> None:
        self.max_fds = _fd_room(self.s)
        sock = _systemd_socket()
        if sock is None:
            sock = _bind(self.s.socket_path)
            self.own_path = (self.s.socket_path, os.stat(self.s.socket_path).st_ino)
        sock.setblocking(False)
        self.listener = sock

        def lost(exc) -> None:
            self.emit(schema.FDS_BUS_LOST, level="warning", address=self.s.address,
                      error=str(exc))

        def back() -> None:
            self.emit(schema.FDS_BUS_BACK, address=self.s.address)

        from .. import Client, Reconnect  # the public client API only
        policy = Reconnect(give_up_after=None, max_delay=1.0, on_disconnect=lost,
                           on_reconnect=back)
        self.bus = Client(self.s.address, max_message=self.s.max_message, reconnect=policy)
        self.bus.whoami(timeout=10.0)
        self.emit(schema.FDS_START, version=__version__, address=self.s.address,
                  socket=self.s.socket_path, timeout_s=self.s.timeout,
                  max_fds_per_uid=self.s.max_fds_per_uid, max_fds=self.max_fds,
                  max_connections=self.s.max_connections)
        # Listening and on the bus (whoami answered): offers and claims work.
        ready(self.log, "fds", socket=self.s.socket_path)

    def stop(self, reason: str) -> None:
        stats = self.stats()       # what it held when told to stop: all closed below
        for offer in self.offers.values():
            wire.close_all(offer.fds)
        self.offers.clear()
        for conn in list(self.conns.values()):
            self.drop(conn)
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.own_path is not None:
            path, ino = self.own_path
            try:
                if os.stat(path).st_ino == ino:     # not a successor's socket
                    os.unlink(path)
            except OSError:
                pass
        if self.bus is not None:
            self.bus.close()
        self.emit(schema.FDS_STOP, reason=reason, **stats)

    def stats(self) -> dict:
        counters = {name: self.counters[name] for name in schema.FDS_COUNTERS}
        return dict(counters, pending=len(self.offers), held=self.held,
                    connections=len(self.conns),
                    uptime_s=round(time.monotonic() - self.started, 3))

    # -- the loop ------------------------------------------------------------------

    def run(self, stopping: Callable[[], bool], wake: int = -1) -> str:
        """Serve until ``stopping()``, asked between turns, is true; ``wake``
        (the runner's) ends a wait when it is readable."""
        self.open()
        assert self.listener is not None
        listen_fd = self.listener.fileno()
        while not stopping():
            now = time.monotonic()
            poller = select.poll()
            if wake >= 0:
                poller.register(wake, select.POLLIN)
            if now >= self.accept_paused_until:
                poller.register(listen_fd, select.POLLIN)
            for fd in self.conns:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(self.next_wait(now) * 1000):
                if fd == listen_fd:
                    self.accept()
                elif fd in self.conns:
                    self.serve(self.conns[fd])
            self.expire(time.monotonic())
        return STOPPED

    def next_wait(self, now: float) -> float:
        due = [TICK]
        if self.offers:
            due.append(next(iter(self.offers.values())).deadline - now)
        if self.accept_paused_until > now:
            due.append(self.accept_paused_until - now)
        return max(0.0, min(due))

    def accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE
                    self.counters["accept_failed"] += 1
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    continue
                raise
            peer = wire.peer_of(sock)
            if (len(self.conns) >= self.s.max_connections
                    or self.conns_by_uid[peer.uid] >= self.s.max_connections_per_uid):
                # Closed at once: the client reads EOF (docs/fds.md).
                self.counters["connections_refused"] += 1
                self.emit(schema.FDS_REFUSED, level="warning", reason="connections",
                          peer=str(peer), detail=f"{len(self.conns)} connections open, "
                          f"{self.conns_by_uid[peer.uid]} of uid {peer.uid}")
                sock.close()
                continue
            sock.setblocking(False)
            self.conns[sock.fileno()] = Conn(sock, peer)
            self.conns_by_uid[peer.uid] += 1
            self.counters["connections_accepted"] += 1

    def unwait(self, conn: Conn) -> None:
        if conn.waiting:
            conn.waiting = False
            queue = self.waiters.get(conn.peer, [])
            if conn in queue:
                queue.remove(conn)
            if not queue:
                self.waiters.pop(conn.peer, None)

    def drop(self, conn: Conn) -> None:
        self.unwait(conn)
        fd = conn.sock.fileno()
        if self.conns.pop(fd, None) is not None:
            self.conns_by_uid[conn.peer.uid] -= 1
            if self.conns_by_uid[conn.peer.uid] <= 0:
                del self.conns_by_uid[conn.peer.uid]
        conn.sock.close()

    def serve(self, conn: Conn) -> None:
        """One request of ``conn`` (or its end)."""
        try:
            packet, fds, cut = wire.recv_fds(conn.sock)
        except BlockingIOError:
            return
        except OSError:
            self.drop(conn)
            return
        conn.idle_since = time.monotonic()
        self.unwait(conn)              # anything it sends ends a wait
        if not packet and not fds:
            self.drop(conn)            # EOF: SOCK_SEQPACKET has no empty requests here
            return
        claimed: Optional[Offer] = None
        try:
            if cut:
                answer = wire.pack_error(wire.E_MALFORMED, "packet or fds cut")
            elif packet.startswith(wire.OFFER):
                answer = self.offer(conn, packet, fds)
                fds = []               # the offer owns them now, or offer() closed them
            elif packet.startswith(wire.CLAIM) and not fds:
                answer, claimed = self.claim(conn, packet)
            elif packet == wire.WAIT:
                claimed = next((o for o in self.offers.values() if o.receiver == conn.peer),
                               None)
                if claimed is None:
                    conn.waiting = True
                    self.waiters.setdefault(conn.peer, []).append(conn)
                    return             # answered when an offer for it comes
                answer = wire.pack_fds(claimed.ticket, claimed.giver, claimed.note)
            else:
                answer = wire.pack_error(wire.E_MALFORMED, "neither OFFER nor CLAIM (which carries no fds)")
        finally:
            wire.close_all(fds)
        try:
            wire.send_fds(conn.sock, answer, claimed.fds if claimed else (), socket.MSG_DONTWAIT)
        except OSError:
            if claimed is not None:    # not passed: the offer keeps them for a retry
                self.counters["claims_unsent"] += 1
            self.drop(conn)
            return
        if claimed is not None:
            # Passed: the kernel holds the receiver's copies; ours are closed.
            del self.offers[claimed.ticket]
            self.forget(claimed)
            self.counters["claims"] += 1
            self.emit(schema.FDS_CLAIM, level="debug", receiver=str(claimed.receiver),
                      count=len(claimed.fds), ticket=claimed.ticket[:8])

    def offer(self, conn: Conn, packet: bytes, fds: List[int]) -> bytes:
        giver = conn.peer
        receiver_raw, _, note = packet[len(wire.OFFER):].partition(b"\0")
        receiver = wire.parse_cred(receiver_raw)
        error = None
        if receiver is None:
            error = (wire.E_ADDRESS, "the receiver is not a local !/cred/GID/UID/PID address")
        elif not fds:
            error = (wire.E_NOFDS, "an OFFER carries 1 to 253 fds (SCM_RIGHTS)")
        elif len(note) > wire.MAX_NOTE:
            error = (wire.E_MALFORMED, f"the note is longer than {wire.MAX_NOTE} bytes")
        elif self.held_by_uid[giver.uid] + len(fds) > self.s.max_fds_per_uid:
            error = (wire.E_LIMIT, f"uid {giver.uid} holds {self.held_by_uid[giver.uid]} fds "
                     f"here, {len(fds)} more would pass --max-fds-per-uid "
                     f"{self.s.max_fds_per_uid}")
        elif self.held + len(fds) > self.max_fds:
            error = (wire.E_LIMIT, f"the service holds {self.held} fds, {len(fds)} more "
                     f"would pass its limit of {self.max_fds}")
        if error is not None:
            wire.close_all(fds)
            self.counters["offers_refused"] += 1
            self.emit(schema.FDS_REFUSED, level="warning" if error[0] == wire.E_LIMIT else "info",
                      reason=error[0], peer=str(giver), detail=error[1])
            return wire.pack_error(*error)
        assert receiver is not None
        ticket = wire.new_ticket()
        self.counters["offers"] += 1
        self.emit(schema.FDS_OFFER, level="debug", giver=str(giver), receiver=str(receiver),
                  count=len(fds), ticket=ticket[:8])
        if self.push(receiver, ticket, giver, note, fds):
            return wire.TICKET + ticket.encode()
        self.offers[ticket] = Offer(ticket, receiver, giver, fds, note,
                                    time.monotonic() + self.s.timeout)
        self.held += len(fds)
        self.held_by_uid[giver.uid] += len(fds)
        assert self.bus is not None
        try:
            self.bus.publish(wire.notification_key(receiver, ticket),
                             wire.pack_notification(len(fds), giver, note))
        except (OSError, ValueError, SbusError) as exc:
            # The ticket stands: a receiver told some other way may claim it.
            self.counters["notifications_failed"] += 1
            self.emit(schema.FDS_BUS_LOST, level="warning", address=self.s.address,
                      error=str(exc))
        return wire.TICKET + ticket.encode()

    def push(self, receiver: wire.Peer, ticket: str, giver: wire.Peer, note: bytes,
             fds: List[int]) -> bool:
        """Hand a new offer straight to a connection of its receiver that sent
        WAIT (no ticket to claim, no notification); True if one took it."""
        queue = self.waiters.get(receiver)
        while queue:
            conn = queue[0]
            self.unwait(conn)
            try:
                wire.send_fds(conn.sock, wire.pack_fds(ticket, giver, note), fds,
                              socket.MSG_DONTWAIT)
            except OSError:
                self.drop(conn)
                queue = self.waiters.get(receiver)
                continue
            conn.idle_since = time.monotonic()
            wire.close_all(fds)
            self.counters["claims"] += 1
            self.counters["pushed"] += 1
            self.emit(schema.FDS_CLAIM, level="debug", receiver=str(receiver), count=len(fds),
                      ticket=ticket[:8])
            return True
        return False

    def claim(self, conn: Conn, packet: bytes):
        ticket = packet[len(wire.CLAIM):]
        offer = self.offers.get(ticket.decode("ascii", "replace")) \
            if wire.TICKET_RE.fullmatch(ticket) else None
        if offer is None or offer.receiver != conn.peer:
            # One answer for both: another process learns nothing of a ticket.
            self.counters["claims_refused"] += 1
            if offer is not None:
                self.emit(schema.FDS_DENIED, level="warning", peer=str(conn.peer),
                          receiver=str(offer.receiver), ticket=offer.ticket[:8])
            return wire.pack_error(wire.E_UNKNOWN, "no such ticket for this process"), None
        return wire.pack_fds(offer.ticket, offer.giver, offer.note), offer

    def forget(self, offer: Offer) -> None:
        wire.close_all(offer.fds)
        self.held -= len(offer.fds)
        self.held_by_uid[offer.giver.uid] -= len(offer.fds)
        if self.held_by_uid[offer.giver.uid] <= 0:
            del self.held_by_uid[offer.giver.uid]

    def expire(self, now: float) -> None:
        while self.offers:
            offer = next(iter(self.offers.values()))
            if offer.deadline > now:
                break
            del self.offers[offer.ticket]
            self.forget(offer)
            self.counters["expired"] += 1
            self.emit(schema.FDS_EXPIRED, giver=str(offer.giver), receiver=str(offer.receiver),
                      count=len(offer.fds), ticket=offer.ticket[:8])
        # A connection that sent nothing for a whole timeout is given up.
        idle = [c for c in self.conns.values()
                if not c.waiting and now - c.idle_since > self.s.timeout]
        for conn in idle:
            self.counters["connections_idle"] += 1
            self.drop(conn)
