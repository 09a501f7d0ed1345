#!/usr/bin/env python3
"""Host to host through NATS: two sbusd brokers, one nats-server, two `sbus bridge`.

    bench/bench_bridge.py [--count N] [--payload BYTES] [--rate R] [--repeat N]
                          [--paths fast,reference] [--json PATH]

Rows, all with --payload-byte messages (default 64) and loss checked:

- ``bridge_rate``: msgs/s from host A's publisher (publish_many) to a
  subscriber on host B, first message to last at B; beside it the CPU time
  per message of each bridge, nats-server and both brokers over that window,
  and of the publisher and the subscriber (their own rusage, from connected
  to done: imports and start-up are not counted), each with the part spent
  in the kernel (``sys_us_per_msg``);
- ``bridge_latency``: p50/p99 from A's publish to B's receive at a fixed
  --rate msgs/s (CLOCK_MONOTONIC stamps; every process is on this machine);
- ``nats_rate``: plain nats-py publisher -> nats-py subscriber over the same
  nats-server, in the same run, for scale, with the CPU time per message of
  nats-server, the publisher and the subscriber, counted as above;
- ``kernel_floor``: the kernel's CPU per packet of sendmmsg and recvmmsg on
  an AF_UNIX SOCK_SEQPACKET pair, packets the size of the row's MSG packets,
  full batches (bench/dgram_floor.c): what each of the four sbus hops of a
  bridged message costs at least, however little its processes do;
- ``nats_frames``: nats-server's CPU per message for the bridge's frames
  (``HPUB`` with the ``Sbus-Key`` header) against plain ``PUB`` of the same
  subject and payload, one raw-socket publisher to one raw-socket
  subscriber, alternated: what the header costs the server.

``--paths`` (default ``fast,reference``) measures the bridges' C fast path
and ``--no-fast-path`` interleaved in one run: each repeat starts the pair of
bridges of each path in turn; rows of the reference path end ``_reference``.
The path ``packets`` is the fast path with ``--no-frames`` (a packet per
message on the local hops, docs/bridge.md "Speed"); its rows end ``_packets``.

Every publisher and subscriber is its own process (``--worker``). Prints a
table on stdout, progress on stderr, and writes JSON (default
bench/results/bridge-<UTC>.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import BIN as PROGRAMS
from harness import NatsServer, Sbusd, Series, alternate, end_process, results_path, say

BIN = Path(sys.executable).parent
KEY = b"bench/key"
PLAIN_SUBJECT = "plain.bench"      # outside the bridges' prefix: plain NATS only


# -- workers (each in its own process) ------------------------------------------

def cpu_now():
    """(user + system, system) CPU seconds of this process (its own rusage:
    load disturbs it least)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_stime


def cpu_since(start):
    """What a worker reports: its CPU seconds since ``start`` (a cpu_now())."""
    now = cpu_now()
    return {"client_cpu_s": now[0] - start[0], "client_sys_s": now[1] - start[1]}


def proc_cpu(pid):
    """(user + system, system) CPU seconds of a process from /proc (every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, int(fields[12]) / tick


def sbus_sub(address, count, timeout, stamps):
    """Receive up to ``count`` messages on KEY; report count, span and, with
    ``stamps``, latencies. Without, it counts each batch whole, as the nats-py
    subscriber counts its messages: the rate row compares transports, not the
    subscribers' own work on each payload."""
    import sbus
    bus = sbus.Client(address)
    bus.subscribe(KEY)
    bus.whoami(timeout=10)
    print("ready", flush=True)
    cpu = cpu_now()
    got, first, last, lat = 0, None, None, []
    deadline = time.monotonic() + timeout
    while got < count:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            batch = bus.receive_many(1024, timeout=min(left, 1.0))
        except TimeoutError:
            if got:     # quiet for a second after traffic: the rest is lost
                break
            continue
        now = time.monotonic_ns()
        if not stamps:
            got += len(batch)       # the subscription is KEY alone
        for m in batch if stamps else ():
            if m.key != KEY:
                continue
            got += 1
            lat.append(now - int(m.payload[:20]))
        first = first or now
        last = now
    return {"received": got, "seconds": (last - first) / 1e9 if got > 1 else None,
            "latency_ns": lat, **cpu_since(cpu)}


