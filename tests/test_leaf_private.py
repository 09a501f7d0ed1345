"""A leaf's clients reaching each other on their own leaf by the keys whoami
gives them (``<link's identity>/!/cred/g/u/p/...``), whatever the leaf sends
up (``--upstream-export``) and whichever link process it runs: the barrier
(``Client.sync``) and requests between two clients of one leaf
(docs/hierarchy.md, "Identities")."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from sbus import Client

from support.sbusd import Sbusd
from support.waiting import wait_until

_STARTED: list = []


@pytest.fixture(autouse=True)
def _stop_brokers():
    yield
    while _STARTED:
        _STARTED.pop().stop()


def broker(workdir, name, *args, upstream=None):
    extra = ["--upstream", upstream.address] if upstream is not None else []
    b = Sbusd.foreground(workdir, *extra, *args, address=str(workdir / name), log_level="info")
    _STARTED.append(b)
    if upstream is not None:
        b.wait_for_event("upstream_connected", timeout=10)
    return b


def up_msgs(leaf) -> int:
    return leaf.stats()["upstream"]["up_msgs"]


def test_sync_on_a_leaf_that_exports_only_some_keys(tmp_path):
    """The barrier's key is the client's own, which the leaf delivers itself:
    it needs neither an export pattern nor the link."""
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", "--upstream-export", "some/", upstream=up)
    with Client(leaf.address) as c:
        assert "/!/cred/" in c.whoami().text  # nested: the link is up
        c.sync(timeout=5)
        c.sync(timeout=5)
    assert up_msgs(leaf) == 0


def test_sync_after_the_link_was_started_again(tmp_path):
    """A new link process has a new identity upstream: a client's nested
    credentials from before name no one any more, its own local form still
    names it."""
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", upstream=up)
    with Client(leaf.address) as c:
        before = c.whoami().text
        c.sync(timeout=5)
        os.kill(int(before.split("/!/cred/")[0].rsplit("/", 1)[1]), signal.SIGTERM)
        leaf.wait_for_event("upstream_link_restarted", timeout=10)
        wait_until(lambda: len(leaf.events("upstream_connected")) == 2, timeout=10,
                   what="the new link up")
        assert c.whoami().text != before
        c.sync(timeout=5)


SERVE_ONCE = """
import sys
from sbus import Client
with Client(sys.argv[1]) as srv:
    srv.serve("rpc/echo", lambda r: r.payload[::-1], count=1)
"""


def test_a_request_between_two_clients_of_a_leaf_that_exports_only_some_keys(tmp_path):
    """The reply goes to the asker's nested inbox: the link takes it off the
    leaf without an export pattern matching it, hands it down in the local
    form, and sends none of it up."""
    up = broker(tmp_path, "up")
    leaf = broker(tmp_path, "leaf", "--upstream-export", "some/", upstream=up)
    srv = subprocess.Popen([sys.executable, "-c", SERVE_ONCE, leaf.address])
    try:
        wait_until(lambda: sum(c["subscriptions"] for c in leaf.stats()["clients"]
                               if c["pid"] == srv.pid) == 2, 10, "the server subscribed")
        with Client(leaf.address) as asker:
            assert asker.request("rpc/echo", b"abc", timeout=5) == b"cba"
        assert srv.wait(10) == 0
    finally:
        srv.kill()
        srv.wait()
    assert up_msgs(leaf) == 0
