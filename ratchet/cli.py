"""The `ratchet` command line.

    ratchet run [--steps N] [--run-id ID] [--store URI] [--config FILE.json]   the nightly cycle
    ratchet sandbox run FILE [--json] | ratchet sandbox doctor                  the sandbox
    ratchet envs import FILE --format taskspec|humaneval                         user task specs
    ratchet verify --tasks T.jsonl --completions C.jsonl                         score any model's outputs
    ratchet gate check FILE.parquet                                               the wave gate

Only `run` reaches Prefect (lazily, inside the command), so the other commands start fast.
`run` checks its settings first (`ratchet.preflight`) and exits 2, one line per problem,
before Prefect is imported or anything starts. Every command fails with one line on stderr,
`error: <what> (<where>)`: exit 2 for bad input or usage, 1 for a check that ran and failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError

from ratchet.cli_errors import OneLineErrors, fail, message, read_text
from ratchet.config import NightlyConfig, StoreConfig, describe
from ratchet.data.cli import app as gate_app
from ratchet.envs_cli import app as envs_app
from ratchet.sandbox.cli import app as sandbox_app
from ratchet.verify.cli import verify_command

app = typer.Typer(help="ratchet: an RL post-training pipeline for LLMs, orchestrated with Prefect.",
                  no_args_is_help=True, add_completion=False, cls=OneLineErrors)
app.add_typer(sandbox_app, name="sandbox", help="Run code in the sandbox; inspect its mechanisms.")
app.add_typer(gate_app, name="gate", help="Great Expectations gates on waves and task tables.")
app.add_typer(envs_app, name="envs", help="Import task specs (taskspec, HumanEval) and audit them.")
app.command("verify", help="Score completions against tasks in the sandbox (one JSON line each).")(verify_command)

SUMMARY_KEYS = ("run_id", "summary", "base_pass_rate", "final_pass_rate", "promoted", "steps", "wall_s")


@app.command()
def run(
    steps: Optional[int] = typer.Option(None, help=f"{describe(NightlyConfig, 'steps')} [default: {NightlyConfig().steps}]"),
    run_id: Optional[str] = typer.Option(None, help="Run id; an existing one is resumed from its LATEST checkpoint."),
    store: Optional[str] = typer.Option(None, help=f"{describe(StoreConfig, 'uri')} [default: {StoreConfig().uri}]"),
    config: Optional[Path] = typer.Option(None, help="JSON file of NightlyConfig fields (overrides)."),
) -> None:
    """Run the nightly training cycle now. The last line printed is one JSON object."""
    cfg = _settings(config, steps, run_id, store)
    from ratchet.preflight import SettingsError, require

    try:
        require(cfg)               # before Prefect is imported: a bad setting costs a second, not a run
    except SettingsError as e:
        for problem in e.problems:
            typer.echo(message(problem, config or "settings"), err=True)
        raise typer.Exit(2) from None
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The ephemeral API migrates a fresh database on first start: allow for a busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from flows.nightly import nightly

    summary = nightly(cfg)
    sys.stderr.flush()
    print(json.dumps({k: summary[k] for k in SUMMARY_KEYS}), flush=True)


def _settings(config: Path | None, steps: int | None, run_id: str | None, store: str | None) -> NightlyConfig:
    """The run's NightlyConfig from --config and the options; fail (exit 2) naming each bad field."""
    fields = {}
    if config is not None:
        text = read_text(config, "config file")
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            fail(f"malformed JSON: {e.msg}", f"{config}:{e.lineno}:{e.colno}")
        if not isinstance(fields, dict):
            fail(f"the config must be a JSON object of NightlyConfig fields, got a {type(fields).__name__}", config)
    for name, value in (("steps", steps), ("run_id", run_id)):
        if value is not None:
            fields[name] = value
    if store is not None:
        fields["store"] = {"uri": store}
    try:
        return NightlyConfig.model_validate(fields)
    except ValidationError as e:
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(config)"
            got = "" if err["type"] == "missing" else f" (got {json.dumps(err.get('input'), default=str)[:60]})"
            typer.echo(message(f"field {where!r}: {err['msg']}{got}", config or "options"), err=True)
        raise typer.Exit(2)


if __name__ == "__main__":
    app()