def sbus_pub(address, count, payload, rate):
    import sbus
    bus = sbus.Client(address)
    cpu = cpu_now()
    pad = b"x" * max(0, payload - 20)
    if rate:
        start = time.monotonic()
        for i in range(count):
            ahead = start + i / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
            bus.publish(KEY, b"%020d" % time.monotonic_ns() + pad)
    else:
        batch = 1000
        for i in range(0, count, batch):
            stamp = b"%020d" % time.monotonic_ns() + pad
            bus.publish_many([(KEY, stamp)] * min(batch, count - i))
    bus.whoami(timeout=30)
    return {"sent": count, **cpu_since(cpu)}


async def _nats_sub(url, count, timeout):
    import nats
    nc = await nats.connect(url)
    state = {"got": 0, "first": None, "last": None}
    done = asyncio.Event()

    async def on_msg(msg):
        state["last"] = time.monotonic_ns()
        state["first"] = state["first"] or state["last"]
        state["got"] += 1
        if state["got"] >= count:
            done.set()

    await nc.subscribe(PLAIN_SUBJECT, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
    await nc.flush()
    print("ready", flush=True)
    cpu = cpu_now()
    seen = -1
    while not done.is_set() and seen != state["got"]:     # until done or quiet for a while
        seen = state["got"]
        try:
            await asyncio.wait_for(done.wait(), timeout if not seen else 2.0)
        except asyncio.TimeoutError:
            pass
    await nc.close()
    got, first, last = state["got"], state["first"], state["last"]
    return {"received": got, "seconds": (last - first) / 1e9 if got > 1 else None,
            **cpu_since(cpu)}


async def _nats_pub(url, count, payload):
    import nats
    nc = await nats.connect(url, pending_size=8 << 20)
    cpu = cpu_now()
    data = b"x" * payload
    for _ in range(count):
        await nc.publish(PLAIN_SUBJECT, data)
    await nc.flush(timeout=60)
    await nc.close()
    return {"sent": count, **cpu_since(cpu)}


def worker(args):
    if args.worker == "sbus_sub":
        out = sbus_sub(args.address, args.count, args.seconds, args.rate > 0)
    elif args.worker == "sbus_pub":
        out = sbus_pub(args.address, args.count, args.payload, args.rate)
    elif args.worker == "nats_sub":
        out = asyncio.run(_nats_sub(args.address, args.count, args.seconds))
    else:
        out = asyncio.run(_nats_pub(args.address, args.count, args.payload))
    print(json.dumps(out), flush=True)


# -- the run --------------------------------------------------------------------

class Processes:
    def __init__(self):
        self.procs = []

    def start(self, argv, **kw):
        p = subprocess.Popen(argv, **kw)
        self.procs.append(p)
        return p

    def stop(self, p):
        end_process(p)

    def stop_all(self):
        for p in reversed(self.procs):
            self.stop(p)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_bridge: timed out waiting for {what}")
        time.sleep(0.05)


def logged(path, event):
    try:
        return any(json.loads(line).get("event") == event
                   for line in Path(path).read_text().splitlines() if line.strip())
    except (FileNotFoundError, ValueError):
        return False


def pair(sub_argv, pub_argv, procs, timeout, watch=None):
    """Start the subscriber, wait for it, run the publisher; the subscriber's
    report, with ``cpu_s`` and ``sys_s``: CPU seconds (all, and in the kernel)
    each process of ``watch`` (name -> Popen) used meanwhile, and the
    publisher's and subscriber's own (their rusage)."""
    watch = watch or {}
    sub = procs.start(sub_argv, stdout=subprocess.PIPE)
    assert sub.stdout.readline().strip() == b"ready"
    before = {name: proc_cpu(p.pid) for name, p in watch.items()}
    pub = subprocess.run(pub_argv, check=True, stdout=subprocess.PIPE, timeout=timeout)
    out, _ = sub.communicate(timeout=timeout)
    report = json.loads(out.splitlines()[-1])
    after = {name: proc_cpu(p.pid) for name, p in watch.items()}
    published = json.loads(pub.stdout.splitlines()[-1])
    for i, field in enumerate(("cpu_s", "sys_s")):
        report[field] = {name: after[name][i] - before[name][i] for name in watch}
    report["cpu_s"]["publisher"] = published["client_cpu_s"]
    report["sys_s"]["publisher"] = published["client_sys_s"]
    report["cpu_s"]["subscriber"] = report["client_cpu_s"]
    report["sys_s"]["subscriber"] = report["client_sys_s"]
    return report


def per_message(r, field="cpu_s"):
    """CPU µs per message received, each process (``sys_s``: in the kernel)."""
    return {name: round(sec * 1e6 / max(r["received"], 1), 2) for name, sec in r[field].items()}


def rate_row(r, sent):
    return {"received": r["received"], "sent": sent,
            "rate": r["received"] / r["seconds"] if r["seconds"] else 0,
            "cpu_us_per_msg": per_message(r), "sys_us_per_msg": per_message(r, "sys_s")}


def kernel_floor(payload):
    """bench/dgram_floor.c's figures for packets of the row's MSG size (compiled
    into bench/bin/ when the source is newer)."""
    src, exe = Path(__file__).resolve().parent / "dgram_floor.c", PROGRAMS / "dgram_floor"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        PROGRAMS.mkdir(exist_ok=True)
        subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(src)], check=True)
    size = len(b"MSG ") + len(KEY) + 1 + payload
    out = subprocess.run([str(exe), "1000000", str(size)], check=True, stdout=subprocess.PIPE,
                         timeout=120).stdout
    return json.loads(out)


