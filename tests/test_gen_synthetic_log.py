"""tools/gen_synthetic_log.py routes like the broker: replaying its log
through the plain-Python reference matcher (sbus._ref.protocol, written from
the spec) gives every sampled message the fan-out the log states."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from sbus import logschema as ls
from sbus._ref.protocol import cred_form, matches
from sbus.sbusd.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import gen_synthetic_log  # noqa: E402


def reaches(key: bytes, cred: dict) -> bool:
    """A !/cred/G/U/P/ key reaches only the credentials it names (empty: any)."""
    form = cred_form(key)
    if form is None:
        return True
    return all(want is None or want == cred[name]
               for want, name in zip(form[:3], ("gid", "uid", "pid")))


def test_every_message_fanout_agrees_with_the_reference_matcher(tmp_path):
    path = tmp_path / "synthetic.log"
    gen_synthetic_log.generate(path, 30_000, seed=5, rate=2000.0, clients=24)
    creds: dict = {}
    patterns: dict = {}         # client -> patterns held, duplicates included
    seen = Counter()
    for line in path.read_text().splitlines():
        r = json.loads(line)
        event = r["event"]
        assert r["schema"] == ls.SCHEMA_VERSION
        if event == ls.BROKER_START:       # the settings a real broker logs
            assert set(r["config"]) == set(Config().summary())
            seen["broker_start"] += 1
        elif event == ls.CLIENT_CONNECT:
            creds[r["client"]] = {k: r[k] for k in ("gid", "uid", "pid")}
            patterns[r["client"]] = []
        elif event == ls.SUBSCRIBE and r["accepted"]:
            patterns[r["client"]].append(r["pattern"].encode())
        elif event == ls.UNSUBSCRIBE and r["accepted"]:
            patterns[r["client"]].remove(r["pattern"].encode())
        elif event == ls.CLIENT_DISCONNECT:
            patterns.pop(r["client"], None)
        elif event == ls.MESSAGE:
            key = r["key"].encode()
            held = {c: [p for p in ps if matches(p, key)] for c, ps in patterns.items()}
            expected = sum(1 for c, hits in held.items() if hits and reaches(key, creds[c]))
            assert r["fanout"] == expected, r
            seen["messages"] += 1
            seen["delivered"] += expected > 0
            # A client whose several patterns match is still one recipient.
            seen["overlapping"] += any(len(hits) > 1 for hits in held.values())
            seen["cred_keys"] += cred_form(key) is not None
    # Lower bounds: enough of each case to exercise the property; the exact
    # figures are the generator's choice, not what this test checks.
    assert seen["messages"] > 10_000 and seen["broker_start"] == 1
    assert seen["delivered"] > 1_000 and seen["overlapping"] > 100 and seen["cred_keys"] > 0
