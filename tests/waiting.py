"""Waiting in tests for what another process or thread does: poll a condition against a deadline.

    until(lambda: not lease.alive(pid, start), timeout=5, what="the run's process to be gone")
    run = until(lambda: finished(get(run_id)), timeout=400, every=2, what=lambda: f"the run, still {state()}")

`cond` may itself assert (a server that died while it was awaited fails at once, with its log);
`what` may be a callable, evaluated only on a timeout (e.g. a log tail at that moment).
"""

from __future__ import annotations

import time


def until(cond, timeout: float = 20.0, what="condition", every: float = 0.05):
    """`cond()`'s first truthy value, polled every `every` s; AssertionError naming `what` (a string, or
    a callable giving one) after `timeout` s."""
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        time.sleep(every)
