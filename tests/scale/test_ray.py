"""Verification fanned out over a local Ray cluster (two worker nodes, started by the
`ray_cluster` fixture): the chunks land on both nodes and the verdicts are the local executor's;
a concurrency above every node's "sandbox" resource still runs, and a chunk that fails or never
finishes comes back as infra errors that say why.
The tiny flow with Ray verification and local training: tests/flows/test_scale_ray.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from envs.production import produce
from ratchet.config import EnvsConfig, VerifyConfig
from ratchet.scale import LocalExecutor, executor_for
from ratchet.verify import verify_many
from tests.waiting import until

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
TIMING = ("execution_time_ms", "peak_memory_mb")


def _items():
    specs = produce("python_functions", EnvsConfig(n_train=8, n_heldout=2)).train[:6]
    wrong = "def f(*a, **k):\n    return 0\n"
    return [(s, c) for s in specs for c in (s.reference_solution, wrong)]


def _same_verdicts(a, b) -> bool:
    drop = lambda v: ({k: x for k, x in v.metrics.items() if k not in TIMING}, v.env_error, v.passed,  # noqa: E731
                      v.feedback and {k: x for k, x in v.feedback.items() if k != "stdout_tail"})
    return [drop(v) for v in a] == [drop(v) for v in b]


def test_a_batch_fans_out_to_both_nodes_with_the_local_verdicts(ray_cluster):
    address, workers = ray_cluster
    items = _items()
    verify = VerifyConfig(executor="ray", ray_address=address, ray_chunk=2)
    ray_ex = executor_for(verify)
    remote = verify_many(items, verify.sandbox_limits(), verify.concurrency, verify.env_error_retries, executor=ray_ex)
    local = verify_many(items, verify.sandbox_limits(), verify.concurrency, verify.env_error_retries,
                        executor=LocalExecutor())
    assert sum(v.passed for v in local) == 6 and not any(v.env_error for v in local)   # the references pass
    assert _same_verdicts(remote, local)
    assert ray_ex.nodes == set(workers)                      # both worker nodes ran chunks; the head none
    assert ray_ex.stats["sandbox_launched"] == len(items) and ray_ex.stats["sandbox_nodes"] == 2


def test_the_nodes_sandbox_resource_caps_concurrent_runs_across_flows(ray_cluster):
    """Two flows verify at once; each node's {"sandbox": 2} admits one 2-run chunk at a time, so at
    most 4 runs overlap cluster-wide (without the cap the 4 chunks of 2 would all run: 8)."""
    from concurrent.futures import ThreadPoolExecutor

    import ray
    from ratchet.sandbox import Limits, Payload
    from ratchet.scale.ray_executor import RESOURCE, RayExecutor

    address, _ = ray_cluster
    code = "import time\nt = time.time()\ntime.sleep(1.0)\nprint(t, time.time())\n"
    flows = [[Payload(code=code + f"# flow {f} run {i}") for i in range(4)] for f in range(2)]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda ps: RayExecutor(address, 2).run_many(ps, Limits(wall_s=20, cpu_s=5), 2), flows))
    spans = [tuple(map(float, r.stdout.split())) for rs in done for r in rs]
    assert len(spans) == 8
    overlap = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert 1 <= overlap <= 4, spans
    assert ray.cluster_resources()[RESOURCE] == 4
    # every chunk gave its slots back (the resource view is refreshed every ~0.1-1 s)
    until(lambda: ray.available_resources().get(RESOURCE) == 4, timeout=10, every=0.1,
          what=lambda: f"every {RESOURCE} slot back, {ray.available_resources().get(RESOURCE)} of 4 free")


def test_stateful_stages_stay_in_the_flow_process():
    """The stages that use the policy session run in the flow's process, which owns the session:
    the nightly names no task runner (Prefect's default runs submitted tasks on threads of this
    process), and only async rollouts are submitted at all (to overlap with training), so no
    stage can land on another worker, where it would meet a StaleSession. Only sandbox runs
    leave (verify.executor)."""
    stateful = {"bootstrap_policy", "rollout_wave", "train_epoch", "checkpoint_policy", "evaluate", "evaluate_incumbent"}
    tree = ast.parse((ROOT / "flows" / "nightly.py").read_text())
    [nightly] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "nightly"]
    [decorator] = [d for d in nightly.decorator_list if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "flow"]
    assert "task_runner" not in {k.arg for k in decorator.keywords}
    offloaded = {n.func.value.id for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr in ("submit", "map", "delay")
                 and isinstance(n.func.value, ast.Name) and n.func.value.id in stateful}
    assert offloaded <= {"rollout_wave"}
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert stateful <= called


def test_every_payload_field_travels_to_the_nodes():
    import dataclasses
    import pickle

    from ratchet.sandbox import Payload
    from ratchet.scale.ray_executor import _unwire, _wire

    p = Payload(program=("/bin/sh", "-c", "make test"), env={"A": "1"}, files={"a.py": "x"},
                readonly_files={"tests/t.py": b"y"}, stdin=b"in", python="/usr/bin/python3", site=True)
    assert all(getattr(p, f.name) not in (None, (), {}, b"", False) or f.name in ("code", "argv")
               for f in dataclasses.fields(Payload))                         # a new field must be set here too
    assert _unwire(pickle.loads(pickle.dumps(_wire(p)))) == p


def _within(seconds: float, call):
    """call()'s value, or a failure if it has not returned in `seconds` (it is left running on a daemon
    thread): a regression that hangs fails instead of hanging the suite."""
    import threading

    got = []
    thread = threading.Thread(target=lambda: got.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert got, f"did not return within {seconds:g} s"
    return got[0]


def test_a_concurrency_above_every_nodes_sandbox_resource_runs_at_the_largest_nodes_size(ray_cluster):
    """concurrency 8 on nodes of {"sandbox": 2}: the chunk asks for 2 and runs 2 at a time (asking for 4,
    no node could ever take it: Ray leaves such a task pending, and the call waited forever)."""
    from ratchet.sandbox import Limits, Payload
    from ratchet.scale.ray_executor import RayExecutor

    address, _ = ray_cluster
    code = "import time\nt = time.time()\ntime.sleep(0.5)\nprint(t, time.time())\n"
    payloads = [Payload(code=code + f"# run {i}") for i in range(4)]
    results = _within(60, lambda: RayExecutor(address, 4).run_many(payloads, Limits(wall_s=20, cpu_s=5), 8))
    assert [r.infra_error for r in results] == [None] * 4 and [r.exit_code for r in results] == [0] * 4
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    overlap = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert overlap <= 2, spans                     # one chunk on one node: no more at once than it holds


def test_chunks_that_never_finish_come_back_as_infra_errors_and_give_their_slots_back(ray_cluster, monkeypatch):
    """Chunks that neither finish nor fail are waited for while an alive node could run them (queued
    behind other flows' chunks: a review saw a wave's chunks cancelled behind an audit's); once none
    can (every sandbox node left after they were submitted: here the nodes' view says so after two
    looks), they are cancelled, and their payloads come back as infra errors saying so."""
    import ray
    from ratchet.sandbox import Limits, Payload
    from ratchet.scale import ray_executor

    def stuck(wired, limits, concurrency):
        import time
        time.sleep(600)

    address, _ = ray_cluster
    looks = []
    largest = ray_executor.largest_node
    monkeypatch.setattr(ray_executor, "largest_node", lambda: looks.append(1) or (largest() if len(looks) <= 3 else 0))
    monkeypatch.setattr(ray_executor, "_remote", ray.remote(stuck))
    monkeypatch.setattr(ray_executor, "STALL_S", 1.0)
    payloads = [Payload(code="print(1)")] * 3
    results = _within(60, lambda: ray_executor.RayExecutor(address, 2).run_many(payloads, Limits(wall_s=1, cpu_s=1), 2))
    assert len(results) == 3 and len(looks) == 5          # connect, two waits while runnable, the give-up, its message
    for r in results:
        assert "no chunk finished in 2 s (chunks of 2 runs, 2 at a time), so the 2 still out were cancelled" in r.infra_error
        assert f"no alive node offers a {ray_executor.RESOURCE!r} resource any more" in r.infra_error
    until(lambda: ray.available_resources().get(ray_executor.RESOURCE) == 4, timeout=30, every=0.1,
          what=lambda: f"the cancelled chunks' slots back, {ray.available_resources().get(ray_executor.RESOURCE)} of 4 free")


def test_a_cluster_whose_sandbox_nodes_are_all_gone_fails_in_one_line(ray_cluster, monkeypatch):
    import ray
    from ratchet.scale.ray_executor import connect

    address, _ = ray_cluster
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": False, "Resources": {"sandbox": 2.0}},
                                               {"Alive": True, "Resources": {"CPU": 1.0}}])
    with pytest.raises(RuntimeError, match="no alive node of the Ray cluster .* offers a 'sandbox' resource"):
        connect(address)


def test_a_chunk_whose_task_raises_names_what_it_raised(ray_cluster, monkeypatch):
    """The first line of a RayTaskError is its `ray::fn() (pid, ip)` header: the message must carry
    the cause (a bug or a version skew on the node) instead."""
    import ray
    from ratchet.sandbox import Payload
    from ratchet.scale import ray_executor

    def raises(wired, limits, concurrency):
        raise ValueError("the real cause: limits has no wall_s")

    address, _ = ray_cluster
    monkeypatch.setattr(ray_executor, "_remote", ray.remote(max_retries=0)(raises))
    results = _within(60, lambda: ray_executor.RayExecutor(address, 2).run_many([Payload(code="print(1)")] * 2))
    assert len(results) == 2
    for r in results:
        assert r.infra_error == "ray task raised ValueError: the real cause: limits has no wall_s"


def test_a_chunk_whose_worker_dies_is_an_infra_error_naming_rays_error(ray_cluster, monkeypatch):
    import ray
    from ratchet.sandbox import Payload
    from ratchet.scale import ray_executor

    def dies(wired, limits, concurrency):
        import os
        os._exit(1)

    address, _ = ray_cluster
    monkeypatch.setattr(ray_executor, "_remote", ray.remote(max_retries=0)(dies))
    results = _within(60, lambda: ray_executor.RayExecutor(address, 2).run_many([Payload(code="print(1)")] * 2))
    assert [r.infra_error.startswith("ray task failed: WorkerCrashedError: ") for r in results] == [True, True]
