"""What /proc says about a process (the broker under test, a server the bench measures) and the machine."""
from __future__ import annotations

import os
import signal
import subprocess

from .waiting import wait_until

CLK_TCK = os.sysconf("SC_CLK_TCK")


def fd_count(pid: int) -> int:
    """How many file descriptors a process holds."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def status_field(pid: int, field: str) -> str:
    """The first word of a /proc/PID/status line (``SigIgn`` as hex text)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return line.split(":", 1)[1].split()[0]
    raise KeyError(f"{field} not in /proc/{pid}/status")


def status_kib(pid: int, field: str) -> int:
    """A kB figure of /proc/PID/status (VmRSS, VmHWM)."""
    return int(status_field(pid, field))


def state(pid: int) -> str:
    """The one-letter state of /proc/PID/stat ('' once the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` (not necessarily our child) runs; a zombie has ended."""
    return state(pid) not in ("", "Z", "X")


def wait_gone(pid: int, timeout=5.0) -> bool:
    """True once ``pid`` has ended, False if it still runs after ``timeout``."""
    return wait_until(lambda: not alive(pid), timeout, interval=0.01, fail=False)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (every thread, exited ones too), in seconds (clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK     # fields 14 and 15


def thread_cpu_seconds(pid: int) -> float:
    """CPU time of the live threads of ``pid``, from schedstat in nanoseconds: finer
    than ``cpu_seconds``' clock ticks, for short intervals (a thread that has
    exited no longer counts)."""
    total = 0.0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0]) * 1e-9
        except (OSError, ValueError, IndexError):
            pass
    return total


def machine_busy_seconds() -> float:
    """CPU time spent by everything, on every core, since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / CLK_TCK


def stop_process(pid: int) -> None:
    """SIGSTOP pid and wait until it really is stopped (kill returns before)."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: state(pid) == "T", what=f"process {pid} to stop", interval=0.005)


def end_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
    """Send ``sig`` to a running ``proc`` and wait, SIGKILL after ``timeout``; its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
