"""Sandbox runs fanned out over a Ray cluster (`VerifyConfig.executor = "ray"`).

    ray start --head --port 6379 --num-cpus 8 --resources '{"sandbox": 8}'            # head (or any node)
    ray start --address HEAD:6379 --num-cpus 16 --resources '{"sandbox": 16}'       # each sandbox worker
    ratchet run --config run.json     # with {"verify": {"executor": "ray", "ray_address": "auto"}}

Each chunk of payloads is one Ray task that asks for `{"sandbox": k}` and no CPU, and runs its
payloads at most k at a time: k is the call's concurrency, capped at the chunk's size and at the
largest "sandbox" resource of one alive node (a task asking for more than any node has would never
be scheduled; a node with fewer than k takes no chunk). A node's "sandbox" resource is the most
sandbox runs it holds at once, across every flow and every run that shares the cluster (the
cross-flow concurrency limit). Nodes without it (a GPU trainer) never get a sandbox task. Chunks
are spread over the nodes (SPREAD scheduling). On the node, the task runs its chunk through
`ratchet.sandbox.run_many` in that Ray worker process (a long-lived process: its zygotes stay
warm between chunks).

A chunk whose Ray task fails (its node or worker died, after Ray's own retries; or it raised:
the message then names what it raised) comes back as infra_error results, and so do the chunks
still out when none has finished for the time one chunk's runs may take plus STALL_S and no alive
node could run them any more (every sandbox node left the cluster after they were submitted: they
are cancelled; chunks merely queued behind other flows' are waited for): the verifier retries them,
and what keeps failing is an env_error, never a model failure. A payload whose
interpreter (`python=`, a task runtime built on the driver under `$RATCHET_RUNTIMES`) does not
exist on the node comes back the same way: put the runtime cache on a path every node shares.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from collections.abc import Mapping
from typing import Sequence

from ratchet.sandbox import Limits, Payload, RunResult, lease, run_many
from ratchet.scale import StatsMixin

RESOURCE = "sandbox"
STALL_S = 300.0
"""Seconds, on top of the wall-clock limits of one chunk's runs, that a call waits for its next chunk to
finish (a worker's start, the sandbox's first slot) before it looks whether any alive node can still
run its chunks: if one can (they are queued behind other flows' chunks), it waits on; if none can
(every sandbox node left), it gives up on the chunks still out."""
log = logging.getLogger("ratchet.scale")
_connected: str | None = None
_lock = threading.Lock()


def connect(address: str) -> int:
    """ray.init once per process ("local": a private one-machine cluster with a "sandbox"
    resource per CPU); the most "sandbox" slots one alive node offers. Fails with one line when
    no alive node offers a whole one."""
    global _connected
    import ray

    with _lock:
        if not ray.is_initialized():
            kw = {"resources": {RESOURCE: float(os.cpu_count() or 1)}} if address == "local" else {}
            ray.init(address=address, namespace="ratchet", log_to_driver=False, configure_logging=False, **kw)
            _connected = address
    slots = largest_node()
    if not slots:
        raise RuntimeError(
            f"no alive node of the Ray cluster at {address!r} offers a {RESOURCE!r} resource, so none may run "
            f"sandboxes: start sandbox workers with `ray start --address ... --resources '{{\"{RESOURCE}\": N}}'`")
    return slots


def largest_node() -> int:
    """The most whole "sandbox" slots one alive node of the connected cluster offers (0: none)."""
    import ray

    return int(max((n["Resources"].get(RESOURCE, 0) for n in ray.nodes() if n["Alive"]), default=0))


def _wire(p: Payload) -> dict:
    """A payload as plain data, every field (its read-only mappings do not pickle)."""
    return {f.name: dict(v) if isinstance(v := getattr(p, f.name), Mapping) else v for f in dataclasses.fields(p)}


def _unwire(w: dict) -> Payload:
    return Payload(**w)


def run_chunk(wired: list[dict], limits: Limits | None, concurrency: int) -> tuple[str, list[RunResult], dict]:
    """On a node: run a chunk through this process's sandbox, at most `concurrency` runs at once (what
    the task's "sandbox" request holds); (node id, results, lease counts)."""
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
        k = min(concurrency or 2, connect(self.address))     # runs at once in a chunk, on one node
        chunks = [payloads[i:i + self.chunk] for i in range(0, len(payloads), self.chunk)]
        fn = _remote_fn()
        out = {fn.options(num_cpus=0, resources={RESOURCE: float(min(k, len(c)))},
                          scheduling_strategy="SPREAD").remote([_wire(p) for p in c], limits, k): i
               for i, c in enumerate(chunks)}     # k, not min(k, len(c)): one warm Sandbox per node for every chunk
        stall_s = (limits or Limits()).wall_s * math.ceil(len(chunks[0]) / k) + STALL_S
        done: dict[int, list[RunResult]] = {}
        while out:
            ready, _ = ray.wait(list(out), num_returns=1, timeout=stall_s)
            if not ready and largest_node() >= k:    # queued behind other flows' chunks, or slow: still runnable
                log.warning("ray: no chunk finished in %.0f s; %d still out, waiting (a node can run them)", stall_s, len(out))
                continue
            if not ready:
                why = _stalled(stall_s, len(out), len(chunks[0]), k)
                log.warning("%s", why)
                for ref, i in out.items():
                    ray.cancel(ref, force=True)
                    done[i] = [RunResult.infra(why)] * len(chunks[i])
                break
            i = out.pop(ready[0])
            try:
                node, results, counted = ray.get(ready[0])
            except ray.exceptions.RayError as e:
                log.warning("ray chunk of %d runs failed: %s", len(chunks[i]), e)   # a raise: the remote traceback
                done[i] = [RunResult.infra(_failed(e))] * len(chunks[i])
                continue
            self._add(counted, {node})
            done[i] = results
        return [r for i in range(len(chunks)) for r in done[i]]


def _failed(e: Exception) -> str:
    """A failed chunk's message. A RayTaskError's own text starts with a `ray::run_chunk() (pid, ip)`
    header: what the task raised is its cause. Anything else is Ray's (a worker or node died)."""
    import ray

    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        return f"ray task raised {type(e.cause).__name__}: {str(e.cause)[:1000]}"
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"ray task failed: {type(e).__name__}: {first}"


def _stalled(stall_s: float, left: int, size: int, k: int) -> str:
    """Why the chunks still out were cancelled, in one line."""
    slots = largest_node()
    now = (f"the largest alive node now offers {slots} {RESOURCE!r} slots" if slots else
           f"no alive node offers a {RESOURCE!r} resource any more: every sandbox node left the cluster")
    return (f"ray: no chunk finished in {stall_s:.0f} s (chunks of {size} runs, {k} at a time), so the {left} "
            f"still out were cancelled; {now}")
