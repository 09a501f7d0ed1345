"""The leaf link's C path (sbus._core.linkpath) against its Python reference
(SBUS_LINK_REFERENCE=1, a Python object per message): the same traffic both
ways, public and private keys mixed, through real brokers and a real link,
must reach the same subscribers as the same messages, exactly and in order.
The C path crosses the leaf's socketpair in frames both ways; the reference
in a packet per message."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from sbus import Client

from support.sbusd import Sbusd
from support.waiting import wait_until

N = 3000        # messages each way, in publish_many batches: boxes fill and spill
MAX_MESSAGE = 4096  # both brokers': BIG crosses as chunks, in the middle of each phase
BIG = 5 * MAX_MESSAGE


def big(phase: str) -> str:
    return phase + "big" + "x" * (BIG - 4)

# A subscriber of everything (public and its own private keys) in its own
# process, so that its credentials name no connection of the publishers'
# process: prints its whoami, then every (key, payload) it gets, in order,
# once every end marker (a payload) named in its second argument came.
COLLECTOR = """
import json, sys
from sbus import Client
c = Client(sys.argv[1])
c.send_cmsg("blocking/hard/block")
c.subscribe("")
c.subscribe("!/cred////")
print(str(c.whoami()), flush=True)
got, ends = [], set(json.loads(sys.argv[2]))
while ends:
    for m in c.receive_many(64, timeout=60):
        got.append([m.key.decode(), m.payload.decode()])
        ends.discard(m.payload.decode())
