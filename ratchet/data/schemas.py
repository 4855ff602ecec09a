"""Polars schemas of ratchet's tables, and constructors that enforce them.

Two tables cross stage boundaries as Parquet in the store:

- the task table (`envs/<family>/<version>/tasks.parquet`, `audit.parquet`): one row per
  task spec, the full spec as JSON in `spec_json`, audit verdicts once audited;
- the trajectory table (`runs/<run_id>/waves/<step>/trajectories.parquet`): one row per
  sampled attempt (DESIGN.md, "Trajectory row"), metrics and feedback from verification,
  reward and advantages once trained on.

    frame = trajectories_frame(rows)            # list[dict] -> typed frame, or one clear error
    frame = conform(pl.read_parquet(p), TRAJECTORY_SCHEMA)

Parquet keeps every type here (lists, structs, f32), so a frame read back equals the one written.
"""

from __future__ import annotations

from typing import Any, Iterable

import polars as pl


class SchemaError(ValueError):
    """A table or row does not fit its schema; the message names the column (and row)."""


# --- task table ----------------------------------------------------------------------------

TASK_SCHEMA = pl.Schema(
    {
        "task_id": pl.String,
        "family": pl.String,
        "difficulty": pl.Int32,
        "version": pl.String,
        "split": pl.String,       # "train" | "heldout"
        "prompt": pl.String,
        "spec_json": pl.String,   # the full TaskSpec, model_dump_json()
    }
)
AUDIT_COLUMNS = pl.Schema({"verdict": pl.String, "reason": pl.String})
"""Added by the audit: verdict (e.g. "pass" / "fail"), reason (why, empty when it passed)."""
AUDITED_TASK_SCHEMA = pl.Schema({**TASK_SCHEMA, **AUDIT_COLUMNS})


def tasks_frame(specs: Iterable[Any], verdicts: Iterable[tuple[str, str]] | None = None) -> pl.DataFrame:
    """Task specs (envs.spec.TaskSpec) -> the task table; with `verdicts` ((verdict, reason) per
    spec, in order) -> the audited task table."""
    rows = [
        {
            "task_id": s.task_id, "family": s.family, "difficulty": s.difficulty, "version": s.version,
            "split": s.split, "prompt": s.prompt, "spec_json": s.model_dump_json(),
        }
        for s in specs
    ]
    if verdicts is None:
        return _frame(rows, TASK_SCHEMA, "task")
    verdicts = list(verdicts)
    if len(verdicts) != len(rows):
        raise SchemaError(f"tasks_frame: {len(rows)} specs but {len(verdicts)} verdicts")
    for row, (verdict, reason) in zip(rows, verdicts):
        row["verdict"], row["reason"] = verdict, reason
    return _frame(rows, AUDITED_TASK_SCHEMA, "task")


# --- trajectory table ----------------------------------------------------------------------

TURN = pl.Struct({"role": pl.String, "content": pl.String})

METRICS = pl.Struct(
    {
        "test_pass_rate": pl.Float64,     # tests passed / total, in [0, 1]
        "tests_passed": pl.Int32,
        "tests_total": pl.Int32,
        "syntax_ok": pl.Boolean,
        "execution_time_ms": pl.Float64,
        "peak_memory_mb": pl.Float64,
        "timed_out": pl.Boolean,
        "format_ok": pl.Boolean,
        "output_bytes": pl.Int64,
        "security_flags": pl.List(pl.String),
        "exit_code": pl.Int32,            # the run's exit status (null: ended by a signal); run_command passes on 0
    }
)

FAILED_TEST = pl.Struct({"name": pl.String, "detail": pl.String})

FEEDBACK = pl.Struct(
    {
        "exit_code": pl.Int32,            # null: the process never exited on its own (killed, not started)
        "killed_by": pl.String,           # the sandbox limit that ended it ("wall", "memory", ...), or null
        "timed_out": pl.Boolean,
        "stdout_tail": pl.String,         # last VerifyConfig.feedback_bytes of stdout (harness result lines left out)
        "stderr_tail": pl.String,         # likewise of stderr (or the sandbox's own error)
        "failed_tests": pl.List(FAILED_TEST),  # pytest FAILED/ERROR lines, failed hidden calls, a failed script
    }
)
"""What the sandbox said about a row's run (ratchet.verify.verifier.feedback_from), for `ratchet trace`."""

TRAJECTORY_SCHEMA = pl.Schema(
    {
        "run_id": pl.String,
        "step": pl.Int64,                 # wave index
        "policy_version": pl.Int64,       # optimizer step of the weights that sampled this row
        "task_id": pl.String,
        "family": pl.String,
        "difficulty": pl.Int32,
        "group_id": pl.String,            # rows sampled from the same prompt share it (GRPO group)
        "sample_idx": pl.Int32,           # index within the group
        "prompt": pl.String,
        "completion": pl.String,          # the final answer (last assistant turn)
        "turns": pl.List(TURN),           # every turn, for multi-turn episodes (single-turn: 2 turns)
        "prompt_tokens": pl.Int32,
        "completion_tokens": pl.Int32,
        "completion_ids": pl.List(pl.Int32),       # [completion_tokens]
        "behavior_logprobs": pl.List(pl.Float32),  # [completion_tokens], from the sampling policy
        "metrics": METRICS,               # null until verified, and for env_error rows
        "reward": pl.Float64,             # null until scored
        "env_error": pl.Boolean,          # infrastructure failure: excluded, never scored as the model's
        "env_error_kind": pl.String,
        "feedback": FEEDBACK,             # null until verified, and for rows that were not run (empty completion)
        "advantage": pl.Float64,          # set by the training stage on the rows it trains on (group estimators)
        "token_advantages": pl.List(pl.Float64),  # [completion_tokens], likewise, for GAE
    }
)

