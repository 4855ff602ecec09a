"""deploy/ on a real Prefect server, as deploy/README.md runs it, on loopback.

A `prefect server start` subprocess (its own PREFECT_HOME and SQLite database, the scheduler
service off so no schedule fires), the work pools of deploy/prefect.yaml, the deployments
registered with `prefect deploy --prefect-file deploy/prefect.yaml --all`, one process worker
per pool (RATCHET_HOME set, the S3 settings pointing at a moto S3 server that stands in for
MinIO, so the deployments' own store `s3://ratchet/prod` is used as registered). Then, through
the REST API, the request the UI's run form sends:

1. audit-envs (00:00 on the schedule) with small envs and audit sections;
2. nightly (02:00) with a partial `cfg` (steps 1, the same small sections, tiny model, no store,
   no min_gain), which Prefect stores as given, one level deep; the flow deep-merges it over the
   deployment's parameters, so the run keeps the store and `eval.min_gain: 0.01`.

Checked: the nightly registered with its concurrency limit (1, ENQUEUE), and ran under it; both
runs COMPLETED; the nightly trained on the audit run's snapshot (one snapshot
version in the store); its summary.json and summary artifact; its persisted result read back
through Prefect; the deployment's settings kept. Server and workers are stopped at the end,
whatever happened. About 2 minutes on 2 cores.

    .venv/bin/python -m pytest tests/deploy/test_server.py -m slow
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from ratchet.net import free_port
from tests.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
SPEC = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())
POOLS = sorted({d["work_pool"]["name"] for d in SPEC["deployments"]})

ENVS = {"n_train": 60, "n_heldout": 12}
AUDIT = {"max_mutants": 2, "reference_runs": 1}
TINY = {   # a partial cfg, as `prefect deployment run -p cfg=...` sends it: no store, no eval.min_gain
    "steps": 1,
    "envs": ENVS,
    "audit": AUDIT,
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 200, "sft_steps": 5, "sft_batch": 8},
    "rollout": {"prompts_per_wave": 4, "group_size": 4, "max_new_tokens": 16},
    "train": {"minibatch_prompts": 2},
    "gate": {"max_zero_variance_frac": 1.0},
    "eval": {"n_tasks": 12},
}


T0 = time.monotonic()


def _mark(what: str) -> None:
    """A timeline on stdout (pytest shows it on failure; -s shows it always)."""
    print(f"[{time.monotonic() - T0:6.1f} s] {what}", flush=True)


class Processes:
    """Subprocesses in their own sessions, each logging to a file; all stopped by `stop_all`."""

    def __init__(self, logs: Path):
        self.logs, self.procs = logs, {}

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self.procs[name]

    def tail(self, name: str, n: int = 4000) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-n:]

    def stop_all(self) -> None:
        """SIGTERM to each process's session and to every descendant (a worker's flow-run
        processes have sessions of their own), SIGKILL to what is left after 20 s."""
        pids = [pid for proc in self.procs.values() for pid in _descendants(proc.pid)]
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for pid in pids:
            _signal(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "RATCHET_", "AWS_"))}   # nothing of this process's own settings
    return {**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}


@pytest.fixture
def stack(tmp_path, s3_env):
    """Server, pools, deployments, one worker per pool; yields (api_url, env, processes)."""
    global T0
    T0 = time.monotonic()
    procs = Processes(tmp_path)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = _clean_env(PREFECT_HOME=str(tmp_path / "prefect-home"),
                     PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false")   # no schedule may fire here
    try:
        server = procs.start("server", [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env)
        def healthy() -> bool:
            assert server.poll() is None, f"prefect server exited:\n{procs.tail('server')}"
            try:
                return httpx.get(f"{api}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        until(healthy, timeout=180, every=0.5, what=lambda: f"/api/health:\n{procs.tail('server')}")
        _mark("server healthy")

        env = {**env, "PREFECT_API_URL": api}
        for pool in POOLS:   # deploy/README.md, step 2
            subprocess.run([PREFECT, "work-pool", "create", pool, "--type", "process"], cwd=ROOT, env=env,
                           check=True, capture_output=True, timeout=120)
        worker_env = {**env, **s3_env, "RATCHET_HOME": str(ROOT),
                      "PYTHONPATH": str(ROOT),               # the pull step imports flows.settings from this checkout
                      "PREFECT_WORKER_QUERY_SECONDS": "5"}   # pick a run up within 5 s (default 10)
        for pool in POOLS:   # step 4: the trainer worker with --limit 1
            limit = ["--limit", "1"] if pool == "ratchet-trainer" else []
            procs.start(f"worker-{pool}", [PREFECT, "worker", "start", "--pool", pool, "--type", "process", *limit],
                        worker_env)
        deployed = subprocess.run([PREFECT, "--no-prompt", "deploy", "--prefect-file", "deploy/prefect.yaml", "--all"],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)   # step 5
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
        _mark("pools created, workers started, deployments registered")
        yield api, env, procs
    finally:
        procs.stop_all()


def _request(method: str, url: str, body: dict | None = None) -> dict | list:
    """One API call, retried as Prefect's own client retries (a busy SQLite answers 503)."""
    for attempt in range(6):
        r = httpx.request(method, url, json=body, timeout=30)
        if r.status_code not in (429, 502, 503) or attempt == 5:
            break
        time.sleep(2 ** attempt)
    assert r.status_code < 300, f"{method} {url}: {r.status_code} {r.text[:1000]}"
    return r.json()


