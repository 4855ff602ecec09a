"""Flow tests use the session's Prefect harness: `def test_x(prefect_harness): ...`
(tests/fixtures/prefect.py, a plugin of tests/conftest.py)."""
