"""The bridge itself: one sbus connection, one NATS connection, two directions.

Local -> NATS: a reader task takes matching messages off the bus in batches
straight into a natswire Exporter (sbus.aio receive_into), which maps each
to its HPUB frame and holds at most ``max_pending`` bytes (full means a drop
at the chosen end, counted); a forwarder task hands runs of it to nats-py
while NATS is connected. The reader never awaits the network, so the local
bus never waits for it.

NATS -> local: one NATS subscription per --import subject; a natswire
Importer maps each message to its key, checks it and packs it; a writer task
publishes what it packed (one sendmmsg for many).

The Exporter and Importer do the per-message work, checks and drop counts
of both paths; sbus.bridge.natsconn joins them to nats-py, through two of its
private names (the fast path) or its public API (the reference path).

The bridge asks its broker for frames (``CMSG link/frames``, granted to the
broker's own uid or root): its deliveries then come many packets to one,
taken apart by the client's LinkInbox, and its imports go out in frames
(``--no-frames``: a packet per message, as any client's).

Echo is off on both sides (``CMSG echo/off`` on sbus, ``no_echo`` on NATS):
what the bridge publishes never comes back to it, so two bridges through
one NATS carry each message at most once and never back to its origin.

With ``--private`` a second local connection takes the broker's link place
(``CMSG link/attach``), names the host (``link/identity``: the nesting
prefix of every whoami here) and subscribes to every host's identity; what
it receives under another host's identity goes to that host's private
subject, what comes in on this host's private subject goes to the process
its key names (docs/bridge.md, "Private keys across hosts").
"""
from __future__ import annotations

import asyncio
import errno
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .. import __version__
from .. import logschema as schema
from .._core import natswire
from ..client.aio import Client as BusClient
from ..client.protocol import MAX_MESSAGE, Message, pack_subscribe
from ..client.reconnect import Reconnect
from ..errors import BacklogFullError, BusClosedError, MessageRefusedError, SbusError
from ..runner import STOPPED, ready, settle_heap
from . import mapping, natsconn
from .counters import Counters
from .defaults import DEFAULT_MAX_PENDING, DEFAULT_STATS_INTERVAL, DEFAULT_STATS_KEY, DROP_NEWEST, DROP_OLDEST

# nats-server's default max_control_line is 4096 bytes: a PUB line with a
# longer subject makes the server close the connection, so such a message
# is dropped (and counted) rather than sent.
MAX_SUBJECT = 3900
# Bad-input drops logged one by one per stats interval; the rest are counted.
DROP_LOG_LIMIT = 20
# The longest wait before a NATS server is tried again (--reconnect-wait doubles up to it).
MAX_RECONNECT_WAIT = 5.0
# Seconds a stopping bridge waits for its pending messages to leave.
SETTLE_TIMEOUT = 2.0
# Seconds between repeated records of the same failed NATS connection attempt.
ERROR_LOG_INTERVAL = 10.0
# How many key -> HPUB frame head mappings the Exporter caches.
_CACHE_SIZE = 4096
_BATCH = 256
# Bytes of the Exporter's frames handed to nats-py at once.
_WRITE_BYTES = 1 << 20
# Back-off of the first NATS connection (nats-py reconnects on its own after).
_CONNECT_DELAY = (0.1, 5.0)
# Seconds to wait for the broker's answer to link/frames (one that predates
# frames for its own uid ignores the request: the bridge goes on in packets).
_FRAMES_TIMEOUT = 2.0


@dataclass
class Settings:
    address: str
    servers: List[str]
    exports: List[str] = field(default_factory=list)
    imports: List[str] = field(default_factory=list)
    subject_prefix: str = mapping.DEFAULT_PREFIX
    max_pending: int = DEFAULT_MAX_PENDING
    drop: str = DROP_OLDEST
    max_message: int = MAX_MESSAGE
    stats_key: str = DEFAULT_STATS_KEY
    stats_interval: float = DEFAULT_STATS_INTERVAL
    reconnect_wait: float = 1.0
    local_flood: Optional[str] = None   # "discard" or "block": CMSG blocking/hard/...
    name: str = "sbus-bridge"
    creds: Optional[str] = None
    token: Optional[str] = None
    user: Optional[str] = None
    password: Optional[str] = None
    tls_ca: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    fast_path: bool = True      # False: nats-py's public API for every message
    frames: bool = True         # ask the broker for frames (False: --no-frames)
    private: bool = False       # carry private keys between hosts (--private)
    host_id: Optional[int] = None   # this host's id among the bridged hosts (--host-id)


