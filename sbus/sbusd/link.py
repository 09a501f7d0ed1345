"""The upstream link of a leaf broker (``sbusd --upstream ADDRESS``).

A child process of sbusd that is a client of both brokers. Locally it holds
the link end of a socketpair the broker made (``Broker.attach_link``): it
receives every local publish its export patterns match, private keys
included, and every key nested under its own identity upstream; never its
own publishes; and a control message for each local connection and
subscription change. Upstream it is an ordinary client with
echo off.

* Upwards: a local publish goes up as written, unless it is a private key
  of a process connected here (``!/cred/G/U/P/...`` with all three fields
  naming a local connection) or the nested form under this leaf's own
  upstream identity (``<own>/!/cred/g/u/p/...``: delivered here, stripped).
  While the upstream is away upward messages wait in a bounded buffer;
  what overflows is counted and logged.
* Downwards: the link subscribes upstream to each distinct public pattern of
  the local clients once (counted by reference) and to ``!/cred////``, its
  own private keys. A message on ``<own>/!/cred/g/u/p/REST`` (``<own>`` as
  whoami answered, or its last form: a nested upstream hands its clients'
  keys down in the local form) is published here as ``!/cred/g/u/p/REST``,
  so the local rules give it to g/u/p alone; anything else comes down as it is.
* Failure: the upstream is reconnected with the client's back-off
  (``sbus.client.reconnect.Reconnect``); on the way back the link asks
  whoami again, resubscribes and flushes its buffer.
* Signals: as every service (``sbus.runner``): SIGTERM and SIGINT stop it
  between two turns of its loop, saying on stderr what it held that is
  lost; it has no log file of its own to reopen.
* Its broker gone (stopped or killed: EOF on the socketpair, or EPIPE on a
  write to it): it reads what the broker wrote before, sends up what the
  upstream takes at once, says on stderr what is lost and exits 0.
* Ready: once the upstream has answered a whoami sent after its first
  subscriptions, they are in place: ``service_ready`` and, under systemd,
  READY=1 (sbusd leaves that to the link when it has ``--upstream``).

It reports to its broker over the same socketpair: ``link/identity`` (its
credentials upstream, the nesting prefix), ``link/log`` (records for the
broker's log) and ``link/state`` (for ``CMSG stats``).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import select
import selectors
import socket
import sys
import time
from typing import Deque, List, Optional, Tuple

from .. import logschema as schema
from .._core.batch import Outbox
from .._core.linkpath import FrameSender, LinkInbox, Relay
from ..client.chunks import chunk_pattern
from ..client.driver import grow_buffers
from ..client.protocol import MAX_MESSAGE, WHOAMI, ControlMessage, Message, pack_control
from ..client.reconnect import Reconnect
from ..runner import Runner, sd_notify
from .uplink import announce_started
from .upstream import CRED, RECV_SIZE, WHOAMI_TIMEOUT, UpstreamError, connect, identity

# The client's policy, never giving up: 0.1 s before the first reconnect, doubling up to 5 s.
BACKOFF = Reconnect(initial_delay=0.1, max_delay=5.0, give_up_after=None,
                    confirm_timeout=WHOAMI_TIMEOUT)
STATE_INTERVAL = 1.0        # seconds between link/state reports
BATCH = 64                  # packets per recvmmsg from the upstream, per sendmmsg down
# Frames per recvmmsg from the local broker once it sends them: 8 of up to 64
# packets fill one Outbox, so a full upstream leaves a batch in it, in C (and
# the same from an upstream that granted frames, for the local broker).
LOCAL_FRAMES = 8
# The per-message reference path (a Python object per message) instead of the
# C one (sbus._core.linkpath); the tests hold the two to the same output.
REFERENCE = os.environ.get("SBUS_LINK_REFERENCE", "") not in ("", "0")
OWN_PRIVATE = b"!/cred////"  # every key private to the link itself, upstream
# After our identity, a local subscription to the keys nested under it.
# '!*' also matches a segment such as '!x' (no reserved use): such a key goes
# up as written, where the upstream gives it to this link alone.
NESTED = b"/!*/"
FLOODS = ("block", "discard")  # sbusd --upstream-flood: the link's hard mode upstream
FRAMES_ASK = pack_control("link/frames")


def hello(flood: str) -> Tuple[bytes, ...]:
    """What the link says first on each upstream connection: it never hears
    its own messages back; the upstream queues what the link cannot take yet,
    and past its limits holds its publishers (block: a link slower than the
    upstream's publishers loses nothing, the bus waits for it as for any block
    client, up to --block-timeout) or discards for it; and whoami, whose
    answer is the link's identity there."""
    return (pack_control("echo/off"), pack_control("blocking/soft/queue"),
            pack_control(f"blocking/hard/{flood}"), pack_control(WHOAMI))


