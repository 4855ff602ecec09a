"""Where sandbox runs execute: in this process ("local") or fanned out over a Ray cluster ("ray").

    executor = executor_for(cfg.verify)              # VerifyConfig.executor: "local" | "ray"
    results = verify_many(items, limits, concurrency, retries, executor=executor)
    executor.stats   # {"sandbox_launched", "sandbox_reaped", "sandbox_orphaned", "sandbox_nodes"}

The switch is this one function, and the one place that uses it is the verifier's run loop
(`ratchet.verify.verifier._run_with_retries`), so waves (`stages.verify_frame`), the held-out
evaluation and the environment audit fan out alike. With "ray", a call's payloads are cut into
chunks of `verify.ray_chunk`; each chunk is one Ray task that runs its payloads through the same
local sandbox on whichever node it lands (`ratchet.sandbox.run_many`: the same namespaces,
limits, leases and reaper), so isolation does not change; results come back in input order.

Only sandbox runs leave the process. The stateful stages (rollout, train, checkpoint, evaluate's
sampling) stay in the flow's process, which owns the policy session (DESIGN.md, "Scale-out
path"): a Ray worker never opens a session, so it can never meet a `StaleSession`.

Counts: `stats` sums, over every call made through the executor, the sandbox runs launched and
what the reapers found (runs killed past their lease, runs whose worker died: ratchet/sandbox/
lease.py), measured in the process(es) that ran them, and how many nodes ran them.
"""
from __future__ import annotations

import socket
from typing import Protocol, Sequence

from ratchet.sandbox import Limits, Payload, RunResult, lease, run_many


class Executor(Protocol):
    stats: dict[str, int]

    def run_many(self, payloads: Sequence[Payload], limits: Limits | None, concurrency: int | None) -> list[RunResult]: ...


def empty_stats() -> dict[str, int]:
    return {"sandbox_launched": 0, "sandbox_reaped": 0, "sandbox_orphaned": 0, "sandbox_nodes": 0}


class StatsMixin:
    def _init_stats(self) -> None:
        self.stats = empty_stats()
        self.nodes: set[str] = set()

    def _add(self, counted: dict[str, int], nodes: set[str]) -> None:
        for k, v in counted.items():
            self.stats[f"sandbox_{k}"] += v
        self.nodes |= nodes
        self.stats["sandbox_nodes"] = len(self.nodes)


class LocalExecutor(StatsMixin):
    """This process's sandbox (the default): `ratchet.sandbox.run_many`."""

    name = "local"

    def __init__(self) -> None:
        self._init_stats()

    def run_many(self, payloads, limits=None, concurrency=None) -> list[RunResult]:
        before = lease.counts()
        results = run_many(payloads, limits=limits, concurrency=concurrency)
        self._add(lease.diff(lease.counts(), before), {socket.gethostname()})
        return results


def executor_for(verify) -> Executor:
    """The executor `verify` (a VerifyConfig) names: a fresh one (its own stats) per call site."""
    if verify.executor == "ray":
        from ratchet.scale.ray_executor import RayExecutor
        return RayExecutor(verify.ray_address, verify.ray_chunk)
    return LocalExecutor()


__all__ = ["Executor", "LocalExecutor", "executor_for", "empty_stats"]