def nats_frames(port, server_pid, payload, count):
    """nats-server's CPU µs per message ({"pub": .., "hpub": ..}) for ``count``
    messages written as plain PUB frames, then as the bridge's HPUB frames,
    by a raw socket, to a raw-socket subscriber that reads them all."""
    import socket
    import threading
    # The bridges' subject's length, outside bridge B's --import: no bridge
    # takes these messages, the raw subscriber is the only one.
    subject, data = b"sbux.bench.key", b"x" * payload
    header = b"NATS/1.0\r\nSbus-Key: " + KEY + b"\r\n\r\n"
    frames = {
        "pub": (b"PUB %s %d\r\n%s\r\n" % (subject, len(data), data),
                b"MSG %s 1 %d\r\n%s\r\n" % (subject, len(data), data)),
        "hpub": (b"HPUB %s %d %d\r\n%s%s\r\n" % (subject, len(header), len(header) + len(data),
                                                  header, data),
                 b"HMSG %s 1 %d %d\r\n%s%s\r\n" % (subject, len(header),
                                                    len(header) + len(data), header, data))}

    def connect(then=b""):
        s = socket.create_connection(("127.0.0.1", port))
        s.recv(4096)    # INFO
        s.sendall(b'CONNECT {"verbose":false,"headers":true,"protocol":1}\r\n' + then + b"PING\r\n")
        got = b""
        while b"PONG\r\n" not in got:
            got += s.recv(4096)
        return s

    out = {}
    for kind, (frame, delivered) in frames.items():
        sub = connect(b"SUB %s 1\r\n" % subject)
        want, got = len(delivered) * count, [0]

        def read():
            while got[0] < want:
                chunk = sub.recv(1 << 20)
                if not chunk:
                    return
                got[0] += len(chunk)
        reader = threading.Thread(target=read)
        reader.start()
        pub = connect()
        blocks, rest = divmod(count, 1000)
        block = frame * 1000
        before = proc_cpu(server_pid)[0]
        for _ in range(blocks):
            pub.sendall(block)
        pub.sendall(frame * rest)
        reader.join(120)
        out[kind] = round((proc_cpu(server_pid)[0] - before) * 1e6 / count, 3)
        pub.close()
        sub.close()
        if got[0] != want:
            raise SystemExit(f"bench_bridge: nats_frames: {kind}: {got[0]} of {want} bytes")
    return out


