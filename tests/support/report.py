"""Figures for the person running the tests."""
import os

# Lines an xdist worker has written and not yet sent: a worker's terminal is
# nobody's, so tests/conftest.py sends them with the next test report and the
# controller writes them.
PENDING: list = []


def report_line(request, text: str) -> None:
    """Write figures to the terminal even under -q and output capture."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        PENDING.append(text)
        return
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if tr is None:
        return
    if capman is not None:
        with capman.global_and_fixture_disabled():
            tr.write_line(text)
    else:
        tr.write_line(text)
