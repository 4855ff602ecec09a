"""Table schemas: constructors enforce types with errors that name the column and row;
Parquet keeps every type (lists, structs, f32, multi-turn).

    .venv/bin/pytest -q tests/data/test_schemas.py
"""

from __future__ import annotations

import polars as pl
import pytest

from envs.spec import TaskSpec
from ratchet.data import (
    AUDITED_TASK_SCHEMA,
    TASK_SCHEMA,
    TRAJECTORY_SCHEMA,
    SchemaError,
    conform,
    schema_diff,
    tasks_frame,
    trajectories_frame,
)
from tests.data.waves import clean_rows, spec, traj_row

FIRST_METRICS = {"test_pass_rate": 0.25, "tests_passed": 1, "tests_total": 4, "syntax_ok": True,
                 "execution_time_ms": 3.0, "peak_memory_mb": 9.0, "timed_out": False, "format_ok": True,
                 "output_bytes": 0, "security_flags": [], "exit_code": 1}
FIRST_FEEDBACK = {"exit_code": 1, "killed_by": None, "timed_out": False, "stdout_tail": "", "stderr_tail": "",
                  "failed_tests": [{"name": "test_f", "detail": "expected 1, got 0"}]}
MULTI_TURN = [  # answer, its verdict and the observation read before the next answer; the last turn observes nothing
    {"turn": 0, "action": "def f(): return 0", "observation": "1 of 4 tests passed: test_f expected 1, got 0",
     "action_tokens": 3, "observation_tokens": 2, "metrics": FIRST_METRICS, "feedback": FIRST_FEEDBACK,
     "passed": False, "reward": 0.25, "env_error": False, "shared": False},
    {"turn": 1, "action": "def f(): return 1", "observation": None, "action_tokens": 1, "observation_tokens": None,
     "metrics": None, "feedback": None, "passed": None, "reward": None, "env_error": None, "shared": False},
]


def test_trajectories_frame_has_the_schema():
    df = trajectories_frame(clean_rows())
    assert df.schema == TRAJECTORY_SCHEMA
    assert df.height == 32
    assert df["behavior_logprobs"].dtype == pl.List(pl.Float32)
    assert df["metrics"].struct.field("tests_total").dtype == pl.Int32


def test_parquet_roundtrip_keeps_types_and_turns(tmp_path):
    rows = clean_rows(groups=2)
    rows[0] = {**rows[0], "turns": MULTI_TURN, "completion": "def f(): return 1", "advantage": 0.75,
               "loss_mask": [1, 1, 1, 0, 0, 1]}  # a1 (3 tokens) + o1 (2) + a2 (1) = completion_tokens 6
    rows[1] = {**rows[1], "metrics": {**rows[1]["metrics"], "security_flags": ["network", "fork"]}}
    rows[2] = traj_row(0, 2, None, env_error=True, env_error_kind="sandbox_start")
    df = trajectories_frame(rows)
    path = tmp_path / "trajectories.parquet"
    df.write_parquet(path)
    back = pl.read_parquet(path)
    assert back.schema == TRAJECTORY_SCHEMA
    assert back.equals(df)
    assert back["turns"][0].to_list() == MULTI_TURN  # every turn kept, in order, with its verdict
    assert back["loss_mask"].dtype == pl.List(pl.Int8)
    assert back["loss_mask"][0].to_list() == [1, 1, 1, 0, 0, 1] and back["loss_mask"][1] is None  # null: all ones
    assert back["metrics"][1]["security_flags"] == ["network", "fork"]
    assert back.row(2, named=True)["metrics"] is None and back.row(2, named=True)["env_error_kind"] == "sandbox_start"
    assert back["behavior_logprobs"][0].to_list() == [-0.5, -0.25, -1.0, -0.125, -2.0, -0.0625]  # exact in f32


