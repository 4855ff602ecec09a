"""Sandbox runs fanned out over a Ray cluster (`VerifyConfig.executor = "ray"`).

    ray start --head --port 6379 --num-cpus 8 --resources '{"sandbox": 8}'            # head (or any node)
    ray start --address HEAD:6379 --num-cpus 16 --resources '{"sandbox": 16}'       # each sandbox worker
    ratchet run --config run.json     # with {"verify": {"executor": "ray", "ray_address": "auto"}}

Each chunk of payloads is one Ray task that asks for `{"sandbox": k}` (k = the chunk's local
concurrency) and no CPU: a node's "sandbox" resource is the most sandbox runs it holds at once,
across every flow and every run that shares the cluster (the cross-flow concurrency limit).
Nodes without it (a GPU trainer) never get a sandbox task. Chunks are spread over the nodes
(SPREAD scheduling). On the node, the task runs its chunk through `ratchet.sandbox.run_many`
in that Ray worker process (a long-lived process: its zygotes stay warm between chunks).

A chunk whose Ray task fails (its node or worker died, after Ray's own retries) comes back as
infra_error results: the verifier retries them, and what keeps failing is an env_error, never a
model failure. A payload whose interpreter (`python=`, a task runtime built on the driver under
`$RATCHET_RUNTIMES`) does not exist on the node comes back the same way: put the runtime cache
on a path every node shares.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping
from typing import Sequence

from ratchet.sandbox import Limits, Payload, RunResult, lease, run_many
from ratchet.scale import StatsMixin

RESOURCE = "sandbox"
_connected: str | None = None
_lock = threading.Lock()


def connect(address: str) -> None:
    """ray.init once per process ("local": a private one-machine cluster with a "sandbox"
    resource per CPU); fail with one line when the cluster offers no "sandbox" resource."""
    global _connected
    import ray

    with _lock:
        if not ray.is_initialized():
            kw = {"resources": {RESOURCE: float(os.cpu_count() or 1)}} if address == "local" else {}
            ray.init(address=address, namespace="ratchet", log_to_driver=False, configure_logging=False, **kw)
            _connected = address
        if not ray.cluster_resources().get(RESOURCE):
            raise RuntimeError(
                f"the Ray cluster at {address!r} offers no {RESOURCE!r} resource, so no node may run sandboxes: "
                f"start sandbox workers with `ray start --address ... --resources '{{\"{RESOURCE}\": N}}'`")


def _wire(p: Payload) -> dict:
    """A payload as plain data, every field (its read-only mappings do not pickle)."""
    return {f.name: dict(v) if isinstance(v := getattr(p, f.name), Mapping) else v for f in dataclasses.fields(p)}


def _unwire(w: dict) -> Payload:
    return Payload(**w)


def run_chunk(wired: list[dict], limits: Limits | None, concurrency: int) -> tuple[str, list[RunResult], dict]:
    """On a node: run a chunk through this process's sandbox; (node id, results, lease counts)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    payloads = [_unwire(w) for w in wired]
    results: list[RunResult | None] = [None] * len(payloads)
    todo = []
    for i, p in enumerate(payloads):
        if p.python is not None and not os.path.exists(p.python):
            results[i] = RunResult.infra(f"interpreter {p.python} does not exist on Ray node {node[:12]}")
        else:
            todo.append(i)
    before = lease.counts()
    for i, r in zip(todo, run_many([payloads[i] for i in todo], limits=limits, concurrency=concurrency)):
        results[i] = r
    return node, results, lease.diff(lease.counts(), before)


_remote = None


def _remote_fn():
    global _remote
    if _remote is None:
        import ray
        _remote = ray.remote(max_retries=2)(run_chunk)
    return _remote


class RayExecutor(StatsMixin):
    name = "ray"

    def __init__(self, address: str, chunk: int):
        self.address, self.chunk = address, chunk
        self._init_stats()

    def run_many(self, payloads: Sequence[Payload], limits: Limits | None = None,
                 concurrency: int | None = None) -> list[RunResult]:
        import ray

        payloads = list(payloads)
        if not payloads:
            return []
        connect(self.address)
        concurrency = concurrency or 2
        chunks = [payloads[i:i + self.chunk] for i in range(0, len(payloads), self.chunk)]
        fn = _remote_fn()
        refs = [fn.options(num_cpus=0, resources={RESOURCE: float(min(concurrency, len(c)))},
                           scheduling_strategy="SPREAD").remote([_wire(p) for p in c], limits, concurrency)
                for c in chunks]
        out: list[RunResult] = []
        for c, ref in zip(chunks, refs):
            try:
                node, results, counted = ray.get(ref)
            except ray.exceptions.RayError as e:
                first = (str(e).strip().splitlines() or [""])[0][:300]
                out += [RunResult.infra(f"ray task failed: {type(e).__name__}: {first}")] * len(c)
                continue
            self._add(counted, {node})
            out += results
        return out