class SettingsError(ValueError):
    """Settings the bridge refuses to start with."""


def check(settings: Settings) -> None:
    """SettingsError for settings that would leak private keys, loop or duplicate."""
    if not settings.servers:
        raise SettingsError("no NATS server: give --nats URL")
    if not settings.exports and not settings.imports:
        raise SettingsError("nothing to bridge: give --export PATTERN and/or --import SUBJECT")
    for pattern in settings.exports:
        if pattern.startswith("!"):
            raise SettingsError(f"--export {pattern!r}: keys starting with '!' name local "
                                f"credentials and are never exported")
        try:
            pack_subscribe(pattern)     # refuses what the broker would refuse
        except MessageRefusedError as exc:
            raise SettingsError(f"--export {pattern!r}: {exc}") from None
    prefix = settings.subject_prefix
    if mapping.check_import(prefix) or any(c in prefix for c in "*>"):
        raise SettingsError(f"--subject-prefix {prefix!r} is not a plain NATS subject")
    for i, subject in enumerate(settings.imports):
        why = mapping.check_import(subject)
        if why:
            raise SettingsError(f"--import {subject!r}: {why}")
        for other in settings.imports[:i]:
            if mapping.subjects_overlap(subject, other):
                raise SettingsError(f"--import {other!r} and {subject!r} overlap: NATS would "
                                    f"deliver a message matching both twice")
    if settings.drop not in (DROP_OLDEST, DROP_NEWEST):
        raise SettingsError(f"--drop must be {DROP_OLDEST} or {DROP_NEWEST}")
    if settings.max_pending < 0:
        raise SettingsError("--max-pending must be 0 or more")
    if settings.private and settings.host_id is None:
        raise SettingsError("--private needs --host-id N: this host's id among the bridged "
                            "hosts, as the NATS permissions name it")
    if settings.host_id is not None:
        if not settings.private:
            raise SettingsError("--host-id names this host for --private only")
        if not 0 <= settings.host_id <= mapping.MAX_HOST_ID:
            raise SettingsError(f"--host-id must be 0 to {mapping.MAX_HOST_ID}")


def _tls(settings: Settings) -> Optional[ssl.SSLContext]:
    if not (settings.tls_ca or settings.tls_cert):
        return None
    ctx = ssl.create_default_context(cafile=settings.tls_ca)
    if settings.tls_cert:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    return ctx


def _redact(url: str) -> str:
    """A server URL as logged: without user:password@ or a token in it."""
    scheme, sep, rest = url.rpartition("://")
    return scheme + sep + rest.rpartition("@")[2]


def _describe(key: bytes) -> str:
    return mapping.encode_header(key[:256])