def test_defaults_for_single_turn_and_int_group_ids():
    row = traj_row(0, 0, 1.0, group_id=7)
    row.pop("turns", None)
    row.pop("advantage")
    df = trajectories_frame([row])
    assert df["group_id"][0] == "7"
    assert df["turns"][0].to_list() == [{"turn": 0, "action": row["completion"], "observation": None,
                                         "action_tokens": row["completion_tokens"], "observation_tokens": None,
                                         "metrics": None, "feedback": None, "passed": None, "reward": None,
                                         "env_error": None, "shared": None}]
    assert df["loss_mask"][0] is None
    assert df["advantage"][0] is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"reward": "high"}, "row 3: column 'reward' expects Float64, got 'high'"),
        ({"step": 1.5}, "row 3: column 'step' expects Int64, got 1.5"),
        ({"completion_ids": [1, "2"]}, "row 3: column 'completion_ids'"),
        ({"env_error": "no"}, "row 3: column 'env_error' expects Boolean"),
        ({"task_id": None}, "row 3: column 'task_id' is required"),
        ({"completion_text": "x"}, "row 3: unknown column(s) ['completion_text']"),
        ({"metrics": {"test_passrate": 1.0}}, "row 3: column 'metrics' has unknown field(s) ['test_passrate']"),
        ({"turns": [{"role": "user", "content": "x"}]}, "row 3: column 'turns' (turns[0]) has unknown field(s) ['content', 'role']"),
        ({"turns": [{"turn": 0, "metrics": {"passrate": 1.0}}]},
         "row 3: column 'turns' (turns[0].metrics) has unknown field(s) ['passrate']"),
        ({"turns": [{"turn": 0, "feedback": {"failed_tests": [{"name": "t", "why": "x"}]}}]},
         "row 3: column 'turns' (turns[0].feedback.failed_tests[0]) has unknown field(s) ['why']"),
        ({"loss_mask": [1, 0, 300]}, "row 3: column 'loss_mask' expects List(Int8)"),
    ],
)
def test_bad_rows_are_named(change, message):
    rows = clean_rows(groups=1)
    rows[3] = {**rows[3], **change}
    with pytest.raises(SchemaError) as e:
        trajectories_frame(rows)
    assert message in str(e.value)


def test_missing_required_column_is_named():
    rows = clean_rows(groups=1)
    del rows[2]["completion_tokens"]
    with pytest.raises(SchemaError, match="row 2: column 'completion_tokens' is required"):
        trajectories_frame(rows)


def test_conform_orders_and_casts():
    df = trajectories_frame(clean_rows(groups=1))
    loose = df.with_columns(pl.col("difficulty").cast(pl.Int64), pl.col("prompt_tokens").cast(pl.Int64)).select(
        reversed(df.columns))
    assert conform(loose, TRAJECTORY_SCHEMA).equals(df)
    with pytest.raises(SchemaError, match=r"missing column\(s\) \['reward'\]"):
        conform(df.drop("reward"), TRAJECTORY_SCHEMA)
    with pytest.raises(SchemaError, match="column 'step' is String and does not cast to Int64"):
        conform(df.with_columns(pl.lit("three").alias("step")), TRAJECTORY_SCHEMA)
    extra = df.with_columns(pl.lit(1).alias("x"))
    with pytest.raises(SchemaError, match=r"unexpected column\(s\) \['x'\]"):
        conform(extra, TRAJECTORY_SCHEMA)
    assert conform(extra, TRAJECTORY_SCHEMA, extra="drop").columns == list(TRAJECTORY_SCHEMA)
    assert conform(extra, TRAJECTORY_SCHEMA, extra="keep").columns == [*TRAJECTORY_SCHEMA, "x"]


def test_schema_diff():
    df = trajectories_frame(clean_rows(groups=1)).rename({"reward": "score"}).with_columns(pl.col("step").cast(pl.Float64))
    assert schema_diff(df, TRAJECTORY_SCHEMA) == {
        "missing": ["reward"], "extra": ["score"], "wrong_type": ["step: got Float64, expected Int64"]}


def test_task_table_roundtrip(tmp_path):
    specs = [spec(i) for i in range(3)]
    df = tasks_frame(specs)
    assert df.schema == TASK_SCHEMA
    audited = tasks_frame(specs, [("pass", ""), ("fail", "empty answer passed"), ("pass", "")])
    assert audited.schema == AUDITED_TASK_SCHEMA
    audited.write_parquet(tmp_path / "audit.parquet")
    back = pl.read_parquet(tmp_path / "audit.parquet")
    assert back.equals(audited)
    assert TaskSpec.model_validate_json(back["spec_json"][1]) == specs[1]  # the full spec survives
    with pytest.raises(SchemaError, match="3 specs but 2 verdicts"):
        tasks_frame(specs, [("pass", "")] * 2)
