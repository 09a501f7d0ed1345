"""What the tests share: a raw client, the sbusd wrapper, waiting, /proc."""
from .conn import SO_SNDBUFFORCE, STATS, WHOAMI, Conn, recv_or_none
from .procfs import (alive, cpu_seconds, fd_count, state, status_field, status_kib,
                     stop_process, wait_gone)
from .report import report_line
from .sbusd import BACKENDS, BIN, ROOT, SBUS, SBUSD, TESTS, Sbusd, read_to_eof
from .steady import SteadyPair
from .waiting import read_records, wait_for_record, wait_until
from .worker import start_worker, worker_report

__all__ = [
    "BACKENDS", "BIN", "ROOT", "SBUS", "SBUSD", "SO_SNDBUFFORCE", "STATS", "TESTS", "WHOAMI",
    "Conn", "Sbusd", "SteadyPair", "alive", "cpu_seconds", "fd_count", "read_records",
    "read_to_eof", "recv_or_none", "report_line", "start_worker", "state", "status_field",
    "status_kib", "stop_process", "wait_for_record", "wait_gone", "wait_until", "worker_report",
]