class Bridge:
    """Create inside a running loop, then ``await run(stop)``."""

    def __init__(self, settings: Settings, log) -> None:
        check(settings)
        s = self.settings = settings
        self.log = log
        self.counters = Counters()
        self._wake = asyncio.Event()
        self._nc = None
        self.connected = False
        self.server = ""
        self._logged_drops = 0
        self._suppressed = 0
        self._last_error = ""
        self._last_error_at = 0.0
        self._started = time.monotonic()
        self.bus: Optional[BusClient] = None
        self.frames = ""    # "on", or "off (why)": as bridge_start says
        self._asking: Optional[asyncio.Future] = None   # frames again, after a reconnect
        # Local messages waiting for NATS, as HPUB frames.
        self._exporter = natswire.Exporter(self._map_out, Message, s.max_pending,
                                           s.drop == DROP_NEWEST, cache_size=_CACHE_SIZE)
        # NATS messages waiting for the local bus, as packed Outboxes.
        self._importer = natswire.Importer(s.subject_prefix, s.max_message, s.max_pending)
        self._inbound_ready = asyncio.Event()
        self._nats_path = natsconn.choose(s.fast_path, self._importer, self._on_import_read,
                                 self._dropped)
        self.path = self._nats_path.name
        # --private: the connection holding the broker's link place, this
        # host's identity, and the NATS subject of its private messages.
        self._link: Optional[BusClient] = None
        self.identity = b""
        if s.private:
            self.identity = mapping.host_identity(s.host_id)
            self._private_subject = f"{mapping.private_prefix(s.subject_prefix)}.{s.host_id}"
            self._exporter.private = self._route_private

    # -- the local side --------------------------------------------------------

    async def _open_bus(self) -> None:
        s = self.settings
        policy = Reconnect(
            give_up_after=None, max_delay=2.0,
            on_disconnect=lambda exc: self.log.warning(
                schema.BRIDGE_LOCAL_LOST, address=s.address, error=str(exc)),
            on_reconnect=self._local_back)
        self.bus = BusClient(s.address, max_message=s.max_message, reconnect=policy)
        self.bus.reassemble = False     # chunks go to NATS as they travel (docs/chunks.md)
        # Echo off first: what the bridge imports must never reach its own
        # export subscriptions.
        await self.bus.send_cmsg("echo/off")
        if s.local_flood:
            await self.bus.send_cmsg(f"blocking/hard/{s.local_flood}")
        for pattern in s.exports:
            await self.bus.subscribe(pattern)
        self.frames = await self._take_frames(self.bus)
        await self.bus.whoami()     # answered in order: the SUBs are in place
        if s.private:
            self._link = await self._claim_link()

    async def _take_frames(self, bus: BusClient) -> str:
        """Ask the broker for frames on ``bus`` (docs/bridge.md, "Speed"):
        "on", or "off (why)", the bridge then going on a packet per message."""
        if not self.settings.frames:
            return "off (--no-frames)"
        try:
            answer = await bus.take_frames(timeout=_FRAMES_TIMEOUT)
        except TimeoutError:
            return "off (the broker did not answer link/frames)"
        return "on" if answer == b"ok" else f"off ({answer.decode('utf-8', 'replace')})"

    def _local_back(self) -> None:
        """The local broker is back, the subscriptions restored: frames are
        asked for again (a new connection starts without)."""
        self.log.info(schema.BRIDGE_LOCAL_BACK, address=self.settings.address)
        if self.frames == "on":
            self._asking = asyncio.ensure_future(self._take_frames_again())

    async def _take_frames_again(self) -> None:
        try:
            await self._take_frames(self.bus)
        except (OSError, SbusError):
            pass    # lost again: the next reconnect asks again

    async def _claim_link(self) -> BusClient:
        """A connection in the broker's link place, named this host, holding
        every host's identity. PermissionError when the broker refuses it (not
        its uid or root, or a leaf or another bridge has the place)."""
        s = self.settings
        link = BusClient(s.address, max_message=s.max_message)
        link.reassemble = False
        try:
            answer = await link.query(b"link/attach")
            if answer != b"ok":
                raise PermissionError(errno.EACCES, answer.decode("utf-8", "replace"))
            await link.send_cmsg("link/identity", self.identity)
            await self._take_frames(link)
            await link.send_cmsg("echo/off")
            if s.local_flood:
                await link.send_cmsg(f"blocking/hard/{s.local_flood}")
            # A pattern naming others, which the client library refuses to
            # send: only the link place's holder may hold it.
            await link.send_packet(b"SUB " + mapping.host_pattern().encode())
            await link.whoami()
        except BaseException:
            link.close()
            raise
        return link

    async def _read_link(self) -> None:
        """The link connection -> the Exporter, whose private hook routes each
        key; a lost link is claimed again (the broker restarted)."""
        ex = self._exporter
        while True:
            try:
                await self._link.receive_into(ex, _BATCH)
            except BusClosedError as exc:
                self._link.close()
                self.log.warning(schema.BRIDGE_LOCAL_LOST, address=self.settings.address,
                                 error=f"the link connection: {exc}")
                self._link = await self._reclaim_link()
                self.log.info(schema.BRIDGE_LOCAL_BACK, address=self.settings.address)
                continue
            if ex.drops_pending:
                self._log_drops("out", ex)
            if ex.pending_msgs and self.connected:
                self._wake.set()

    async def _reclaim_link(self) -> BusClient:
        delay = _CONNECT_DELAY[0]
        while True:
            await asyncio.sleep(delay)
            try:
                return await self._claim_link()
            except (OSError, BusClosedError):
                delay = min(delay * 2, _CONNECT_DELAY[1])

    def _route_private(self, key: bytes, payload: bytes):
        """The Exporter's hook for a key under a host's identity: another host's
        goes to its private subject; this host's is delivered here."""
        s, c = self.settings, self.counters
        hit = mapping.host_of(key)
        if hit is None:
            return None
        host, rest = hit
        if not mapping.names_a_process(rest):
            return None     # names no process (or another host's identity): nowhere to go
        if host == s.host_id:
            c.private_local += 1
            self._importer.deliver(rest, payload)
            self._on_import_read()
            return None
        subject = mapping.private_subject(s.subject_prefix, host, s.host_id, rest)
        if len(subject) > MAX_SUBJECT:
            return False
        c.private_out += 1
        return subject, mapping.encode_header(rest)

    def _map_out(self, key: bytes) -> Optional[Tuple[str, str]]:
        """(subject, Sbus-Key value) of a key; None if NATS would refuse the subject."""
        subject = mapping.key_to_subject(key, self.settings.subject_prefix)
        if len(subject) > MAX_SUBJECT:
            return None
        return subject, mapping.encode_header(key)

    def _pending_msgs(self) -> int:
        return self._exporter.pending_msgs + self._nats_path.held

    async def _read_local(self) -> None:
        """Local bus -> the Exporter. Awaits only the local socket."""
        bus, ex = self.bus, self._exporter
        while True:
            await bus.receive_into(ex, _BATCH)
            if ex.drops_pending:
                self._log_drops("out", ex)
            if ex.pending_msgs and self.connected:
                self._wake.set()

    async def _forward(self) -> None:
        """The Exporter -> NATS, one run at a time, while connected."""
        c = self.counters
        while True:
            await self._wake.wait()
            self._wake.clear()
            nc = self._nc
            while self._pending_msgs() and self.connected and nc.is_connected:
                sent = await self._nats_path.send(nc, self._exporter, _WRITE_BYTES)
                if sent is None:
                    break       # kept: sent once NATS is back
                c.out_forwarded += sent[0]
                c.out_forwarded_bytes += sent[1]

    # -- the NATS side ---------------------------------------------------------

    async def _on_private(self, msg) -> None:
        """A message on this host's private subject: to the process its key names."""
        subject, imp = msg.subject, self._importer
        try:
            sender = subject[len(self._private_subject) + 1:].split(".", 1)[0]
            mapping.parse_host_id(sender)
            value = msg.headers.get(mapping.HEADER) if msg.headers else None
            key = mapping.decode_header(value) if value is not None else mapping.subject_to_key(
                subject, f"{self._private_subject}.{sender}")
        except (ValueError, mapping.UnmappableError) as exc:
            imp.refuse(b"", msg.data, f"not a private subject of this host: {exc}", subject)
        else:
            if not mapping.names_a_process(key):
                imp.refuse(key, msg.data, "names no process of this host", subject)
            elif imp.deliver(key, msg.data, subject):
                self.counters.private_in += 1
        self._on_import_read()

    async def _on_nats(self, msg) -> None:
        """A message nats-py delivered through its public API: on the
        reference path each one, on the fast path those parsed before their
        subscription was handed to the Importer."""
        headers = msg.headers
        self._importer.push(msg.subject, headers.get(mapping.HEADER) if headers else None,
                            msg.data)
        self._on_import_read()

    def _on_import_read(self) -> None:
        """After the Importer took messages: wake the writer, log drops."""
        imp = self._importer
        if imp.pending_msgs:
            self._inbound_ready.set()
        if imp.drops_pending:
            self._log_drops("in", imp)

    async def _write_local(self) -> None:
        """The Importer's Outboxes -> the local bus, one sendmmsg(2) each."""
        imp, c = self._importer, self.counters
        while True:
            await self._inbound_ready.wait()
            self._inbound_ready.clear()
            for box, payload_bytes in imp.take():
                count = len(box)
                try:
                    await self.bus.publish_packed(box)
                except (BacklogFullError, BusClosedError) as exc:
                    # The broker is away and the backlog full (or the bus closed).
                    sent = getattr(exc, "sent", 0)
                    c.in_forwarded += sent
                    c.in_dropped_local += count - sent
                    self._log_drop("in", "local", None, 0,
                                   f"{count - sent} messages: {exc}", "")
                else:
                    c.in_forwarded += count
                    c.in_forwarded_bytes += payload_bytes
                imp.recycle(box)

    def _dropped(self, direction: str, reason: str, key: Optional[bytes], size: int,
                 detail: str, subject: str = "") -> None:
        """Count one dropped message; log it unless too many were logged lately."""
        name = f"{direction}_dropped_{reason}"
        setattr(self.counters, name, getattr(self.counters, name) + 1)
        self._log_drop(direction, reason, key, size, detail, subject)

    def _log_drops(self, direction: str, source) -> None:
        """Log the drops a natswire Importer/Exporter counted (and described)."""
        records, undescribed = source.take_drops()
        for reason, key, size, detail, subject in records:
            self._log_drop(direction, reason, key, size, detail, subject)
        self._suppressed += undescribed

    def _log_drop(self, direction: str, reason: str, key: Optional[bytes], size: int,
                  detail: str, subject: str) -> None:
        if self._logged_drops >= DROP_LOG_LIMIT:
            self._suppressed += 1
            return
        self._logged_drops += 1
        self.log.warning(schema.BRIDGE_DROP, direction=direction, reason=reason,
                         subject=subject, key=None if key is None else _describe(key),
                         size=size, detail=detail, suppressed=self._suppressed)
        self._suppressed = 0

    async def _connect_nats(self) -> None:
        import nats.aio.client
        s = self.settings
        options = dict(
            servers=s.servers, name=s.name, no_echo=True, allow_reconnect=True,
            max_reconnect_attempts=-1, reconnect_time_wait=s.reconnect_wait,
            connect_timeout=2, pending_size=1 << 20,
            disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
            error_cb=self._on_error, closed_cb=self._on_closed)
        if s.creds:
            options["user_credentials"] = s.creds
        if s.token:
            options["token"] = s.token
        if s.user:
            options["user"] = s.user
            options["password"] = s.password
        tls = _tls(s)
        if tls is not None:
            options["tls"] = tls
        delay = _CONNECT_DELAY[0]
        while True:
            # Made before connecting, so the error callback can lengthen its
            # wait between attempts while the first connection fails too.
            nc = self._nc = nats.aio.client.Client()
            self._nats_path.install(nc)
            try:
                await nc.connect(**options)
                break
            except Exception as exc:        # nats-py raises several kinds; all mean "later"
                self.log.warning(schema.BRIDGE_DISCONNECTED, server=self._seeds(),
                                 error=f"connect failed: {exc!r}",
                                 pending_msgs=self._pending_msgs())
                await asyncio.sleep(delay)
                delay = min(delay * 2, _CONNECT_DELAY[1])
        for subject in s.imports:
            sub = await nc.subscribe(subject, cb=self._on_nats, pending_msgs_limit=-1,
                                     pending_bytes_limit=256 << 20)
            # On the fast path its frames go to the Importer from here; anything
            # nats-py parsed before still reaches _on_nats, which hands it over.
            self._nats_path.subscribed(sub)
        if s.private:
            # nats-py's public API on either path: private messages are few.
            await nc.subscribe(self._private_subject + ".>", cb=self._on_private,
                               pending_msgs_limit=-1, pending_bytes_limit=256 << 20)
        await self._connected()

    async def _connected(self) -> None:
        nc = self._nc
        try:
            await nc.flush(timeout=5)     # the server has our SUBs before we say so
        except Exception:
            pass
        self.connected = nc.is_connected
        if not self.connected:
            return
        self.counters.nats_connects += 1
        self._exporter.max_payload = nc.max_payload
        nc.options["reconnect_time_wait"] = self.settings.reconnect_wait
        url = nc.connected_url
        self.server = f"{url.hostname}:{url.port}" if url else ""
        self.log.info(schema.BRIDGE_CONNECTED, server=self.server,
                      nats_connects=self.counters.nats_connects,
                      pending_msgs=self._pending_msgs())
        if self.counters.nats_connects == 1:
            settle_heap()   # nats-py and its connection, made after ready()
        self._wake.set()

    async def _on_disconnected(self) -> None:
        if self.connected:
            self.connected = False
            self.counters.nats_disconnects += 1
            self.log.warning(schema.BRIDGE_DISCONNECTED, server=self.server,
                             error="connection lost; reconnecting",
                             pending_msgs=self._pending_msgs())

    async def _on_reconnected(self) -> None:
        await self._connected()

    async def _on_error(self, exc: Exception) -> None:
        from nats.errors import SlowConsumerError
        if isinstance(exc, SlowConsumerError):
            return self._dropped("in", "local", None, 0, "NATS dropped for this slow subscriber",
                                 getattr(exc, "subject", ""))
        if "permissions violation" in str(exc).lower():
            # The server refused a subscription or a publication: its
            # authorization, logged every time (the message is lost).
            return self.log.warning(schema.BRIDGE_REFUSED, server=self.server, error=str(exc))
        if self.connected:
            return
        # A failed (re)connection attempt: nats-py tries the next server, and
        # one it tried lately after reconnect_time_wait, which doubles up to
        # MAX_RECONNECT_WAIT (back-off) and is reset once connected.
        if self._nc is not None:
            wait = self._nc.options.get("reconnect_time_wait", self.settings.reconnect_wait)
            self._nc.options["reconnect_time_wait"] = min(
                max(wait, self.settings.reconnect_wait) * 2, MAX_RECONNECT_WAIT)
        # Logged when the error changes; the same error again after ERROR_LOG_INTERVAL s.
        text, now = repr(exc), time.monotonic()
        if text != self._last_error or now - self._last_error_at >= ERROR_LOG_INTERVAL:
            self._last_error, self._last_error_at = text, now
            self.log.warning(schema.BRIDGE_DISCONNECTED, server=self.server or self._seeds(),
                             error=text, pending_msgs=self._pending_msgs())

    async def _on_closed(self) -> None:
        self.connected = False

    def _seeds(self) -> str:
        return ",".join(_redact(url) for url in self.settings.servers)

    async def _settle(self, timeout: float) -> None:
        """On stop: give what is pending a moment to leave, both ways."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while ((self._pending_msgs() and self.connected) or self._importer.pending_msgs) \
                and loop.time() < deadline:
            await asyncio.sleep(0.01)

    # -- state -----------------------------------------------------------------

    def state(self) -> dict:
        out = {"connected": self.connected, "server": self.server,
               "pending_msgs": self._pending_msgs(),
               "pending_bytes": self._exporter.pending_bytes,
               "max_pending": self.settings.max_pending}
        out["frames_in"], out["frames_out"] = self.bus.frames if self.bus is not None else (0, 0)
        out.update(self._counts())
        return out

    def _counts(self) -> dict:
        return self.counters.as_dict(self._exporter.counts(), self._importer.counts())

    async def _report(self) -> None:
        key = self.settings.stats_key
        while True:
            await asyncio.sleep(self.settings.stats_interval)
            state = self.state()
            self.log.info(schema.BRIDGE_STATS, **state)
            self._logged_drops = 0
            if key:
                try:
                    await self.bus.publish(key, json.dumps(state, separators=(",", ":")))
                except (BacklogFullError, MessageRefusedError, BusClosedError):
                    pass    # the broker is away; the log has the same record

    async def run(self, stop: asyncio.Event) -> str:
        """Bridge until ``stop`` is set; the reason it stopped."""
        s = self.settings
        await self._open_bus()
        self.log.info(schema.BRIDGE_START, version=__version__, path=self.path,
                      nats_py=natsconn.nats_py_version(), address=s.address, nats=self._seeds(),
                      exports=" ".join(s.exports), imports=" ".join(s.imports),
                      subject_prefix=s.subject_prefix, max_pending=s.max_pending, drop=s.drop,
                      stats_key=s.stats_key, identity=self.identity.decode(), frames=self.frames)
        # The local side is in place (_open_bus); NATS connects, and reconnects, by itself.
        ready(self.log, "bridge", exports=" ".join(s.exports))
        tasks = [asyncio.ensure_future(t) for t in (
            self._read_local(), self._forward(), self._write_local(), self._connect_nats(),
            self._report(), *([self._read_link()] if s.private else []))]
        stopping = asyncio.ensure_future(stop.wait())
        try:
            running = {stopping, *tasks}
            while not stopping.done():
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for t in done:      # only connecting to NATS ends on its own
                    if t is not stopping and t.exception() is not None:
                        raise t.exception()
            reason = STOPPED
            await self._settle(SETTLE_TIMEOUT)
        finally:
            for t in (stopping, *tasks):
                t.cancel()
            await asyncio.gather(stopping, *tasks, return_exceptions=True)
            await self._close()
        return reason

    async def _close(self) -> None:
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.close(), 5)
            except Exception:
                pass
        if self.bus is not None:
            self.bus.close()
        if self._link is not None:
            self._link.close()

    def stopped(self, reason: str) -> None:
        self.log.info(schema.BRIDGE_STOP, reason=reason,
                      uptime_s=round(time.monotonic() - self._started, 3),
                      **self._counts())
