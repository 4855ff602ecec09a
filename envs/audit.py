"""The environment quality audit: which tasks are fit to train on, and why the others are not.

    verdicts = audit(specs, limits)                 # one Verdict per spec, in order
    [v for v in verdicts if v.verdict != "pass"]    # quarantined, each with its reason

Per task, in the sandbox (DESIGN.md layer 1; issue 4):

- the reference solution passes on every one of `reference_runs` runs (else "flaky"; never
  passes: "broken");
- trivial answers fail: the family's list, e.g. empty, `pass`, return the input, return a
  constant, raise ("trivial_passes");
- mutation testing: mutants of the reference (`envs.mutation`) must be killed by the tests;
  a score below `mutation_threshold` is "weak_tests";
- the reference's runtime is within `max_reference_ms` ("too_slow"); the prompt fits the
  model's context ("too_long"); a task the verifier cannot run at all is "env_error".

Cost. Every candidate of every task goes into as few sandbox waves as possible. Run 1 of each
reference is a full verification (`verify_many`, the path training uses; its wall time is the
runtime checked against the budget). For `check_calls` tasks the rest (repeat references,
trivial answers, mutants) runs as ONE sandbox run per task: each candidate is compiled in its
own namespace and every (candidate, test) call's result is serialised and compared outside,
exactly as the verifier does; a mutant that loops is stopped by a per-call alarm. A probe run
that fails as a whole (timeout, hard exit, output cap) is retried task by task, then redone
with one verification per candidate (`candidate_wall_s` each). Other tasks (run_command)
verify each candidate on its own.

Measured on 2 shared cores (load average ~8 from other jobs): the default python_functions
production (3286 tasks: 2986 train + 300 held-out) audits in ~27-35 s (~22 s of it the
first reference runs, ~9 s the probes); HumanEval's 164 problems in ~7-11 s.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, replace
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from envs.mutation import mutants as make_mutants
from envs.spec import COMPLETION, CheckCalls, OverwriteFile, TaskSpec
from ratchet.config import VerifyConfig
from ratchet.sandbox import Limits, Payload, RunResult, run_many
from ratchet.sandbox.harness import MARK, call_harness, parse_harness_output

VerdictName = Literal["pass", "flaky", "weak_tests", "broken", "trivial_passes", "too_slow", "too_long", "env_error"]
VERDICTS: tuple[str, ...] = ("pass", "flaky", "weak_tests", "broken", "trivial_passes", "too_slow", "too_long", "env_error")


class AuditConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    reference_runs: int = Field(3, ge=1, le=10, description="Runs of the reference; every one must pass (else: flaky).")
    max_mutants: int = Field(8, ge=0, le=200, description="Mutants of the reference tried per task (0: no mutation testing).")
    max_command_mutants: int = Field(3, ge=0, le=200, description="Mutants per run_command task (each costs a process, e.g. pytest).")
    mutation_threshold: float = Field(0.8, ge=0, le=1, description="Least fraction of mutants the tests must kill (else: weak_tests).")
    max_reference_ms: float = Field(2000.0, gt=0, description="Wall-time budget of one reference run (else: too_slow).")
    max_prompt_chars: int = Field(16000, ge=1, description="Prompt budget in characters, used when no token counter is given.")
    max_prompt_tokens: int | None = Field(None, ge=1, description="Prompt budget in tokens (needs a count_tokens callable).")
    candidate_wall_s: float = Field(1.0, gt=0, le=600, description="Wall-clock limit of a trivial-answer or mutant run (a mutant that loops is killed).")
    batch_probes: bool = Field(True, description="Run the extra candidates of a check_calls task together in one sandbox run.")


@dataclass(frozen=True)
class Verdict:
    task_id: str
    verdict: VerdictName
    reason: str                       # empty when it passed
    mutation_score: float | None      # killed / mutants; None when no mutant could be made or run
    reference_ms: float | None = None


def limits_for(verify: VerifyConfig) -> Limits:
    """Sandbox limits of one verification run, from the user's VerifyConfig."""
    return Limits(wall_s=verify.timeout_s, cpu_s=max(1.0, verify.timeout_s), memory_mb=verify.memory_mb)


def trivial_answers(spec: TaskSpec) -> list[str]:
    """The family's trivial answers; for imported tasks, metadata["trivial_answers"]."""
    from envs.registry import FAMILIES, get_family
    if spec.family not in FAMILIES:
        try:
            get_family(spec.family)
        except KeyError:
            pass
    if spec.family in FAMILIES:
        return list(FAMILIES[spec.family].trivial_answers(spec))
    return list(spec.metadata.get("trivial_answers", ["", "pass\n"]))


