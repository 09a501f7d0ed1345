"""``sbus fds``: fds handed between processes named by ``!/cred/`` addresses
(docs/fds.md), with a real sbusd and the real service process.

Covered: fds (a pipe, a sealed memfd) pass from one process to another,
which reads them; a process of uid 65534, and another process of the same
uid, can neither claim another's ticket nor read its notification; an offer
nobody claims is closed after --timeout; --max-fds-per-uid refuses with a
clear error; churn (offers, claims, expiries, abrupt disconnects, garbage)
leaves the service's fd table as it was; SIGHUP reopens the log, SIGTERM
stops cleanly; a C program written from docs/fds.md on either side.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sbus import Client
from sbus import logschema as ls
from sbus.fdpass import wire
from sbus.fdpass.client import FdsError, Giver, Receiver, claim, give, is_sealed, memfd_payload

from support import NOBODY, SBUS, TESTS, Conn, Started, asroot, fd_count, read_records, wait_for_record, wait_until
from support.logged import LoggedProcess
from support.procfs import end_process

TIMEOUT = 15.0

# A receiver in a process of its own: prints its address, takes one hand-over
# and prints what it found as JSON (a pipe read to EOF, a memfd hashed).
RECEIVER = r"""
import hashlib, json, mmap, os, stat, sys
from sbus import Client
from sbus.fdpass.client import Receiver, is_sealed
bus = Client(sys.argv[1])
r = Receiver(bus)
print(r.address, flush=True)
with r.take(timeout=30) as h:
    out = {"giver": h.giver, "note": h.note.decode(), "fds": []}
    for fd in h.fds:
        st = os.fstat(fd)
        if stat.S_ISFIFO(st.st_mode):
            data = b""
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                data += chunk
            out["fds"].append({"pipe": data.decode()})
        else:
            with mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ) as m:
                out["fds"].append({"size": st.st_size, "sha256": hashlib.sha256(m).hexdigest(),
                                   "sealed": is_sealed(fd)})
print(json.dumps(out), flush=True)
"""


class FdsProcess(LoggedProcess):
    """``sbus -a ADDRESS fds ARGS...`` logging JSON (debug) to a file."""

    event_timeout = TIMEOUT

    def __init__(self, workdir: Path, address: str, *args: str):
        self.address = address
        super().__init__(workdir, "fds", [SBUS, "-a", address, "fds", *args])
        try:
            self.start_record = self.wait_for_event(ls.FDS_START, TIMEOUT)
        except AssertionError:
            self.kill()
            raise AssertionError(f"sbus fds did not start: {self.stderr_text()}") from None
        self.socket = self.start_record["socket"]
        # Listening and on the bus: the one readiness record every service writes.
        ready = self.wait_for_event(ls.SERVICE_READY, TIMEOUT)
        assert (ready["service"], ready["socket"]) == ("fds", self.socket), ready
        self.base_fds = fd_count(self.pid)      # no connection, no offer yet

    def stop(self, sig=signal.SIGTERM) -> int:
        return super().stop(sig, TIMEOUT)


@pytest.fixture
def bus(open_broker):
    return open_broker()


@pytest.fixture
def services(tmp_path):
    started = Started()

    def start(address, *args) -> FdsProcess:
        return started.add(FdsProcess(tmp_path, address, *args))

    yield start
    started.end(FdsProcess.kill)


@pytest.fixture
def receivers():
    started = []

    def start(address) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", RECEIVER, address], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def me(address) -> str:
    with Client(address) as c:
        return str(c.whoami(timeout=TIMEOUT))


def finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=TIMEOUT * 2)
    assert p.returncode == 0, err
    return json.loads(out.splitlines()[-1])


def test_a_pipe_and_a_memfd_pass_to_another_process(bus, services, receivers):
    svc = services(bus.address)
    assert svc.socket == bus.address + ".fds"       # the default: next to the bus socket
    assert os.stat(svc.socket).st_mode & 0o777 == 0o666
    p = receivers(bus.address)
    receiver = p.stdout.readline().strip()
    assert receiver.startswith("!/cred/") and receiver.endswith(f"/{p.pid}")
    data = os.urandom(1 << 20)
    memfd = memfd_payload(data)
    r, w = os.pipe()
    try:
        ticket = give(receiver, [r, memfd], b"frame 7", address=bus.address)
        assert wire.TICKET_RE.fullmatch(ticket.encode())
        os.close(r)
        os.write(w, b"through the pipe")
    finally:
        os.close(w)
        os.close(memfd)
    got = finish(p)
    assert got["giver"] == me(bus.address).rsplit("/", 1)[0] + f"/{os.getpid()}"
    assert got["note"] == "frame 7"
    assert got["fds"] == [{"pipe": "through the pipe"},
                          {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                           "sealed": True}]
    svc.wait_for_event(ls.FDS_CLAIM)


def test_sealed_memfd_as_a_large_payload(bus, services, receivers):
    """docs/fds.md's example: 64 MiB handed over without being copied."""
    services(bus.address)
    p = receivers(bus.address)
    receiver = p.stdout.readline().strip()
    data = os.urandom(64 << 20)
    fd = memfd_payload(data, "snapshot")
    with pytest.raises(PermissionError):
        os.write(fd, b"x")                      # sealed: not even its maker may change it
    give(receiver, [fd], b"application/octet-stream", address=bus.address)
    os.close(fd)
    got = finish(p)
    assert got["fds"] == [{"size": 64 << 20, "sha256": hashlib.sha256(data).hexdigest(),
                           "sealed": True}]


