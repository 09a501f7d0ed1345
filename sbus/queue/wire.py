"""The queue's wire convention (docs/queues.md): keys and payloads, packed and parsed.

Keys under ``sbus/queue/`` are the service's public requests and are never
jobs. Everything else the service says goes to one consumer's private inbox
(``sbus.client.private``); everything a consumer says after its hello goes to
the service's private control key. Payloads are ASCII fields separated by
single spaces, the last field taking the rest of the payload; a delivered
job carries its original ``key\\0payload`` after its two fields, as a ``MSG``
packet does.
"""
from __future__ import annotations

import json
from typing import Dict, List, NamedTuple, Tuple

PREFIX = b"sbus/queue/"
HELLO_KEY = "sbus/queue/hello"     # <prefetch> [batch] <inbox> <pattern>; again to renew the lease
STATE_KEY = "sbus/queue/state"     # <inbox> <pattern>

# A producer's batch of jobs on key K is published on K + PUT_SUFFIX: records
# <size> <payload>, back to back, in packets of at most PUT_PACKET bytes.
PUT_SUFFIX = "/.sbus-jobs"
PUT_PACKET = 32 << 10

# Suffixes of a consumer's inbox (service -> consumer).
WELCOME = "welcome"    # <token> <lease seconds> <control key>
JOB = "job"            # <tag> <deliveries> <key>\0<payload>
JOBS = "jobs"          # records <size> <job payload>, back to back (consumers that said batch)
EXPIRED = "expired"    # <token>: the service forgot this consumer; say hello again
STATE = "state"        # the service's state as JSON
REFUSED = "refused"    # <reason>: the access policy does not let this consumer read the jobs
# Suffix of the service's inbox: its control key (consumer -> service).
CONTROL = "ctl"

# The word in a hello by which a consumer asks for its jobs in batches.
BATCH = b"batch"

# The longest inbox a hello may name, and so the most a delivery adds to the
# job's own packet ("MSG key\0payload"): the inbox, "jobs", a record's three
# counts and their spaces, and the NUL after the delivery's key. A job within
# that much of the broker's --max-message is dropped on arrival (counted as
# oversize): it could not be delivered.
MAX_INBOX = 200
DELIVERY_OVERHEAD = MAX_INBOX + len(JOBS) + 3 * (20 + 1) + 1

# Verbs on the control key: "<verb> <token> <arguments>".
ACK = "ack"            # <tag>...: done, forget these jobs
NACK = "nack"          # <tag>...: not done, give these jobs to a consumer again
REJECT = "reject"      # <tag>...: not done, and drop these jobs (counted)
BYE = "bye"            # (nothing): leaving; its unacknowledged jobs go back to the queue
VERBS = (ACK, NACK, REJECT, BYE)


class WireError(ValueError):
    """A payload that does not follow the convention."""


def _fields(payload: bytes, count: int) -> List[bytes]:
    """``count`` fields: count-1 separated by single spaces, the last the rest."""
    parts = payload.split(b" ", count - 1)
    if len(parts) != count:
        raise WireError(f"expected {count} fields: {payload[:80]!r}")
    return parts


def _count(raw: bytes, what: str) -> int:
    if not raw.isdigit() or len(raw) > 18:
        raise WireError(f"{what} is not a count: {raw[:20]!r}")
    return int(raw)


def parse_inbox(raw: bytes, what: str = "inbox") -> str:
    """An inbox or key given to the service: it must be private, or the service
    would publish jobs and state for anyone to read."""
    if not raw.startswith(b"!/cred/") or b" " in raw:
        raise WireError(f"{what} is not a private key: {raw[:80]!r}")
    if len(raw) > MAX_INBOX:
        raise WireError(f"{what} is longer than {MAX_INBOX} bytes")
    return raw.decode("ascii", "surrogateescape")


# -- public requests ----------------------------------------------------------------

class Hello(NamedTuple):
    prefetch: int
    inbox: str
    pattern: bytes
    batch: bool     # the consumer takes ``jobs`` batches


def pack_hello(prefetch: int, inbox: str, pattern: str, batch: bool = False) -> bytes:
    words = f"{prefetch} batch {inbox} " if batch else f"{prefetch} {inbox} "
    return words.encode() + pattern.encode("utf-8", "surrogateescape")


def parse_hello(payload: bytes) -> Hello:
    if payload.startswith(b"batch ", payload.find(b" ") + 1):
        prefetch, _, inbox, pattern = _fields(payload, 4)
        batch = True
    else:
        prefetch, inbox, pattern = _fields(payload, 3)
        batch = False
    return Hello(_count(prefetch, "prefetch"), parse_inbox(inbox), pattern, batch)


def pack_state_request(inbox: str, pattern: str) -> bytes:
    return f"{inbox} ".encode() + pattern.encode("utf-8", "surrogateescape")


def parse_state_request(payload: bytes) -> Tuple[str, bytes]:
    """(inbox, pattern)."""
    inbox, pattern = _fields(payload, 2)
    return parse_inbox(inbox), pattern


# -- service -> consumer ---------------------------------------------------------------

