"""What the tests (and bench/harness.py) share: a raw client, the wrappers of sbusd, the
store and the queue service (on one LoggedProcess, as is the bridge's in ``nats``), a free
TCP port, waiting, /proc, a second user, what a factory fixture started (``Started``).

Submodules not imported here: ``analytics_log`` (the analytics tests' hand-made log),
``budget`` (time and example budgets), ``garbage`` (fuzz atoms), ``systemd`` (the unit files).
"""
from .conn import SO_SNDBUFFORCE, STATS, WHOAMI, Conn, recv_or_none
from .logged import LoggedProcess
from .nats import free_port
from .procfs import alive, cpu_seconds, fd_count, state, status_field, status_kib, stop_process, wait_gone
from .queuesvc import QueueService
from .report import report_line
from .sbusd import BACKENDS, BIN, ROOT, SBUS, SBUSD, TESTS, Sbusd, read_to_eof
from .seconduser import NOBODY, OTHER_GID, Child, asroot, make_public_dir, run_as, spawn_children
from .started import Started
from .steady import SteadyPair
from .store import StoreProcess
from .waiting import read_records, readable, wait_for_record, wait_until
from .worker import start_worker, worker_report

__all__ = [
    "BACKENDS", "BIN", "NOBODY", "OTHER_GID", "ROOT", "SBUS", "SBUSD", "SO_SNDBUFFORCE", "STATS", "TESTS", "WHOAMI",
    "Child", "Conn", "LoggedProcess", "QueueService", "Sbusd", "Started", "SteadyPair", "StoreProcess", "alive",
    "asroot", "cpu_seconds", "fd_count", "free_port", "make_public_dir", "read_records", "readable",
    "read_to_eof", "recv_or_none", "report_line", "run_as", "spawn_children", "start_worker", "state", "status_field",
    "status_kib", "stop_process", "wait_for_record", "wait_gone", "wait_until", "worker_report",
]
