"""Every test starts from the environment the session started with.

Lightning writes `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK`, ... into `os.environ` when a test
trains in process under a distributed strategy. Left there, they leak into later tests: a
subprocess inherits a port the test process may still hold (EADDRINUSE), and a "[rank: 0]"
prefix appears on a one-line error a test compares. Which test sees the leak depends on the
order tests run in (with pytest-xdist, on which worker), so each test's changes are undone.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _environment_restored():
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
