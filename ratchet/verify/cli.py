"""`ratchet verify`: run any model's completions against tasks in the sandbox, one JSON line each.

    ratchet verify --tasks tasks.jsonl --completions completions.jsonl [--format humaneval]

Each line printed: task_id, id, line (in the completions file), metrics, reward, env_error. The reward is `ratchet.reward.score`
under the task's reward_logic and the default RewardConfig; the sandbox limits are
`VerifyConfig.sandbox_limits()`, as in training. No Prefect is imported here.

A completion line is {"task_id": ..., "completion": "...", "id": optional string or integer}.
Every rejected line (of either file) is reported on stderr with its line and field
(`c.jsonl:3: field 'completion': Field required`) and, for completions, printed as a row
with its `error`; the good lines are still verified, and the command then exits 2. Two lines
with the same task_id and the same `id` are refused (the second); lines without an `id` may
repeat a task. A missing, binary or undecodable file: one `error:` line, exit 2.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import typer
from pydantic import ValidationError

from ratchet.cli_errors import fail, message, read_text
from ratchet.config import VerifyConfig, describe


def _err(msg: str) -> None:
    typer.echo(msg, err=True)


@dataclass(frozen=True)
class CompletionLine:
    line: int
    task_id: object = None
    completion: str | None = None
    id: str | int | None = None
    errors: tuple[tuple[str, str], ...] = ()      # (field, why); empty: a good line

    def messages(self, source: str) -> list[str]:
        return [f"{source}:{self.line}: field {f!r}: {why}" for f, why in self.errors]


def parse_completions(text: str, known: set[str]) -> list[CompletionLine]:
    """Each non-blank line of a completions JSONL as a CompletionLine, with every error of a bad one."""
    out, first = [], {}
    for n, raw in enumerate(text.split("\n"), 1):      # not splitlines: JSON strings may hold U+2028
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            out.append(CompletionLine(n, errors=(("(json)", f"malformed JSON: {e.msg} at column {e.colno}"),)))
            continue
        if not isinstance(obj, dict):
            out.append(CompletionLine(n, errors=(("(line)", f"expected a JSON object, got {type(obj).__name__}"),)))
            continue
        tid, completion, cid, errors = obj.get("task_id"), obj.get("completion"), obj.get("id"), []
        if "task_id" not in obj:
            errors.append(("task_id", "Field required"))
        elif not isinstance(tid, str):
            errors.append(("task_id", f"expected a string (got {json.dumps(tid)[:60]})"))
        elif tid not in known:
            errors.append(("task_id", f"unknown task {tid!r}"))
        if "completion" not in obj:
            errors.append(("completion", "Field required"))
        elif not isinstance(completion, str):
            errors.append(("completion", f"expected a string (got {json.dumps(completion)[:60]})"))
        if cid is not None and (isinstance(cid, bool) or not isinstance(cid, (str, int))):
            errors.append(("id", f"expected a string or an integer (got {json.dumps(cid)[:60]})"))
        elif cid is not None and isinstance(tid, str):
            if (tid, cid) in first:
                errors.append(("id", f"duplicate completion id {cid!r} for task {tid!r} (first on line {first[tid, cid]})"))
            else:
                first[tid, cid] = n
        out.append(CompletionLine(n, tid if isinstance(tid, str) else None,
                                  completion if isinstance(completion, str) else None,
                                  cid if isinstance(cid, (str, int)) and not isinstance(cid, bool) else None, tuple(errors)))
    return out


def verify_command(
    tasks: Path = typer.Option(..., "--tasks", help="Tasks JSONL (any format `ratchet envs import` reads)."),
    completions: Path = typer.Option(..., "--completions",
                                     help='JSONL of {"task_id": ..., "completion": ..., "id": optional, unique per task}.'),
    format: str = typer.Option("taskspec", "--format", "-f", help="Format of --tasks: taskspec | humaneval."),
    concurrency: int = typer.Option(VerifyConfig().concurrency, help=describe(VerifyConfig, "concurrency")),
    timeout_s: float = typer.Option(VerifyConfig().timeout_s, help=describe(VerifyConfig, "timeout_s")),
) -> None:
    """Run each completion against its task in the sandbox; one JSON line per completion.
    Exit 2 when any line of either file was rejected (the good ones are still verified)."""
    from envs.importers import FORMATS, parse_lines
    from ratchet.config import RewardConfig
    from ratchet.reward import score
    from ratchet.verify import verify_many
    from ratchet.watch import progress_bar

    if format not in FORMATS:
        fail(f"unknown format {format!r}; known: {', '.join(FORMATS)}", "--format")
    try:
        verify = VerifyConfig(timeout_s=timeout_s, concurrency=concurrency)
    except ValidationError as e:
        err = e.errors()[0]
        fail(f"{err['msg']} (got {err['input']})", f"--{str(err['loc'][0]).replace('_', '-')}")
    result = parse_lines(read_text(tasks, "tasks file").split("\n"), format, str(tasks))
    comp_lines = parse_completions(read_text(completions, "completions file"), {s.task_id for s in result.specs})
    if not comp_lines:
        fail("no completion lines", completions)
    for bad in result.bad:
        _err(bad.message())
    for c in comp_lines:
        for m in c.messages(str(completions)):
            _err(m)
    by_id = {s.task_id: s for s in result.specs}
    good = [c for c in comp_lines if not c.errors]
    with progress_bar("verify") as progress:     # a bar on stderr when it is a terminal
        results = dict(zip((c.line for c in good), verify_many(
            [(by_id[c.task_id], c.completion) for c in good], verify.sandbox_limits(), verify.concurrency,
            verify.env_error_retries, progress=progress)))
    for c in comp_lines:
        if c.errors:
            typer.echo(json.dumps({"task_id": c.task_id, "id": c.id, "line": c.line, "metrics": None, "reward": None,
                                   "env_error": None, "error": _row_error(c)}))
            continue
        spec, v = by_id[c.task_id], results[c.line]
        typer.echo(json.dumps({"task_id": c.task_id, "id": c.id, "line": c.line, "metrics": v.metrics or None,
                               "reward": None if v.env_error else score(v.metrics, spec.reward_logic, RewardConfig()),
                               "env_error": v.env_error,
                               "env_error_kind": v.env_error_kind}))
    sys.stdout.flush()
    rejected = [str(b.line) for b in result.bad], [str(c.line) for c in comp_lines if c.errors]
    if rejected[0] or rejected[1]:
        where = "; ".join(f"{path}: line {', '.join(lines[:10])}{' ...' if len(lines) > 10 else ''}"
                          for path, lines in zip((tasks, completions), rejected) if lines)
        _err(message(f"{len(rejected[0]) + len(rejected[1])} input line(s) rejected", where))
        raise typer.Exit(2)


def _row_error(c: CompletionLine) -> str:
    """The `error` of a rejected line's output row (an unknown task_id keeps its historic wording)."""
    if c.errors == (("task_id", f"unknown task {c.task_id!r}"),):
        return "unknown task_id"
    return "bad completion line: " + "; ".join(f"{f}: {why}" for f, why in c.errors)