def _py_step(spec: TaskSpec) -> OverwriteFile | None:
    """The .py file the completion is written into, if any."""
    for s in spec.execution_steps:
        if isinstance(s, OverwriteFile) and COMPLETION in s.content and s.path.endswith(".py"):
            return s
    return None


def task_mutants(spec: TaskSpec, limit: int) -> list[str]:
    step = _py_step(spec)
    if step is None:
        return make_mutants(spec.reference_solution, limit=limit, seed=spec.task_id, python=False)
    prefix, suffix = step.content.split(COMPLETION, 1)
    return make_mutants(spec.reference_solution, prefix, suffix, limit=limit, seed=spec.task_id)


def _passed(metrics: dict) -> bool:
    return metrics.get("test_pass_rate", 0.0) >= 1.0 and not metrics.get("timed_out", False)


def _canonical(js: str | None) -> str | None:
    return None if js is None else json.dumps(json.loads(js), separators=(",", ":"), ensure_ascii=True)


# --- the probe: many candidates of one check_calls task in one sandbox run -------------------

_PROBE = '''
import signal as _sig
class _Slow(BaseException):
    pass
def _on_alarm(*_):
    raise _Slow()
_sig.signal(_sig.SIGALRM, _on_alarm)
def _timed(_t, _f, *_a):
    if _t:
        _sig.setitimer(_sig.ITIMER_REAL, _t)
    try:
        return _f(*_a)
    finally:
        _sig.setitimer(_sig.ITIMER_REAL, 0)
_SRCS = SRCS_
_FNS = []
for _src, _entry, _t in _SRCS:
    _g = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        _timed(_t, exec, compile(_src, "solution.py", "exec"), _g)
        _FNS.append(_g.get(_entry))
    except BaseException:
        _FNS.append(None)
def __ratchet_probe(_i, *_a):
    return _timed(_SRCS[_i][2], _FNS[_i], *_a)
'''
"""Each candidate is compiled in its own namespace; a candidate that is not a reference repeat
gets a per-call alarm, so a mutant that loops is killed alone instead of sinking the run."""


def _probeable(spec: TaskSpec) -> bool:
    checks = [s for s in spec.execution_steps if isinstance(s, CheckCalls)]
    return len(checks) == 1 and _py_step(spec) is not None and bool(spec.tests)


def _probe_payload(group: list[tuple[TaskSpec, list[str]]], alarms: list[float] | None = None) -> Payload:
    """One sandbox run for the candidates of several check_calls tasks (one task when it has
    files of its own). alarms: per task, the per-call time limit of its non-reference candidates."""
    srcs, args = [], []
    for k, (spec, candidates) in enumerate(group):
        entry = next(s for s in spec.execution_steps if isinstance(s, CheckCalls)).entry_point
        step = _py_step(spec)
        for c in candidates:
            args += [json.dumps([len(srcs), *json.loads(t.args)]) for t in spec.tests]
            alarm = 0.0 if c == spec.reference_solution or alarms is None else alarms[k]
            srcs.append((step.content.replace(COMPLETION, c), entry, alarm))
    spec = group[0][0]
    files = {}
    if len(group) == 1:
        for s in spec.with_completion(spec.reference_solution):
            if isinstance(s, OverwriteFile):
                files[s.path.removeprefix("/app/").lstrip("/")] = s.content
        files = {**spec.files, **files}
    program = _PROBE.replace("SRCS_", repr(srcs))
    return Payload(code=call_harness(program, "__ratchet_probe", args), files=files,
                   readonly_files=dict(spec.test_files) if len(group) == 1 else {})


def _probe_results(group: list[tuple[TaskSpec, list[str]]], res: RunResult) -> list[list[bool]] | None:
    """Per task, per candidate: passed every test? None if the run failed as a whole."""
    if res.infra_error or res.killed_by or res.timed_out or f"{MARK}\tEND\t" not in res.stdout:
        return None
    got = parse_harness_output(res.stdout, n=sum(len(c) * len(s.tests) for s, c in group))
    out, pos = [], 0
    for spec, candidates in group:
        want = [_canonical(x.expected) for x in spec.tests]
        mine = []
        for _ in candidates:
            calls = got[pos:pos + len(want)]
            pos += len(want)
            mine.append(all(g is not None and _canonical(g) == w for g, w in zip(calls, want)))
        out.append(mine)
    return out