class Welcome(NamedTuple):
    token: str
    lease: float
    control: str


def pack_welcome(token: str, lease: float, control: str) -> bytes:
    return f"{token} {lease:g} {control}".encode()


def parse_welcome(payload: bytes) -> Welcome:
    token, lease, control = _fields(payload, 3)
    try:
        seconds = float(lease)
    except ValueError:
        raise WireError(f"lease is not a number: {lease[:20]!r}") from None
    return Welcome(token.decode("ascii", "replace"), seconds,
                   control.decode("ascii", "surrogateescape"))


def pack_job(tag: int, deliveries: int, key: bytes, payload: bytes) -> bytes:
    return b"%d %d %s\0%s" % (tag, deliveries, key, payload)


def parse_job(payload: bytes) -> Tuple[int, int, bytes, bytes]:
    """(tag, deliveries, key, payload)."""
    tag, deliveries, rest = _fields(payload, 3)
    key, sep, body = rest.partition(b"\0")
    if not sep:
        raise WireError("a job without NUL after its key")
    return _count(tag, "tag"), _count(deliveries, "deliveries"), key, body


def pack_jobs_py(tags: List[int], jobs: List[tuple], limit: int) -> List[bytes]:
    """The plain-Python twin of ``sbus._core.jobs.pack_jobs``: ``jobs``
    payloads of at most ``limit`` bytes (a larger record alone), each job
    ``(key, payload)`` delivered once or ``(key, payload, deliveries)``."""
    out: List[bytes] = []
    packet = b""
    for tag, job in zip(tags, jobs):
        body = pack_job(tag, job[2] if len(job) > 2 else 1, job[0], job[1])
        record = b"%d %s" % (len(body), body)
        if packet and len(packet) + len(record) > limit:
            out.append(packet)
            packet = b""
        packet += record
    if packet:
        out.append(packet)
    return out


def parse_jobs_py(payload: bytes) -> List[Tuple[int, int, bytes, bytes]]:
    """The plain-Python twin of ``sbus._core.jobs.parse_jobs``: the records
    of a ``jobs`` payload as (tag, deliveries, key, payload)."""
    return [parse_job(record) for record in _records(payload, "a jobs record")]


def _records(payload: bytes, what: str) -> List[bytes]:
    """The records ``SIZE PAYLOAD`` one after another of a ``jobs`` payload or a
    producer's batch, each record's payload; ``what`` names them in an error."""
    out = []
    at = 0
    while at < len(payload):
        space = payload.find(b" ", at)
        if space < 0:
            raise WireError(f"{what} without its size")
        size = _count(payload[at:space], "size")
        at = space + 1 + size
        if at > len(payload):
            raise WireError(f"{what} longer than its payload")
        out.append(payload[space + 1:at])
    return out


def pack_puts_py(key: bytes, payloads: List[bytes], limit: int = PUT_PACKET) -> List[Tuple[bytes, bytes]]:
    """The plain-Python twin of ``sbus._core.jobs.pack_puts``: the packets
    (key, payload) that publish ``payloads`` as jobs on ``key``, batches of
    at most ``limit`` bytes on ``key`` + PUT_SUFFIX, a job whose record alone
    is larger as a plain job on ``key``, in order."""
    batch_key = key + PUT_SUFFIX.encode()
    out: List[Tuple[bytes, bytes]] = []
    packet = b""
    for payload in payloads:
        record = b"%d %s" % (len(payload), payload)
        if packet and len(packet) + len(record) > limit:
            out.append((batch_key, packet))
            packet = b""
        if len(record) > limit:
            out.append((key, payload))
        else:
            packet += record
    if packet:
        out.append((batch_key, packet))
    return out


def parse_puts_py(payload: bytes) -> List[bytes]:
    """The job payloads of a producer's batch (records ``SIZE PAYLOAD``)."""
    return _records(payload, "a batch record")


def pack_state(state: Dict) -> bytes:
    return json.dumps(state, sort_keys=True).encode()


# -- consumer -> service ----------------------------------------------------------------

def pack_control(verb: str, token: str, *args) -> bytes:
    return " ".join((verb, token, *map(str, args))).encode()


def parse_control(payload: bytes) -> Tuple[str, str, bytes]:
    """(verb, token, arguments): the arguments are the tags of ack, nack and
    reject, as they came (``parse_tags`` reads them)."""
    parts = payload.split(b" ", 2)
    if len(parts) < 2:
        raise WireError(f"control without a token: {payload[:80]!r}")
    verb = parts[0].decode("ascii", "replace")
    if verb not in VERBS:
        raise WireError(f"unknown verb {verb!r}")
    return verb, parts[1].decode("ascii", "replace"), parts[2] if len(parts) > 2 else b""


def parse_tags_py(args: bytes) -> List[int]:
    """The plain-Python twin of ``sbus._core.jobs.parse_tags``: the tags in
    the arguments of a control message, counts separated by spaces (extra
    spaces are ignored)."""
    tags = [a for a in args.split(b" ") if a]
    for raw in tags:
        _count(raw, "a tag")
    return list(map(int, tags))
