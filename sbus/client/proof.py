"""The spec's four-step identity proof, both sides (docs/proof.md).

    A: Send A's credentials to B.
    B: Send B's credentials with routing key private to A.
    A: Send a random message with routing key private to B.
    B: Send back the message with routing key private to A.

On the wire, each payload is text fields joined by one NUL:

1. A publishes on the responder's key: ``A-credentials NUL K2``
2. B publishes on K2: ``B-credentials NUL K3``
3. A publishes on K3: ``NONCE NUL K4``
4. B publishes on K4: ``NONCE``

K2 and K4 are in A's reply inbox (:mod:`.private`'s one form,
``<credentials>/reply/<id>/<n>``), K3 in B's proof inbox
(``<credentials>/proof/<id>/<token>``). Each side takes a key only under the
credentials its sender claims (the credentials, then ``/``), so only their
holder reads what is sent there: the broker hands a ``!/cred/G/U/P/`` key to
those credentials alone, and each hop of a leaf or a private bridge does
the same for its part of a nested key. A's NONCE coming back proves B holds
what it claimed at step 2; B's token, told only to A's credentials at step 2,
coming back at step 3 proves A holds what it claimed at step 1. So each side
ends with the other's verified credentials.

:func:`prove` (``Client.prove``) is A's plan: the answers are routed to it
like replies, so other messages stay queued for ``receive()``.
:func:`serve_proofs` is B: ``for peer in serve_proofs(client, pattern)``
(``async for`` on an asyncio client), a plan over the services' contract.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Optional, Tuple

from .._core.batch import pack_publish
from ..errors import BusClosedError, MessageRefusedError, ProofError
from .connection import Connection, Plan
from .private import PrivateInbox, new_id
from .protocol import Credentials, Message, Text, encode
from .steps import ITEM, Run

__all__ = ["KIND", "PROOF_TIMEOUT", "prove", "serve_proofs"]

KIND = "proof"
# Seconds an initiator waits for the whole proof, and a responder keeps a
# proof that reached step 2 open for step 3.
PROOF_TIMEOUT = 10.0
# Proofs a responder keeps open at once: past that the oldest is dropped,
# so a flood of step 1s costs it bounded memory.
MAX_OPEN = 1024


def _join(*fields: Text) -> bytes:
    return b"\0".join(encode(f) for f in fields)


def claim(payload: bytes) -> Optional[Tuple[str, bytes]]:
    """``credentials NUL key`` with the key under the credentials (and
    ``!/cred/``-shaped), as (credentials, key); None for anything else."""
    text, sep, key = payload.partition(b"\0")
    try:
        creds = text.decode("ascii")
        Credentials.parse(creds)
    except (UnicodeDecodeError, ValueError):
        return None
    if not sep or b"\0" in key or not key.startswith(text + b"/") or len(key) <= len(text) + 1:
        return None
    return creds, key


def _step(conn: Connection, step: int, key: Text, payload: bytes, reply_key: bytes,
          waiter: Any, deadline: float, why: str) -> Plan:
    """Send step ``step`` and return the answer, the next step, that comes
    on ``reply_key``. Noted as a request: a lost connection fails it, and a
    reconnecting client sends it again to the new broker."""
    try:
        packet = pack_publish(key, payload, conn.max_message)
    except MessageRefusedError as exc:
        raise ProofError(step, f"the broker would refuse it: {exc}") from None
    return (yield from conn.exchange(reply_key, packet, waiter, deadline,
                                     lambda: ProofError(step + 1, why)))


def prove(conn: Connection, key: Text, timeout: float) -> Plan:
    """A's side: prove to whoever answers on ``key`` and have them prove
    to us; returns their verified Credentials, or raises ProofError saying
    which step failed."""
    deadline = time.monotonic() + timeout
    replies = yield from conn.open_replies(timeout, deadline)
    me = str(replies.credentials)
    w2, w4 = conn.new_waiter(), conn.new_waiter()
    k2, k4 = replies.expect(w2), replies.expect(w4)
    try:
        answer = yield from _step(conn, 1, key, _join(me, k2), k2, w2, deadline, (
            f"nobody answered on {key!r} within {timeout:g} s (no responder serves it)"))
        claimed = claim(answer)
        if claimed is None:
            raise ProofError(2, f"a malformed answer: {answer[:200]!r}")
        peer, k3 = claimed
        nonce = new_id() + new_id()
        back = yield from _step(conn, 3, k3, _join(nonce, k4), k4, w4, deadline, (
            f"{peer} did not send the nonce back within {timeout:g} s: the answer at "
            f"step 2 came from a process without those credentials, or the peer is gone"))
        if back != nonce.encode():
            raise ProofError(4, f"{peer} sent back another nonce")
        return Credentials.parse(peer)
    finally:
        replies.forget(k2)
        replies.forget(k4)


def _responding(pattern: Text, count: Optional[int], timeout: float) -> Plan:
    me = str((yield ("whoami", None)))
    inbox = PrivateInbox(Credentials.parse(me), KIND)
    yield ("subscribe", None, inbox.pattern)
    yield ("subscribe", None, pattern)
    open_: "collections.OrderedDict[bytes, Tuple[str, float]]" = collections.OrderedDict()
    proved = 0
    while proved != count:
        try:
            message = yield ("receive", None)
        except BusClosedError:
            return
        if type(message) is not Message:
            continue
        now = time.monotonic()
        while open_ and next(iter(open_.values()))[1] < now:
            open_.popitem(last=False)
        token = inbox.suffix_of(message.key)
        if token is None:                               # 1. someone's credentials
            claimed = claim(message.payload)
            if claimed is None:
                continue
            token = new_id().encode()
            open_[token] = (claimed[0], now + timeout)
            if len(open_) > MAX_OPEN:
                open_.popitem(last=False)
            try:                                        # 2. ours, private to them
                yield ("publish", None, claimed[1], _join(me, inbox.key(token)))
            except MessageRefusedError:
                del open_[token]
            continue
        opened = open_.pop(token, None)                 # 3. their nonce, on our token
        if opened is None:
            continue
        nonce, sep, k4 = message.payload.partition(b"\0")
        if not sep or not k4.startswith(opened[0].encode() + b"/"):
            continue
        try:
            yield ("publish", None, k4, nonce)          # 4. the nonce back to them
        except MessageRefusedError:
            continue
        proved += 1
        yield (ITEM, Credentials.parse(opened[0]))


def serve_proofs(client: Any, pattern: Text, count: Optional[int] = None,
                 timeout: float = PROOF_TIMEOUT) -> Run:
    """B's side: answer the proofs asked on ``pattern``; iterate it (``for``,
    or ``async for`` on an asyncio client) for each peer's verified
    Credentials, until ``count`` were proved or the broker closes the
    connection. A proof left after step 2 is dropped after ``timeout`` s.
    Other messages the client receives meanwhile are skipped: give it a
    client of its own."""
    return Run(client, _responding(pattern, count, timeout))
