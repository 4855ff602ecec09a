"""Exactly-once training across crashes, by fault injection.

Small `ratchet run`s are SIGKILLed at random points — inside local store writes (before the
renames, and between the bytes' rename and the metadata's), between two files of a checkpoint
upload, with a checkpoint complete but LATEST not yet moved, and at random moments chosen by the
test — then resumed with the same run id. Every resumed run must end with weights bit-identical
to an uninterrupted run of the same config, a summary listing every wave exactly once, and the
killed attempt recorded as interrupted.

The runs are subprocesses of `python -m ratchet.cli run` against one Prefect API server that
this module starts (so that each run does not pay for its own), each with a local store of its
own. Trial points are drawn from a seeded generator (printed, so that a failure can be replayed).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ratchet.store import open_store
from tests.flows.test_signals import TINY as SIGNALS_TINY

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
TINY = {**SIGNALS_TINY, "steps": STEPS}   # the signal tests' tiny run, shorter
# (point, highest visit drawn): a tiny run visits each point at least this often
POINTS = [("store.write.between", 50), ("store.put_dir", 10)]   # checkpoint.latest too, by hand: passed


@pytest.fixture(scope="module")
def api_url(prefect_harness):
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def _run(tmp: Path, name: str, store: Path, api_url: str, fault: str | None = None) -> subprocess.Popen:
    config = tmp / "tiny.json"
    config.write_text(json.dumps(TINY))
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("RATCHET_FAULT", None)
    if fault:
        env["RATCHET_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "ratchet.cli", "run", "--config", str(config), "--run-id", "fi",
                             "--store", str(store)], cwd=ROOT, env=env,
                            stdout=open(tmp / f"{name}.out", "w"), stderr=open(tmp / f"{name}.err", "w"))


def _finish(proc: subprocess.Popen, tmp: Path, name: str) -> dict:
    proc.wait(timeout=600)
    err = (tmp / f"{name}.err").read_text()
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{err[-3000:]}"
    return json.loads((tmp / f"{name}.out").read_text().strip().splitlines()[-1])


def _attempts(store_path: Path) -> list[str]:
    """The outcomes of the run's attempts so far, as the store holds them ([] before the first)."""
    store = open_store(str(store_path))
    if not store.exists("runs/fi/attempts.json"):
        return []
    return [a["outcome"] for a in store.get_json("runs/fi/attempts.json")]


def _final_weights(store_path: Path) -> str:
    """sha256 of the final checkpoint's weights, from its manifest."""
    store = open_store(str(store_path))
    manifest = store.get_json(store.get_pointer("runs/fi/checkpoints/LATEST"))
    return manifest["files"]["model.safetensors"]["sha256"]


@pytest.fixture(scope="module")
def reference(api_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    t0 = time.monotonic()
    summary = _finish(_run(tmp, "reference", tmp / "store", api_url), tmp, "reference")
    return {"weights": _final_weights(tmp / "store"), "summary": summary, "wall_s": time.monotonic() - t0}


def _trials() -> list[tuple[str, int | float]]:
    rng = random.Random(20261203)
    drawn = [(p, rng.randint(1, hi)) for p, hi in POINTS]
    return drawn + [("time", rng.uniform(0.15, 0.85))]


@pytest.mark.slow
@pytest.mark.parametrize("point, when", _trials(), ids=lambda v: str(v))
def test_a_run_killed_anywhere_resumes_to_the_same_weights(point, when, api_url, reference, tmp_path):
    store = tmp_path / "store"
    if point == "time":      # SIGKILL from outside at a fraction of the reference run's wall time
        proc = _run(tmp_path, "killed", store, api_url)
        try:
            proc.wait(timeout=when * reference["wall_s"])
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    else:
        proc = _run(tmp_path, "killed", store, api_url, fault=f"{point}:{when}")
        proc.wait(timeout=600)
    killed = proc.returncode == -signal.SIGKILL
    if not killed:   # the run finished before the point (or time) came: then it must equal the reference
        assert proc.returncode == 0, (tmp_path / "killed.err").read_text()[-3000:]
    # a kill during the process's teardown comes after its attempt was closed "completed"
    after_end = killed and _attempts(store)[-1:] == ["completed"]

    summary = _finish(_run(tmp_path, "resumed", store, api_url), tmp_path, "resumed")
    assert _final_weights(store) == reference["weights"], f"killed at {point}:{when}: weights differ"
    assert summary["final_pass_rate"] == reference["summary"]["final_pass_rate"]
    full = open_store(str(store)).get_json("runs/fi/summary.json")
    assert [w["step"] for w in full["history"]] == list(range(STEPS))          # every wave, exactly once
    outcomes = [a["outcome"] for a in full["attempts"]]
    assert outcomes[-1] == "completed"
    if after_end:
        assert outcomes == ["completed", "completed"], outcomes
    elif killed and len(outcomes) > 1:
        assert outcomes[0].startswith("interrupted"), outcomes


def test_fault_points_are_inert_unless_named(tmp_path):
    """Without RATCHET_FAULT, or naming another point, a point does nothing (in a child process,
    where the environment is read at import)."""
    code = ("from ratchet import faults\n"
            "for _ in range(3): faults.point('store.write')\n"
            "print('alive')")
    for fault in (None, "store.put_dir:1", "store.write:4"):
        env = {k: v for k, v in os.environ.items() if k != "RATCHET_FAULT"} | ({"RATCHET_FAULT": fault} if fault else {})
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == "alive", (fault, out.stderr)
    env = {**os.environ, "RATCHET_FAULT": "store.write:2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL and "alive" not in out.stdout


def test_an_overwrite_killed_between_its_renames_leaves_the_old_object_readable(tmp_path):
    """Found by this module: the local store renamed an object's bytes, then its metadata; a
    crash in between left a rewritten key (attempts.json, LEASE, a wave's stats) "corrupt" for
    ever, and the run could not resume. The metadata now goes first and vouches for both."""
    from ratchet.store import open_store

    open_store(str(tmp_path)).put_json("runs/r/attempts.json", [{"attempt": 0}])
    code = ("import sys; from ratchet.store import open_store\n"
            "open_store(sys.argv[1]).put_json('runs/r/attempts.json', [{'attempt': 0}, {'attempt': 1}])")
    env = {**os.environ, "RATCHET_FAULT": "store.write.between:1"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=ROOT, capture_output=True)
    assert out.returncode == -signal.SIGKILL
    store = open_store(str(tmp_path))
    assert store.get_json("runs/r/attempts.json") == [{"attempt": 0}]          # the old object, whole
    ref = store.ref("runs/r/attempts.json")
    assert store.get_json(ref) == [{"attempt": 0}]                               # a Ref of what is there
    store.put_json("runs/r/attempts.json", [{"attempt": 0}, {"attempt": 1}])
    assert store.get_json("runs/r/attempts.json") == [{"attempt": 0}, {"attempt": 1}]
    (tmp_path / "runs/r/attempts.json").write_text("[]")                         # real corruption is still caught
    with pytest.raises(Exception, match="corrupt"):
        store.get_json("runs/r/attempts.json")
