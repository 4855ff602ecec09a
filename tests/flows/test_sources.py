"""An imported task set as a source of the nightly cycle, beside a generated family.

    .venv/bin/python -m pytest tests/flows/test_sources.py -q

The file's tasks are pytest tasks that carry their own test files and need a dependency the host
does not have (`tinyops`, a wheel built here: `tinyops @ file:///...`, so no network), plus
pytest itself: the runtime is a content-addressed venv (envs/runtime.py), under a cache folder
outside /tmp that the test removes. Two waves; the summary reports the source's pass rates,
its import counts (a duplicate, a contaminated task, a bad line) and where the bad line went.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import uuid
import zipfile
from pathlib import Path

import pytest

from envs.runtime import _writable
from ratchet.config import (AuditConfig, EnvsConfig, EvalConfig, GateConfig, ModelConfig, MonitorConfig,
                            NightlyConfig,
                            RolloutConfig, StoreConfig, TrainConfig, VerifyConfig)
from ratchet.store import open_store

pytestmark = pytest.mark.slow   # ~60-90 s on 2 shared cores: a runtime venv is built, every answer runs pytest


def tiny_wheel(folder: Path) -> Path:
    """A pure-Python wheel of `tinyops` (double(x) = 2x), written by hand: no build backend, no index."""
    files = {"tinyops/__init__.py": "def double(x):\n    return 2 * x\n",
             "tinyops-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinyops\nVersion: 0.1\n",
             "tinyops-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: ratchet-tests\nRoot-Is-Purelib: true\n"
                                            "Tag: py3-none-any\n"}
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for name, text in files.items()]
    files["tinyops-0.1.dist-info/RECORD"] = "\n".join([*record, "tinyops-0.1.dist-info/RECORD,,"]) + "\n"
    path = folder / "tinyops-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def task(task_id: str, k: int, split: str, difficulty: int, wheel: Path, prompt: str | None = None) -> dict:
    """Write mul(x) = k*x with tinyops.double where it helps; hidden pytest file, own dependency."""
    ref = ("from tinyops import double\n\n\ndef mul(x):\n    return double(x) * %d // 2\n" % k)
    tests = "from main import mul\n\n" + "".join(
        f"\ndef test_{i}():\n    assert mul({x}) == {k * x}\n" for i, x in enumerate((1, 3, -2, 7)))
    return {"task_id": task_id, "split": split, "difficulty": difficulty,
            "prompt": prompt or f"Write /app/main.py defining mul(x) that returns {k} times x; tinyops.double is installed.",
            "environment_config": {"runtime": "python3", "dependencies": ["pytest==9.2.0", f"tinyops @ {wheel.as_uri()}"]},
            "execution_steps": [{"action": "overwrite_file", "path": "/app/main.py", "content": "<model_generated_code>"},
                                {"action": "run_command", "command": "pytest -q /app/tests/"}],
            "test_files": {"tests/test_main.py": tests},
            "reference_solution": ref}


@pytest.fixture(scope="module")
def runtimes():
    """RATCHET_RUNTIMES outside /tmp (the sandbox gives each run its own /tmp), removed afterwards."""
    root = Path.home() / ".cache" / "ratchet" / f"test-sources-{uuid.uuid4().hex[:8]}"
    mp = pytest.MonkeyPatch()
    mp.setenv("RATCHET_RUNTIMES", str(root))
    yield root
    mp.undo()
    if root.exists():
        _writable(root)
        shutil.rmtree(root)


@pytest.fixture(scope="module")
def run(prefect_harness, runtimes, tmp_path_factory):
    from flows.nightly import nightly

    d = tmp_path_factory.mktemp("sources")
    wheel = tiny_wheel(d)
    held_prompt = "Write /app/main.py defining mul(x) that returns 11 times x; tinyops.double is installed."
    lines = [json.dumps(task("m2", 2, "train", 1, wheel)), json.dumps(task("m3", 3, "train", 2, wheel)),
             json.dumps(task("m4", 4, "train", 3, wheel)), json.dumps(task("m5", 5, "train", 1, wheel)),
             json.dumps(task("m2-again", 2, "train", 1, wheel)),                        # exact duplicate of m2
             json.dumps(task("leak", 11, "train", 2, wheel, prompt=held_prompt)),       # a held-out prompt
             '{"task_id": "broken", "execution_steps": []}',                             # a bad line
             json.dumps(task("h6", 6, "heldout", 1, wheel)), json.dumps(task("h11", 11, "heldout", 2, wheel))]
    src = d / "mul_tasks.jsonl"
    src.write_text("\n".join(lines) + "\n")
    store_uri = str(d / "store")
    cfg = NightlyConfig(
        run_id="src", steps=2, checkpoint_every=2, store=StoreConfig(uri=store_uri),
        envs=EnvsConfig(n_train=40, n_heldout=6, sources=(str(src),)),
        audit=AuditConfig(reference_runs=1, max_command_mutants=1, max_mutants=4, max_reference_ms=60_000),
        verify=VerifyConfig(timeout_s=60),                   # pytest under a loaded machine: slow, not wrong
        model=ModelConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=200, sft_steps=10, sft_batch=16),
        rollout=RolloutConfig(prompts_per_wave=3, group_size=2, max_new_tokens=16),
        train=TrainConfig(minibatch_prompts=2),
        gate=GateConfig(max_zero_variance_frac=1.0),
        monitor=MonitorConfig(max_zero_variance_frac=None),  # the tiny model's groups are all-equal
        eval=EvalConfig(n_tasks=8, min_gain=1.0),
    )
    return store_uri, str(src), nightly(cfg)


def test_the_summary_reports_the_imported_source(run):
    store_uri, src, summary = run
    by = summary["by_source"]
    assert set(by) == {"python_functions", "imported-mul_tasks"}, by
    mine = by["imported-mul_tasks"]
    assert mine["base_n_tasks"] == mine["final_n_tasks"] == 2 and 0.0 <= mine["base"] <= 1.0 and 0.0 <= mine["final"] <= 1.0
    assert mine["final_ci"][0] <= mine["final"] <= mine["final_ci"][1]
    assert by["python_functions"]["final_n_tasks"] == 6            # eval.n_tasks 8 = 6 + 2: each source its share
    assert "| family imported-mul_tasks | " in summary["eval_table"]      # its family is its source's name
    final = {r["source"]: r for r in summary["final"]["tables"]["source"]}
    assert final["imported-mul_tasks"]["pass_at_1"] == mine["final"]
    held = {t for t in summary["final"]["results"] if t.startswith("imported-mul_tasks/")}
    assert held == {"imported-mul_tasks/h6", "imported-mul_tasks/h11"}


def test_import_counts_and_the_bad_line_are_reported(run):
    store_uri, src, summary = run
    (rec,) = summary["sources"]
    assert rec["source"] == src and rec["name"] == "imported-mul_tasks"
    c = rec["counts"]
    assert (c["lines_ok"], c["lines_bad"], c["split_declared"]) == (8, 1, 8)
    assert (c["train"]["exact_duplicates"], c["train"]["contaminated"], c["train"]["kept"]) == (1, 1, 4)
    assert c["heldout"]["kept"] == 2
    store = open_store(store_uri)
    (bad,) = [json.loads(ln) for ln in store.get_bytes(rec["bad_lines"][len(store.root_uri) + 1:]).decode().splitlines()]
    assert bad["line"] == 7 and bad["source"] == src and "execution_steps" in bad["message"]


def test_the_imported_tasks_were_audited_and_trained_on(run):
    store_uri, src, summary = run
    store = open_store(store_uri)
    version = summary["sources"][0]["version"]
    audit = store.read_table(f"envs/imported-mul_tasks/{version}/audit.parquet")
    assert audit.height == 6 and (audit["verdict"] == "pass").all(), audit.select("task_id", "verdict", "reason").rows()
    for step in range(2):
        scored = store.read_table(f"runs/src/waves/{step:06d}/scored.parquet")
        mine = scored.filter(scored["family"] == "imported-mul_tasks")
        assert mine.height == 3 * 2 and not mine["env_error"].any(), mine.select("env_error_kind").rows()
        assert mine["reward"].is_not_null().all()
    assert summary["policy_version"] == 2
