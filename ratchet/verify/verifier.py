"""Verification: run a completion's execution steps in the sandbox and measure what happened.

    results = verify_many([(spec, completion), ...], cfg.verify.sandbox_limits())   # in order
    results[0].passed, results[0].metrics, results[0].env_error

This is the single call site between judging an answer and the sandbox: waves, held-out
evaluation, the environment audit and `ratchet verify` all come through here. Each item becomes
one sandbox run (fresh namespaces each time); identical (task, completion) pairs in one
call are run once. A run that fails for infrastructure reasons (the sandbox could not
start, a worker died, the task's runtime could not be built) is retried; if it keeps
failing the item is marked `env_error` and is never scored as the model's failure.

Two kinds of task:
- `check_calls`: the harness calls the entry point on each hidden test's args (and each
  visible example's, `metadata["visible_tests"]`) and prints plain-data results; they are
  compared with the expected values here, outside the sandbox (`same`: canonical JSON, with
  a task's `metadata["float_tolerance"]` for floats). Tasks without dependencies
  run on the sandbox's fast isolated interpreter.
- `run_command`: the snapshot files and overwrite_file steps go into the workdir, the hidden
  `test_files` are placed after them read-only, and the command line runs under `/bin/sh -c`
  with the bin directory of `runtime_python(env)` (None: the sandbox's host python) first on
  PATH (`ratchet.verify.commands`). Counts from the declared report file, else pytest's output,
  become tests_passed/tests_total (a line that runs pytest and leaves neither passes nothing); a
  line that does not run pytest passes (1 of 1) when it exits 0. A runtime that lacks a program or
  pytest the line needs is an env_error, decided before the run.

Feedback: each run's `Verification.feedback` keeps what a person needs to read a verdict: the
exit code, which limit ended it, the tails of stdout and stderr (`feedback_bytes` each; the
harness's result lines are left out of stdout), and the failed tests (pytest's FAILED/ERROR
lines with their message; for check_calls each failed hidden call's args, expected and got;
for a script the last line of stderr). `ratchet trace` shows it; it never reaches the model.

Hacking guards here: hidden tests are placed after the completion's files and read-only;
call results are compared outside the sandbox; visible-only success is flagged
(`ratchet.verify.guards`); an empty completion is not run and scores nothing. A run's output is the
answer's to write: should a parser here raise on it, that answer fails, flagged `unparseable_result`
(penalised), and the call goes on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from envs.runtime import resolve
from envs.source import parse_python
from envs.spec import (COMPLETION, NEVER_RAN, CallTest, CheckCalls, EnvironmentConfig, OverwriteFile, Report, RunCommand,
                        TaskSpec, for_task, judge_step, module_step, tolerance_of, workdir_files, workdir_path)
from ratchet.verify.commands import (PYTEST_EXTRA, Command, parse_command, pytest_report, report_counts,
                                     runtime_problem, shell_program, split_report)
from ratchet.verify.guards import SPECIAL_CASED, is_empty, special_cased, visible_tests
from ratchet.sandbox import Limits, Payload, RunResult, run_many
from ratchet.sandbox.harness import MARK, _int, call_harness, parse_harness_output
from ratchet.sandbox.host import host_python
from ratchet.sandbox.model import DEFAULT_PATH

RuntimePython = Callable[[EnvironmentConfig], str]
FEEDBACK_BYTES = 2048
"""Default bytes kept of a run's stdout and of its stderr (their tails) in `Verification.feedback`."""
MAX_FAILED_TESTS = 20
"""Failed tests listed in the feedback (the first ones)."""
PROGRESS_CHUNK = 8
"""With a progress callback, verify_many runs 8 x concurrency items at a time between reports."""
UNPARSEABLE = "unparseable_result"
"""Flag of a run whose output (the answer's to write) a parser here raised on: the answer fails, penalised."""


