#!/usr/bin/env python3
"""The access policy's fixed costs (docs/policy.md): reading a policy file,
compiling it for one client, and the size of that client's table.

    bench/bench_policy.py [--rules 10000] [--repeat 5]

A generated policy of ``--rules`` rules in the forms a big site writes (a
namespace per uid, group rules that disconnect, everyone rules with
wildcards), read with ``sbus.access.load``. Goals (issue 36): 10,000 rules
load in under 1 s; a client's compiled table is at most 1 KiB. Prints one
line per figure (the median of ``--repeat`` runs); asserts nothing.
The per-message cost is the broker core's, measured by ``make bench`` once
the core enforces policies.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sbus.access import load, parse  # noqa: E402


def policy_text(n: int) -> str:
    """``n`` rules: 1 in 100 names everyone, 3 in 10 a group, the rest a uid."""
    out = ['default = "deny"', 'on_deny = "drop"', ""]
    for i in range(n):
        kind = i % 100
        if kind == 0:       # everyone: read pub/, never write power/
            out += ["[[rule]]", 'deny = "publish"', f'pattern = "power/{i}/*"',
                    'on_deny = "disconnect"'] if i % 200 else \
                ["[[rule]]", 'allow = "subscribe"', f'pattern = "pub/{i}/"']
        elif kind < 30:     # groups kept off locked keys
            out += ["[[rule]]", f"gid = {2000 + i % 300}", 'deny = "publish"',
                    f'pattern = "team/{i}/locked/"', 'on_deny = "disconnect"']
        else:               # a namespace per uid
            out += ["[[rule]]", f"uid = {1000 + i}", 'allow = ["publish", "subscribe"]',
                    f'pattern = ["home/u{i}/", "svc/{i % 50}/*/state"]']
        out.append("")
    return "\n".join(out)


def timed(fn, repeat: int):
    """The median CPU time of ``repeat`` calls (CPU, not wall-clock: a busy
    machine's other processes do not count), and the last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.process_time()
        result = fn()
        times.append(time.process_time() - start)
    return statistics.median(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "policy.toml")
        with open(path, "w") as f:
            f.write(policy_text(args.rules))
        size = os.path.getsize(path)
        load_s, policy = timed(lambda: load(path), args.repeat)
    print(f"load: {len(policy.rules)} rules ({size / 1024:.0f} KiB) in {load_s * 1000:.0f} ms "
          f"of CPU (goal: under 1000 ms for 10,000)")
    # A fresh policy object per run: compile_for keeps what it compiled.
    uid = 1000 + 450       # a uid with a rule of its own (kind 50)
    compile_s, access = timed(lambda: load_copy(policy).compile_for(uid, 2001, (2007,), "u"),
                              args.repeat)
    print(f"compile_for one client: {compile_s * 1e6:.0f} us, {len(access.entries)} entries "
          f"(its uid's, two groups', everyone's), publish table {access.nbytes} bytes "
          f"(one per identity, shared by its connections; goal: at most 1024)")
    small = parse(policy_text(100)).compile_for(1000 + 50, 2001, (2007,), "u")
    print(f"the same with 100 rules: {len(small.entries)} entries, publish table "
          f"{small.nbytes} bytes")
    key = b"home/u450/x"
    per = timed(lambda: [access.may_publish(key) for _ in range(1000)], 3)[0] / 1000
    print(f"may_publish in Python: {per * 1e6:.1f} us (reference only: the core "
          "decides publishes in C from to_bytes())")
    for pattern in (b"home/u450/", b"", b"pub/200/"):
        sub_s, decision = timed(lambda: access.may_subscribe(pattern), 3)
        print(f"may_subscribe({pattern.decode()!r}): {sub_s * 1000:.2f} ms, "
              f"{'allowed' if decision.allowed else 'refused'}")
    return 0


def load_copy(policy):
    """The same rules without the compiled tables of earlier runs."""
    from sbus.access.model import Policy
    return Policy(policy.path, policy.default_allow, policy.default_action, policy.rules,
                  policy.warnings)


if __name__ == "__main__":
    sys.exit(main())
