"""The sans-I/O connection state (sbus/client/connection.py), driven by hand
with no broker: its plans yield actions and take results, and reply routing
happens in its triage for both drivers. Also the services' contract with a
client (sbus/client/services.py)."""
from __future__ import annotations

import ast
import asyncio
import socket
from pathlib import Path

import pytest

import sbus
import sbus.aio
from sbus.client import connection as c
from sbus.client.connection import Connection
from sbus.client.protocol import MAX_MESSAGE, ControlMessage, Message
from sbus.client.services import AsyncBusClient, BusClient

CLIENT = Path(sbus.__file__).parent / "client"


def parsed(conn: Connection, *packets: bytes):
    """``packets`` as the connection's own parser reads them from a socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        for p in packets:
            theirs.send(p)
        return conn.parser.receive(ours.fileno(), 64, 0, 1.0)


def test_a_query_plan_sends_then_waits_and_returns_the_routed_reply():
    conn = Connection("/run/none", MAX_MESSAGE, False, None)
    conn.up = conn.live = True
    plan = conn.query("stats", None, 0, 1.0)
    actions = [next(plan)]
    while actions[-1][0] != c.WAIT:
        actions.append(plan.send(None))
    assert [a[0] for a in actions] == [c.LOCK, c.SEND_ONE, c.UNLOCK, c.WAIT]
    assert actions[1][1] == b"CMSG stats"
    waiter = actions[-1][1]
    assert conn.triage(parsed(conn, b"MSG a\0x", b"CMSG stats\0{}", b"CMSG other")) is None
    assert waiter.done()
    with pytest.raises(StopIteration) as stop:
        plan.send(None)
    assert stop.value.value == b"{}"
    assert list(conn.inbox) == [Message(b"a", b"x"), ControlMessage(b"other", b"")]


def test_the_reply_to_an_abandoned_query_is_dropped_and_the_next_one_answered():
    conn = Connection("/run/none", MAX_MESSAGE, False, None)
    conn.up = conn.live = True
    first = conn.query("k", None, 0, None)
    while next(first)[0] != c.WAIT:
        pass
    with pytest.raises(TimeoutError):
        first.throw(TimeoutError())     # what a driver throws when the deadline passes
    second = conn.query("k", None, 0, None)
    action = next(second)
    while action[0] != c.WAIT:
        action = second.send(None)
    conn.triage(parsed(conn, b"CMSG k\0late", b"CMSG k\0mine"))
    with pytest.raises(StopIteration) as stop:
        second.send(None)
    assert stop.value.value == b"mine" and not conn.inbox


def test_a_lost_broker_keeps_the_packets_for_the_next_and_replays_the_session():
    conn = Connection("/run/none", MAX_MESSAGE, False, True)
    conn.up = conn.live = True
    conn.admit(b"SUB news/")
    plan = conn.send_now(b"MSG news/a\0x", 0)
    assert next(plan) == (c.LOCK,)
    assert plan.send(None)[0] == c.SEND_ONE
    assert plan.throw(BrokenPipeError(32, "gone"))[0] == c.LOST
    conn.lose(BrokenPipeError())    # what the driver does for LOST
    assert plan.send(None) == (c.RECONNECT, False, None)
    assert plan.send(False) == (c.UNLOCK,)
    assert conn.backlog.nbytes == len(b"MSG news/a\0x")
    again = conn.reconnecting(False)
    assert next(again) == (c.CONNECT,)
    conn.up = True
    send = again.send(None)
    assert send[0] == c.SEND and list(send[1].unsent()) == [b"SUB news/", b"CMSG !/cred/whoami"]


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_both_clients_keep_the_services_contract(kind):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with theirs:
        if kind == "sync":
            with sbus.Client(f"/dev/fd/{ours.detach()}") as bus:
                assert isinstance(bus, BusClient)
        else:
            async def make():
                async with sbus.aio.Client(f"/dev/fd/{ours.detach()}") as bus:
                    return isinstance(bus, AsyncBusClient)
            assert asyncio.run(make())


@pytest.mark.parametrize("module", ["consume.py", "requests.py", "store.py", "private.py"])
def test_the_services_use_only_public_methods_of_a_client(module):
    tree = ast.parse((CLIENT / module).read_text())
    private = [f"{node.value.id}.{node.attr}" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
               and node.value.id in ("client", "bus", "own") and node.attr.startswith("_")]
    assert private == []