@dataclass
class Verification:
    metrics: dict = field(default_factory=dict)
    env_error: bool = False
    env_error_kind: str | None = None
    feedback: dict | None = None
    """The FEEDBACK struct (ratchet.data.schemas) of the sandbox run; None when nothing ran."""

    @property
    def passed(self) -> bool:
        """The one definition of "passed", for the audit, evaluation and reports alike: verified
        (no env_error), every hidden test passed, and within the wall-clock limit."""
        return not self.env_error and passed(self.metrics)


def passed(metrics: dict | None) -> bool:
    """A run's metrics say: every hidden test passed, and within the wall-clock limit."""
    return bool(metrics) and metrics.get("test_pass_rate", 0.0) >= 1.0 and not metrics.get("timed_out", False)


@dataclass(frozen=True)
class Plan:
    """One sandbox run and how to read its result."""

    payload: Payload
    kind: str                      # "calls" | "pytest" (one pytest command) | "shell" (any other line)
    hidden: tuple[CallTest, ...] = ()
    visible: tuple[CallTest, ...] = ()
    tolerance: float | None = None   # metadata["float_tolerance"]: how `same` compares numbers
    command: Command | None = None   # run_command: the parsed line (its programs are checked before the run)
    report: Report | None = None     # run_command: the report file it writes


def canonical(js: str | None) -> str | None:
    """JSON text in one spelling, so '[1, 2]' == '[1,2]' but '1' != 'true' != '1.0'."""
    if js is None:
        return None
    return json.dumps(json.loads(js), separators=(",", ":"), ensure_ascii=True)


def float_tolerance(spec: TaskSpec) -> float | None:
    """The task's `metadata["float_tolerance"]` (None: results must be equal as canonical JSON)."""
    return for_task(spec.task_id, tolerance_of, spec.metadata, "metadata.")   # the schema's rule


def same(got: str | None, expected: str, tolerance: float | None = None) -> bool:
    """Whether a call's plain-data result (harness JSON) is the expected one: the one comparison of
    results, outside the sandbox. Without a tolerance: equal canonical JSON. With one (a task's
    `metadata["float_tolerance"]`, e.g. HumanEval's 1e-6): the same, except that two numbers of
    which one is a float are equal when `math.isclose(a, b, rel_tol=tol, abs_tol=tol)`, as
    HumanEval's `abs(candidate(x) - y) < 1e-6` and Python's `2 == 2.0` have it; bools are not
    numbers here, two ints are compared exactly, and tuple/list, set/dict tags still differ. A result
    that cannot be compared is not the expected one: the answer printed it, nested deeper than json's
    stack reaches here (a frame or two below the harness parser's check), or an int beyond any float."""
    if got is None:
        return False
    try:
        if tolerance is None:
            return canonical(got) == canonical(expected)
        return _close(json.loads(got), json.loads(expected), tolerance)
    except (ValueError, RecursionError, OverflowError):
        return False


def _close(a, b, tol: float) -> bool:
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool) and not isinstance(b, bool):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    return type(a) is type(b) and a == b


def solution_files(spec: TaskSpec, completion: str) -> dict[str, str]:
    """The workdir of one run: the snapshot's files, then every overwrite_file step with `completion`."""
    files = workdir_files(spec.files)
    for step in spec.with_completion(completion):
        if isinstance(step, OverwriteFile):
            files[workdir_path(step.path)] = step.content
    return files


def _solution_source(spec: TaskSpec, completion: str) -> str:
    """The module the call harness imports: the first overwritten .py file (the answer's own, or a
    task's check.py that runs a non-Python answer, as the shell family's does), else the completion."""
    step = module_step(spec.with_completion(completion))
    return completion if step is None else step.content


def _one_step(spec: TaskSpec) -> CheckCalls | RunCommand:
    return for_task(spec.task_id, judge_step, spec.execution_steps)   # the schema's rule


