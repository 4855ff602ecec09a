"""Sandbox leases and the reaper (ratchet/sandbox/lease.py): every run is leased; a run whose
worker died, or that outlives its lease, is killed and counted; a wave's counts reach its stats."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ratchet.sandbox import available_backends, lease
from ratchet.scale import LocalExecutor
from tests.waiting import until

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = [b for b, why in available_backends().items() if why is None]
WORKER = """
import sys
from ratchet.sandbox import Limits, Payload, Sandbox
with Sandbox(Limits(wall_s=60, cpu_s=60), backend=sys.argv[1], concurrency=1) as sb:
    sb.run(Payload(code="import time; time.sleep(60)"))
"""


@pytest.fixture
def leases(tmp_path, monkeypatch):
    d = tmp_path / "leases"
    monkeypatch.setenv("RATCHET_SANDBOX_LEASES", str(d))
    return d


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _one_lease(d: Path) -> dict | None:
    """The one lease in `d`, or None while there is none, or it is half-written (as `lease.reap` reads them)."""
    files = [p for p in d.glob("*.json")] if d.exists() else []
    try:
        return json.loads(files[0].read_text()) if len(files) == 1 else None
    except ValueError:
        return None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_worker_leaves_no_sandbox_process_and_is_counted_orphaned(tmp_path, backend):
    leases = tmp_path / "worker-leases"   # the worker's; this process's own reaper threads never look here
    worker = subprocess.Popen([sys.executable, "-c", WORKER, backend], cwd=ROOT,
                              env={**os.environ, "RATCHET_SANDBOX_LEASES": str(leases)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        rec = until(lambda: _one_lease(leases), what="the run's lease")
        assert rec["owner"] == worker.pid and lease.alive(rec["pid"], rec["start"])
        helpers = [c for c in _children(worker.pid) if c != rec["pid"]] if backend == "zygote" else []
        before = lease.counts()
        worker.kill()                                  # the worker dies mid-run (SIGKILL: no clean-up of its own)
        for pid in helpers:                            # ...and its zygote with it: only the reaper is left
            os.kill(pid, signal.SIGKILL)
        worker.wait()
        if backend == "zygote":
            time.sleep(0.5)
            assert lease.alive(rec["pid"], rec["start"]), "the orphaned run should still be running here"
        else:   # the run dies with its worker (PR_SET_PDEATHSIG; bwrap also --die-with-parent), before any reaper
            until(lambda: not lease.alive(rec["pid"], rec["start"]), timeout=10, what="the run to die with its worker")
        found = lease.reap(str(leases))
        until(lambda: not lease.alive(rec["pid"], rec["start"]), timeout=5, what="the run's process to be gone")
        # zygote: the run outlived its worker and zygote, the reaper killed it; subprocess/bwrap: the reaper
        # only counts the orphaned lease
        assert found == {"reaped": 1 if backend == "zygote" else 0, "orphaned": 1}
        assert lease.diff(lease.counts(), before) | {"launched": 0} == {"launched": 0, **found}
        assert not list(leases.glob("*.json*"))
    finally:
        if worker.poll() is None:
            worker.kill()


def test_a_run_past_its_lease_is_killed_and_a_reused_pid_never_is(leases):
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        held = lease.take(proc.pid, wall_s=1.0)
        path = Path(held.path)
        forged = json.loads(path.read_text()) | {"pid": other.pid, "start": 1}   # not the process that started then
        (leases / "forged.json").write_text(json.dumps(forged))
        assert lease.reap(now=time.time()) == {"reaped": 0, "orphaned": 0}     # within the lease: left alone
        found = lease.reap(str(leases), now=time.time() + 1.0 + lease.GRACE_S + 1)
        assert found == {"reaped": 1, "orphaned": 0}
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert other.poll() is None                                            # the forged lease killed nothing
        assert not path.exists()
        held.release()                                                         # the owner's release: harmless
    finally:
        for p in (proc, other):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_executor_counts_a_waves_launched_runs(leases):
    from ratchet.sandbox import Limits, Payload
    ex = LocalExecutor()
    results = ex.run_many([Payload(code=f"print({i})") for i in range(5)], Limits(wall_s=5), 2)
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(5)]
    assert ex.stats["sandbox_launched"] == 5 and ex.stats["sandbox_nodes"] == 1
    assert ex.stats["sandbox_reaped"] == ex.stats["sandbox_orphaned"] == 0
    assert not list(leases.glob("*.json"))                                    # every lease released


def test_ratchet_sandbox_reap_ends_a_dead_workers_run(tmp_path):
    leases = tmp_path / "host-leases"     # the command's; this process's reaper threads never look here
    run = subprocess.Popen(["sleep", "30"], start_new_session=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        rec = {"pid": run.pid, "start": lease.start_time(run.pid), "owner": dead.pid, "owner_start": None,
               "deadline": time.time() + 60, "uid": None, "host": "here"}
        leases.mkdir()
        (leases / f"{run.pid}.json").write_text(json.dumps(rec))
        out = subprocess.run([sys.executable, "-m", "ratchet.cli", "sandbox", "reap", "--json"], cwd=ROOT,
                             env={**os.environ, "RATCHET_SANDBOX_LEASES": str(leases)},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) | {"dir": None} == {"reaped": 1, "orphaned": 1, "leases": 0, "dir": None}
        assert run.wait(timeout=5) == -signal.SIGKILL
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
