"""Validation gates: Great Expectations suites that a table must pass before it moves on.

- `check_tasks(df)`: a produced (or audited) task table, before rollouts sample from it.
- `check_wave(df, cfg, reward_bounds, max_tokens)`: a scored wave, before it may train.

Each suite is declared once, below, as a list of `Check`s: a name we use in reports, the
Great Expectations expectation that implements it, and the frame it runs on. Row-level
checks run as GX expectations on pandas views of the table (GX does not take polars);
aggregates (env_error rate, zero-variance groups) are GX expectations on small derived
frames; column types are checked on the polars schema (GX only sees pandas dtypes). Every
failure, whatever ran it, lands in one `GateReport`.

GX is imported on the first check (it costs seconds), never at module import.

    report = check_wave(pl.read_parquet(path), GateConfig(), reward_bounds=(-0.5, 1.0), max_tokens=256)
    if not report.success: print(report.to_markdown())

Run on a file: `ratchet gate check FILE.parquet`.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import polars as pl

from ratchet.config import GateConfig
from ratchet.data.schemas import (
    AUDIT_COLUMNS,
    TASK_SCHEMA,
    TRAJECTORY_NULLABLE,
    TRAJECTORY_SCHEMA,
    schema_diff,
)
from ratchet.errors import picklable

N_EXAMPLES = 5


# --- the report -----------------------------------------------------------------------------

@dataclass(frozen=True)
class GateFailure:
    check: str                 # our name for the rule, e.g. "reward_in_bounds"
    expectation: str           # the GX expectation type, e.g. "expect_column_values_to_be_between"
    column: str | None
    unexpected_count: int | None   # rows (or groups) that broke it; None for table-level checks
    examples: list[Any] = field(default_factory=list)   # a few offending rows / groups / values
    observed: Any = None       # the aggregate observed, for aggregate checks
    detail: str = ""           # the rule in words, with its threshold


@dataclass(frozen=True)
class GateReport:
    gate: str                  # "wave" | "tasks"
    success: bool
    rows: int
    checks: list[str]          # every check that ran
    failures: list[GateFailure]
    source: str = ""           # what was checked (a URI or a path), for the report heading

    def failed(self, check: str | None = None, expectation: str | None = None, column: str | None = None) -> list[GateFailure]:
        """Failures matching every given field."""
        return [f for f in self.failures
                if (check is None or f.check == check) and (expectation is None or f.expectation == expectation)
                and (column is None or f.column == column)]

    def raise_if_failed(self) -> GateReport:
        """Raise GateError (carrying this report) unless the gate passed; return self otherwise."""
        if not self.success:
            raise GateError(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain, strict-JSON data (NaN/inf become the strings "nan"/"inf")."""
        return _clean(asdict(self))

    def to_markdown(self) -> str:
        where = f" `{self.source}`" if self.source else ""
        if self.success:
            return f"## {self.gate} gate{where}: passed\n\n{self.rows} rows, {len(self.checks)} checks passed.\n"
        lines = [
            f"## {self.gate} gate{where}: FAILED",
            "",
            f"{self.rows} rows; {len(self.failures)} of {len(self.checks)} checks failed.",
            "",
            "| check | expectation | column | unexpected | observed | examples |",
            "|---|---|---|---|---|---|",
        ]
        for f in self.failures:
            cells = [f.check, f"`{f.expectation}`", f.column or "", "" if f.unexpected_count is None else str(f.unexpected_count),
                     "" if f.observed is None else _short(f.observed), "; ".join(_short(e) for e in f.examples)]
            lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
        lines += ["", *[f"- **{f.check}**: {f.detail}" for f in self.failures if f.detail]]
        return "\n".join(lines) + "\n"


@picklable
class GateError(Exception):
    """A gate failed; `.report` has every failed expectation, `str()` is its Markdown."""

    def __init__(self, report: GateReport):
        self.report = report
        super().__init__(report.to_markdown())