def plan(spec: TaskSpec, completion: str, runtime_python: RuntimePython | None = None) -> Plan:
    """The sandbox run for a spec's execution steps with `completion` substituted."""
    files, tests_ro = solution_files(spec, completion), workdir_files(spec.test_files)
    step = _one_step(spec)
    if isinstance(step, CheckCalls):
        visible = visible_tests(spec)
        args = [t.args for t in (*spec.tests, *visible)]
        code = call_harness(_solution_source(spec, completion), step.entry_point, args)
        python = runtime_python(spec.environment_config) if runtime_python and spec.environment_config.dependencies else None
        payload = Payload(code=code, files=files, readonly_files=tests_ro, python=python, site=python is not None)
        return Plan(payload, "calls", spec.tests, visible, float_tolerance(spec))
    python = runtime_python(spec.environment_config) if runtime_python else None
    return _command_plan(step, files, tests_ro, python)


def _command_plan(step: RunCommand, files: dict, tests_ro: dict, python: str | None) -> Plan:
    """`/bin/sh -c LINE` with the runtime's bin directory first on PATH (its python, pytest)."""
    report = step.report.model_copy(update={"path": workdir_path(step.report.path)}) if step.report else None
    exe = python or host_python()
    cmd = parse_command(step.command, json_report=report is not None and report.format == "pytest-json", python=exe)
    env = {"PATH": f"{os.path.dirname(exe)}:{DEFAULT_PATH}", "PYTEST_ADDOPTS": " ".join(PYTEST_EXTRA)}
    program = shell_program(cmd, exe, report.path if report else None)
    payload = Payload(program=program, files=files, readonly_files=tests_ro, python=python, site=True, env=env)
    return Plan(payload, cmd.kind, command=cmd, report=report)


def build_payload(spec: TaskSpec, completion: str, runtime_python: RuntimePython | None = None) -> Payload:
    """The sandbox payload for a spec's execution steps with `completion` substituted."""
    return plan(spec, completion, runtime_python).payload


def _syntax_ok(spec: TaskSpec, completion: str) -> bool:
    """The completion is non-empty and its .py file parses; an answer that is not Python (the shell
    family's solution.sh) is not parsed."""
    if is_empty(completion):
        return False
    own = spec.python_file()
    if own is None:
        return True
    return parse_python(own.content.replace(COMPLETION, completion)) is not None


def _calls_passed(stdout: str, hidden: tuple[CallTest, ...], visible: tuple[CallTest, ...],
                  tolerance: float | None = None) -> tuple[int, int]:
    """(hidden passed, visible passed): results compared here, outside the sandbox (`same`)."""
    tests = (*hidden, *visible)
    got = parse_harness_output(stdout, n=len(tests))
    ok = [same(g, t.expected, tolerance) for g, t in zip(got, tests)]
    return sum(ok[:len(hidden)]), sum(ok[len(hidden):])


def _command_passed(p: Plan, res: RunResult) -> tuple[int, int, list[str]]:
    """(passed, total, flags) of a run_command (rules: ratchet/verify/commands.py). pytest kind: its
    counts (report file, else terminal output) if coherent and in agreement with its exit code (0 if
    and only if nothing failed; 5 when no test ran) and with each other; else 0 passed, flagged.
    Shell kind: the report's or pytest's counts, a non-zero exit despite a full pass counting as one
    more failed test; without counts, 0 if the line runs pytest, else 1 of 1 when the line exits 0."""
    stdout, data = split_report(res.stdout) if p.report else (res.stdout, None)
    ran_pytest = p.kind == "pytest" or (p.command is not None and p.command.pytest)
    terminal, coherent = pytest_report(stdout, strict=p.kind == "pytest") if ran_pytest else (None, True)
    counts = terminal
    if p.report:
        counts, file_ok = report_counts(data, p.report.format)
        coherent = coherent and file_ok and (terminal is None or p.kind != "pytest" or terminal == counts)
    if counts is None:
        if ran_pytest or p.report:   # its exit code may be the answer's os._exit(0), or tail's in a pipeline
            return 0, 0, []
        return int(res.exit_code == 0 and not res.killed_by), 1, []
    passed, total = counts["passed"], counts["passed"] + counts["failed"] + counts["errors"]
    if p.kind == "pytest":
        agrees = (res.exit_code == 0) == (total == passed) or (res.exit_code == 5 and total == 0)
        if not coherent or not (agrees or res.killed_by):
            return 0, total, ["inconsistent_test_report"]
        return passed, total, []
    if not coherent:
        return 0, total, ["inconsistent_test_report"]
    if passed == total and (res.exit_code != 0 or res.killed_by):
        return passed, total + 1, []
    return passed, total, []