def start_bridges(procs, work, hosts, url, path):
    """Bridge a exports bench/, bridge b imports it; once both are connected,
    {"bridge_a": Popen, "bridge_b": Popen}."""
    started, logs = {}, {}
    # a's broker blocks the publisher rather than discard when bridge a falls
    # behind (--local-flood block): the rate row is lossless by design.
    for name, side in (("a", ["--export", "bench/", "--local-flood", "block"]),
                       ("b", ["--import", "sbus.bench.>"])):
        logs[name] = work / f"bridge-{name}-{path}-{len(procs.procs)}.log"
        extra = {"reference": ["--no-fast-path"], "packets": ["--no-frames"]}.get(path, [])
        started["bridge_" + name] = procs.start(
            [str(BIN / "sbus"), "-a", hosts[name], "bridge", "--nats", url, *side, *extra,
             "--max-pending", str(256 << 20), "--stats-interval", "60",
             "--log-format", "json", "--log-file", str(logs[name])],
            stdout=subprocess.DEVNULL)
    for name in logs:
        wait_for(lambda: logged(logs[name], "bridge_connected"), 30, f"bridge {name}")
    return started


def run(args):
    me = [sys.executable, str(Path(__file__).resolve())]
    work = Path(tempfile.mkdtemp(prefix="sbus-bench-bridge-"))
    procs = Processes()
    servers = []            # nats-server and the two brokers, stopped last
    results = {}
    try:
        nats = NatsServer(work)
        servers.append(nats)
        url = nats.url
        nats_server = nats.proc
        hosts, brokers = {}, {}
        for name in ("a", "b"):
            address = str(work / f"{name}.socket")
            sbusd = Sbusd(work, ["-f", "-a", address, "--log-level", "off"], address=address,
                          log_level=None).ready(timeout=10)
            servers.append(sbusd)
            hosts[name] = address
            brokers["sbusd_" + name] = sbusd.proc
        paths = args.paths.split(",")
        bridges, running = {}, [None]      # the bridges and the path they take
        common = ["--payload", str(args.payload)]
        rows = {("bridge_rate" + ("" if path == "fast" else "_" + path)): path for path in paths}
        rows["nats_rate"] = None
        rows["nats_frames"] = None
        started = dict.fromkeys(rows, 0)

        def run_one(label):
            started[label] += 1
            say(f"repeat {started[label]}/{args.repeat}: {label}")
            if label == "nats_frames":
                # 1,000,000 at least: its CPU is read in clock ticks (10 ms)
                return nats_frames(nats.port, nats_server.pid, args.payload,
                                   max(args.count, 1_000_000))
            if label == "nats_rate":
                r = pair(me + ["--worker", "nats_sub", "--address", url, "--count", str(args.count),
                               "--seconds", "120"],
                         me + ["--worker", "nats_pub", "--address", url, "--count", str(args.count),
                               *common], procs, 300, watch={"nats_server": nats_server})
                return rate_row(r, args.count)
            path = rows[label]
            if running[0] != path:
                for p in bridges.values():
                    procs.stop(p)
                bridges.clear()
                bridges.update(start_bridges(procs, work, hosts, url, path))
                running[0] = path
            r = pair(me + ["--worker", "sbus_sub", "--address", hosts["b"], "--count",
                           str(args.count), "--seconds", "120", "--rate", "0"],
                     me + ["--worker", "sbus_pub", "--address", hosts["a"], "--count",
                           str(args.count), "--rate", "0", *common], procs, 300,
                     watch={**bridges, "nats_server": nats_server, **brokers})
            return rate_row(r, args.count)

        results.update({label: s.runs for label, s in alternate(rows, args.repeat, run_one).items()
                        if s.runs})
        for path in paths:
            suffix = "" if path == "fast" else "_" + path
            if len(paths) > 1:
                for p in bridges.values():
                    procs.stop(p)
                bridges = start_bridges(procs, work, hosts, url, path)
            say(f"bridge_latency{suffix}")
            n = int(args.rate * args.latency_seconds)
            r = pair(me + ["--worker", "sbus_sub", "--address", hosts["b"], "--count", str(n),
                           "--seconds", str(args.latency_seconds + 30), "--rate", str(args.rate)],
                     me + ["--worker", "sbus_pub", "--address", hosts["a"], "--count", str(n),
                           "--rate", str(args.rate), *common], procs, 300)
            lat = sorted(r["latency_ns"])
            results["bridge_latency" + suffix] = [{
                "received": r["received"], "sent": n, "rate": args.rate,
                "p50_us": lat[len(lat) // 2] / 1000 if lat else None,
                "p99_us": lat[int(len(lat) * 0.99)] / 1000 if lat else None}]
    finally:
        procs.stop_all()
        for server in reversed(servers):
            server.stop()
    say("kernel_floor")
    results["kernel_floor"] = [kernel_floor(args.payload)]
    return results


def cpu_lines(rows):
    """CPU µs per message of each process (medians), then its part in the kernel."""
    out = []
    for field, title in (("cpu_us_per_msg", "CPU us/msg  "), ("sys_us_per_msg", "  in kernel ")):
        cpu = Series(rows).medians(field)
        out.append(f"    {title}" + "  ".join(f"{k} {v:.2f}" for k, v in cpu.items())
                   + f"   all {sum(cpu.values()):.2f}")
    return out


def table(results, payload, load):
    med = lambda rows, f: Series(rows).median(f)     # noqa: E731
    nr = results["nats_rate"]
    lost_n = sum(r["sent"] - r["received"] for r in nr)
    lines = [f"{payload}-byte messages; load average {load}",
             f"plain nats-py         {med(nr, 'rate'):>10,.0f} msg/s   lost {lost_n}",
             *cpu_lines(nr)]
    for suffix in ("", "_packets", "_reference"):
        br = results.get("bridge_rate" + suffix)
        if not br:
            continue
        name = "bridge A->B" + {"": "", "_packets": " (packets)", "_reference": " (ref)"}[suffix]
        lost_b = sum(r["sent"] - r["received"] for r in br)
        ratio = med(br, "rate") / med(nr, "rate") if med(nr, "rate") else 0
        lat = results["bridge_latency" + suffix][0]
        lines += [
            f"{name:<21} {med(br, 'rate'):>10,.0f} msg/s   lost {lost_b}   ratio {ratio:.2f}",
            *cpu_lines(br),
            f"    latency @{lat['rate']:,}/s  p50 {lat['p50_us']:.0f} us"
            f"  p99 {lat['p99_us']:.0f} us   lost {lat['sent'] - lat['received']}"]
    frames = Series(results["nats_frames"]).median
    lines.append(f"nats-server CPU us/msg, raw frames: PUB {frames('pub'):.2f}"
                 f"  HPUB with Sbus-Key {frames('hpub'):.2f}")
    floor = results["kernel_floor"][0]
    hop = floor["send_us"] + floor["recv_us"]
    lines.append(f"kernel floor, one {floor['size']}-byte sbus packet: send {floor['send_us']:.2f}"
                 f" + receive {floor['recv_us']:.2f} us; the bridged message crosses 4 sbus hops,"
                 f" a packet each on the publisher's and the subscriber's: {2 * hop:.2f} us"
                 f" ({4 * hop:.2f} us with --no-frames)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=200_000)
    ap.add_argument("--payload", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--paths", default="fast,reference",
                    help="bridge paths to measure, interleaved: fast, packets (fast with --no-frames), reference")
    ap.add_argument("--latency-seconds", type=float, default=5.0)
    ap.add_argument("--json", help="where to write the figures")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=60, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    results = run(args)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(table(results, args.payload, load))
    for rows in results.values():
        for r in rows:
            r.pop("latency_ns", None)
    path = Path(args.json) if args.json else results_path("bridge")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"payload": args.payload, "load": load, "rows": results},
                               indent=2))
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
