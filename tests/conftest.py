"""Shared fixtures: fixture plugins live in tests/fixtures/ (one file each).

`import ratchet` first: it pins torch's CPU numerics (ratchet/__init__.py), which must happen
before any test module imports torch."""

import ratchet  # noqa: F401

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.prefect", "tests.fixtures.ray"]