def _counts(p: Plan, res: RunResult) -> tuple[int, int, list[str]]:
    """(hidden tests passed, hidden tests, flags) of one run."""
    if p.kind != "calls":
        return _command_passed(p, res)
    passed, seen = _calls_passed(res.stdout, p.hidden, p.visible, p.tolerance)
    total = len(p.hidden)
    cased = bool(p.visible) and total > 0 and special_cased(seen / len(p.visible), passed / total)
    return passed, total, [SPECIAL_CASED] if cased else []


def metrics_from(spec: TaskSpec, completion: str, res: RunResult, p: Plan | None = None) -> dict:
    """The METRICS struct (ratchet.data.schemas) of one run."""
    p = p or Plan(Payload(code="pass"), "calls", spec.tests, visible_tests(spec), float_tolerance(spec))
    try:
        passed, total, more = _counts(p, res)
    except Exception:   # the answer wrote what a parser could not read: its failure, never the whole call's
        passed, total, more = 0, len(p.hidden), [UNPARSEABLE]
    flags = [*res.security_events, *more]
    syntax_ok = _syntax_ok(spec, completion)
    return {
        "test_pass_rate": passed / total if total else 0.0,
        "tests_passed": passed,
        "tests_total": total,
        "syntax_ok": syntax_ok,
        "execution_time_ms": res.wall_ms,
        "peak_memory_mb": res.peak_memory_mb,
        "timed_out": res.timed_out,
        "format_ok": syntax_ok,
        "output_bytes": len(res.stdout) + len(res.stderr),
        "security_flags": flags,
        "exit_code": res.exit_code,
    }


def tail(text: str, limit: int) -> str:
    """The last `limit` bytes of `text` (cut at a character boundary), marked when something was cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return f"[... {len(data) - limit} bytes cut]\n" + data[len(data) - limit:].decode("utf-8", "ignore")


_PYTEST_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")


def _short(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _call_detail(args: str, expected: str, got: str, n: int = 300) -> str:
    """"args A: expected E, got G" in at most n characters. A long one is cut in the args first (inside
    their brackets, so that the observation can still write it as a call) and then in the expected
    value, never at its end: what the call got (or that it never ran, which the episode's observation
    looks for) is always shown."""
    whole = f"args {args}: expected {expected}, got {got}"
    if len(whole) <= n:
        return whole
    tail = f": expected {_short(expected, 100)}, got {_short(got, 100)}"
    room = n - len(tail) - len("args ")
    if args.startswith("[") and args.endswith("]"):
        return f"args [{_short(args[1:-1], room - 2)}]{tail}"
    return f"args {_short(args, room)}{tail}"


def failed_tests(p: Plan, res: RunResult) -> list[dict]:
    """The failed hidden tests of one run, [{"name", "detail"}], at most MAX_FAILED_TESTS."""
    out: list[dict] = []
    if p.kind == "calls":
        got = parse_harness_output(res.stdout, n=len(p.hidden) + len(p.visible))
        raised = _raised_calls(res.stdout)
        for i, (g, t) in enumerate(zip(got, p.hidden)):
            if not same(g, t.expected, p.tolerance):
                shown = g if g is not None else raised.get(i, NEVER_RAN)
                out.append({"name": f"call {i}", "detail": _call_detail(str(t.args), str(t.expected), str(shown))})
    elif p.kind == "pytest" or (p.command is not None and p.command.pytest):
        for line in res.stdout.splitlines():
            m = _PYTEST_FAILED.match(line.strip())
            if m:
                out.append({"name": m.group(2), "detail": _short(f"{m.group(1)}" + (f": {m.group(3)}" if m.group(3) else ""))})
    elif res.exit_code != 0 or res.killed_by:
        last = next((ln.strip() for ln in reversed(res.stderr.splitlines()) if ln.strip()), "")
        why = f"killed by the {res.killed_by} limit" if res.killed_by else f"exit {res.exit_code}"
        out.append({"name": p.command.line if p.command else " ".join(p.payload.argv), "detail": _short(f"{why}" + (f": {last}" if last else ""))})
    return out[:MAX_FAILED_TESTS]


def _raised_calls(stdout: str) -> dict[int, str]:
    """{call index: "raised NameOfException: its message"} from the harness's "!Exception: message" result lines."""
    out = {}
    for line in stdout.splitlines():
        parts = line.split("\t", 2)
        i = _int(parts[1]) if len(parts) == 3 and parts[0] == MARK and parts[2].startswith("!") else None
        if i is not None:   # not str.isdigit: "²" is a digit to it and the answer may print such a line
            out[i] = "raised " + parts[2][1:]
    return out