def test_receiver_in_this_process_take_and_notice(bus, services):
    services(bus.address)
    with Client(bus.address) as c:
        rcv = Receiver(c)
        c.subscribe("other/")
        c.publish("other/x", b"not for fds")
        r, w = os.pipe()
        with Giver(address=bus.address) as g:
            t1 = g.give(rcv.address, [r], b"one")
            t2 = g.give(rcv.address, [w], b"two")
        os.close(r)
        os.close(w)
        with rcv.take(timeout=TIMEOUT) as h1, rcv.take(timeout=TIMEOUT) as h2:
            assert (h1.ticket, h1.note, h2.ticket, h2.note) == (t1, b"one", t2, b"two")
            os.write(h2.fds[0], b"ok")
            assert os.read(h1.fds[0], 2) == b"ok"
        assert [m.key for m in rcv.others] == [b"other/x"]
        with pytest.raises(FdsError) as e:     # claimed once only
            rcv.claim(t1)
        assert e.value.code == wire.E_UNKNOWN


@asroot
def test_another_uid_cannot_claim_nor_read_the_notification(bus, services, spawn):
    svc = services(bus.address)
    with Client(bus.address) as c:
        rcv = Receiver(c)
        inbox = rcv.address + "/fds/"

        def child(ctl):
            wild = Conn.to(bus.address)
            kept_all = wild.sub_ok("")              # everything it may see
            spy = Conn.to(bus.address)
            kept_inbox = spy.sub_ok(inbox)          # refused: not its credentials
            ctl.send({"ready": True})
            ticket = ctl.wait()["ticket"]
            try:
                claim(ticket, path=svc.socket)
                claimed = "claimed!"
            except FdsError as exc:
                claimed = exc.code
            seen = [p.decode("latin-1") for p in wild.collect()]
            return {"kept_all": kept_all, "kept_inbox": kept_inbox, "claimed": claimed,
                    "seen": seen}

        ch = spawn(child)
        assert ch.recv() == {"ready": True}
        r, w = os.pipe()
        ticket = give(rcv.address, [r], b"secret note", address=bus.address)
        os.close(r)
        ch.send({"ticket": ticket})
        got = ch.result()
        assert got == {"kept_all": True, "kept_inbox": False, "claimed": wire.E_UNKNOWN,
                       "seen": []}
        denied = svc.wait_for_event(ls.FDS_DENIED)
        assert denied["peer"].split("/")[3] == str(NOBODY)
        # The ticket survived the attempt: its process still takes it.
        with rcv.take(timeout=TIMEOUT) as h:
            assert h.ticket == ticket and h.note == b"secret note"
            os.write(w, b"!")
            assert os.read(h.fds[0], 1) == b"!"
        os.close(w)


