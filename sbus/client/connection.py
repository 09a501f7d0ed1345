"""The protocol state of one client connection, with no I/O: bytes and events in, actions out.

:class:`Connection` is what both clients are, apart from their syscalls and
their way of waiting (as h11's and wsproto's connections are for HTTP and
WebSocket). :class:`sbus.client.sync.Client` and :class:`sbus.client.aio.Client`
each hold one and drive it:

- events in: a batch the compiled :class:`~sbus._core.batch.Inbox` parsed
  (:meth:`Connection.triage`: replies to their queries and requests, late
  ones dropped, the rest queued, the end of the connection noted); the
  connection lost (:meth:`Connection.lose`), a reconnect attempt that
  failed, the broker's answer to the replay;
- state: buffered mode (the outbox and the send flags of what it holds), the
  queue of what was received ahead of the caller (errors in their turn), the
  queries sent and not yet answered (oldest first: the broker answers in
  order; an abandoned one still owns its reply, which is dropped), the reply
  inbox of requests to other clients (:mod:`sbus.client.requests`), and,
  with a reconnect policy (:mod:`sbus.client.reconnect`), the session, the
  backlog and the reconnect state machine;
- actions out: every flow that must wait (publishing a batch and accounting
  for what went out, a query, a reconnect and its replay, the backlog's
  delivery) is a *plan*, a generator that yields actions (``SEND`` this
  outbox, ``WAIT`` for this waiter, ``SLEEP``, ``CONNECT``...) and is sent
  their results or thrown their errors. A driver runs a plan with its own
  loop (``_run``): the blocking one makes the syscall and blocks, the
  asyncio one awaits. So the logic is written once, and the drivers differ
  only where the waiting differs.

A waiter is anything with a future's ``done``/``set_result``/``set_exception``/
``result``: an :class:`asyncio.Future`, or :class:`Waiter` for the blocking client.
"""
from __future__ import annotations

import collections
import errno
import socket
import time
from typing import Any, Callable, Deque, Generator, List, Optional, Tuple, Union

from .. import address as _address
from .._core.batch import Inbox, Outbox, check_pattern, pack_publish
from .._core.protocol import cred_form
from ..errors import (
    BacklogFullError,
    BatchInterruptedError,
    BusClosedError,
    KeyRefusedError,
    MessageRefusedError,
    MessageTooLargeError,
    SbusError,
)
from . import chunks as _chunks
from . import reconnect as _reconnect
from .protocol import (
    FRAMES,
    WHOAMI,
    ControlMessage,
    Credentials,
    Message,
    Text,
    _routing_key,
    pack_control,
    parse_stats,
)
from .reconnect import Reconnect
from .waiter import Waiter, settle

__all__ = ["Connection", "GONE", "Request", "Waiter", "settle"]

# send(2)/recv(2) errors that mean the broker is gone (EBADF: the client
# already knows, and keeps fd -1 until it reconnects).
GONE = frozenset((errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF))

# The actions a plan yields; the tuple's other items are the action's arguments.
SEND = 0        # (SEND, outbox, flags): sendmmsg all of it (asyncio: waiting while full)
SEND_ONE = 1    # (SEND_ONE, packet, flags): one send(2)
WAIT = 2        # (WAIT, waiter, deadline, flags): until done; TimeoutError past deadline
SLEEP = 3       # (SLEEP, seconds)
CONNECT = 4     # (CONNECT,): open a socket and attach it (the OSError thrown back)
DETACH = 5      # (DETACH,): close the socket of a failed attempt
LOST = 6        # (LOST, exc): the broker went away: detach, lose(), reconnect as the driver does
RECONNECT = 7   # (RECONNECT, wait, deadline): blocking: reconnecting(); asyncio: False (its task does)
DELIVER = 8     # (DELIVER,): run deliver() (asyncio: holding the send lock)
SHUT = 9        # (SHUT, error): close the client; later calls raise ``error``
LOCK = 10       # (LOCK,), (UNLOCK,): asyncio: hold the send lock (the outbox is shared);
                # a plan that raises in between leaves the unlocking to its runner
UNLOCK = 11
ARM = 12        # (ARM,): asyncio: start the buffered mode's flush timer

Plan = Generator[Tuple[Any, ...], Any, Any]