def _groups(items, budget: int, budget_ms: float, ref_ms: dict[int, float]):
    """Pack tasks into probe runs: result lines under `budget` bytes of stdout, and an estimated
    run time (reference time x candidates) under `budget_ms`. A task with files runs alone."""
    groups, cur, size, ms = [], [], 0, 0.0
    for i, spec, cands in items:
        cost = len(cands) * sum(48 + len(t.expected) for t in spec.tests)
        est = len(cands) * ref_ms.get(i, 0.0)
        alone = bool(spec.files or spec.test_files)
        if cur and (alone or size + cost > budget or ms + est > budget_ms):
            groups.append(cur)
            cur, size, ms = [], 0, 0.0
        cur.append((i, spec, cands))
        size, ms = size + cost, ms + est
        if alone:
            groups.append(cur)
            cur, size, ms = [], 0, 0.0
    return groups + ([cur] if cur else [])


# --- the audit -------------------------------------------------------------------------------

def _verify(items, limits, concurrency, retries, runtime_python):
    from ratchet.reward.verify import verify_many
    kw = {}
    if runtime_python is not None and "runtime_python" in inspect.signature(verify_many).parameters:
        kw["runtime_python"] = runtime_python
    return verify_many(items, limits, concurrency=concurrency, retries=retries, **kw) if items else []


def _runnable(spec: TaskSpec) -> str | None:
    """Why the verifier cannot run this task at all (None if it can)."""
    try:
        from ratchet.reward.verify import build_payload
        build_payload(spec, spec.reference_solution)
    except (ValueError, NotImplementedError) as e:
        return f"the verifier cannot run this task: {e}"
    except Exception:
        return None  # e.g. runtime resolution needs arguments here: leave it to verify_many
    return None


def audit(specs: list[TaskSpec], limits: Limits | None = None, cfg: AuditConfig | None = None,
          concurrency: int | None = None, retries: int = 2,
          count_tokens: Callable[[str], int] | None = None,
          runtime_python: Callable | None = None) -> list[Verdict]:
    """Audit each spec; one Verdict per spec, in order."""
    cfg = cfg or AuditConfig()
    limits = limits or Limits()
    short = replace(limits, wall_s=min(limits.wall_s, cfg.candidate_wall_s), cpu_s=min(limits.cpu_s, cfg.candidate_wall_s))
    verify = lambda items, lim=limits: _verify(items, lim, concurrency, retries, runtime_python)  # noqa: E731
    blocked = [_runnable(s) for s in specs]
    live = [i for i in range(len(specs)) if blocked[i] is None]

    # 1. reference run 1 of every task: a full verification (the training path; its time is the runtime)
    first = dict(zip(live, verify([(specs[i], specs[i].reference_solution) for i in live])))

    # 2. every other candidate: reference repeats, trivial answers, mutants
    cands = {i: (cfg.reference_runs - 1, trivial_answers(specs[i]),
                 task_mutants(specs[i], cfg.max_mutants if _probeable(specs[i]) else cfg.max_command_mutants))
             for i in live}
    outcome: dict[int, list[bool | None]] = {}   # per candidate: passed every test (None: env_error)
    if cfg.batch_probes:
        ref_ms = {i: first[i].metrics.get("execution_time_ms", limits.wall_s * 1000) for i in live}
        outcome = _probe_all(specs, [i for i in live if _probeable(specs[i])], cands, ref_ms, limits, concurrency)
    rest = [i for i in live if i not in outcome]
    rep_ok: dict[int, list] = {i: [] for i in rest}
    for k in range(cfg.reference_runs - 1):   # one call per repeat: verify_many runs identical pairs once
        for i, v in zip(rest, verify([(specs[i], specs[i].reference_solution) for i in rest])):
            rep_ok[i].append(None if v.env_error else _passed(v.metrics))
    items = [(i, c) for i in rest for c in cands[i][1] + cands[i][2]]
    cand_ok: dict[int, list] = {i: [] for i in rest}
    for (i, _), v in zip(items, verify([(specs[i], c) for i, c in items], short)):
        cand_ok[i].append(None if v.env_error else _passed(v.metrics))
    outcome.update({i: rep_ok[i] + cand_ok[i] for i in rest})

    out = []
    for i, s in enumerate(specs):
        if blocked[i] is not None:
            out.append(Verdict(s.task_id, "env_error", blocked[i], None))
            continue
        reps, triv, muts = cands[i]
        oc = outcome[i]
        out.append(_judge(s, cfg, first[i], oc[:reps], triv, oc[reps:reps + len(triv)], muts,
                          oc[reps + len(triv):], count_tokens))
    return out