def _clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "tolist"):         # numpy scalars and arrays
        return _clean(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    return repr(x)


def _short(x: Any, n: int = 80) -> str:
    if isinstance(x, dict):
        s = ", ".join(f"{k}={_short(v, 40)}" for k, v in x.items())
    else:
        s = repr(x.item() if hasattr(x, "item") else x)
    return s if len(s) <= n else s[: n - 1] + "…"


# --- suite declarations ---------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    name: str
    frame: str                          # which derived frame it runs on
    expectation: Callable[[Any], Any]   # gxe module -> Expectation
    needs: tuple[str, ...] = ()         # source columns that must be present with the right type
    detail: str = ""
    aggregate: bool = False             # a statistic of the frame: skipped when the frame is empty


_OK = "env_error == False"
_EMPTY_SCORED = "completion_empty == True and env_error == False"


def wave_checks(cfg: GateConfig, reward_bounds: tuple[float, float] | None, max_tokens: int | None) -> list[Check]:
    """The wave gate, declared once. `reward_bounds=None` only demands finite rewards."""
    lo, hi = reward_bounds if reward_bounds is not None else (-1.7976931348623157e308, 1.7976931348623157e308)
    checks = [
        Check("wave_not_empty", "rows", lambda g: g.ExpectTableRowCountToBeBetween(min_value=1), (),
              "a wave has at least one trajectory"),
        Check("reward_not_null", "rows", lambda g: g.ExpectColumnValuesToNotBeNull(
            column="reward", row_condition=_OK, condition_parser="pandas"), ("reward", "env_error"),
            "every row that is not an env_error has a reward, and it is not NaN"),
        Check("reward_in_bounds", "rows", lambda g: g.ExpectColumnValuesToBeBetween(
            column="reward", min_value=lo, max_value=hi, row_condition=_OK, condition_parser="pandas"),
            ("reward", "env_error"), f"reward is finite and within the reward logic's bounds [{lo:g}, {hi:g}]"),
        Check("empty_completion_reward", "rows", lambda g: g.ExpectColumnValuesToBeBetween(
            column="reward", max_value=0.0, row_condition=_EMPTY_SCORED, condition_parser="pandas"),
            ("reward", "env_error", "completion"), "an empty completion never earns a positive reward"),
        Check("empty_completion_passes", "rows", lambda g: g.ExpectColumnValuesToBeBetween(
            column="test_pass_rate", max_value=0.0, row_condition=_EMPTY_SCORED, condition_parser="pandas"),
            ("metrics", "env_error", "completion"), "an empty completion never counts as passing tests"),
        Check("env_error_rate", "rows", lambda g: g.ExpectColumnMeanToBeBetween(
            column="env_error", min_value=0.0, max_value=cfg.max_env_error_rate), ("env_error",),
            f"at most {cfg.max_env_error_rate:.1%} of rows are env_error (infrastructure failures)", aggregate=True),
        Check("zero_variance_groups", "groups", lambda g: g.ExpectColumnMeanToBeBetween(
            column="zero_variance", min_value=0.0, max_value=cfg.max_zero_variance_frac),
            ("group_id", "reward", "env_error"),
            f"at most {cfg.max_zero_variance_frac:.1%} of groups have all-equal rewards (no learning signal)",
            aggregate=True),
        Check("loss_mask_fits", "rows", lambda g: g.ExpectColumnValuesToBeInSet(
            column="loss_mask_fits", value_set=[True]), ("loss_mask", "completion_tokens"),
            "a row's loss_mask (multi-turn: 0 on observation tokens) is null or has one 0/1 entry per completion "
            "token, at least one of them 1"),
    ]
    if max_tokens is not None:
        checks.append(Check("tokens_within_context", "rows", lambda g: g.ExpectColumnValuesToBeBetween(
            column="total_tokens", min_value=0, max_value=max_tokens), ("prompt_tokens", "completion_tokens"),
            f"prompt_tokens + completion_tokens <= {max_tokens} (the context length)"))
    return checks


def task_checks(audited: bool) -> list[Check]:
    """The task-table gate, declared once."""
    checks = [
        Check("tasks_not_empty", "rows", lambda g: g.ExpectTableRowCountToBeBetween(min_value=1), (),
              "a task table has at least one task"),
        Check("task_id_not_null", "rows", lambda g: g.ExpectColumnValuesToNotBeNull(column="task_id"), ("task_id",)),
        Check("task_id_unique", "rows", lambda g: g.ExpectColumnValuesToBeUnique(column="task_id"), ("task_id",),
              "task ids are unique"),
        Check("prompt_not_empty", "rows", lambda g: g.ExpectColumnValuesToMatchRegex(column="prompt", regex=r"\S"),
              ("prompt",), "every prompt has a non-blank character"),
        Check("prompt_not_null", "rows", lambda g: g.ExpectColumnValuesToNotBeNull(column="prompt"), ("prompt",)),
        Check("difficulty_in_range", "rows", lambda g: g.ExpectColumnValuesToBeBetween(
            column="difficulty", min_value=1, max_value=5), ("difficulty",), "difficulty is 1..5"),
        Check("difficulty_not_null", "rows", lambda g: g.ExpectColumnValuesToNotBeNull(column="difficulty"), ("difficulty",)),
        Check("split_valid", "rows", lambda g: g.ExpectColumnValuesToBeInSet(
            column="split", value_set=["train", "heldout"]), ("split",), "split is train or heldout"),
        Check("spec_json_parses", "rows", lambda g: g.ExpectColumnValuesToBeJsonParseable(column="spec_json"),
              ("spec_json",), "spec_json holds the full task spec as JSON"),
    ]
    # GX's in-set, regex and JSON expectations pass a null: each of those columns must also be present
    checks += [Check(f"{column}_not_null", "rows", lambda g, c=column: g.ExpectColumnValuesToNotBeNull(column=c), (column,))
               for column in ("split", "spec_json", "family", "version")]
    if audited:
        checks += [
            Check("verdict_present", "rows", lambda g: g.ExpectColumnValuesToNotBeNull(column="verdict"), ("verdict",),
                  "every task of an audited table has a verdict"),
            Check("verdict_not_empty", "rows", lambda g: g.ExpectColumnValuesToMatchRegex(column="verdict", regex=r"\S"),
                  ("verdict",), "verdicts are not blank"),
        ]
    return checks


# --- the gates ------------------------------------------------------------------------------

def check_wave(
    df: pl.DataFrame,
    cfg: GateConfig | None = None,
    reward_bounds: tuple[float, float] | None = None,
    max_tokens: int | None = None,
    source: str = "",
    signal: pl.Series | None = None,
) -> GateReport:
    """Run the wave gate on a scored trajectory table (TRAJECTORY_SCHEMA). `signal`: per row, what a
    group's rows must differ in to train (`ratchet.stages.learning_signal`; None: the reward)."""
    cfg = cfg or GateConfig()
    failures = _schema_failures(df, TRAJECTORY_SCHEMA, required=[c for c in TRAJECTORY_SCHEMA if c not in TRAJECTORY_NULLABLE])
    usable = {c for c, t in TRAJECTORY_SCHEMA.items() if df.schema.get(c) == t}
    if "reward" in usable:
        df = df.with_columns(pl.col("reward").alias("signal") if signal is None else signal.alias("signal"))
    frames = {"rows": _wave_rows(df, usable), "groups": _wave_groups(df, usable)}
    checks = wave_checks(cfg, reward_bounds, max_tokens)
    failures += _run_gx("wave", checks, frames, usable)
    failures = [_with_aggregate_examples(f, df, usable) for f in failures]
    names = ["columns_present", "column_types", "required_not_null"] + [c.name for c in checks]
    return GateReport("wave", not failures, df.height, names, failures, source)


def check_tasks(df: pl.DataFrame, source: str = "") -> GateReport:
    """Run the task-table gate; the table counts as audited when it has a `verdict` column."""
    audited = "verdict" in df.columns
    schema = pl.Schema({**TASK_SCHEMA, **AUDIT_COLUMNS}) if audited else TASK_SCHEMA
    failures = _schema_failures(df, schema, required=[])
    usable = {c for c, t in schema.items() if df.schema.get(c) == t}
    rows = df.select([c for c in schema if c in usable]).with_row_index("row").to_pandas()
    checks = task_checks(audited)
    failures += _run_gx("tasks", checks, {"rows": rows}, usable)
    names = ["columns_present", "column_types"] + [c.name for c in checks]
    return GateReport("tasks", not failures, df.height, names, failures, source)


def _schema_failures(df: pl.DataFrame, schema: pl.Schema, required: list[str]) -> list[GateFailure]:
    import pandas as pd

    gx = _gx()
    out = []
    # column presence: a GX expectation on an empty frame with the table's columns
    with _LOCK:
        batch = _batch("schema", pd.DataFrame(columns=df.columns))
        res = batch.validate(gx.expectations.ExpectTableColumnsToMatchSet(column_set=list(schema), exact_match=False))
    diff = schema_diff(df, schema)
    if not res.success:
        out.append(GateFailure("columns_present", "expect_table_columns_to_match_set", None, len(diff["missing"]),
                               diff["missing"], detail=f"missing {diff['missing']}; extra {diff['extra']}"))
    for c, t in schema.items():
        if c in df.columns and df.schema[c] != t:
            out.append(GateFailure("column_types", "expect_column_values_to_be_of_type", c, df.height,
                                   [f"got {df.schema[c]}, expected {t}"], detail=f"{c} is {df.schema[c]}, the schema says {t}"))
    present = [c for c in required if c in df.columns]     # none present: nothing to count (not a crash)
    nulls = df.select([pl.col(c).null_count() for c in present]).row(0, named=True) if present else {}
    for c, n in nulls.items():
        if n:
            rows = df.with_row_index("row").filter(pl.col(c).is_null())["row"].head(N_EXAMPLES).to_list()
            out.append(GateFailure("required_not_null", "expect_column_values_to_not_be_null", c, n,
                                   [{"row": r} for r in rows], detail=f"{c} is required"))
    return out


def _wave_rows(df: pl.DataFrame, usable: set[str]):
    """The pandas view the row-level wave checks run on: one row per trajectory."""
    cols: list[pl.Expr] = [pl.col(c) for c in ("task_id", "group_id", "reward", "env_error_kind") if c in usable]
    cols.append(pl.col("env_error") if "env_error" in usable else pl.lit(False).alias("env_error"))
    if "completion" in usable:
        cols.append((pl.col("completion").fill_null("").str.strip_chars() == "").alias("completion_empty"))
    if "metrics" in usable:
        cols.append(pl.col("metrics").struct.field("test_pass_rate").alias("test_pass_rate"))
    if {"prompt_tokens", "completion_tokens"} <= usable:
        cols.append((pl.col("prompt_tokens").cast(pl.Int64) + pl.col("completion_tokens")).alias("total_tokens"))
    if {"loss_mask", "completion_tokens"} <= usable:
        m = pl.col("loss_mask")
        fits = ((m.list.len() == pl.col("completion_tokens")) & m.list.eval(pl.element().is_in([0, 1])).list.all()
                & (m.list.max() == 1))
        cols.append((m.is_null() | fits.fill_null(False)).alias("loss_mask_fits"))
    return df.with_row_index("row").select(pl.col("row"), *cols).to_pandas()


def _wave_groups(df: pl.DataFrame, usable: set[str]):
    """One row per group of non-env_error rows: zero_variance = 1.0 if its rows' `signal` (the
    reward, or what the trainer compares: check_wave) is all equal."""
    if not {"group_id", "reward", "env_error"} <= usable:
        return None
    groups = (df.filter(~pl.col("env_error"))
              .group_by("group_id")
              .agg(pl.len().alias("n"), (pl.col("signal").n_unique() == 1).cast(pl.Float64).alias("zero_variance"))
              .sort("group_id"))
    return groups.to_pandas() if groups.height else None


def _with_aggregate_examples(f: GateFailure, df: pl.DataFrame, usable: set[str]) -> GateFailure:
    """GX reports an aggregate's observed value only; add which rows/groups made it."""
    if f.check == "env_error_rate":
        kinds = (df.filter(pl.col("env_error")).group_by("env_error_kind").len().sort("len", descending=True)
                 .head(N_EXAMPLES).rows(named=True)) if "env_error_kind" in usable else []
        n = int(df["env_error"].sum())
        return replace(f, unexpected_count=n, examples=kinds)
    if f.check == "zero_variance_groups":
        zv = (df.filter(~pl.col("env_error")).group_by("group_id")
              .agg(pl.col("reward").first(), pl.col("signal").n_unique().alias("k"), pl.len().alias("n"))
              .filter(pl.col("k") == 1).sort("group_id"))
        examples = [{"group_id": g, "reward": r, "n": n} for g, r, n in zv.select("group_id", "reward", "n").head(N_EXAMPLES).rows()]
        return replace(f, unexpected_count=zv.height, examples=examples)
    return f


# --- GX plumbing ----------------------------------------------------------------------------

_GX: Any = None
_CTX: Any = None
_LOCK = threading.RLock()
"""GX's context is not thread-safe; gates may run in a Prefect thread pool."""


def _gx():
    """great_expectations, imported once and quietly (no analytics, no progress bars)."""
    global _GX
    with _LOCK:
        if _GX is None:
            os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
            import great_expectations as gx
            import great_expectations.expectations  # noqa: F401  (gx.expectations.*)

            _GX = gx
    return _GX


def _context():
    """One ephemeral, in-memory GX context per process."""
    global _CTX
    with _LOCK:
        if _CTX is None:
            gx = _gx()
            from great_expectations.data_context.types.base import (
                DataContextConfig,
                InMemoryStoreBackendDefaults,
                ProgressBarsConfig,
            )

            _CTX = gx.get_context(mode="ephemeral", project_config=DataContextConfig(
                store_backend_defaults=InMemoryStoreBackendDefaults(),
                analytics_enabled=False,
                progress_bars=ProgressBarsConfig(globally=False),
            ))
    return _CTX


def _ids_first(example: Any, id_cols: list[str]) -> Any:
    """{reward: nan, row: 3, task_id: t} -> {row: 3, task_id: t, reward: nan}: easier to read."""
    if not isinstance(example, dict):
        return example
    return {**{k: example[k] for k in id_cols if k in example}, **example}


def _batch(name: str, pdf):
    """A GX batch over a pandas frame (the data source is replaced on each call: nothing accumulates)."""
    source = _context().data_sources.add_or_update_pandas(name)
    return source.add_dataframe_asset("frame").add_batch_definition_whole_dataframe("all") \
        .get_batch(batch_parameters={"dataframe": pdf})


def _run_gx(gate: str, checks: list[Check], frames: dict[str, Any], usable: set[str]) -> list[GateFailure]:
    """Validate each frame's checks as one GX suite; turn failed results into GateFailures."""
    gx = _gx()
    failures = []
    for frame_name, pdf in frames.items():
        if pdf is None:
            continue
        todo = [c for c in checks if c.frame == frame_name and set(c.needs) <= usable
                and not (c.aggregate and len(pdf) == 0)]
        if not todo:
            continue
        suite = gx.ExpectationSuite(name=f"{gate}_{frame_name}")
        for c in todo:
            expectation = c.expectation(gx.expectations)
            expectation.meta = {"check": c.name}
            suite.add_expectation(expectation)
        id_cols = [c for c in ("row", "task_id", "group_id") if c in pdf.columns][:2] or [pdf.columns[0]]
        with _LOCK:
            result = _batch(f"{gate}_{frame_name}", pdf).validate(suite, result_format={
                "result_format": "COMPLETE", "unexpected_index_column_names": id_cols,
                "partial_unexpected_count": N_EXAMPLES, "include_unexpected_rows": False,
            })
        by_name = {c.name: c for c in todo}
        for r in result.results:
            if r.success:
                continue
            cfg = r.expectation_config
            check = by_name[cfg.meta["check"]]
            res = r.result or {}
            exc = (r.exception_info or {}).get("exception_message")
            failures.append(GateFailure(
                check=check.name,
                expectation=cfg.type,
                column=cfg.kwargs.get("column"),
                unexpected_count=res.get("unexpected_count"),
                examples=[_ids_first(e, id_cols) for e in
                          (res.get("unexpected_index_list") or res.get("partial_unexpected_list") or [])[:N_EXAMPLES]],
                observed=res.get("observed_value"),
                detail=check.detail + (f" (GX raised: {exc})" if exc else ""),
            ))
    order = {c.name: i for i, c in enumerate(checks)}
    return sorted(failures, key=lambda f: order.get(f.check, 0))