print(json.dumps(got), flush=True)
"""


def collector(address, ends):
    p = subprocess.Popen([sys.executable, "-c", COLLECTOR, address, json.dumps(ends)],
                         stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def link_identity(leaf) -> str:
    with Client(leaf.address) as c:
        return str(c.whoami()).rsplit("/!/cred/", 1)[0]


def traffic(tmp_path, monkeypatch, reference: bool) -> dict:
    """Phase d: a publisher upstream sends public keys, keys private to the
    collector on the leaf (nested under the link's identity), to the link
    itself and to the collector upstream. Phase u: a publisher on the leaf
    sends public keys, keys private to the collector upstream (they go up),
    to the collector on the leaf (they stay), and nested under the link's own
    identity (sent back down). What each collector got, by phase."""
    monkeypatch.setenv("SBUS_LINK_REFERENCE", "1" if reference else "0")
    work = tmp_path / ("reference" if reference else "c")
    work.mkdir()
    # Chunks are packets the link's C path hands to its Python (Inbox.chunks),
    # so each phase has a turn that stops in the middle and goes on after.
    limit = ("--max-message", str(MAX_MESSAGE))
    up = Sbusd.foreground(work, *limit, address=str(work / "up"), log_level="info")
    leaf = Sbusd.foreground(work, "--upstream", up.address, *limit, address=str(work / "leaf"),
                            log_level="info")
    procs = []
    try:
        leaf.wait_for_event("upstream_connected", timeout=10)
        link = link_identity(leaf)
        (down_p, down_who), (up_p, up_who) = (collector(leaf.address, ["d.end", "u.end", "u.back.end"]),
                                              collector(up.address, ["d.end", "u.end"]))
        procs = [down_p, up_p]
        local_form = down_who[len(link) + 1:]   # the leaf collector as the leaf names it
        wait_until(lambda: any(c["subscriptions"] >= 2 and not c["echo"]
                               for c in up.stats()["clients"]), timeout=10,
                   what="the leaf's subscriptions upstream")

        def mixed(phase, targets, *more):
            for i in range(N):
                yield targets[i % len(targets)].format(i=i), f"{phase}{i}".encode()
            yield f"t/end/{phase}", f"{phase}.end".encode()
            yield from more

        def publish(address, phase, messages):
            with Client(address, max_message=MAX_MESSAGE) as pub:
                pub.publish_many(itertools.islice(messages, N // 2))
                pub.publish(f"t/{phase}/big", big(phase))
                pub.publish_many(messages)
                pub.whoami()

        publish(up.address, "d", mixed("d", ["t/d/{i}", down_who + "/d{i}", "t/d/x/{i}",
                                             link + "/self{i}", up_who + "/d{i}", "t/d/{i}"]))
        publish(leaf.address, "u", mixed("u", ["t/u/{i}", up_who + "/u{i}", local_form + "/u{i}",
                                              link + "/" + local_form + "/n{i}", "t/u/y/{i}"],
                                         # behind the last message the link sends back down
                                         (link + "/" + local_form + "/nend", b"u.back.end")))
        out = {}
        for name, p in (("leaf", down_p), ("upstream", up_p)):
            got = json.loads(p.communicate(timeout=120)[0])
            out[name] = {phase: [m for m in got if m[1][:1] == phase] for phase in "du"}
        # The link's report (once a second) that counts both phases' traffic.
        state = wait_until(lambda: (s := leaf.stats()["upstream"]).get("up_msgs", 0) >= N // 2
                           and s.get("down_msgs", 0) >= N // 2 and s, timeout=10,
                           what="the link's report of the traffic")
        return out, {"link": link, "leaf": local_form, "upstream": up_who}, state
    finally:
        for p in procs:
            p.kill()
            p.wait()
        leaf.stop()
        up.stop()


@pytest.mark.timeout(600)
def test_the_c_path_delivers_what_the_reference_does(tmp_path, monkeypatch):
    ref, who, ref_state = traffic(tmp_path, monkeypatch, reference=True)
    c, who_c, c_state = traffic(tmp_path, monkeypatch, reference=False)
    # The C path has frames on the leaf's socketpair both ways (frames.pxd);
    # the reference never asks for them.
    assert (ref_state["frames_down"], ref_state["frames_up"]) == (0, 0)
    assert c_state["frames_down"] > 0 and c_state["frames_up"] > 0, c_state
    pid = {name: w.rsplit("/", 1)[1] for name, w in who.items()}
    pid_c = {name: w.rsplit("/", 1)[1] for name, w in who_c.items()}

    def same_names(got, pids):
        # The collectors' and the link's pids differ between the two runs: name them.
        text = json.dumps(got)
        for name, p in pids.items():
            text = text.replace(f"/{p}/", f"/<{name}>/")
        return json.loads(text)

    def routes(got):
        # On the leaf, phase u reaches the collector straight from the leaf's
        # broker, except the keys nested under the link's identity, which
        # the link sends back down: two routes, no order between them.
        u = got["leaf"]["u"]
        back = [m for m in u if m[0].rsplit("/", 1)[1].startswith("n")]
        return {**got, "leaf": {"d": got["leaf"]["d"], "u": [m for m in u if m not in back],
                                "u back": back}}

    assert routes(same_names(c, pid_c)) == routes(same_names(ref, pid))
    # ...and the reference is the traffic it should be: nothing lost, private keys
    # delivered as the rules say, each once and in order.
    leaf, upstream = ref["leaf"], ref["upstream"]
    down_private = [m for m in leaf["d"] if m[0].startswith("!")]
    assert [m[1] for m in down_private] == [f"d{i}" for i in range(N) if i % 6 == 1]
    assert all(m[0] == f"{who['leaf']}/d{m[1][1:]}" for m in down_private)    # stripped
    def public(phase, kept):
        return [f"{phase}{i}" for i in range(N // 2) if kept(i)] + [big(phase)] + \
            [f"{phase}{i}" for i in range(N // 2, N) if kept(i)] + [f"{phase}.end"]

    assert [m[1] for m in leaf["d"] if not m[0].startswith("!")] == public("d", lambda i: i % 6 in (0, 2, 5))
    up_private = [m for m in upstream["u"] if m[0].startswith("!")]
    assert [m[1] for m in up_private] == [f"u{i}" for i in range(N) if i % 5 == 1]
    assert [m[1] for m in upstream["u"] if not m[0].startswith("!")] == public("u", lambda i: i % 5 in (0, 4))
    # Private to the leaf's collector: straight to it, or nested under the
    # link's identity and sent back down by the link, in order each.
    kept = [m for m in leaf["u"] if m[0].startswith("!")]
    assert [m[1] for m in kept if not m[0].rsplit("/", 1)[1].startswith("n")] == \
        [f"u{i}" for i in range(N) if i % 5 == 2]
    assert [m for m in kept if m[0].rsplit("/", 1)[1].startswith("n")] == \
        [[f"{who['leaf']}/n{i}", f"u{i}"] for i in range(N) if i % 5 == 3] + \
        [[f"{who['leaf']}/nend", "u.back.end"]]
