"""What a client needs to ride out a broker restart: the policy, the session
it replays, and the backlog of what was published while the broker was away.

Held by the connection state (:mod:`sbus.client.connection`) for both clients; nothing
here does I/O. What other clients published while the broker was away is gone:
a broker keeps no messages, and a new one starts with no subscriptions.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Counter, Deque, Dict, Iterable, List, Optional, Tuple, Union

from .._core.batch import Outbox
from ..errors import BacklogFullError, BusClosedError, PatternRefusedError

__all__ = ["Backlog", "Reconnect", "Session", "policy"]

# CMSG keys whose last value a new broker connection must be told again,
# grouped by the setting they choose (the spec's "most recent takes precedence").
_SETTINGS = (b"echo/", b"blocking/soft/", b"blocking/hard/", b"order/")


@dataclass(frozen=True)
class Reconnect:
    """How a client reconnects when the broker goes away.

    Attempts start at once, then wait ``initial_delay`` seconds, doubling up
    to ``max_delay``. The client gives up (and is closed, raising
    BusClosedError) after ``max_attempts`` failed attempts in a row or
    ``give_up_after`` seconds without a broker, whichever comes first; None
    means no such limit. An attempt succeeds once the new broker has
    answered a ``!/cred/whoami`` sent after the replayed subscriptions and
    settings (within ``confirm_timeout`` seconds), so the subscriptions are
    in place when ``on_reconnect()`` is called. ``on_disconnect(exc)`` is
    called when the connection is found lost. Messages published meanwhile
    are kept, up to ``max_backlog`` bytes of packets, and sent in order.
    """

    initial_delay: float = 0.05
    max_delay: float = 2.0
    max_attempts: Optional[int] = None
    give_up_after: Optional[float] = 60.0
    confirm_timeout: float = 5.0
    max_backlog: int = 1 << 20
    on_disconnect: Optional[Callable[[BaseException], None]] = None
    on_reconnect: Optional[Callable[[], None]] = None

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failed attempts in a row."""
        if failures <= 0:
            return 0.0
        return min(self.max_delay, self.initial_delay * (2 ** min(failures - 1, 30)))

    def exhausted(self, failures: int, down_for: float) -> bool:
        return ((self.max_attempts is not None and failures >= self.max_attempts) or
                (self.give_up_after is not None and down_for >= self.give_up_after))


def policy(reconnect: Union[None, bool, Reconnect]) -> Optional[Reconnect]:
    """The policy a ``reconnect=`` argument names: False/None off, True the defaults."""
    if reconnect is None or reconnect is False:
        return None
    if reconnect is True:
        return Reconnect()
    if isinstance(reconnect, Reconnect):
        return reconnect
    raise TypeError(f"reconnect must be a bool or sbus.Reconnect, not {type(reconnect).__name__}")


def refusal(address: str, patterns: Tuple[bytes, ...]) -> BusClosedError:
    """What a client stops with when a new broker closed the connection on
    its replay twice in a row: it refuses the client, or one of ``patterns``."""
    if not patterns:
        return BusClosedError(f"{address}: the broker closes every new connection "
                              f"at once: it refuses this client (its log says why)")
    shown = ", ".join(repr(p.decode("utf-8", "replace")) for p in patterns)
    which = "it refuses the pattern" if len(patterns) == 1 else "it refuses one of them"
    return PatternRefusedError(
        f"{address}: the broker closed the connection twice when the "
        f"subscription{'s' if len(patterns) > 1 else ''} to {shown} "
        f"{'were' if len(patterns) > 1 else 'was'} replayed: {which} (its log says "
        f"{'which and ' if len(patterns) > 1 else ''}why); the client stopped", patterns)


class Session:
    """The subscriptions (a multiset: SUB adds one, UNSUB removes one) and
    the last echo / flood-control / order setting a client sent."""

    def __init__(self) -> None:
        self.subscriptions: Counter[bytes] = collections.Counter()
        self.settings: Dict[bytes, bytes] = {}

    @staticmethod
    def covers(packet: bytes) -> bool:
        """True for a SUB, UNSUB or setting: what a reconnect replays from the
        session, so the backlog need not keep it."""
        if packet.startswith((b"SUB ", b"UNSUB ")):
            return True
        if packet.startswith(b"CMSG "):
            return packet[5:].partition(b"\0")[0].startswith(_SETTINGS)
        return False

    def note(self, packet: bytes) -> bool:
        """Record a SUB, UNSUB or setting; True if the packet is one of those."""
        if packet.startswith(b"SUB "):
            self.subscriptions[packet[4:]] += 1
            return True
        if packet.startswith(b"UNSUB "):
            pattern = packet[6:]
            if self.subscriptions[pattern] > 1:
                self.subscriptions[pattern] -= 1
            else:
                self.subscriptions.pop(pattern, None)
            return True
        if packet.startswith(b"CMSG "):
            key = packet[5:].partition(b"\0")[0]
            for group in _SETTINGS:
                if key.startswith(group):
                    self.settings[group] = packet
                    return True
        return False

    def replay(self) -> List[bytes]:
        """The packets that put a new connection in the same state."""
        packets = list(self.settings.values())
        for pattern, count in self.subscriptions.items():
            packets.extend([b"SUB " + pattern] * count)
        return packets


class Backlog:
    """Packets published while the broker was away, oldest first, at most
    ``max_bytes`` of them. ``nbytes`` is what it holds."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._packets: Deque[bytes] = collections.deque()

    def __len__(self) -> int:
        return len(self._packets)

    def add(self, packet: bytes) -> None:
        """Keep ``packet`` last; BacklogFullError (it is not kept) past ``max_bytes``."""
        if self.nbytes + len(packet) > self.max_bytes:
            raise BacklogFullError(
                f"the broker is away and the backlog holds {self.nbytes} of its "
                f"{self.max_bytes} bytes; a {len(packet)}-byte packet was not kept")
        self._packets.append(packet)
        self.nbytes += len(packet)

    def add_front(self, packets: Iterable[bytes]) -> None:
        """Put ``packets`` (in their order) before the others, whatever the
        bound: they were packed or asked before anything the backlog holds."""
        packets = list(packets)
        self._packets.extendleft(reversed(packets))
        self.nbytes += sum(map(len, packets))

    def move_to(self, out: Outbox) -> int:
        """Move the oldest packets into ``out`` while it takes them; how many moved."""
        moved = 0
        packets = self._packets
        while packets and out.add_packet(packets[0]):
            self.nbytes -= len(packets.popleft())
            moved += 1
        return moved

    def clear(self) -> None:
        self._packets.clear()
        self.nbytes = 0
