"""`ratchet verify`: run any model's completions against tasks in the sandbox, one JSON line each.

    ratchet verify --tasks tasks.jsonl --completions completions.jsonl [--format humaneval]

Each line printed: task_id, metrics, reward, env_error. The reward is `ratchet.reward.score`
under the task's reward_logic and the default RewardConfig; the sandbox limits are
`VerifyConfig.sandbox_limits()`, as in training. No Prefect is imported here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ratchet.config import VerifyConfig, describe


def _err(msg: str) -> None:
    typer.echo(msg, err=True)


def verify_command(
    tasks: Path = typer.Option(..., "--tasks", help="Tasks JSONL (any format `ratchet envs import` reads)."),
    completions: Path = typer.Option(..., "--completions", help='JSONL of {"task_id": ..., "completion": ...}.'),
    format: str = typer.Option("taskspec", "--format", "-f", help="Format of --tasks: taskspec | humaneval."),
    concurrency: int = typer.Option(VerifyConfig().concurrency, help=describe(VerifyConfig, "concurrency")),
    timeout_s: float = typer.Option(VerifyConfig().timeout_s, help=describe(VerifyConfig, "timeout_s")),
) -> None:
    """Run each completion against its task in the sandbox; one JSON line per completion."""
    from envs.importers import read_tasks
    from ratchet.config import RewardConfig
    from ratchet.reward import score
    from ratchet.verify import verify_many
    try:
        result = read_tasks(tasks, format)
    except (ValueError, OSError) as e:
        _err(f"error: {e}")
        raise typer.Exit(1)
    for bad in result.bad:
        _err(bad.message())
    by_id = {s.task_id: s for s in result.specs}
    items, rows = [], []
    for n, raw in enumerate(completions.read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            tid, completion = obj["task_id"], obj["completion"]
            if not isinstance(completion, str):
                raise TypeError("completion must be a string")
        except (ValueError, KeyError, TypeError) as e:
            _err(f"{completions}:{n}: {type(e).__name__}: {e}")
            rows.append({"line": n, "task_id": None, "error": f"bad completion line: {e}"})
            continue
        if tid not in by_id:
            _err(f"{completions}:{n}: field 'task_id': unknown task {tid!r}")
            rows.append({"line": n, "task_id": tid, "error": "unknown task_id"})
            continue
        rows.append({"line": n, "task_id": tid, "item": len(items)})
        items.append((by_id[tid], completion))
    verify = VerifyConfig(timeout_s=timeout_s, concurrency=concurrency)
    results = verify_many(items, verify.sandbox_limits(), verify.concurrency, verify.env_error_retries)
    for row in rows:
        if "item" not in row:
            typer.echo(json.dumps({"task_id": row["task_id"], "metrics": None, "reward": None, "env_error": None,
                                   "error": row["error"]}))
            continue
        spec, v = items[row["item"]][0], results[row["item"]]
        typer.echo(json.dumps({"task_id": row["task_id"], "metrics": v.metrics or None,
                               "reward": None if v.env_error else score(v.metrics, spec.reward_logic, RewardConfig()),
                               "env_error": v.env_error,
                               "env_error_kind": v.env_error_kind}))
    sys.stdout.flush()
