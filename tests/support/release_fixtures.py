"""The fixtures the release's test modules share (tests/conftest.py loads
this plugin): each module asks for the release and the dependency wheels on
its own, so the modules can run on parallel workers (support.release)."""
from __future__ import annotations

import pytest

from support.release import build, dependency_downloader


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    return build(tmp_path_factory)


@pytest.fixture(scope="module")
def dependency_wheels(tmp_path_factory):
    return dependency_downloader(tmp_path_factory)