def split(packet: bytes) -> Tuple[bytes, bytes, bytes]:
    """(verb, key, payload) of a packet."""
    head, _, payload = packet.partition(b"\0")
    verb, _, key = head.partition(b" ")
    return verb, key, payload


def cred_fields(key: bytes) -> Optional[Tuple[bytes, bytes, bytes]]:
    """The gid, uid and pid fields of a ``!/cred/G/U/P/`` key, or None."""
    parts = key[len(CRED):].split(b"/", 3)
    if len(parts) < 4:
        return None
    return parts[0], parts[1], parts[2]


class Link:
    """The link's state and its loop; ``run()`` returns when the local broker goes."""

    def __init__(self, local: socket.socket, upstream: str, exports: List[str],
                 buffer_max: int, max_message: int = MAX_MESSAGE, flood: str = "block"):
        self.local = local
        self.max_message = max_message
        self.upstream = upstream
        self.hello = hello(flood)
        exports_raw = [p.encode() for p in exports]
        # With each export its chunk twin: a chunked message goes up as its chunks (docs/chunks.md).
        self.exports = exports_raw + [t for t in map(chunk_pattern, exports_raw) if t] or [b""]
        self.buffer_max = buffer_max
        self.sel = selectors.DefaultSelector()
        self.up: Optional[socket.socket] = None
        self.state = "away"
        self.prefix: Optional[bytes] = None      # our credentials upstream
        self.own_forms: Tuple[bytes, ...] = ()   # the prefixes of keys private to us
        self.refs: collections.Counter = collections.Counter()  # public pattern -> local subs
        self.local_creds: collections.Counter = collections.Counter()
        self.up_out: Deque[Tuple[bool, bytes]] = collections.deque()  # (is MSG, packet)
        self.held_msgs = 0
        self.local_out: Deque[bytes] = collections.deque()
        self.local_writable = True  # not waiting for EVENT_WRITE on the local socket
        self.local_paused = False   # not reading the leaf: the upstream is behind
        # Downward messages come in recvmmsg batches and go down in sendmmsg ones;
        # in frames, taken apart, once an upstream of our uid (or root) granted them.
        self.inbox = LinkInbox(RECV_SIZE - 1, Message, ControlMessage, BATCH)
        self.up_framer = FrameSender(max_message)   # to an upstream that takes frames
        self.up_frames = False      # this upstream connection was granted frames
        self.outbox = Outbox(RECV_SIZE)
        # The C path: public messages cross in Relays (Inbox.receive's sink)
        # with no Python object each; upward ones from local_inbox, in up_box.
        self.reference = REFERENCE
        self.local_inbox = LinkInbox(RECV_SIZE - 1, Message, ControlMessage, BATCH)
        self.local_inbox.chunks = False     # relayed as they travel
        self.down = Relay(self.outbox, local.fileno(), self.down_private)
        # Frames to and from the local broker once it says it takes them.
        self.framer = FrameSender(max_message)
        self.up_box = Outbox(RECV_SIZE)
        self.up_relay: Optional[Relay] = None      # per upstream connection
        self.up_batch = Outbox(RECV_SIZE)           # up_out's packets, per sendmmsg
        self.up_paused = False      # not reading the upstream: the local broker is behind
        self.retry_at = 0.0
        self.failures = 0           # connection attempts failed in a row
        self.asked_at = 0.0
        self.next_state = 0.0
        self.counts = {"up_msgs": 0, "down_msgs": 0, "overflow_dropped": 0,
                       "kept_local": 0, "connects": 0, "disconnects": 0}
        self.reason = ""
        self.subscribed = False     # this connection's SUBs are in place upstream
        self.ready_said = False
        self.local_gone = False     # the local broker closed the socketpair: run() ends
        self.lost_down = 0          # messages for the local broker after it went
        self.dropped_at_gone = 0    # overflow_dropped then: what drops later is said on stderr
        local.setblocking(False)
        self.sel.register(local, selectors.EVENT_READ, "local")
        if not self.reference:
            self.send_local(b"CMSG link/frames")
        for pattern in self.exports:
            self.send_local(b"SUB " + pattern)

    # ---- reporting to the broker
    def log(self, event: str, **fields) -> None:
        fields["event"] = event
        self.send_local(b"CMSG link/log\0" + json.dumps(fields).encode())

    def report_state(self) -> None:
        state = {"state": self.state, "address": self.upstream,
                 "identity": self.prefix.decode() if self.prefix else None,
                 "patterns": len(self.refs), "held": self.held_msgs,
                 "subscribed": self.subscribed,
                 "reason": self.reason or None, **self.counts,
                 "frames_down": self.framer.frames, "frames_up": self.local_inbox.frames,
                 "upstream_frames": "on" if self.up_frames else "off",
                 "frames_from_upstream": self.inbox.frames, "frames_to_upstream": self.up_framer.frames}
        self.send_local(b"CMSG link/state\0" + json.dumps(state).encode())

    # ---- writing
    def send_local(self, packet: bytes) -> None:
        self.local_out.append(packet)
        self.write_local()

    def write_local(self) -> None:
        """Send what waits for the local broker (the Outbox, then local_out),
        BATCH packets per sendmmsg; watch for writability only while something
        is left."""
        out, box = self.local_out, self.outbox
        fd = self.local.fileno()
        while not self.local_gone:
            while out and len(box) < BATCH:
                if not box.add_packet(out[0]):
                    if not len(box):
                        out.popleft()   # larger than RECV_SIZE: no broker takes it
                    break
                out.popleft()
            if not len(box):
                break
            try:
                if self.down.framer is not None:
                    self.down.framer.send(box, fd)
                else:
                    box.send(fd, socket.MSG_DONTWAIT)
            except BlockingIOError:
                out.extendleft(reversed(box.unsent()))
                box.clear()
                break
            except ConnectionError:
                # EPIPE, ECONNRESET: the broker went (it stopped, or was
                # killed) while we had something to tell it.
                out.extendleft(reversed(box.unsent()))
                box.clear()
                self.gone()
        if self.local_gone:
            self.drop_down()
        if self.up_paused and not out:
            self.up_paused = False
            self.watch_up()
        if self.local_writable != (not out):
            self.local_writable = not out
            self.watch_local()

    def watch_local(self) -> None:
        mask = (0 if self.local_paused else selectors.EVENT_READ) | \
            (0 if self.local_writable else selectors.EVENT_WRITE)
        try:
            self.sel.get_key(self.local)
            watched = True
        except KeyError:
            watched = False
        if mask and watched:
            self.sel.modify(self.local, mask, "local")
        elif mask:
            self.sel.register(self.local, mask, "local")
        elif watched:
            self.sel.unregister(self.local)

    def pause_local(self, pause: bool) -> None:
        """While the upstream is up but behind (something waits for it), the
        link reads no more from the leaf: the leaf's queue for it holds the
        rest and the leaf's publishers wait, as for any block client, rather
        than the link holding them and dropping past --upstream-buffer. Never
        while it is not reading the upstream either (up_paused): then each
        broker could wait for the other through the link."""
        pause = pause and not self.up_paused and self.state == "up" and not self.local_gone
        if pause != self.local_paused:
            self.local_paused = pause
            self.watch_local()

    def send_up(self, packet: bytes, is_msg: bool, write: bool = True) -> None:
        if is_msg:
            if self.held_msgs >= self.buffer_max:
                self.counts["overflow_dropped"] += 1
                if self.counts["overflow_dropped"] & (self.counts["overflow_dropped"] - 1) == 0:
                    self.log(schema.UPSTREAM_OVERFLOW, dropped=self.counts["overflow_dropped"],
                             buffer_max=self.buffer_max)
                return
            self.held_msgs += 1
        elif self.state != "up":
            return      # subscriptions are made again from refs on the way back
        self.up_out.append((is_msg, packet))
        if self.state == "up" and write:
            self.write_up()

    def write_up(self) -> None:
        """Send what waits for the upstream: what the up Relay's box kept
        first, then up_out, BATCH packets per sendmmsg."""
        box, out = self.up_batch, self.up_out
        relay = self.up_relay
        if relay is not None and relay.blocked:
            relay.flush()
            self.counts["up_msgs"] += relay.sent
            relay.sent = 0
            if relay.error is not None:
                self.lost(relay.error.strerror or str(relay.error))
                return
        while out and not (relay is not None and relay.blocked):
            n = 0
            for _, packet in itertools.islice(out, BATCH):
                if not box.add_packet(packet):
                    break
                n += 1
            if not n:
                break       # cannot be: the box holds any packet the local broker sends
            try:
                box.send(self.up.fileno(), socket.MSG_DONTWAIT)
                sent = n
            except BlockingIOError:
                sent = n - len(box)
            except OSError as e:
                box.clear()
                self.lost(e.strerror or str(e))
                return
            box.clear()
            for _ in range(sent):
                if out.popleft()[0]:
                    self.held_msgs -= 1
                    self.counts["up_msgs"] += 1
            if sent < n:
                break
        if self.local_paused and not self.behind():
            self.pause_local(False)
        self.watch_up()

    def behind(self) -> bool:
        """Something waits for the upstream: up_out, or the up Relay's box."""
        return bool(self.up_out) or (self.up_relay is not None and self.up_relay.blocked)

    def watch_up(self) -> None:
        if self.up is None:
            return
        mask = (0 if self.up_paused else selectors.EVENT_READ) | \
            (selectors.EVENT_WRITE if self.state == "up" and self.behind() else 0)
        try:
            self.sel.get_key(self.up)
            watched = True
        except KeyError:
            watched = False
        if mask and watched:
            self.sel.modify(self.up, mask, "up")
        elif mask:
            self.sel.register(self.up, mask, "up")
        elif watched:
            self.sel.unregister(self.up)

    # ---- the upstream connection
    def try_connect(self) -> None:
        try:
            sock = connect(self.upstream, self.max_message)
        except UpstreamError as e:
            self.retry(str(e))
            return
        sock.setblocking(False)
        self.up = sock
        self.state = "identifying"
        self.asked_at = time.monotonic()
        self.sel.register(sock, selectors.EVENT_READ, "up")
        # Frames upstream too: granted to a link of the upstream's uid or root,
        # else packets; asked before whoami, so answered before the link is up.
        asks = self.hello if self.reference else self.hello[:-1] + (FRAMES_ASK,) + self.hello[-1:]
        try:
            for packet in asks:
                sock.send(packet)
        except OSError as e:
            self.lost(e.strerror or str(e))

    def identified(self, creds: bytes) -> None:
        if b"" not in self.exports and creds != self.prefix:
            # Keys nested under our identity are for processes here (up_private),
            # whatever the exports let up; the subscription for '' takes them anyway.
            if self.prefix is not None:
                self.send_local(b"UNSUB " + self.prefix + NESTED)
            self.send_local(b"SUB " + creds + NESTED)
        self.prefix = creds
        last = creds[creds.rfind(b"/!/cred/") + 1:] if b"/!/cred/" in creds else creds
        self.own_forms = tuple(dict.fromkeys((creds + b"/", last + b"/")))
        self.send_local(b"CMSG link/identity\0" + creds)
        # Subscriptions first, then the held messages, in their order.
        pending = list(self.up_out)
        self.up_out.clear()
        self.up_out.append((False, b"SUB " + OWN_PRIVATE))
        self.up_out.extend((False, b"SUB " + p) for p in self.refs)
        # Answered after the SUBs, in order: then they are in place upstream.
        self.up_out.append((False, pack_control(WHOAMI)))
        self.subscribed = False
        self.up_out.extend(item for item in pending if item[0])
        self.state = "up"
        self.up_relay = Relay(self.up_box, self.up.fileno(), self.up_private)
        self.up_relay.keep = True   # a full upstream: what its box holds waits there, in C
        if self.up_frames:
            self.up_relay.framer = self.up_framer
        self.failures = 0
        self.counts["connects"] += 1
        self.reason = ""
        self.log(schema.UPSTREAM_CONNECTED, address=self.upstream, identity=creds.decode(),
                 patterns=len(self.refs), held=self.held_msgs)
        self.write_up()
        self.report_state()

    def in_place(self) -> None:
        """The subscriptions of this connection are in place upstream: the
        first time, the link is ready (one service_ready record; READY=1 for
        systemd: a leaf's unit is started once its link is)."""
        self.subscribed = True
        if not self.ready_said:
            self.ready_said = True
            self.log(schema.SERVICE_READY, service="link", pid=os.getpid(),
                     address=self.upstream, identity=self.prefix.decode(),
                     patterns=len(self.refs))
            sd_notify("READY=1")
        self.report_state()

    def lost(self, reason: str) -> None:
        was_up = self.state == "up"
        self.subscribed = False
        if self.up_relay is not None and self.up_relay.blocked:
            # What the upstream had not taken waits for the next, first.
            kept = self.up_box.unsent()
            self.up_box.clear()
            self.held_msgs += len(kept)
            self.up_out.extendleft((True, packet) for packet in reversed(kept))
        self.up_relay = None
        self.up_frames = False      # asked again on the next connection
        self.state = "away"
        self.pause_local(False)     # away: held within --upstream-buffer, or dropped
        if self.up is not None:
            self.up_paused = False
            try:
                self.sel.unregister(self.up)
            except KeyError:
                pass            # paused with nothing to write: not watched
            self.up.close()
            self.up = None
        # Control packets are rebuilt on the way back; messages wait.
        self.up_out = collections.deque(item for item in self.up_out if item[0])
        if was_up:
            self.counts["disconnects"] += 1
            self.log(schema.UPSTREAM_DISCONNECTED, address=self.upstream, reason=reason,
                     held=self.held_msgs)
        self.retry(reason)

    def retry(self, reason: str) -> None:
        self.failures += 1
        wait = BACKOFF.delay(self.failures)
        if reason != self.reason:
            self.log(schema.UPSTREAM_RETRY, address=self.upstream, reason=reason,
                     in_s=round(wait, 3))
        self.reason = reason
        self.state = "away"
        self.retry_at = time.monotonic() + wait
        self.report_state()

    # ---- packets
    def from_up(self, item) -> None:
        """One Message, ControlMessage or error of an Inbox batch from the upstream."""
        if type(item) is ControlMessage and item.key == b"link/frames":   # ok: it takes frames
            self.up_frames = item.payload == b"ok"     # answered before whoami, so before the Relay is made
            return
        if self.state == "identifying":
            if type(item) is ControlMessage:
                creds = identity(item)
                if creds is not None:
                    self.identified(creds)
            else:
                self.lost(f"not an sbusd (sent {item!r:.60} before whoami)")
            return
        if type(item) is not Message:
            if not self.subscribed and identity(item) is not None:
                self.in_place()
            return      # the upstream's control replies; a packet too large for us
        self.counts["down_msgs"] += 1
        key = item.key
        if key[:1] == b"!":
            key = self.down_private(key, item.payload)
            if key is None:
                return
        self.local_out.append(b"MSG " + key + b"\0" + item.payload)

    def down_private(self, key: bytes, payload: bytes) -> Optional[bytes]:
        """The key a private message from the upstream has here, or None when
        it is for no one here. Our prefix as whoami answered it, or (when the
        upstream is itself nested) its last form: the upstream's own clients
        reach us by both."""
        for own in self.own_forms:
            if key.startswith(own):
                key = key[len(own):]
                # addressed to this leaf itself: no one here to take it
                return key if key.startswith(CRED) else None
        return key

    def from_local(self, packet: bytes) -> None:
        verb, key, payload = split(packet)
        if verb == b"CMSG":
            self.on_note(key, payload)
        elif verb == b"MSG":
            self.on_publish(packet, key)

    def on_note(self, key: bytes, payload: bytes) -> None:
        if key == b"link/sub":
            if payload.startswith(CRED):
                return      # local: a private pattern is a local process's
            self.refs[payload] += 1
            if self.refs[payload] == 1:
                self.send_up(b"SUB " + payload, False)
        elif key == b"link/unsub":
            if payload not in self.refs:
                return
            self.refs[payload] -= 1
            if self.refs[payload] == 0:
                del self.refs[payload]
                self.send_up(b"UNSUB " + payload, False)
        elif key == b"link/conn":
            self.local_creds[payload] += 1
        elif key == b"link/frames":
            if payload == b"ok":    # from now on the broker takes our frames
                self.down.framer = self.framer
        elif key == b"link/gone":
            self.local_creds[payload] -= 1
            if self.local_creds[payload] <= 0:
                del self.local_creds[payload]

    def on_publish(self, packet: bytes, key: bytes) -> None:
        if key[:1] != b"!" or self.up_private(key, packet[5 + len(key):]) is not None:
            self.send_up(packet, True)

    def up_private(self, key: bytes, payload: bytes) -> Optional[bytes]:
        """The key a local publish on a private key goes up with, or None when
        it stays here (sent back down by this call when it must be)."""
        if self.prefix is not None and key.startswith(self.prefix + b"/" + CRED):
            # Nested under our own identity: a process here; the local rules decide.
            self.counts["kept_local"] += 1
            self.send_local(b"MSG " + key[len(self.prefix) + 1:] + b"\0" + payload)
            return None
        if key.startswith(CRED):
            fields = cred_fields(key)
            if fields is not None and all(fields) and \
                    b"/".join(str(int(f)).encode() for f in fields) in self.local_creds:
                self.counts["kept_local"] += 1
                return None
        return key

    # ---- the loop
    def run(self, runner: Optional[Runner] = None) -> int:
        """Link until the local broker goes, or ``runner`` (its signals) says stop."""
        if runner is not None:
            self.sel.register(runner.fileno(), selectors.EVENT_READ, "signals")
        self.try_connect()
        while True:
            if runner is not None and runner.between_turns():
                return self.leave(stopped=True)
            now = time.monotonic()
            timeout = STATE_INTERVAL
            if self.state == "away":
                timeout = max(0.0, min(timeout, self.retry_at - now))
            for key, mask in self.sel.select(timeout):
                if key.data == "local":
                    if mask & selectors.EVENT_WRITE:
                        self.write_local()
                    if mask & selectors.EVENT_READ and not self.read_local():
                        return self.leave()
                elif self.up is not None and key.fileobj is self.up:
                    if mask & selectors.EVENT_WRITE:
                        self.write_up()
                    if self.up is not None and mask & selectors.EVENT_READ:
                        self.read_up()
                if self.local_gone:
                    return self.leave()
            now = time.monotonic()
            if self.state == "away" and now >= self.retry_at:
                self.try_connect()
            elif self.state == "identifying" and now - self.asked_at > WHOAMI_TIMEOUT:
                self.lost(f"no answer to whoami within {WHOAMI_TIMEOUT:g} s (not an sbusd?)")
            if now >= self.next_state:
                self.next_state = now + STATE_INTERVAL
                self.report_state()

    def gone(self) -> None:
        """The local broker closed our socketpair: nothing more is written to it."""
        if not self.local_gone:
            self.local_gone = True
            self.dropped_at_gone = self.counts["overflow_dropped"]

    def leave(self, stopped: bool = False) -> int:
        """The link ends: its broker went (EOF, or EPIPE on a write), or a
        signal ``stopped`` it. After the broker went, read what it wrote
        before (its EOF ends that). Give the upstream one more chance to
        take what waits, then say on stderr (sbusd's, the one place sure to
        be left) what is lost. Status 0: a broker that stops ends its link,
        and a signal is an ordinary stop."""
        if not stopped:
            self.gone()
            ready = select.poll()
            ready.register(self.local, select.POLLIN)
            # Its EOF ends this; a broker still there (it never is) would have
            # nothing to read, not a loop spinning on it.
            while ready.poll(0) and self.read_local():
                pass
        if self.state == "up" and self.behind():
            self.write_up()
        held = self.held_msgs + len(self.up_box)
        if self.local_gone:     # drops before it went were logged (upstream_overflow)
            held += self.counts["overflow_dropped"] - self.dropped_at_gone
        else:
            self.write_local()
            self.drop_down()
        why = "the link was stopped" if stopped else "the leaf broker went away"
        self.stop()
        if held or self.lost_down:
            note = (f"sbusd-link: {why}; lost {held} messages held for "
                    f"the upstream ({self.upstream}) and {self.lost_down} on their way down\n")
            try:
                os.write(2, note.encode())
            except OSError:
                pass    # stderr went with the broker (a pipe it read): nothing is left to tell
        return 0

    def drop_down(self) -> None:
        """What still waits for the local broker is lost: its messages are counted."""
        self.lost_down += sum(packet.startswith(b"MSG ") for packet in self.local_out)
        self.local_out.clear()

    def stop(self) -> None:
        """Leave the upstream; what was held for it is lost, as on any exit."""
        if self.up is not None:
            self.up.close()
            self.up = None
        self.sel.close()

    def read_local(self) -> bool:
        if not self.reference:
            return self.read_local_batched()
        for _ in range(64):
            try:
                packet = self.local.recv(RECV_SIZE)
            except BlockingIOError:
                return True
            except ConnectionError:
                return False
            if not packet:
                return False
            self.from_local(packet)
        return True

    def read_local_batched(self) -> bool:
        """Up to 4 recvmmsg batches from the local broker; while the upstream
        is up and nothing waits for it, the public messages go up in C (the
        up Relay, several batches per pump), the rest as the reference path
        takes them, in order."""
        fd = self.local.fileno()
        limit = LOCAL_FRAMES if self.down.framer is not None else BATCH
        budget = 4
        while budget > 0:
            if self.state == "up" and self.behind():
                self.pause_local(True)
                if self.local_paused:
                    return True
            relay = self.up_relay if self.state == "up" else None
            try:
                if relay is None:
                    batch = self.local_inbox.receive(fd, limit, socket.MSG_DONTWAIT)
                    budget -= 1
                    drained = len(batch) < limit
                else:
                    relay.hold = bool(self.up_out)     # behind what waits: spilled, in order
                    try:
                        batch = relay.pump(self.local_inbox, fd, limit, budget)
                    finally:
                        self.relayed_up(relay)
                    budget -= relay.batches
                    drained = relay.drained
            except BlockingIOError:
                return True
            except ConnectionError:
                return False
            for item in batch:
                if type(item) is ControlMessage:
                    self.on_note(item.key, item.payload)
                elif type(item) is Message:
                    self.on_publish(b"MSG " + item.key + b"\0" + item.payload, item.key)
                elif isinstance(item, ConnectionError):
                    return False
            if drained:
                break
        return True

    def relayed_up(self, relay: Relay) -> None:
        """After a batch through the up Relay: send what it holds; what the
        upstream did not take waits in up_out (held, within --upstream-buffer)."""
        relay.flush()
        self.counts["up_msgs"] += relay.sent
        relay.sent = 0
        if relay.error is not None:
            self.lost(relay.error.strerror or str(relay.error))
        spill = relay.take_spill()
        for packet in spill:
            self.send_up(packet, True, write=False)
        if spill and self.state == "up":
            self.write_up()
        elif relay.blocked and self.state == "up":
            self.watch_up()     # written once the upstream takes more

    def read_up(self) -> None:
        budget = 16     # recvmmsg batches per turn; then the leaf's side has its turn
        limit = LOCAL_FRAMES if self.up_frames else BATCH
        while budget > 0:
            if self.local_out:
                self.write_local()
            if self.pause_up():
                break
            # The C path: with nothing waiting before them, messages go down
            # through the Relay (into the Outbox write_local sends first),
            # batch after batch in one pump until something needs Python.
            relay = self.down if not self.reference and self.state == "up" \
                and not self.local_out else None
            try:
                if relay is None:
                    batch = self.inbox.receive(self.up.fileno(), limit, socket.MSG_DONTWAIT)
                    budget -= 1
                    drained = len(batch) < limit
                else:
                    try:
                        batch = relay.pump(self.inbox, self.up.fileno(), limit, budget)
                    finally:
                        self.counts["down_msgs"] += relay.pumped
                        self.local_out.extend(relay.take_spill())
                        relay.error = None      # the local broker is going: read_local sees it
                    budget -= relay.batches
                    drained = relay.drained
            except BlockingIOError:
                break
            except OSError as e:
                self.lost(e.strerror or str(e))
                break
            if relay is None and self.state == "up" and not self.local_out:
                batch = self.pack_public(batch)
            for item in batch:
                if isinstance(item, ConnectionError):   # BusClosedError: the end, last
                    self.lost("the upstream closed the connection")
                    break
                self.from_up(item)
                if self.up is None:
                    break
            if self.up is None or drained or self.local_gone:
                break
        self.write_local()
        self.pause_up()

    def pause_up(self) -> bool:
        """Read no more than the local broker takes: while it is behind, what
        comes down waits in the upstream's queue for the link (and in the
        socket), not in ours; write_local reads on once ours is empty."""
        if self.local_out and self.up is not None and not self.up_paused:
            self.up_paused = True
            self.watch_up()
            self.pause_local(False)
        return bool(self.local_out)

    def pack_public(self, batch: list) -> list:
        """The common case, with nothing waiting before it: public messages go
        straight into the Outbox (which write_local sends ahead of local_out);
        returns the batch from the first other item on, for from_up."""
        box = self.outbox
        for i, item in enumerate(batch):
            if type(item) is not Message or item.key[:1] == b"!" or len(box) == BATCH \
                    or not box.add_publish(item.key, item.payload):
                self.counts["down_msgs"] += i
                return batch[i:]
        self.counts["down_msgs"] += len(batch)
        return []


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="sbusd-link", description=__doc__.split("\n")[0])
    ap.add_argument("--fd", type=int, required=True, help="the broker's end of the socketpair")
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--export", action="append", default=[])
    ap.add_argument("--buffer", type=int, required=True)
    ap.add_argument("--max-message", type=int, default=MAX_MESSAGE,
                    help="the broker's --max-message: the largest packet sent up")
    # A link that an older sbusd started (a live upgrade's) gets no --flood.
    ap.add_argument("--flood", choices=FLOODS, default="block")
    ap.add_argument("--stderr-fd", type=int, help="sbusd's stderr, ours once we run "
                    "(until then our stderr is the pipe that tells sbusd why we did not)")
    args = ap.parse_args(argv)
    local = socket.socket(fileno=args.fd)
    grow_buffers(local, args.max_message)   # what comes down is as large as what goes up
    with Runner() as runner:
        link = Link(local, args.upstream, args.export, args.buffer, args.max_message, args.flood)
        announce_started(args.stderr_fd)
        return link.run(runner)


if __name__ == "__main__":
    sys.exit(main())