def feedback_from(p: Plan, res: RunResult, limit: int = FEEDBACK_BYTES) -> dict:
    """The FEEDBACK struct (ratchet.data.schemas) of one run: what a person reads to see why."""
    stdout = res.stdout
    if p.kind == "calls":       # the result lines are in failed_tests; keep what the completion printed
        stdout = "\n".join(ln for ln in stdout.splitlines() if not ln.startswith(MARK + "\t"))
    elif p.report:              # the report file's encoded copy is not output anyone wrote
        stdout = split_report(stdout)[0]
    try:
        failed = failed_tests(p, res) if res.infra_error is None else []
    except Exception:   # as in metrics_from, which flags the run UNPARSEABLE
        failed = []
    return {"exit_code": res.exit_code, "killed_by": res.killed_by, "timed_out": res.timed_out,
            "stdout_tail": tail(stdout, limit), "stderr_tail": tail(res.stderr or res.infra_error or "", limit),
            "failed_tests": failed}


def empty_metrics(spec: TaskSpec) -> dict:
    """Metrics of an empty completion, which is not run: nothing passed, nothing well-formed."""
    return {"test_pass_rate": 0.0, "tests_passed": 0, "tests_total": len(spec.tests), "syntax_ok": False,
            "execution_time_ms": 0.0, "peak_memory_mb": 0.0, "timed_out": False, "format_ok": False,
            "output_bytes": 0, "security_flags": [], "exit_code": None}


def _env_error(kind: str, message: str) -> Verification:
    first = (message.strip().splitlines() or [""])[0]
    return Verification(metrics={}, env_error=True, env_error_kind=f"{kind}: {first}"[:300])


def _plan_or_verdict(spec: TaskSpec, completion: str, runtime_python: RuntimePython | None) -> Plan | Verification:
    """A Plan to run, or the Verification already known (empty completion, task or runtime error)."""
    if is_empty(completion):
        return Verification(metrics=empty_metrics(spec))
    try:
        p = plan(spec, completion, runtime_python)
    except ValueError as e:
        return _env_error("task", str(e))
    except Exception as e:  # the runtime resolver failed: an environment problem
        return _env_error("runtime", f"{type(e).__name__}: {e}")
    problem = p.command and runtime_problem(p.command, p.payload.python or host_python(), p.payload.env["PATH"])
    return Verification(metrics={}, env_error=True, env_error_kind=problem[:300]) if problem else p


def _run_with_retries(plans: dict, limits: Limits | None, concurrency: int | None, retries: int,
                      executor=None) -> dict:
    """Run every plan; rerun those whose sandbox failed, up to `retries` more times. The one
    dispatch point: `executor` (`ratchet.scale.executor_for(cfg.verify)`: this process, or Ray
    tasks over a cluster) runs the payloads; None: this process's sandbox."""
    results: dict = {}
    pending = list(plans)
    run = executor.run_many if executor is not None else run_many
    for _ in range(retries + 1):
        runs = run([plans[k].payload for k in pending], limits=limits, concurrency=concurrency)
        results.update(zip(pending, runs))
        pending = [k for k in pending if results[k].infra_error is not None]
        if not pending:
            break
    return results