def test_another_process_of_the_same_uid_cannot_claim(bus, services):
    svc = services(bus.address)
    with Client(bus.address) as c:
        rcv = Receiver(c)
        r, w = os.pipe()
        ticket = give(rcv.address, [r], address=bus.address)
        os.close(r)
        code = (f"from sbus.fdpass.client import claim, FdsError\n"
                f"try:\n    claim({ticket!r}, path={svc.socket!r})\n    print('claimed')\n"
                f"except FdsError as e:\n    print(e.code)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=TIMEOUT)
        assert out.stdout.strip() == wire.E_UNKNOWN, out.stderr
        with rcv.take(timeout=TIMEOUT) as h:
            assert h.ticket == ticket
        os.close(w)


def test_unclaimed_fds_are_closed_after_the_timeout(bus, services):
    # Long enough for the count below to be taken on a loaded machine.
    svc = services(bus.address, "--timeout", "2")
    base = fd_count(svc.pid)
    with Client(bus.address) as c:
        rcv = Receiver(c)
        r, w = os.pipe()
        ticket = give(rcv.address, [r, r, r], address=bus.address)
        os.close(r)
        # The giver's connection may not be closed there yet: wait for it to be.
        wait_until(lambda: fd_count(svc.pid) == base + 3, TIMEOUT, "3 fds held")
        rec = svc.wait_for_event(ls.FDS_EXPIRED)
        assert rec["count"] == 3 and rec["ticket"] == ticket[:8]
        # The service held the pipe's last read end: writing now breaks it.
        with pytest.raises(BrokenPipeError):
            os.write(w, b"x")
        os.close(w)
        wait_until(lambda: fd_count(svc.pid) == base, TIMEOUT, "the fds closed")
        with pytest.raises(FdsError) as e:
            rcv.claim(ticket)
        assert e.value.code == wire.E_UNKNOWN


def test_per_uid_limit_refuses_with_a_clear_error(bus, services):
    svc = services(bus.address, "--max-fds-per-uid", "4")
    with Client(bus.address) as c:
        rcv = Receiver(c)
        r, w = os.pipe()
        try:
            ticket = give(rcv.address, [r] * 3, address=bus.address)
            with pytest.raises(FdsError) as e:
                give(rcv.address, [r, w], address=bus.address)
            assert e.value.code == wire.E_LIMIT
            assert "uid 0 holds 3 fds" in str(e.value) and "--max-fds-per-uid 4" in str(e.value)
            assert svc.wait_for_event(ls.FDS_REFUSED)["reason"] == wire.E_LIMIT
            give(rcv.address, [w], address=bus.address)        # 4: still within
            rcv.claim(ticket).close()
            give(rcv.address, [r, w, r], address=bus.address)  # room again
        finally:
            os.close(r)
            os.close(w)


def test_refusals_of_malformed_offers(bus, services):
    svc = services(bus.address)
    r, w = os.pipe()
    try:
        for receiver, fds, code in (("!/cred/1/2", [r], wire.E_ADDRESS),
                                    ("!/cred/1/2/3/!/cred/4/5/6", [r], wire.E_ADDRESS),
                                    ("pub/lic", [r], wire.E_ADDRESS)):
            # Past the client's own check: what a C giver could send.
            with Giver(svc.socket) as g:
                wire.send_fds(g.sock, wire.OFFER + receiver.encode() + b"\0", fds)
                answer = g.sock.recv(4096)
            assert wire.parse_error(answer)[0] == code, receiver
        for packet, fds, code in ((wire.OFFER + b"!/cred/1/2/3\0", [], wire.E_NOFDS),
                                  (b"HELLO", [], wire.E_MALFORMED),
                                  (wire.CLAIM + b"zz", [], wire.E_UNKNOWN),
                                  (wire.CLAIM + b"0" * 32, [r], wire.E_MALFORMED),
                                  (wire.OFFER + b"!/cred/1/2/3\0" + b"n" * 4097, [r],
                                   wire.E_MALFORMED)):
            with Giver(svc.socket) as g:
                wire.send_fds(g.sock, packet, fds)
                answer = g.sock.recv(4096)
            assert wire.parse_error(answer)[0] == code, packet
    finally:
        os.close(r)
        os.close(w)


def test_churn_leaves_no_fd_in_the_service(bus, services):
    """Offers claimed, offers expired, offers pushed to waiters that are gone,
    connections dropped at every step, and garbage: afterwards the service's
    fd table is what it was."""
    svc = services(bus.address, "--timeout", "1")
    time.sleep(0.2)
    base = fd_count(svc.pid)
    r, w = os.pipe()
    with Client(bus.address) as c:
        rcv = Receiver(c)
        claimed = 0
        mine = f"!/cred/{os.getegid()}/{os.geteuid()}/{os.getpid()}"
        for i in range(60):
            n = 1 + i % 7
            with Giver(svc.socket) as g:
                # A waiter of this process that is gone, or going, as an offer
                # comes (closed before the ticket below, which it cannot take).
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(svc.socket)
                s.send(wire.WAIT)
                if i % 2:
                    s.close()
                g.give(mine, [w])
                s.close()
                ticket = g.give(rcv.address, [r] * n)
            kind = i % 5
            if kind == 0:
                rcv.claim(ticket).close()
                claimed += 1
            elif kind == 1:                   # CLAIM, then gone before the answer
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(svc.socket)
                s.send(wire.CLAIM + ticket.encode())
                s.close()
            elif kind == 2:                   # OFFER, then gone before the ticket
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(svc.socket)
                wire.send_fds(s, wire.OFFER + rcv.address.encode() + b"\0", [r, w])
                s.close()
            elif kind == 3:                   # connected, then gone, saying nothing
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(svc.socket)
                s.close()
            else:                             # garbage with fds
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(svc.socket)
                wire.send_fds(s, b"NONSENSE", [r, w, r])
                s.recv(4096)
                s.close()
        # Left to expire: everything not claimed (kind 1's claim may have won).
        wait_until(lambda: fd_count(svc.pid) == base, 30, "the service's fds back to the base")
    os.close(r)
    os.close(w)
    assert svc.stop() == 0
    stop = svc.events(ls.FDS_STOP)[-1]
    assert stop["held"] == 0 and stop["pending"] == 0
    assert (stop["offers"], stop["offers_refused"]) == (60 + 60 + 12, 0)
    assert stop["claims"] >= claimed and stop["expired"] >= 1
    assert stop["claims"] + stop["expired"] == stop["offers"]


def test_sighup_reopens_the_log_and_sigterm_stops_cleanly(bus, services):
    svc = services(bus.address)
    moved = svc.log_path.with_suffix(".old")
    svc.log_path.rename(moved)
    os.kill(svc.pid, signal.SIGHUP)
    wait_until(svc.log_path.exists, TIMEOUT, "a new log file")
    with Client(bus.address) as c:
        rcv = Receiver(c)
        r, w = os.pipe()
        give(rcv.address, [r, w], address=bus.address)
        os.close(r)
        os.close(w)
    svc.wait_for_event(ls.FDS_OFFER)             # in the new file
    assert svc.stop(signal.SIGTERM) == 0
    stop = svc.events(ls.FDS_STOP)[-1]
    assert stop["reason"] == "signal" and stop["pending"] == 1
    assert not os.path.exists(svc.socket)        # its socket file is gone with it
    assert svc.stderr_text() == ""
    assert all(r["event"] != ls.FDS_STOP for r in read_records(moved))


def test_every_logged_fds_field_is_in_the_schema(bus, services):
    svc = services(bus.address, "--timeout", "0.3", "--max-fds-per-uid", "1")
    with Client(bus.address) as c:
        rcv = Receiver(c)
        r, w = os.pipe()
        rcv.claim(give(rcv.address, [r], address=bus.address)).close()
        give(rcv.address, [r], address=bus.address)
        with pytest.raises(FdsError):
            give(rcv.address, [w], address=bus.address)
        os.close(r)
        os.close(w)
        svc.wait_for_event(ls.FDS_EXPIRED)
    svc.stop()
    common = {name for name, _ in ls.COMMON_FIELDS}
    seen = set()
    for rec in svc.records():
        if rec["event"] in ls.FDS_EVENT_FIELDS:
            seen.add(rec["event"])
            assert set(rec) - common == {n for n, _ in ls.FDS_EVENT_FIELDS[rec["event"]]}, rec
    assert seen >= {ls.FDS_START, ls.FDS_STOP, ls.FDS_OFFER, ls.FDS_CLAIM, ls.FDS_EXPIRED,
                    ls.FDS_REFUSED}
    broker = ls.all_fields()
    for event, fields in ls.FDS_EVENT_FIELDS.items():
        for name, tag in fields:
            assert broker.get(name, tag) == tag, (event, name)


@pytest.fixture(scope="module")
def c_fds(tmp_path_factory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    exe = tmp_path_factory.mktemp("fds") / "fds"
    proc = subprocess.run(["gcc", "-std=c99", "-D_DEFAULT_SOURCE", "-O2", "-Wall", "-Wextra",
                           "-Werror", "-o", str(exe), str(TESTS / "c" / "fds.c")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return exe


def test_c_receiver_takes_from_python(bus, services, c_fds):
    svc = services(bus.address)
    p = subprocess.Popen([str(c_fds), "take", bus.address, svc.socket],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        receiver = p.stdout.readline().strip()
        fd = memfd_payload(b"hello from python")
        give(receiver, [fd], b"greeting", address=bus.address)
        os.close(fd)
        out, err = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    giver = me(bus.address).rsplit("/", 1)[0] + f"/{os.getpid()}"
    assert out == f"{giver} greeting hello from python\n"


def test_python_receiver_takes_from_c(bus, services, c_fds):
    svc = services(bus.address)
    with Client(bus.address) as c:
        rcv = Receiver(c)
        out = subprocess.run([str(c_fds), "give", svc.socket, rcv.address, "a note",
                              "hello from C"], capture_output=True, text=True, timeout=TIMEOUT)
        assert out.returncode == 0, out.stderr
        with rcv.take(timeout=TIMEOUT) as h:
            assert h.ticket == out.stdout.strip() and h.note == b"a note"
            assert is_sealed(h.fds[0])
            assert os.pread(h.fds[0], 100, 0) == b"hello from C"
            assert h.giver.endswith("/" + h.giver.split("/")[-1])
        out = subprocess.run([str(c_fds), "give", svc.socket, "!/cred/1/2", "n", "t"],
                             capture_output=True, text=True, timeout=TIMEOUT)
        assert out.returncode == 1 and out.stderr.startswith("ERR address ")


def test_socket_activation_serves_the_socket_systemd_passes(bus, tmp_path):
    """As sbus-fds.socket would: the socket at fd 3, LISTEN_FDS/LISTEN_PID;
    the service serves it and leaves the file to systemd when it stops."""
    from support.systemd import ACTIVATE
    path = bus.address + ".fds"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    log = tmp_path / "activated.log"
    p = subprocess.Popen([sys.executable, "-c", ACTIVATE, str(listener.fileno()), "self", SBUS,
                          "-a", bus.address, "fds", "--log-format", "json", "--log-file",
                          str(log)], pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL)
    listener.close()
    try:
        wait_for_record(log, ls.FDS_START, timeout=TIMEOUT)
        with Client(bus.address) as c:
            rcv = Receiver(c)
            r, w = os.pipe()
            give(rcv.address, [w], address=bus.address)
            with rcv.take(timeout=TIMEOUT) as h:
                os.write(h.fds[0], b"activated")
            os.close(w)
            assert os.read(r, 100) == b"activated"
            os.close(r)
        assert end_process(p) == 0
        assert os.path.exists(path)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_kept_claim_connection_closed_for_silence_is_opened_again(bus, services):
    svc = services(bus.address, "--timeout", "0.5")
    with Client(bus.address) as c:
        rcv = Receiver(c)
        r, w = os.pipe()
        give(rcv.address, [r], address=bus.address)
        rcv.take(timeout=TIMEOUT).close()
        svc.wait_for_event(ls.FDS_CLAIM)
        wait_until(lambda: fd_count(svc.pid) == svc.base_fds, TIMEOUT,
                   "the idle connection closed")
        give(rcv.address, [w], address=bus.address)
        with rcv.take(timeout=TIMEOUT) as h:
            os.write(h.fds[0], b"again")
        assert os.read(r, 10) == b"again"
        os.close(r)
        os.close(w)
    svc.stop()
    assert svc.events(ls.FDS_STOP)[-1]["connections_idle"] >= 1



def test_connections_beyond_the_limit_are_closed_at_once(bus, services):
    svc = services(bus.address, "--max-connections", "2")
    held = [Giver(svc.socket), Giver(svc.socket)]
    try:
        r, w = os.pipe()
        with pytest.raises(FdsError) as e:
            give("!/cred/0/0/1", [r], path=svc.socket)
        assert e.value.code == "closed"
        assert svc.wait_for_event(ls.FDS_REFUSED)["reason"] == "connections"
        assert wire.TICKET_RE.fullmatch(held[0].give("!/cred/0/0/1", [w]).encode())
        os.close(r)
        os.close(w)
    finally:
        for g in held:
            g.close()


def test_wait_takes_offers_without_the_bus(bus, services, c_fds):
    """WAIT: an offer already there comes at once, a later one as it is made,
    and a process waits for its own offers only (a C waiter is another pid)."""
    from sbus.fdpass.client import Claimer
    svc = services(bus.address)
    mine = f"!/cred/{os.getegid()}/{os.geteuid()}/{os.getpid()}"
    r, w = os.pipe()
    try:
        early = give(mine, [r], b"early", path=svc.socket)
        p = subprocess.Popen([str(c_fds), "wait", svc.socket], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        other = p.stdout.readline().strip()
        assert other.endswith(f"/{p.pid}")
        with Claimer(svc.socket) as claimer:
            with claimer.wait(timeout=TIMEOUT) as h:
                assert (h.ticket, h.note, h.giver) == (early, b"early", mine)
            with pytest.raises(socket.timeout):
                claimer.wait(timeout=0.3)       # nothing yet; the wait stands
            fd = memfd_payload(b"for C")
            give(other, [fd], b"c-note", path=svc.socket)
            os.close(fd)
            out, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, err
            assert out == f"{mine} c-note for C\n"
            late = give(mine, [w], b"late", path=svc.socket)
            with claimer.wait(timeout=TIMEOUT) as h:
                assert (h.ticket, h.note) == (late, b"late")
                os.write(h.fds[0], b"w")
            assert os.read(r, 1) == b"w"
    finally:
        os.close(r)
        os.close(w)
    svc.stop()
    stop = svc.events(ls.FDS_STOP)[-1]
    # The late one was pushed to the standing wait; C's, if its WAIT came first.
    assert stop["pushed"] in (1, 2) and (stop["claims"], stop["pending"]) == (3, 0)


def test_the_asyncio_twins_give_take_claim_and_wait(bus, services):
    """The fds calls on an asyncio client (sbus.aio): the same conversations
    as the blocking ones, awaited: take queues other messages, a claim is
    taken once, a take with nothing offered times out, a WAIT that timed
    out stands and takes the next offer, a kept connection the service
    has ended is opened again."""
    import asyncio

    from sbus.aio import Client as AsyncClient
    from sbus.fdpass.client import AsyncClaimer, AsyncGiver, AsyncReceiver, aclaim, agive
    svc = services(bus.address)
    mine = f"!/cred/{os.getegid()}/{os.geteuid()}/{os.getpid()}"
    r, w = os.pipe()

    async def run() -> None:
        async with AsyncClient(bus.address) as c:
            rcv = await AsyncReceiver.open(c)
            assert rcv.address == mine
            await c.subscribe("other/")
            await c.publish("other/x", b"not for fds")
            async with AsyncGiver(address=bus.address) as g:
                t1 = await g.give(rcv.address, [r], b"one")
                t2 = await g.give(rcv.address, [w], b"two")
            with await rcv.take(timeout=TIMEOUT) as h1, await rcv.take(timeout=TIMEOUT) as h2:
                assert (h1.ticket, h1.note, h1.giver, h2.ticket, h2.note) == (
                    t1, b"one", mine, t2, b"two")
                os.write(h2.fds[0], b"ok")
                assert os.read(h1.fds[0], 2) == b"ok"
            assert [m.key for m in rcv.others] == [b"other/x"]
            with pytest.raises(FdsError) as e:     # claimed once only
                await rcv.claim(t1)
            assert e.value.code == wire.E_UNKNOWN
            with pytest.raises(TimeoutError):
                await rcv.take(timeout=0.3)
            # A kept claim connection that has ended (the service closes
            # one silent too long) is opened again by the next claim.
            sock = rcv.claimer.sock
            sock.shutdown(socket.SHUT_RDWR)
            t3 = await agive(rcv.address, [r], path=svc.socket)
            with await rcv.take(timeout=TIMEOUT) as h3:
                assert h3.ticket == t3
            assert rcv.claimer.sock is not sock
            rcv.close()
        t4 = give(mine, [w], b"four", path=svc.socket)
        with await aclaim(t4, path=svc.socket) as h4:
            assert (h4.note, len(h4.fds)) == (b"four", 1)
        async with AsyncClaimer(svc.socket) as claimer:
            with pytest.raises(TimeoutError):
                await claimer.wait(timeout=0.3)     # nothing yet; the wait stands
            assert claimer.waiting
            late = await agive(mine, [w], b"late", path=svc.socket)
            with await claimer.wait(timeout=TIMEOUT) as h:
                assert (h.ticket, h.note) == (late, b"late")
        with pytest.raises(ValueError):
            await agive(mine, [], path=svc.socket)
        with pytest.raises(FdsError) as e:
            await aclaim("0" * 32, path=svc.socket)
        assert e.value.code == wire.E_UNKNOWN

    try:
        asyncio.run(run())
    finally:
        os.close(r)
        os.close(w)
    svc.stop()
    stop = svc.events(ls.FDS_STOP)[-1]
    assert (stop["claims"], stop["pending"]) == (5, 0)
