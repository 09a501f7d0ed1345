"""Figures for the person running the tests."""


def report_line(request, text: str) -> None:
    """Write figures to the terminal even under -q and output capture."""
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if tr is None:
        return
    if capman is not None:
        with capman.global_and_fixture_disabled():
            tr.write_line(text)
    else:
        tr.write_line(text)