TRAJECTORY_NULLABLE = frozenset({"turns", "behavior_logprobs", "metrics", "reward", "env_error_kind", "feedback",
                                 "advantage", "token_advantages"})
"""Columns that may be null (or absent from the row dicts); all others are required."""

_STRUCT_FIELDS = {"metrics": set(METRICS.to_schema()), "turns": {"role", "content"},
                  "feedback": set(FEEDBACK.to_schema())}


def trajectories_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Build the trajectory table from row dicts, cast to TRAJECTORY_SCHEMA.

    Ints are accepted for float columns and for `group_id` (stored as its string); nullable
    columns may be omitted; omitted `turns` become [user: prompt, assistant: completion]. Anything else that does not fit raises one SchemaError naming
    the column, the row and the value."""
    rows = [_defaults(r) for r in rows]
    return _frame(rows, TRAJECTORY_SCHEMA, "trajectory", nullable=TRAJECTORY_NULLABLE)


def _defaults(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row)
    if isinstance(row.get("group_id"), int) and not isinstance(row["group_id"], bool):
        row["group_id"] = str(row["group_id"])
    if row.get("turns") is None and isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        row["turns"] = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    return row


def _frame(rows: list[dict[str, Any]], schema: pl.Schema, what: str, nullable: frozenset[str] = frozenset()) -> pl.DataFrame:
    known = set(schema)
    for i, row in enumerate(rows):
        unknown = set(row) - known
        if unknown:
            raise SchemaError(f"{what} row {i}: unknown column(s) {sorted(unknown)}; expected {list(schema)}")
        missing = [c for c in schema if c not in nullable and row.get(c) is None]
        if missing:
            raise SchemaError(f"{what} row {i}: column {missing[0]!r} is required (missing or null)")
        for col, fields in _STRUCT_FIELDS.items():
            if col in schema and row.get(col) is not None:
                items = row[col] if col == "turns" else [row[col]]
                for item in items:
                    extra = set(item) - fields if isinstance(item, dict) else set()
                    if extra:
                        raise SchemaError(f"{what} row {i}: column {col!r} has unknown field(s) {sorted(extra)}; "
                                          f"expected {sorted(fields)}")
    columns = []
    for col, dtype in schema.items():
        values = [r.get(col) for r in rows]
        try:
            columns.append(pl.Series(col, values, dtype=dtype, strict=True))
        except (TypeError, pl.exceptions.PolarsError, OverflowError) as e:
            i, bad = _first_bad(values, dtype)
            raise SchemaError(f"{what} row {i}: column {col!r} expects {dtype}, got {bad!r}") from e
    return pl.DataFrame(columns)


def _first_bad(values: list[Any], dtype: pl.DataType) -> tuple[int | str, Any]:
    for i, v in enumerate(values):
        try:
            pl.Series("x", [v], dtype=dtype, strict=True)
        except (TypeError, pl.exceptions.PolarsError, OverflowError):
            return i, v
    return "?", "(a value that only fails together with the others)"


def conform(df: pl.DataFrame, schema: pl.Schema, extra: str = "error") -> pl.DataFrame:
    """Return `df` with exactly `schema`'s columns, in its order and types.

    Missing columns are an error; so is a value that does not cast (e.g. "abc" to int) or a
    cast that loses information (strict). Extra columns: "error" (default), "drop" or "keep"
    (kept after the schema's)."""
    missing = [c for c in schema if c not in df.columns]
    if missing:
        raise SchemaError(f"missing column(s) {missing}; have {df.columns}")
    extras = [c for c in df.columns if c not in schema]
    if extras and extra == "error":
        raise SchemaError(f"unexpected column(s) {extras}; expected {list(schema)}")
    exprs = []
    for col, dtype in schema.items():
        if df.schema[col] == dtype:
            exprs.append(pl.col(col))
            continue
        try:
            df.select(pl.col(col).cast(dtype, strict=True))
        except pl.exceptions.PolarsError as e:
            raise SchemaError(f"column {col!r} is {df.schema[col]} and does not cast to {dtype}: {e}") from e
        exprs.append(pl.col(col).cast(dtype, strict=True))
    keep = [pl.col(c) for c in extras] if extra == "keep" else []
    return df.select(exprs + keep)


def schema_diff(df: pl.DataFrame | pl.Schema, schema: pl.Schema) -> dict[str, list[str]]:
    """{"missing": [...], "extra": [...], "wrong_type": ["col: got X, expected Y", ...]}."""
    have = df.schema if isinstance(df, pl.DataFrame) else df
    return {
        "missing": [c for c in schema if c not in have],
        "extra": [c for c in have if c not in schema],
        "wrong_type": [f"{c}: got {have[c]}, expected {t}" for c, t in schema.items() if c in have and have[c] != t],
    }