def _probe_all(specs, idx, cands, ref_ms, limits: Limits, concurrency) -> dict[int, list[bool]]:
    """Probe results per task index; a task missing from the answer needs one run per candidate.
    Groups that fail as a whole are retried task by task."""
    todo = [(i, specs[i], [specs[i].reference_solution] * cands[i][0] + cands[i][1] + cands[i][2]) for i in idx]
    groups = _groups(todo, limits.output_bytes // 2, 250 * limits.wall_s, ref_ms)
    alarm = {i: min(max(0.2, 20 * ref_ms.get(i, 0.0) / 1000), limits.wall_s / 4) for i in idx}
    done: dict[int, list[bool]] = {}
    for attempt in range(2):
        payloads = [_probe_payload([(s, c) for _, s, c in g], [alarm[i] for i, _, _ in g]) for g in groups]
        failed = []
        for g, res in zip(groups, run_many(payloads, limits=limits, concurrency=concurrency) if payloads else []):
            r = _probe_results([(s, c) for _, s, c in g], res)
            if r is not None:
                done.update({i: ok for (i, _, _), ok in zip(g, r)})
            elif len(g) > 1:
                failed += [[t] for t in g]
        groups = failed
    return done


def _short(text: str, n: int = 60) -> str:
    r = repr(text)
    return r if len(r) <= n else r[: n - 3] + "..."


def _judge(spec, cfg: AuditConfig, run1, repeats, triv, triv_ok, muts, mut_ok, count_tokens) -> Verdict:
    tid = spec.task_id
    valid = [ok for ok in mut_ok if ok is not None]
    score = (sum(not ok for ok in valid) / len(valid)) if valid else None
    ms = run1.metrics.get("execution_time_ms") if not run1.env_error else None
    v = lambda name, why: Verdict(tid, name, why, score, ms)  # noqa: E731
    if run1.env_error:
        return v("env_error", f"reference run failed for infrastructure reasons: {run1.env_error_kind}")
    size = count_tokens(spec.prompt) if count_tokens and cfg.max_prompt_tokens else len(spec.prompt)
    budget = cfg.max_prompt_tokens if count_tokens and cfg.max_prompt_tokens else cfg.max_prompt_chars
    unit = "tokens" if count_tokens and cfg.max_prompt_tokens else "chars"
    if size > budget:
        return v("too_long", f"prompt is {size} {unit}, over the budget of {budget}")
    m = run1.metrics
    if m.get("timed_out"):
        return v("too_slow", f"reference run hit the wall-clock limit ({m.get('execution_time_ms', 0):.0f} ms)")
    runs = [_passed(m), *[ok for ok in repeats if ok is not None]]
    if not any(runs):
        return v("broken", f"reference fails: {m.get('tests_passed', 0)}/{m.get('tests_total', 0)} tests pass"
                 + (f"; stderr: {m['stderr'][:200]}" if m.get("stderr") else ""))
    if not all(runs):
        return v("flaky", f"reference passed {sum(runs)} of {len(runs)} runs")
    if ms is not None and ms > cfg.max_reference_ms:
        return v("too_slow", f"reference took {ms:.0f} ms, over the budget of {cfg.max_reference_ms:.0f} ms")
    passing = [t for t, ok in zip(triv, triv_ok) if ok]
    if passing:
        return v("trivial_passes", "trivial answer(s) pass every test: " + ", ".join(_short(t) for t in passing))
    if score is not None and score < cfg.mutation_threshold:
        survivors = [mm for mm, ok in zip(muts, mut_ok) if ok]
        return v("weak_tests", f"tests kill {len(valid) - len(survivors)}/{len(valid)} mutants "
                 f"(score {score:.2f} < {cfg.mutation_threshold}); a survivor: {_short(survivors[0], 120)}")
    return v("pass", "")


def regression(previous, current):
    """Tasks (by task_id, in both audits) whose verdict changed: task_id, split, previous,
    current, reason (the current one). Both arguments are audit tables (polars)."""
    import polars as pl
    prev = previous.select("task_id", pl.col("verdict").alias("previous"))
    cur = current.select("task_id", "split", pl.col("verdict").alias("current"), "reason")
    return (cur.join(prev, on="task_id", how="inner")
            .filter(pl.col("previous") != pl.col("current"))
            .select("task_id", "split", "previous", "current", "reason"))
