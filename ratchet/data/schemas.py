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

TURN = pl.Struct(
    {
        "turn": pl.Int32,                 # 0-based index in the episode
        "action": pl.String,              # the model's answer at this turn (as verified)
        "observation": pl.String,         # what came back and was appended after it; null on the last turn
        "action_tokens": pl.Int32,        # sampled tokens of the answer (EOS / stop included)
        "observation_tokens": pl.Int32,   # tokens of the observation as the model saw them; null when none
        "metrics": METRICS,               # this answer's verification; null where not verified
        "feedback": FEEDBACK,             # likewise
        "passed": pl.Boolean,             # Verification.passed of this answer; null where not verified
        "reward": pl.Float64,             # this answer's reward; null where not scored
        "env_error": pl.Boolean,          # its verification hit an infrastructure failure
        "shared": pl.Boolean,             # a copy of the answer another episode of the group sampled (agent.branch):
                                          # its tokens were sampled once, there; null: single-turn
    }
)
"""One turn of an episode: answer k, its verdict, and the observation the model read before answer k + 1.
The row's `completion_ids` are every turn's action and observation tokens in order, and its
`loss_mask` marks which are the model's own."""

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
        "completion": pl.String,          # the final answer (last turn's action)
        "turns": pl.List(TURN),           # every turn of the episode (single-turn: one turn, the completion)
        "prompt_tokens": pl.Int32,
        "completion_tokens": pl.Int32,
        "completion_ids": pl.List(pl.Int32),       # [completion_tokens]: a1 + o1 + a2 + ... (multi-turn)
        "behavior_logprobs": pl.List(pl.Float32),  # [completion_tokens], from the sampling policy (0.0 on observations)
        "loss_mask": pl.List(pl.Int8),             # [completion_tokens]: 1 = the model's token, 0 = observation; null = all 1
        "metrics": METRICS,               # null until verified, and for env_error rows
        "reward": pl.Float64,             # null until scored
        "env_error": pl.Boolean,          # infrastructure failure: excluded, never scored as the model's
        "env_error_kind": pl.String,
        "feedback": FEEDBACK,             # null until verified, and for rows that were not run (empty completion)
        "advantage": pl.Float64,          # set by the training stage on the rows it trains on (group estimators)
        "token_advantages": pl.List(pl.Float64),  # [completion_tokens], likewise, for GAE
    }
)

TRAJECTORY_NULLABLE = frozenset({"turns", "behavior_logprobs", "loss_mask", "metrics", "reward", "env_error_kind", "feedback",
                                 "advantage", "token_advantages"})
"""Columns that may be null (or absent from the row dicts); all others are required."""

_STRUCT_COLUMNS = ("metrics", "turns", "feedback")
"""Columns holding structs: their dicts are checked for unknown fields (polars would drop them silently)."""


def trajectories_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Build the trajectory table from row dicts, cast to TRAJECTORY_SCHEMA.

    Ints are accepted for float columns and for `group_id` (stored as its string); nullable
    columns may be omitted; omitted `turns` become the single turn {turn: 0, action: completion,
    action_tokens: completion_tokens} (the rest null). Anything else that does not fit raises one
    SchemaError naming the column, the row and the value."""
    rows = [_defaults(r) for r in rows]
    return _frame(rows, TRAJECTORY_SCHEMA, "trajectory", nullable=TRAJECTORY_NULLABLE)


def _defaults(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row)
    if isinstance(row.get("group_id"), int) and not isinstance(row["group_id"], bool):
        row["group_id"] = str(row["group_id"])
    if row.get("turns") is None and isinstance(row.get("completion"), str):
        row["turns"] = [single_turn(row["completion"], row.get("completion_tokens"))]
    return row


def single_turn(completion: str, completion_tokens: int | None) -> dict[str, Any]:
    """The `turns` entry of a single-turn row: the completion as turn 0, nothing observed after it."""
    return {"turn": 0, "action": completion, "observation": None, "action_tokens": completion_tokens,
            "observation_tokens": None, "metrics": None, "feedback": None, "passed": None, "reward": None,
            "env_error": None, "shared": None}


def _unknown_fields(value: Any, dtype: pl.DataType, path: str) -> tuple[str, list[str], list[str]] | None:
    """The first dict inside `value` with fields its struct type lacks: (where, extra, expected)."""
    if isinstance(dtype, pl.Struct) and isinstance(value, dict):
        fields = {f.name: f.dtype for f in dtype.fields}
        extra = sorted(set(value) - set(fields))
        if extra:
            return path, extra, sorted(fields)
        for key, v in value.items():
            found = _unknown_fields(v, fields[key], f"{path}.{key}") if v is not None else None
            if found:
                return found
    elif isinstance(dtype, pl.List) and isinstance(dtype.inner, (pl.Struct, pl.List)) and isinstance(value, list):
        for j, v in enumerate(value):
            found = _unknown_fields(v, dtype.inner, f"{path}[{j}]")
            if found:
                return found
    return None


def _frame(rows: list[dict[str, Any]], schema: pl.Schema, what: str, nullable: frozenset[str] = frozenset()) -> pl.DataFrame:
    known = set(schema)
    for i, row in enumerate(rows):
        unknown = set(row) - known
        if unknown:
            raise SchemaError(f"{what} row {i}: unknown column(s) {sorted(unknown)}; expected {list(schema)}")
        missing = [c for c in schema if c not in nullable and row.get(c) is None]
        if missing:
            raise SchemaError(f"{what} row {i}: column {missing[0]!r} is required (missing or null)")
        for col in _STRUCT_COLUMNS:
            found = _unknown_fields(row[col], schema[col], col) if col in schema and row.get(col) is not None else None
            if found:
                where, extra, fields = found
                at = f" ({where})" if where != col else ""
                raise SchemaError(f"{what} row {i}: column {col!r}{at} has unknown field(s) {extra}; "
                                  f"expected {fields}")
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

