"""The Great Expectations gates: a clean wave passes; each corruption is stopped by the
expectation written for it, and only by that one.

    .venv/bin/pytest -q tests/data
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import polars as pl
import pytest

from ratchet.config import GateConfig
from ratchet.data import trajectories_frame
from ratchet.data.gates import check_tasks, check_wave
from ratchet.store import open_store
from tests.data.waves import clean_rows, clean_wave, task_table, traj_row

BOUNDS = (-0.5, 1.0)


def gate(df: pl.DataFrame, cfg: GateConfig | None = None, bounds=BOUNDS, max_tokens: int | None = 64):
    return check_wave(df, cfg or GateConfig(), reward_bounds=bounds, max_tokens=max_tokens)


def failed_checks(report) -> set[str]:
    return {f.check for f in report.failures}


def with_rows(changes: dict[int, dict]) -> pl.DataFrame:
    rows = clean_rows()
    for i, kw in changes.items():
        rows[i] = {**rows[i], **kw}
    return trajectories_frame(rows)


def test_clean_wave_passes():
    report = gate(clean_wave())
    assert report.success, report.to_markdown()
    assert report.failures == [] and report.rows == 32
    assert {"reward_not_null", "reward_in_bounds", "env_error_rate", "zero_variance_groups",
            "empty_completion_reward", "empty_completion_passes", "tokens_within_context"} <= set(report.checks)
    assert "passed" in report.to_markdown()


def test_nan_reward():
    report = gate(with_rows({5: {"reward": math.nan}}))
    assert failed_checks(report) == {"reward_not_null"}
    (f,) = report.failures
    assert (f.expectation, f.column, f.unexpected_count) == ("expect_column_values_to_not_be_null", "reward", 1)
    assert f.examples[0]["row"] == 5 and f.examples[0]["task_id"] == "task1"


def test_missing_reward_on_a_scored_row():
    report = gate(with_rows({2: {"reward": None}}))
    assert failed_checks(report) == {"reward_not_null"}


@pytest.mark.parametrize("bad", [1.5, -3.0, math.inf, -math.inf])
def test_reward_out_of_range(bad):
    report = gate(with_rows({7: {"reward": bad}, 9: {"reward": bad}}))
    assert failed_checks(report) == {"reward_in_bounds"}
    (f,) = report.failures
    assert (f.expectation, f.column, f.unexpected_count) == ("expect_column_values_to_be_between", "reward", 2)
    assert [e["row"] for e in f.examples] == [7, 9]


def test_infinite_reward_fails_without_declared_bounds():
    report = gate(with_rows({0: {"reward": math.inf}}), bounds=None)
    assert failed_checks(report) == {"reward_in_bounds"}
    assert gate(with_rows({0: {"reward": 1e6}}), bounds=None).success


def test_env_error_spike():
    rows = clean_rows()
    for i in range(0, 32, 4):  # 8 of 32 rows: 25% > 5%
        rows[i] = traj_row(i // 4, 0, None, env_error=True, env_error_kind="sandbox_start")
    report = gate(trajectories_frame(rows))
    assert failed_checks(report) == {"env_error_rate"}
    (f,) = report.failures
    assert (f.expectation, f.column) == ("expect_column_mean_to_be_between", "env_error")
    assert f.observed == pytest.approx(0.25) and f.unexpected_count == 8
    assert f.examples == [{"env_error_kind": "sandbox_start", "len": 8}]
    # the same rows under a looser threshold: env_error rows (reward null) are excluded, not failures
    assert gate(trajectories_frame(rows), GateConfig(max_env_error_rate=0.3)).success


def test_constant_rewards():
    rows = [traj_row(g, i, 1.0) for g in range(8) for i in range(4)]
    report = gate(trajectories_frame(rows))
    assert failed_checks(report) == {"zero_variance_groups"}
    (f,) = report.failures
    assert (f.expectation, f.column) == ("expect_column_mean_to_be_between", "zero_variance")
    assert f.observed == pytest.approx(1.0) and f.unexpected_count == 8
    assert f.examples[0] == {"group_id": "g0", "reward": 1.0, "n": 4}


def test_zero_variance_fraction_threshold():
    rows = clean_rows()
    for i in range(4):  # group g0 all 0.5: 1 of 8 groups
        rows[i] = {**rows[i], "reward": 0.5}
    assert gate(trajectories_frame(rows)).success
    report = gate(trajectories_frame(rows), GateConfig(max_zero_variance_frac=0.1))
    assert failed_checks(report) == {"zero_variance_groups"}
    assert report.failures[0].observed == pytest.approx(1 / 8)


def test_env_error_rows_do_not_count_toward_group_variance():
    rows = clean_rows()
    # g1 keeps one scored row and three env_errors: a group of one reward is zero-variance
    for i in (5, 6, 7):
        rows[i] = traj_row(1, i - 4, None, env_error=True, env_error_kind="worker_died")
    report = gate(trajectories_frame(rows), GateConfig(max_env_error_rate=0.2, max_zero_variance_frac=0.1))
    assert failed_checks(report) == {"zero_variance_groups"}
    assert report.failures[0].examples == [{"group_id": "g1", "reward": 0.25, "n": 1}]


def test_empty_completion_scored_as_pass():
    report = gate(with_rows({3: {"completion": "", "reward": 1.0}, 11: {"completion": "  \n"}}))
    assert failed_checks(report) == {"empty_completion_reward", "empty_completion_passes"}
    reward = report.failed(check="empty_completion_reward")[0]
    assert (reward.expectation, reward.column, reward.unexpected_count) == ("expect_column_values_to_be_between", "reward", 2)
    passes = report.failed(check="empty_completion_passes")[0]
    assert (passes.column, passes.unexpected_count) == ("test_pass_rate", 2)
    assert {e["row"] for e in passes.examples} == {3, 11}


def test_empty_completion_with_zero_reward_is_fine():
    rows = clean_rows()
    rows[0] = {**rows[0], "completion": "", "reward": 0.0, "metrics": {**rows[0]["metrics"], "test_pass_rate": 0.0}}
    assert gate(trajectories_frame(rows)).success


def test_tokens_beyond_context():
    report = gate(with_rows({4: {"completion_tokens": 50}}), max_tokens=64)
    assert failed_checks(report) == {"tokens_within_context"}
    (f,) = report.failures
    assert (f.column, f.unexpected_count, f.examples[0]["row"]) == ("total_tokens", 1, 4)
    assert "tokens_within_context" not in gate(clean_wave(), max_tokens=None).checks


def test_loss_mask_that_does_not_fit_its_completion():
    """Multi-turn rows carry a 0/1 mask per completion token (6 here); a mask of another length, with
    another value, or with no action token at all would break or void training: stopped at the gate."""
    ok = with_rows({1: {"loss_mask": [1, 1, 0, 0, 1, 1]}})
    assert gate(ok).success, gate(ok).to_markdown()
    report = gate(with_rows({1: {"loss_mask": [1, 1, 0, 0, 1, 1]}, 3: {"loss_mask": [1, 0, 1]},
                             5: {"loss_mask": [1, 0, 2, 0, 1, 1]}, 6: {"loss_mask": [0] * 6}}))
    assert failed_checks(report) == {"loss_mask_fits"}
    (f,) = report.failures
    assert (f.column, f.unexpected_count) == ("loss_mask_fits", 3)
    assert sorted(e["row"] for e in f.examples) == [3, 5, 6]


@pytest.mark.parametrize(
    "mutate, check, column",
    [
        (lambda df: df.drop("reward"), "columns_present", None),
        (lambda df: df.rename({"reward": "score"}), "columns_present", None),
        (lambda df: df.drop("metrics"), "columns_present", None),
        (lambda df: df.with_columns(pl.col("reward").cast(pl.String)), "column_types", "reward"),
        (lambda df: df.with_columns(pl.col("step").cast(pl.Float64)), "column_types", "step"),
        (lambda df: df.with_columns(pl.col("behavior_logprobs").cast(pl.List(pl.Float64))), "column_types", "behavior_logprobs"),
        (lambda df: df.with_columns(pl.lit(None, pl.String).alias("task_id")), "required_not_null", "task_id"),
    ],
    ids=["missing", "renamed", "missing_struct", "reward_str", "step_float", "logprobs_f64", "null_task_id"],
)
def test_wrong_schema(mutate, check, column):
    report = gate(mutate(clean_wave()))
    assert not report.success
    assert failed_checks(report) == {check}, report.to_markdown()
    f = report.failures[0]
    assert f.column == column
    if check == "columns_present":
        assert f.expectation == "expect_table_columns_to_match_set"
        assert f.examples in (["reward"], ["metrics"])


def test_extra_columns_are_allowed():
    assert gate(clean_wave().with_columns(pl.lit(0.0).alias("ref_logprob_mean"))).success


def test_several_corruptions_all_reported():
    report = gate(with_rows({0: {"reward": math.nan}, 1: {"reward": 7.0}, 2: {"completion_tokens": 1000}}))
    assert failed_checks(report) == {"reward_not_null", "reward_in_bounds", "tokens_within_context"}


def test_report_renders_and_serialises():
    report = gate(with_rows({5: {"reward": math.nan}, 6: {"reward": 9.0}}))
    md = report.to_markdown()
    assert "FAILED" in md and "expect_column_values_to_not_be_null" in md and "reward_in_bounds" in md
    d = report.to_dict()
    json.dumps(d, allow_nan=False)  # strict JSON (a Prefect artifact / a CLI --json)
    assert d["success"] is False and d["failures"][0]["examples"][0]["reward"] == "nan"


def test_wave_parquet_roundtrip_through_store_then_gate(tmp_path):
    store = open_store(str(tmp_path / "store"))
    ref = store.write_table("runs/run0/waves/3/trajectories.parquet", clean_wave())
    assert check_wave(store.read_table(ref), GateConfig(), BOUNDS, 64, source=ref.uri).success


def test_gates_module_does_not_import_gx():
    code = "import sys, ratchet.data.gates, ratchet.data.cli; print('great_expectations' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- task tables ----------------------------------------------------------------------------

def test_clean_task_tables_pass():
    for audited in (False, True):
        report = check_tasks(task_table(audited=audited))
        assert report.success, report.to_markdown()
    assert "verdict_present" in check_tasks(task_table(audited=True)).checks
    assert "verdict_present" not in check_tasks(task_table()).checks


@pytest.mark.parametrize(
    "mutate, check, column",
    [
        (lambda df: pl.concat([df, df.head(1)]), "task_id_unique", "task_id"),
        (lambda df: df.with_columns(pl.when(pl.col("task_id").str.ends_with("/2")).then(pl.lit("")).otherwise("prompt").alias("prompt")),
         "prompt_not_empty", "prompt"),
        (lambda df: df.with_columns(pl.when(pl.col("task_id").str.ends_with("/2")).then(pl.lit(" \t")).otherwise("prompt").alias("prompt")),
         "prompt_not_empty", "prompt"),
        (lambda df: df.with_columns(pl.when(pl.col("task_id").str.ends_with("/2")).then(6).otherwise("difficulty").cast(pl.Int32).alias("difficulty")),
         "difficulty_in_range", "difficulty"),
        (lambda df: df.with_columns(pl.lit(0, pl.Int32).alias("difficulty")), "difficulty_in_range", "difficulty"),
        (lambda df: df.with_columns(pl.lit("test").alias("split")), "split_valid", "split"),
        (lambda df: df.with_columns(pl.lit("{not json").alias("spec_json")), "spec_json_parses", "spec_json"),
        (lambda df: df.drop("prompt"), "columns_present", None),
        (lambda df: df.with_columns(pl.col("difficulty").cast(pl.String)), "column_types", "difficulty"),
        *[(lambda df, c=c: df.with_columns(pl.when(pl.col("task_id").str.ends_with("/2")).then(None).otherwise(c).alias(c)),
           f"{c}_not_null", c) for c in ("split", "spec_json", "family", "version")],   # GX's in-set and JSON checks pass a null
    ],
    ids=["dup_id", "empty_prompt", "blank_prompt", "difficulty_6", "difficulty_0", "split", "spec_json", "no_prompt", "difficulty_str",
         "null_split", "null_spec_json", "null_family", "null_version"],
)
def test_bad_task_tables(mutate, check, column):
    report = check_tasks(mutate(task_table()))
    assert failed_checks(report) == {check}, report.to_markdown()
    assert report.failures[0].column == column


def test_audited_table_needs_verdicts():
    df = task_table(audited=True).with_columns(
        pl.when(pl.col("task_id").str.ends_with("/1")).then(None).otherwise("verdict").alias("verdict"))
    report = check_tasks(df)
    assert failed_checks(report) == {"verdict_present"}
    (f,) = report.failures
    assert (f.expectation, f.column, f.unexpected_count) == ("expect_column_values_to_not_be_null", "verdict", 1)
    assert f.examples[0]["task_id"] == "python_functions/1"


def test_empty_tables_fail():
    report = gate(clean_wave().head(0))
    assert failed_checks(report) == {"wave_not_empty"}
    assert report.failures[0].expectation == "expect_table_row_count_to_be_between"
    assert failed_checks(check_tasks(task_table().head(0))) == {"tasks_not_empty"}


def test_all_env_error_wave_fails_on_the_rate_only():
    rows = [traj_row(g, i, None, env_error=True, env_error_kind="store_unreachable") for g in range(2) for i in range(4)]
    assert failed_checks(gate(trajectories_frame(rows))) == {"env_error_rate"}


def test_raise_if_failed():
    from ratchet.data.gates import GateError

    assert gate(clean_wave()).raise_if_failed().success
    with pytest.raises(GateError, match="reward_not_null") as e:
        gate(with_rows({0: {"reward": math.nan}})).raise_if_failed()
    assert e.value.report.failed(check="reward_not_null")