class Request:
    """A query or request sent and not yet answered; ``waiter`` is None once
    its caller gave up, ``packet`` None if a reconnect must not send it again."""

    __slots__ = ("key", "packet", "waiter")

    def __init__(self, key: bytes, packet: bytes, waiter: Any) -> None:
        self.key, self.packet, self.waiter = key, packet, waiter


class Connection:
    """The state of one client connection and its plans; see the module docstring.

    ``waiter`` makes a waiter (``loop.create_future`` for asyncio); ``wake``,
    if set, is called when the connection ends, for receivers to look again.
    A driver sets ``up`` while it has a socket and ``credentials`` on connecting.
    """

    def __init__(self, address: Optional[str], max_message: int, buffered: bool,
                 reconnect: Union[None, bool, Reconnect],
                 waiter: Callable[[], Any] = Waiter) -> None:
        self.address = _address.from_environment(address)
        self.max_message = max_message
        self.buffered = buffered
        self.new_waiter = waiter
        self.wake: Optional[Callable[[], None]] = None
        self.policy = _reconnect.policy(reconnect)
        self.session = _reconnect.Session() if self.policy else None
        self.backlog = _reconnect.Backlog(self.policy.max_backlog) if self.policy else None
        self.up = False         # a socket is attached
        self.live = False       # and sends may go straight to it (no backlog owed first)
        self.delivering = False
        self.closed = False
        self.eof = False        # the broker closed the connection (without a policy: for good)
        self.echo = True        # the broker's default; the barrier (.barrier) needs it on
        self.out = Outbox(max_message)
        self.out_flags = 0
        self.parser = Inbox(max_message, Message, ControlMessage)
        self.chunker, self.chunks = _chunks.Chunker(max_message), _chunks.Reassembler()
        # Received and not yet taken: messages, or the exception to raise in that place.
        self.inbox: Deque[Any] = collections.deque()
        self.parser.queue = self.inbox      # for Inbox.take_batch
        self.requests: Deque[Request] = collections.deque()     # oldest first
        # Requests to other clients: their reply inbox and waiters
        # (sbus.client.requests.Replies), made on the first one.
        self.replies: Any = None
        self.restoring: Any = None      # the waiter of the replay's whoami
        self.failures = 0           # failed reconnect attempts in a row
        self.last_failure: Optional[BaseException] = None
        self.refusals = 0           # new connections in a row closed during the replay
        self.closed_by: Optional[BusClosedError] = None     # raised once closed, if set
        # (gid, uid, pid) the broker read with SO_PEERCRED; None: unknown.
        self.credentials: Optional[Tuple[int, int, int]] = None
        self.down_since = 0.0
        self.next_attempt = 0.0
        # sent_frames' FrameSender while the broker takes our frames (take_frames).
        self.framer: Any = None
        self.sent_frames: Any = None
        self.losses = 0

    # -- the errors a client raises, each worded once ------------------------------

    def gone(self) -> BusClosedError:
        if self.closed:
            return self.closed_by or BusClosedError("the client is closed")
        return BusClosedError("the broker closed the connection")

    def check_open(self) -> None:
        """BusClosedError once closed, or once the broker closed a client without a policy."""
        if self.closed or (self.eof and self.policy is None):
            raise self.gone()

    def gave_up(self) -> BusClosedError:
        """The policy gave up; the last attempt's error is the cause, and worded."""
        last = self.last_failure
        error = BusClosedError(f"{self.address}: no broker after {self.failures} attempts "
                               f"to reconnect" + (f"; the last: {last}" if last else ""))
        error.__cause__ = last
        self.closed_by = error
        return error

    def too_large(self, packet: bytes) -> None:
        if len(packet) > self.max_message:
            raise MessageTooLargeError(
                f"packet of {len(packet)} bytes exceeds the bus limit of {self.max_message}")

    def send_failed(self, exc: OSError, packet: Optional[bytes]) -> None:
        """Raise what a failed send(2) of ``packet`` means, unless the broker
        went away and the policy rides it out."""
        if self.closed:
            raise self.gone() from None
        if exc.errno == errno.EMSGSIZE:
            raise MessageTooLargeError(
                f"the kernel refused a {len(packet or b'')}-byte packet (socket send buffer "
                f"too small; see net.core.wmem_max)") from exc
        if exc.errno not in GONE:
            raise exc
        if self.policy is None:
            raise self.gone() from exc

    # -- what is sent ----------------------------------------------------------------

    def admit(self, packet: bytes) -> bool:
        """Check a raw packet before it is sent or packed and note it in the
        session; True if a reconnect replays it (a SUB, UNSUB or setting)."""
        self.too_large(packet)
        if packet.startswith(b"SUB !"):
            self.check_private(packet[4:])
        elif packet.startswith(b"CMSG echo/"):
            self.echo = not packet.startswith(b"CMSG echo/off")
        if self.session is None:
            return False
        if packet.startswith(b"SUB "):
            check_pattern(packet[4:])   # replayed on every reconnect: never a refused one
        return self.session.note(packet)

    def check_private(self, pattern: bytes) -> None:
        """KeyRefusedError for a ``!/cred/GID/UID/PID/`` pattern naming other
        credentials than this connection's: the broker would close the connection.
        In the nested form a whoami answers behind a leaf broker or a private
        bridge (``<prefix>/!/cred/GID/UID/PID/...``) the last form of the chain
        is this client's; the prefix before it is the broker's to check."""
        if self.credentials is None or not pattern.startswith(b"!/cred/"):
            return
        form = cred_form(pattern)
        while form is not None and pattern[form[3]:].startswith(b"!/cred/"):
            nested = cred_form(pattern[form[3]:])
            if nested is None:
                break
            pattern = pattern[form[3]:]
            form = nested
        if form is None or all(f is None or f == own for f, own in zip(form, self.credentials)):
            return
        ours = "!/cred/{}/{}/{}/".format(*self.credentials)
        raise KeyRefusedError(
            f"private pattern {pattern.decode('utf-8', 'replace')!r} names other credentials "
            f"than this client's, {ours}: only they may subscribe to it (the broker would "
            f"close the connection); leave a field empty to mean this client's")

    def pack(self, packet: bytes, flags: int) -> bool:
        """Pack for buffered mode; False if what is packed must be sent first
        (the outbox is full, or holds packets for other send flags)."""
        if flags != self.out_flags and len(self.out):
            return False
        self.out_flags = flags
        return self.out.add_packet(packet)

    def keep(self, packet: bytes) -> None:
        """The broker is away: keep ``packet`` for the next one (BacklogFullError if it does not fit)."""
        if self.closed or self.policy is None:
            raise self.gone()
        if not self.session.covers(packet):
            self.backlog.add(packet)

    def keep_outbox(self, out: Outbox, done: int) -> None:
        """What ``out`` holds goes behind the backlog, in order. BacklogFullError
        at the first packet that does not fit (``index`` and ``sent``: ``done``
        plus the packets kept before it; it and the rest are not kept)."""
        kept = 0
        try:
            for packet in out.unsent():
                self.keep(packet)
                kept += 1
        except BacklogFullError as exc:
            exc.index = exc.sent = done + kept
            raise
        finally:
            out.clear()

    def keep_owed(self, out: Outbox) -> None:
        """What ``out`` still owes was packed before the backlog: it goes in front."""
        self.backlog.add_front(p for p in out.unsent() if not self.session.covers(p))
        out.clear()

    # -- what is received ------------------------------------------------------------

    def triage(self, batch: List[Any]) -> Optional[BusClosedError]:
        """Take a batch: replies go to their requests' waiters (an abandoned
        request's is dropped), the rest is queued in order. Returns the end of
        the connection when a policy rides it out (the driver then calls
        LOST's handler); without one, the end is queued and the waiters fail.
        Chunks are reassembled first (:mod:`.chunks`)."""
        if self.parser.chunked:
            batch = self.chunks.feed_batch(batch)
        if self.replies is not None and (self.parser.routed or self.parser.chunked):
            batch = self.replies.route(batch)
        inbox = self.inbox
        if not self.parser.irregular:
            inbox.extend(batch)
            return None
        for item in batch:
            kind = type(item)
            if kind is ControlMessage and self.requests:
                request = self.answer(item)
                if request is None:
                    inbox.append(item)
                else:
                    settle(request.waiter, item.payload)
            elif kind is BusClosedError:
                if self.policy is not None and not self.closed:
                    return item
                else:
                    inbox.append(item)
                    self.fail(item)
                return None
            else:
                inbox.append(item)
        return None

    def fail(self, exc: BaseException) -> None:
        """The connection ended for good: the waiting requests fail with ``exc``."""
        self.eof = True
        requests, self.requests = self.requests, collections.deque()
        for request in requests:
            settle(request.waiter, error=exc)
        if self.wake is not None:
            self.wake()

    def late(self, reply: ControlMessage) -> bool:
        """True (and it is forgotten) if ``reply`` answers an abandoned request."""
        request = next((r for r in self.requests if r.key == reply.key), None)
        if request is None or request.waiter is not None:
            return False
        self.requests.remove(request)
        return True

    # -- requests and their replies --------------------------------------------------

    def ask(self, key: bytes, packet: bytes, waiter: Any) -> Request:
        """Note a request before it is sent, so that its reply finds it."""
        request = Request(key, packet, waiter)
        self.requests.append(request)
        return request

    @staticmethod
    def abandon(request: Request) -> None:
        """Its caller gave up: the reply, when it comes, is dropped."""
        request.waiter = None

    def unask(self, request: Request) -> None:
        """The request was never sent, or its answer came by another way."""
        if request in self.requests:
            self.requests.remove(request)

    def answer(self, reply: ControlMessage) -> Optional[Request]:
        """The oldest request with the reply's key, taken off the list; None if there is none."""
        for request in self.requests:
            if request.key == reply.key:
                self.requests.remove(request)
                return request
        return None

    def querying(self) -> bool:
        return any(r.waiter is not None and not r.waiter.done() for r in self.requests)

    # -- losing and finding the broker -----------------------------------------------

    def lost(self, exc: BaseException) -> bool:
        """The connection failed: True if the driver is to detach its socket
        and call :meth:`lose`. During a replay the attempt fails instead
        (False); without a policy, BusClosedError."""
        if self.policy is None:
            raise self.gone() from exc
        if self.restoring is not None:
            settle(self.restoring, error=BusClosedError(f"the new connection failed: {exc}"))
            return False
        return self.up

    def lose(self, exc: BaseException) -> None:
        """The connection failed and the driver closed its socket: what the
        outbox owes goes in front of the backlog, abandoned requests are
        forgotten (a new broker owes no old replies) and the clock starts."""
        self.up = self.live = False
        self.framer = None
        self.losses += 1
        self.keep_owed(self.out)
        self.requests = collections.deque(r for r in self.requests if r.waiter is not None)
        self.failures = 0
        self.down_since = time.monotonic()
        self.next_attempt = 0.0
        if self.policy.on_disconnect is not None:
            self.policy.on_disconnect(exc)

    def pause(self) -> Optional[float]:
        """Seconds until the next attempt is due (0: now); None once the policy gives up."""
        now = time.monotonic()
        if self.policy.exhausted(self.failures, now - self.down_since):
            return None
        return max(0.0, self.next_attempt - now)

    def attempt_failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_failure = exc
        self.next_attempt = time.monotonic() + self.policy.delay(self.failures)

    def refused_replay(self, exc: BaseException) -> Optional[BusClosedError]:
        """A reconnect attempt failed with ``exc`` after connecting. A new broker
        that closes the connection before answering the replay's whoami, twice
        in a row (once may be a broker stopping), refuses the replay: the error
        the client stops with (later calls raise it too); None to try again."""
        closed = isinstance(exc, BusClosedError) or getattr(exc, "errno", None) in GONE
        self.refusals = self.refusals + 1 if closed else 0
        if self.refusals < 2:
            return None
        error = _reconnect.refusal(self.address, tuple(self.session.subscriptions))
        error.__cause__ = exc
        self.closed_by = error
        return error

    def restored(self) -> None:
        """The new broker answered the whoami: the requests the old one left
        unanswered are asked again, first in the backlog."""
        self.failures = self.refusals = 0
        self.last_failure = None
        self.requests = collections.deque(r for r in self.requests if r.waiter is not None)
        self.backlog.add_front(r.packet for r in self.requests if r.packet is not None)
        if self.policy.on_reconnect is not None:
            self.policy.on_reconnect()

    def shut(self) -> List[Any]:
        """Closed: nothing more is sent or kept; returns the waiters to fail."""
        self.closed = True
        self.out.clear()
        if self.backlog is not None:
            self.backlog.clear()
        waiters = [r.waiter for r in self.requests]
        self.requests.clear()
        return waiters

    # -- plans (see the module docstring) --------------------------------------------

    def reconnecting(self, wait: bool, deadline: Optional[float] = None) -> Plan:
        """Attempt to connect (when one is due, or waiting for it); True once
        connected, restored and the backlog sent, False if an attempt is not
        due and ``wait`` is false. BusClosedError once the policy gives up;
        TimeoutError once ``deadline`` (monotonic) passes first."""
        if self.policy is None:
            raise self.gone()
        while True:
            while not self.up:
                pause = self.pause()
                if pause is None:
                    error = self.gave_up()
                    yield (SHUT, error)
                    raise error
                if pause:
                    if not wait:
                        return False
                    if deadline is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError(f"{self.address}: no broker within the timeout")
                        pause = min(pause, left)
                    yield (SLEEP, pause)
                    continue
                try:
                    yield (CONNECT,)
                except OSError as exc:
                    self.attempt_failed(exc)
                    continue
                try:
                    yield from self.restore()
                except (OSError, SbusError, TimeoutError) as exc:
                    self.out.clear()
                    yield (DETACH,)
                    self.attempt_failed(exc)
                    refusal = self.refused_replay(exc)
                    if refusal is not None:
                        yield (SHUT, refusal)
                        raise refusal from exc
                    continue
                self.restored()
            yield (DELIVER,)
            if self.up:
                return True

    def restore(self) -> Plan:
        """Send the replay (the session, then a whoami) and wait for the answer
        to its whoami: then the subscriptions are in place. What arrives
        first is queued; a broker that hangs up refused the replay."""
        self.eof = False
        waiter = self.restoring = self.new_waiter()
        # First in line: the broker answers them before any request asked again.
        whoami = Request(WHOAMI, b"", waiter)
        self.requests.appendleft(whoami)
        replay = self.session.replay() + [pack_control(WHOAMI)]
        frames = None
        if self.sent_frames is not None:    # frames were granted before: asked again first
            frames = Request(FRAMES, b"", self.new_waiter())
            self.requests.appendleft(frames)
            replay.insert(0, pack_control(FRAMES))
        try:
            for packet in replay:
                while not self.out.add_packet(packet):
                    yield (SEND, self.out, 0)
            yield (SEND, self.out, 0)
            yield (WAIT, waiter, time.monotonic() + self.policy.confirm_timeout, 0)
            waiter.result()
            # Answered in order: a broker that said nothing before the whoami predates frames.
            if frames is not None and frames.waiter.done() and frames.waiter.result() == b"ok":
                self.framer = self.sent_frames
        finally:
            self.restoring = None
            self.unask(whoami)
            if frames is not None:
                self.unask(frames)

    def deliver(self) -> Plan:
        """Send the backlog (the requests asked again first, and what is
        published meanwhile) until it is empty; then sends go straight out."""
        self.delivering = True
        self.out_flags = 0
        try:
            while self.backlog and self.up:
                self.backlog.move_to(self.out)
                try:
                    yield (SEND, self.out, 0)
                except OSError as exc:
                    if exc.errno not in GONE:
                        self.out.clear()
                        raise
                    yield (LOST, exc)
        finally:
            self.delivering = False
        if self.up:
            self.live = True

    def send_out(self, out: Outbox, flags: int, done: int = 0) -> Plan:
        """Send ``out`` (the send lock held); ``done`` messages of this batch
        went out before it, for BatchInterruptedError's ``sent``. While the
        broker is away, what it holds is kept behind the backlog."""
        while len(out):
            if not self.live and not self.delivering:
                if self.closed or self.policy is None:
                    out.clear()
                    raise self.gone()
                self.keep_outbox(out, done)
                yield (RECONNECT, False, None)
                return
            before = out.head
            try:
                yield (SEND, out, flags)
            except OSError as exc:
                sent = done + out.head - before
                if self.closed:
                    out.clear()
                    raise self.gone() from None
                if exc.errno not in GONE:
                    exc.sent = sent     # BlockingIOError (MSG_DONTWAIT): the rest stays packed
                    raise
                if self.policy is None:
                    total = sent + len(out)
                    out.clear()
                    self.fail(self.gone())
                    raise BatchInterruptedError(
                        f"the broker closed the connection after {sent} of {total} messages "
                        f"of the batch were sent", sent) from exc
                yield (LOST, exc)
                if len(out):    # not the client's outbox: owed before what is kept since
                    self.keep_owed(out)
                yield (RECONNECT, False, None)
                return

    def flush(self, reconnect: Optional[bool] = None) -> Plan:
        """Send what buffered mode packed; then, unless ``reconnect`` is None,
        a reconnecting client without a broker attempts to come back (waiting
        for it if ``reconnect`` is true) and sends the backlog."""
        if len(self.out):
            yield (LOCK,)
            yield from self.send_out(self.out, self.out_flags)
            yield (UNLOCK,)
        elif self.closed:
            raise self.gone()
        if reconnect is not None and not self.up and self.policy is not None:
            yield (RECONNECT, reconnect, None)

    def publish_many(self, items: Any, flags: int) -> Plan:
        """Pack (key, payload) pairs and send them batch by batch; how many
        were published. Refusals and failures as docs/clients.md says."""
        if self.closed:
            raise self.gone()
        out = self.out
        yield (LOCK,)
        try:
            if len(out):
                yield from self.send_out(out, self.out_flags)
            items = iter(items)
            packed = 0
            self.out_flags = flags
            while True:
                try:
                    packed += out.pack_many(items, packed)
                except MessageRefusedError as exc:
                    yield from self.send_out(out, flags, exc.index - len(out))
                    exc.sent = exc.index
                    raise
                yield from self.send_out(out, flags, packed - len(out))
                if out.exhausted:
                    break
        except BlockingIOError:
            out.clear()     # a full socket under MSG_DONTWAIT: ``sent`` says how far it got
            raise
        yield (UNLOCK,)
        return packed

    def publish_packed(self, box: Outbox, flags: int) -> Plan:
        """Send an Outbox packed elsewhere, as publish_many sends its own."""
        if self.closed:
            box.clear()
            raise self.gone()
        count = len(box)
        yield (LOCK,)
        if len(self.out):
            yield from self.send_out(self.out, self.out_flags)
        self.out_flags = flags
        yield from self.send_out(box, flags)
        yield (UNLOCK,)
        return count

    def failed_send(self, exc: OSError, packet: Optional[bytes]) -> Plan:
        """A failed send of ``packet``: raise, or with a policy keep the packet
        (a full backlog raises only if the broker is not back at once)."""
        self.send_failed(exc, packet)
        if self.up:
            yield (LOST, exc)
        if packet is not None:
            try:
                self.keep(packet)
            except BacklogFullError:
                if not (yield (RECONNECT, False, None)):
                    raise
                yield from self.send_now(packet, 0)
                return
        yield (RECONNECT, False, None)

    def send_now(self, packet: bytes, flags: int) -> Plan:
        """One packet, in its turn after what is packed; kept while the broker is away."""
        if not self.live:
            self.keep(packet)
            yield (RECONNECT, False, None)
            return
        yield (LOCK,)
        if len(self.out):
            yield from self.send_out(self.out, self.out_flags)
        if not self.live:
            self.keep(packet)
        else:
            try:
                yield (SEND_ONE, packet, flags)
            except BlockingIOError:
                raise
            except OSError as exc:
                yield from self.failed_send(exc, packet)
        yield (UNLOCK,)

    def send_packet(self, packet: bytes, flags: int) -> Plan:
        """A raw packet: checked and noted, then sent (buffered: packed behind the rest)."""
        if self.closed:
            raise self.gone()
        if self.admit(packet) and not self.up:
            return      # replayed once the broker is back
        if self.buffered:
            yield from self.publish_buffered(packet, flags)
        else:
            yield from self.send_now(packet, flags)

    def publish_buffered(self, packet: bytes, flags: int) -> Plan:
        """Buffered mode: pack ``packet``, sending what is packed first if need be."""
        while not self.pack(packet, flags):
            yield from self.flush()
        yield (ARM,)

    def query(self, key: Text, payload: Optional[Text], flags: int,
              timeout: Optional[float]) -> Plan:
        """Send a control message and return the payload of the broker's reply:
        the next control message with the same key (other messages are queued).
        A reply that comes after the caller gave up is dropped; a reconnecting
        client asks the new broker again."""
        raw_key = _routing_key(key, "key")
        packet = pack_control(raw_key, payload)
        self.too_large(packet)
        yield from self.flush()
        self.check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.up and self.policy is not None:
            yield (RECONNECT, True, deadline)
        request = self.ask(raw_key, packet, self.new_waiter())
        try:
            yield from self.send_request(packet, flags)
        except BaseException:
            self.unask(request)
            raise
        try:
            yield (WAIT, request.waiter, deadline, flags & ~socket.MSG_PEEK)
            return request.waiter.result()
        finally:
            self.abandon(request)

    def take_frames(self, timeout: Optional[float]) -> Plan:
        """Ask for frames (``CMSG link/frames``); the answer, ``ok`` or
        ``refused: why``. Granted, either client sends its batches in
        frames (``framer``), asked again on a new connection (restore); the
        parser takes frames apart (the driver made it a LinkInbox first)."""
        losses = self.losses
        answer = yield from self.query(FRAMES, None, 0, timeout)
        if answer == b"ok" and self.losses == losses:   # granted on this very connection
            if self.sent_frames is None:
                from .._core.linkpath import FrameSender
                self.sent_frames = FrameSender(self.max_message)
            self.framer = self.sent_frames
        return answer

    def whoami(self, flags: int, timeout: Optional[float]) -> Plan:
        reply = yield from self.query(WHOAMI, None, flags, timeout)
        return Credentials.parse(reply.decode("ascii", "replace"))

    def stats(self, flags: int, timeout: Optional[float]) -> Plan:
        return parse_stats((yield from self.query(b"stats", None, flags, timeout)))

    def send_request(self, packet: bytes, flags: int) -> Plan:
        """Send a noted request now, never buffered; one the broker did not
        take is asked again of the next broker (see :meth:`restored`)."""
        if not self.live:
            if self.policy is None:
                raise self.gone()
            return
        yield (LOCK,)
        if len(self.out):
            yield from self.send_out(self.out, self.out_flags)
        if self.live:
            try:
                yield (SEND_ONE, packet, flags)
            except BlockingIOError:
                raise
            except OSError as exc:
                self.send_failed(exc, None)
                yield (LOST, exc)
        yield (UNLOCK,)

    def open_replies(self, timeout: float, deadline: float) -> Plan:
        """The reply inbox (:class:`sbus.client.requests.Replies`), subscribed
        on its first use: where replies and the barrier (:mod:`.barrier`) return."""
        from .requests import Replies
        replies = self.replies
        if replies is None:
            replies = Replies(self.new_waiter())
            self.replies = replies
            try:
                replies.open((yield from self.whoami(0, timeout)))
                self.parser.route = replies.inbox.local     # see triage
                yield from self.send_packet(b"SUB " + replies.inbox.pattern.encode(), 0)
                yield from self.flush()
            except BaseException as exc:
                self.replies = None
                self.parser.route = b""
                replies.opening.set_exception(exc)
                replies.opening.exception()     # seen: the first asker raises it
                raise
            replies.opening.set_result(None)
        elif not replies.opening.done():
            yield (WAIT, replies.opening, deadline, 0)
            replies.opening.result()
        return replies

    def request(self, key: Text, payload: Text, timeout: float) -> Plan:
        """A request to another client (docs/requests.md): the reply's body.
        The reply is routed here by :meth:`triage`, for both drivers; a
        reconnecting client asks again after a reconnect."""
        from .requests import pack_request, parse_reply, timed_out
        deadline = time.monotonic() + timeout
        replies = yield from self.open_replies(timeout, deadline)
        waiter = self.new_waiter()
        reply_to = replies.expect(waiter)
        body = pack_request(reply_to, payload)
        # A request one packet cannot hold goes as chunks, and is not asked again on reconnect.
        big = 5 + len(_routing_key(key, "key")) + len(body) > self.max_message
        packet = None if big else pack_publish(key, body, self.max_message)
        try:
            return parse_reply((yield from self.exchange(
                reply_to, packet, waiter, deadline, lambda: timed_out(key, timeout),
                chunked=(key, body))))
        finally:
            replies.forget(reply_to)

    def exchange(self, reply_key: bytes, packet: Optional[bytes], waiter: Any, deadline: float,
                 timed_out: Callable[[], BaseException], chunked: tuple = ()) -> Plan:
        """Send ``packet`` (None: ``chunked``'s key and body, as chunks) and
        return what ``waiter`` gets on ``reply_key`` (:meth:`triage` routes
        it), or raise ``timed_out()`` at ``deadline``. Noted as a request
        meanwhile: a lost connection fails it, and a reconnecting client sends
        it again (a request, a proof's step)."""
        request = self.ask(reply_key, packet, waiter)
        try:
            if packet is None:
                yield from _chunks.publish(self, *chunked, 0)
            elif self.buffered:
                yield from self.send_packet(packet, 0)
                yield from self.flush()
            else:
                yield from self.send_now(packet, 0)
            try:
                yield (WAIT, waiter, deadline, 0)
            except TimeoutError:
                raise timed_out() from None
            return waiter.result()
        finally:
            self.unask(request)

