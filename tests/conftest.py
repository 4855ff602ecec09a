"""Shared fixtures: fixture plugins live in tests/fixtures/ (one file each)."""

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.ray"]
