"""Waiting in tests for what another process or thread does: poll a condition against a deadline."""

from __future__ import annotations

import time


def until(cond, timeout: float = 20.0, what: str = "condition"):
    """`cond()`'s first truthy value, polled every 50 ms; AssertionError naming `what` after `timeout` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
