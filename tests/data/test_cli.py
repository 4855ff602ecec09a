"""`ratchet gate check FILE.parquet`: prints the report, exits non-zero on failure.

    .venv/bin/pytest -q tests/data/test_cli.py
"""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from ratchet.data import trajectories_frame
from ratchet.data.cli import app
from tests.data.waves import clean_rows, clean_wave, task_table

runner = CliRunner()


def test_clean_wave_exits_zero(tmp_path):
    path = tmp_path / "trajectories.parquet"
    clean_wave().write_parquet(path)
    result = runner.invoke(app, ["check", str(path), "--reward-min", "0", "--reward-max", "1", "--max-tokens", "64"])
    assert result.exit_code == 0, result.output
    assert "wave gate" in result.output and "passed" in result.output


def test_corrupt_wave_exits_one_with_report(tmp_path):
    rows = clean_rows()
    rows[2] = {**rows[2], "reward": math.nan}
    for i in range(0, 8):
        rows[8 + i] = {**rows[8 + i], "env_error": True, "env_error_kind": "sandbox_start", "reward": None, "metrics": None}
    path = tmp_path / "bad.parquet"
    trajectories_frame(rows).write_parquet(path)

    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 1
    assert "FAILED" in result.output and "reward_not_null" in result.output and "env_error_rate" in result.output

    # a looser threshold from the command line leaves only the NaN
    result = runner.invoke(app, ["check", str(path), "--max-env-error-rate", "0.5", "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert [f["check"] for f in report["failures"]] == ["reward_not_null"]


def test_task_table_is_detected(tmp_path):
    path = tmp_path / "tasks.parquet"
    task_table().write_parquet(path)
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 0 and "tasks gate" in result.output


def test_unreadable_file_is_a_usage_error(tmp_path):
    path = tmp_path / "not.parquet"
    path.write_text("hello")
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 2 and "cannot read" in result.output


def test_half_given_bounds_are_refused(tmp_path):
    path = tmp_path / "trajectories.parquet"
    clean_wave().write_parquet(path)
    result = runner.invoke(app, ["check", str(path), "--reward-min", "0"])
    assert result.exit_code == 2 and "--reward-max" in result.output