def _verdict(spec: TaskSpec, completion: str, p: Plan, res: RunResult, feedback_bytes: int) -> Verification:
    feedback = feedback_from(p, res, feedback_bytes)
    if res.infra_error is not None:
        return dataclasses.replace(_env_error("sandbox", res.infra_error), feedback=feedback)
    return Verification(metrics=metrics_from(spec, completion, res, p), feedback=feedback)


def verify_many(items: list[tuple[TaskSpec, str]], limits: Limits | None = None,
                concurrency: int | None = None, retries: int = 2,
                runtime_python: RuntimePython | None = resolve, feedback_bytes: int = FEEDBACK_BYTES,
                progress: Callable[[int, int], None] | None = None, executor=None) -> list[Verification]:
    """Verify each (spec, completion); results in input order. `limits`: `VerifyConfig.sandbox_limits()`.
    `runtime_python(env)` gives the interpreter of a task's environment (default: `envs.runtime.resolve`,
    a content-addressed venv per dependency set; None: the sandbox's host python, with site-packages,
    for run_command tasks; check_calls tasks without dependencies always use the fast isolated one).
    `feedback_bytes`: how much of each run's stdout and stderr its feedback keeps (`VerifyConfig.feedback_bytes`).
    `progress(done, total)`, if given, is called as items finish (last with done == total == len(items));
    the runs then go in chunks of PROGRESS_CHUNK x concurrency.
    `executor`: where the sandbox runs execute (`ratchet.scale.executor_for(cfg.verify)`; None: this process)."""
    keys = [(spec.task_id, completion) for spec, completion in items]
    runtime_python = _cached(runtime_python) if runtime_python else None
    first = {k: items[i] for i, k in reversed(list(enumerate(keys)))}
    todo = {k: _plan_or_verdict(*first[k], runtime_python) for k in first}
    plans = {k: v for k, v in todo.items() if isinstance(v, Plan)}
    if progress is not None:
        results = _run_reporting(plans, keys, limits, concurrency, retries, progress, executor)
    else:
        results = _run_with_retries(plans, limits, concurrency, retries, executor) if plans else {}
    done = {k: v if isinstance(v, Verification) else _verdict(*first[k], v, results[k], feedback_bytes)
            for k, v in todo.items()}
    return [Verification(dict(done[k].metrics), done[k].env_error, done[k].env_error_kind, _copy(done[k].feedback))
            for k in keys]


def _copy(feedback: dict | None) -> dict | None:
    return None if feedback is None else {**feedback, "failed_tests": [dict(t) for t in feedback["failed_tests"]]}


def _run_reporting(plans: dict, keys: list, limits: Limits | None, concurrency: int | None, retries: int,
                   progress: Callable[[int, int], None], executor=None) -> dict:
    """`_run_with_retries` in chunks, reporting progress(done, total) over every item (duplicates too)."""
    per_key, order, results = Counter(keys), list(plans), {}
    finished = len(keys) - sum(per_key[k] for k in order)    # known without a run: empty completions, task errors
    progress(finished, len(keys))
    size = PROGRESS_CHUNK * (concurrency or 2)
    for i in range(0, len(order), size):
        chunk = order[i:i + size]
        results.update(_run_with_retries({k: plans[k] for k in chunk}, limits, concurrency, retries, executor))
        finished += sum(per_key[k] for k in chunk)
        progress(finished, len(keys))
    return results


def _cached(resolve: RuntimePython) -> RuntimePython:
    """Resolve each environment once per call (a resolver may build a virtual environment)."""
    cache: dict[EnvironmentConfig, str] = {}

    def resolved(env: EnvironmentConfig) -> str:
        if env not in cache:
            cache[env] = resolve(env)
        return cache[env]
    return resolved
