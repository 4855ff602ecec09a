"""The command line: fast help without Prefect, and `ratchet run` ending in one JSON line."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ratchet(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "ratchet.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_help_lists_the_commands_and_does_not_import_prefect():
    out = _ratchet("--help")
    assert out.returncode == 0, out.stderr
    for command in ("run", "sandbox", "gate"):
        assert command in out.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys, ratchet.cli; print('prefect' in sys.modules)"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "False", probe.stderr


def test_run_prints_one_json_object_last(tmp_path):
    config = {
        "steps": 2, "run_id": "cli-run", "store": {"uri": str(tmp_path / "store")},
        "envs": {"n_train": 40, "n_heldout": 8},
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 200, "sft_steps": 10, "sft_batch": 8},
        "rollout": {"prompts_per_wave": 4, "group_size": 2, "max_new_tokens": 12},
        "gate": {"max_zero_variance_frac": 1.0},
        "monitor": {"max_zero_variance_frac": None},
        "eval": {"n_tasks": 8},
    }
    (tmp_path / "tiny.json").write_text(json.dumps(config))
    out = _ratchet("run", "--config", str(tmp_path / "tiny.json"),
                   env={"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    assert out.returncode == 0, out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(last) == {"run_id", "summary", "base_pass_rate", "final_pass_rate", "promoted", "steps", "wall_s"}
    assert last["run_id"] == "cli-run" and last["steps"] == 2
    assert Path(last["summary"].removeprefix("file://")).exists()


def test_run_rejects_a_bad_config_with_the_field_named(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"steps": 0}))
    out = _ratchet("run", "--config", str(tmp_path / "bad.json"))
    assert out.returncode != 0 and "steps" in (out.stderr + out.stdout)