def _post(api: str, path: str, body: dict) -> dict | list:
    return _request("POST", f"{api}{path}", body)


def _deployment(api: str, name: str) -> dict:
    [dep] = [d for d in _post(api, "/deployments/filter", {}) if d["name"] == name]
    return dep


def _run(api: str, deployment: str, parameters: dict, procs: Processes, timeout_s: float = 400) -> dict:
    """Start a run the way the UI's run form does, wait for a final state, return the flow run."""
    dep = _deployment(api, deployment)
    run = _post(api, f"/deployments/{dep['id']}/create_flow_run", {
        "state": {"type": "SCHEDULED", "message": "Run from the Prefect UI"},
        "parameters": parameters, "enforce_parameter_schema": True})
    latest = [run]

    def final() -> dict | None:
        latest[0] = _request("GET", f"{api}/flow_runs/{run['id']}")
        return latest[0] if latest[0]["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    run = until(final, timeout=timeout_s, every=2,
                what=lambda: f"{deployment} to end (still {latest[0]['state']['type']})")
    _mark(f"{deployment}: {run['state']['type']} (run time {run['total_run_time']:.1f} s)")
    if run["state"]["type"] != "COMPLETED":
        logs = _post(api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}, "sort": "TIMESTAMP_ASC"})
        lines = "\n".join(f"{entry['level']} {entry['message'][:800]}" for entry in logs)
        pool = dep["work_pool_name"]
        pytest.fail(f"{deployment}: {run['state']['type']}: {run['state']['message']}\n{lines[-6000:]}\n"
                    f"worker log:\n{procs.tail(f'worker-{pool}')}")
    return run


def test_deployments_on_a_real_server(stack, s3_env):
    from ratchet.store import open_store

    api, env, procs = stack
    nightly_dep = _deployment(api, "nightly")
    kept = nightly_dep["parameters"]["cfg"]
    assert kept["store"]["uri"].startswith("s3://") and kept["eval"]["min_gain"] > 0   # what must survive the override
    # `prefect deploy` registered prefect.yaml's concurrency_limit: one nightly at a time, the next enqueued
    assert nightly_dep["global_concurrency_limit"]["limit"] == 1, nightly_dep["global_concurrency_limit"]
    assert nightly_dep["concurrency_options"]["collision_strategy"] == "ENQUEUE"

    for pool in POOLS:   # every pool a deployment names has a worker polling it
        until(lambda: [w for w in _post(api, f"/work_pools/{pool}/workers/filter", {}) if w["status"] == "ONLINE"],
              timeout=120, every=1, what=lambda: f"a worker online for {pool}:\n{procs.tail(f'worker-{pool}')}")

    _mark("a worker online for every pool")
    audit_run = _run(api, "audit-envs", {"envs": ENVS, "audit": AUDIT}, procs)
    run_id = f"server-{uuid.uuid4().hex[:8]}"
    nightly_run = _run(api, "nightly", {"cfg": {**TINY, "run_id": run_id}}, procs)

    # Prefect stored the partial cfg as given (one level deep): without the flow's merge the store was gone
    assert "store" not in nightly_run["parameters"]["cfg"]
    store = open_store(kept["store"]["uri"])
    summary = store.get_json(f"runs/{run_id}/summary.json")
    assert summary["config"]["store"]["uri"] == kept["store"]["uri"]
    assert summary["config"]["eval"]["min_gain"] == kept["eval"]["min_gain"]
    assert summary["config"]["eval"]["n_tasks"] == TINY["eval"]["n_tasks"] and summary["config"]["steps"] == 1
    assert summary["attempts"][-1]["outcome"] == "completed"

    # the audit run's snapshot is the nightly's: one snapshot version (same store, same settings),
    # produced by the audit run, reused by the nightly, audited by both
    family = summary["config"]["envs"]["families"][0]
    assert len(store.get_json(f"envs/{family}/versions.json")) == 1

    artifacts = _post(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [nightly_run["id"]]}}})
    [md] = [a for a in artifacts if a["key"] == f"summary-{run_id}"]
    assert md["type"] == "markdown" and f"# Run {run_id}" in md["data"] and "held-out pass@1" in md["data"]
    assert _post(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [audit_run["id"]]}}})

    # the nightly's persisted result, read back through Prefect as any client would
    read = subprocess.run([sys.executable, "-c", (
        "import json, sys\n"
        "from prefect.client.orchestration import get_client\n"
        "with get_client(sync_client=True) as c:\n"
        "    run = c.read_flow_run(sys.argv[1])\n"
        "print(json.dumps(run.state.result()))\n"), nightly_run["id"]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-3000:]
    result = json.loads(read.stdout.strip().splitlines()[-1])
    assert result["run_id"] == run_id and result["summary"] == f"{kept['store']['uri']}/runs/{run_id}/summary.json"

    # nothing ran but what this test started: no schedule fired
    runs = _post(api, "/flow_runs/filter", {})
    assert sorted(r["id"] for r in runs if r["parent_task_run_id"] is None) == sorted([audit_run["id"], nightly_run["id"]])
