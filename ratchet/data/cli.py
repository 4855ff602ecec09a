"""`ratchet gate ...`: run a validation gate on a Parquet file from the command line.

    ratchet gate check runs/<id>/waves/3/trajectories.parquet --reward-min -0.5 --reward-max 1 --max-tokens 256
    ratchet gate check envs/python_functions/v1/audit.parquet      # a task table: the task gate

Prints the report (Markdown, or JSON with --json) and exits 1 when the gate fails; a file
that is missing, not Parquet, or shares no column with the gate's table is one `error:` line, exit 2.
Mounted by ratchet/cli.py as `app.add_typer(gate_app, name="gate")`.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from ratchet.cli_errors import fail

app = typer.Typer(help="Validation gates on Parquet tables (Great Expectations).", no_args_is_help=True)


class Kind(str, Enum):
    auto = "auto"
    wave = "wave"
    tasks = "tasks"


@app.callback()
def _gate() -> None:
    """Validation gates on Parquet tables (Great Expectations)."""


@app.command()
def check(
    file: Path = typer.Argument(..., help="A trajectory (wave) or task table, as Parquet."),
    kind: Kind = typer.Option(Kind.auto, help="Which gate; auto: tasks if the table has spec_json, else wave."),
    max_env_error_rate: Optional[float] = typer.Option(None, min=0, max=1, help="Override GateConfig.max_env_error_rate."),
    max_zero_variance_frac: Optional[float] = typer.Option(None, min=0, max=1, help="Override GateConfig.max_zero_variance_frac."),
    reward_min: Optional[float] = typer.Option(None, help="Lowest reward the reward logic can give (with --reward-max)."),
    reward_max: Optional[float] = typer.Option(None, help="Highest reward the reward logic can give (with --reward-min)."),
    max_tokens: Optional[int] = typer.Option(None, min=1, help="Context length: prompt_tokens + completion_tokens must fit."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of Markdown."),
) -> None:
    """Run the wave gate (or the task gate) on FILE; exit 1 if it fails."""
    import polars as pl

    from ratchet.config import GateConfig
    from ratchet.data.gates import check_tasks, check_wave

    from ratchet.data.schemas import TASK_SCHEMA, TRAJECTORY_SCHEMA

    if (reward_min is None) != (reward_max is None):
        fail("give both --reward-min and --reward-max, or neither", "--reward-min / --reward-max")
    if reward_min is not None and reward_min > reward_max:
        fail(f"--reward-min {reward_min} is above --reward-max {reward_max}", "--reward-min / --reward-max")
    if not file.exists():
        fail("no such file", file)
    if file.is_dir():
        fail("a directory, expected a Parquet file", file)
    try:
        df = pl.read_parquet(file)
    except (OSError, pl.exceptions.PolarsError) as e:
        fail(f"cannot read as Parquet: {str(e).splitlines()[0]}", file)

    tasks = kind is Kind.tasks or (kind is Kind.auto and "spec_json" in df.columns)
    schema = TASK_SCHEMA if tasks else TRAJECTORY_SCHEMA
    if not set(df.columns) & set(schema):
        fail(f"the table shares no column with a {'task' if tasks else 'wave'} table "
             f"(has {', '.join(df.columns[:8]) or 'no columns'}; expected e.g. {', '.join(list(schema)[:4])})", file)
    if tasks:
        report = check_tasks(df, source=str(file))
    else:
        overrides = {k: v for k, v in {"max_env_error_rate": max_env_error_rate,
                                       "max_zero_variance_frac": max_zero_variance_frac}.items() if v is not None}
        bounds = (reward_min, reward_max) if reward_min is not None else None
        report = check_wave(df, GateConfig(**overrides), reward_bounds=bounds, max_tokens=max_tokens, source=str(file))
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.to_markdown())
    raise typer.Exit(0 if report.success else 1)
