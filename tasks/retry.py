"""The retry rule of every task: retry transient failures only (`ratchet.errors.is_transient`).

    @task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only)
"""

from __future__ import annotations

from ratchet.errors import is_transient


def transient_only(task, task_run, state) -> bool:
    """Prefect's retry_condition_fn: a failed attempt is retried only when its exception may clear."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return is_transient(exc)
