"""Fixtures for flow tests: one Prefect test harness (temporary database) for the session.

Use it explicitly: `def test_x(prefect_harness): ...` (not autouse, so tests that need no
Prefect API start no server)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):  # a busy 2-core CI machine
        yield
