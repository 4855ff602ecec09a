"""The environment quality audit: which tasks are fit to train on, and why the others are not.

    verdicts = audit(specs, cfg.audit, cfg.verify)      # one Verdict per spec, in order
    [v for v in verdicts if v.verdict != "pass"]         # quarantined, each with its reason

The audit is a client of the one verifier (`ratchet.verify`): a reference run is the same
sandbox run, compared the same way and "passed" in the same sense as a training rollout or a
held-out evaluation, under the same `VerifyConfig.sandbox_limits()`. Per task:

- hidden tests can be read off the prompt, or repeat a visible example ("leaky_tests",
  `ratchet.verify.guards.hidden_test_leaks`; checked before anything runs; tests or visible
  examples that cannot be read, e.g. a malformed `metadata.visible_tests`: "broken");
- the reference solution passes on every one of `reference_runs` runs (else "flaky"; never
  passes: "broken");
- trivial answers fail: the family's list, e.g. empty, `pass`, return the input, return a
  constant, raise ("trivial_passes");
- mutation testing: mutants of the reference (`envs.mutation`) must be killed by the tests;
  a score below `mutation_threshold` is "weak_tests";
- the reference's runtime is within `max_reference_ms` ("too_slow"); the prompt is within
  `max_prompt_chars` ("too_long"); a task the verifier cannot run at all is "env_error".
  The audit knows no model: its verdicts are shared by every run. Whether a prompt leaves a run's
  model room to answer is that run's check, after the audit (`ratchet.room`, the nightly's
  `fit_to_context`).

Cost. Every candidate of every task goes into as few sandbox waves as possible. Run 1 of each
reference is a full verification (`verify_many`, the path training uses; its wall time is the
runtime checked against the budget). For `check_calls` tasks the rest (repeat references,
trivial answers, mutants) runs as ONE sandbox run per task: each candidate is compiled in its
own namespace and every (candidate, test) call's result is serialised and compared outside
with the verifier's `same` (its one comparison, float tolerance included); a mutant that
loops is stopped by a per-call alarm. A probe run that fails as a whole (timeout, hard exit,
output cap) is retried task by task, then redone with one verification per candidate (`candidate_wall_s` each). Other tasks (run_command)
verify each candidate on its own.

Measured on 2 shared cores (load average ~8 from other jobs): the default python_functions
production (3286 tasks: 2986 train + 300 held-out) audits in ~27-35 s (~22 s of it the
first reference runs, ~9 s the probes); HumanEval's 164 problems in ~7-11 s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Callable

from envs.mutation import mutants as make_mutants
from envs.registry import get_family
from envs.snapshot import Verdict
from envs.spec import COMPLETION, CheckCalls, TaskSpec, workdir_files
from ratchet.config import AuditConfig, VerifyConfig
from ratchet.sandbox import Limits, Payload, RunResult, run_many
from ratchet.scale import executor_for
from ratchet.sandbox.harness import MARK, call_harness, parse_harness_output
from ratchet.verify import Verification, solution_files, verify_many
from ratchet.verify.guards import hidden_test_leaks
from ratchet.verify.verifier import build_payload, float_tolerance, same

def trivial_answers(spec: TaskSpec) -> list[str]:
    """The family's trivial answers; for imported tasks, metadata["trivial_answers"]."""
    try:
        return list(get_family(spec.family).trivial_answers(spec))
    except KeyError:   # not a generated family: an imported task set
        return list(spec.metadata.get("trivial_answers", ["", "pass\n"]))


def task_mutants(spec: TaskSpec, limit: int) -> list[str]:
    step = spec.python_file()
    if step is None:
        return make_mutants(spec.reference_solution, limit=limit, seed=spec.task_id, python=False)
    prefix, suffix = step.content.split(COMPLETION, 1)
    return make_mutants(spec.reference_solution, prefix, suffix, limit=limit, seed=spec.task_id)


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
    return len(checks) == 1 and spec.python_file() is not None and bool(spec.tests)


def _probe_payload(group: list[tuple[TaskSpec, list[str]]], alarms: list[float] | None = None) -> Payload:
    """One sandbox run for the candidates of several check_calls tasks (one task when it has
    files of its own). alarms: per task, the per-call time limit of its non-reference candidates."""
    srcs, args = [], []
    for k, (spec, candidates) in enumerate(group):
        entry = next(s for s in spec.execution_steps if isinstance(s, CheckCalls)).entry_point
        step = spec.python_file()
        for c in candidates:
            args += [json.dumps([len(srcs), *json.loads(t.args)]) for t in spec.tests]
            alarm = 0.0 if c == spec.reference_solution or alarms is None else alarms[k]
            srcs.append((step.content.replace(COMPLETION, c), entry, alarm))
    spec = group[0][0]
    files = solution_files(spec, spec.reference_solution) if len(group) == 1 else {}
    program = _PROBE.replace("SRCS_", repr(srcs))
    return Payload(code=call_harness(program, "__ratchet_probe", args), files=files,
                   readonly_files=workdir_files(spec.test_files) if len(group) == 1 else {})


def _probe_results(group: list[tuple[TaskSpec, list[str]]], res: RunResult) -> list[list[bool]] | None:
    """Per task, per candidate: passed every test? None if the run failed as a whole."""
    if res.infra_error or res.killed_by or res.timed_out or f"{MARK}\tEND\t" not in res.stdout:
        return None
    got = parse_harness_output(res.stdout, n=sum(len(c) * len(s.tests) for s, c in group))
    out, pos = [], 0
    for spec, candidates in group:
        tol, n = float_tolerance(spec), len(spec.tests)
        mine = []
        for _ in candidates:
            calls = got[pos:pos + n]
            pos += n
            mine.append(all(g is not None and same(g, t.expected, tol) for g, t in zip(calls, spec.tests)))
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

@dataclass(frozen=True)
class Candidates:
    """What one task's tests are tried against besides its first reference run."""

    repeats: int                # further runs of the reference (flakiness)
    trivial: list[str]          # answers that must fail
    mutants: list[str]          # near-misses of the reference that the tests must kill

    def sources(self, reference: str | None) -> list[str]:
        return [reference] * self.repeats + self.trivial + self.mutants


def _candidates(spec: TaskSpec, cfg: AuditConfig) -> Candidates:
    if spec.reference_solution is None:   # an imported task without a reference: trivial answers only
        return Candidates(0, trivial_answers(spec), [])
    limit = cfg.max_mutants if _probeable(spec) else cfg.max_command_mutants
    return Candidates(cfg.reference_runs - 1, trivial_answers(spec), task_mutants(spec, limit))


def _blocked(spec: TaskSpec) -> Verdict | None:
    """The verdict of a task that must not run at all: leaking tests, tests that cannot be read, or one
    the verifier cannot run."""
    try:
        leaks = hidden_test_leaks(spec)
    except (ValueError, TypeError) as e:   # e.g. a malformed metadata.visible_tests: nothing to check against
        return Verdict(spec.task_id, "broken", f"its tests cannot be read: {e}", None)
    if leaks:
        return Verdict(spec.task_id, "leaky_tests", "; ".join(leaks[:3]), None)
    try:
        build_payload(spec, spec.reference_solution or "pass\n", runtime_python=lambda env: "python3")
    except (ValueError, NotImplementedError) as e:
        return Verdict(spec.task_id, "env_error", f"the verifier cannot run this task: {e}", None)
    return None


def audit(specs: list[TaskSpec], cfg: AuditConfig = AuditConfig(), verify: VerifyConfig = VerifyConfig(),
          progress: Callable[[int, int], None] | None = None) -> list[Verdict]:
    """Audit each spec; one Verdict per spec, in order. `progress(done, total)`, if given, counts the
    candidate runs (first reference runs, repeats, trivial answers, mutants) as they finish."""
    limits = verify.sandbox_limits()
    short = replace(limits, wall_s=min(limits.wall_s, cfg.candidate_wall_s), cpu_s=min(limits.cpu_s, cfg.candidate_wall_s))
    executor = executor_for(verify)   # this process's sandbox, or Ray tasks over a cluster (verify.executor)
    blocked = [_blocked(s) for s in specs]
    live = [i for i in range(len(specs)) if blocked[i] is None]
    with_ref = [i for i in live if specs[i].reference_solution is not None]
    candidates = {i: _candidates(specs[i], cfg) for i in live}
    n_runs = {i: len(candidates[i].sources(specs[i].reference_solution)) for i in live}
    tally = _Tally(progress, len(with_ref) + sum(n_runs.values()))
    run = lambda items, lim=limits: verify_many(items, lim, verify.concurrency, verify.env_error_retries,  # noqa: E731
                                                progress=tally.part(len(items)), executor=executor)

    # 1. reference run 1 of every task: a full verification (the training path; its time is the runtime)
    first = dict(zip(with_ref, run([(specs[i], specs[i].reference_solution) for i in with_ref])))

    # 2. every other candidate: reference repeats, trivial answers, mutants
    outcome: dict[int, list[bool | None]] = {}   # per candidate: passed (None: env_error)
    if cfg.batch_probes:
        ref_ms = {i: first[i].metrics.get("execution_time_ms", limits.wall_s * 1000) for i in with_ref}
        probed = [i for i in with_ref if _probeable(specs[i])]
        outcome = _probe_all(specs, probed, candidates, ref_ms, limits, verify.concurrency, executor)
        tally.add(sum(n_runs[i] for i in outcome))
    rest = [i for i in live if i not in outcome]
    outcome.update({i: [] for i in rest})
    for _ in range(max((candidates[i].repeats for i in rest), default=0)):
        # one call per repeat: verify_many runs identical pairs of one call once
        again = [i for i in rest if len(outcome[i]) < candidates[i].repeats]
        for i, v in zip(again, run([(specs[i], specs[i].reference_solution) for i in again])):
            outcome[i].append(_ok(v))
    items = [(i, c) for i in rest for c in candidates[i].trivial + candidates[i].mutants]
    for (i, _), v in zip(items, run([(specs[i], c) for i, c in items], short)):
        outcome[i].append(_ok(v))

    verdicts = []
    for i, spec in enumerate(specs):
        if blocked[i] is not None:
            verdicts.append(blocked[i])
            continue
        c, ok = candidates[i], outcome[i]
        results = Results(first.get(i), ok[:c.repeats], ok[c.repeats:c.repeats + len(c.trivial)],
                          ok[c.repeats + len(c.trivial):])
        verdicts.append(_judge(spec, cfg, c, results))
    return verdicts


class _Tally:
    """One progress(done, total) over several calls, each reporting its own (done, of its n)."""

    def __init__(self, progress: Callable[[int, int], None] | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def part(self, n: int) -> Callable[[int, int], None] | None:
        base, self.done = self.done, self.done + n
        return None if self.progress is None else (lambda done, _n: self.progress(base + done, self.total))

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def _ok(v: Verification) -> bool | None:
    return None if v.env_error else v.passed


@dataclass(frozen=True)
class Results:
    """One task's outcomes, in the order of its Candidates (None: the run was an env_error)."""

    first: Verification | None  # the first reference run (None: no reference)
    repeats: list[bool | None]
    trivial: list[bool | None]
    mutants: list[bool | None]


def _probe_all(specs, idx, candidates: dict[int, Candidates], ref_ms, limits: Limits,
               concurrency, executor=None) -> dict[int, list[bool]]:
    """Probe results per task index; a task missing from the answer needs one run per candidate.
    Groups that fail as a whole are retried task by task."""
    todo = [(i, specs[i], candidates[i].sources(specs[i].reference_solution)) for i in idx]
    groups = _groups(todo, limits.output_bytes // 2, 250 * limits.wall_s, ref_ms)
    alarm = {i: min(max(0.2, 20 * ref_ms.get(i, 0.0) / 1000), limits.wall_s / 4) for i in idx}
    done: dict[int, list[bool]] = {}
    for _attempt in range(2):
        payloads = [_probe_payload([(s, c) for _, s, c in g], [alarm[i] for i, _, _ in g]) for g in groups]
        failed = []
        run = executor.run_many if executor is not None else run_many
        for g, res in zip(groups, run(payloads, limits=limits, concurrency=concurrency) if payloads else []):
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


def _judge(spec: TaskSpec, cfg: AuditConfig, c: Candidates, r: Results) -> Verdict:
    valid = [ok for ok in r.mutants if ok is not None]
    score = (sum(not ok for ok in valid) / len(valid)) if valid else None
    run1 = r.first
    ms = run1.metrics.get("execution_time_ms") if run1 is not None and not run1.env_error else None
    v = lambda name, why: Verdict(spec.task_id, name, why, score, ms)  # noqa: E731
    if run1 is not None and run1.env_error:
        return v("env_error", f"reference run failed for infrastructure reasons: {run1.env_error_kind}")
    if len(spec.prompt) > cfg.max_prompt_chars:
        return v("too_long", f"prompt is {len(spec.prompt)} chars, over the budget of {cfg.max_prompt_chars}")
    if run1 is not None:
        m = run1.metrics
        if m.get("timed_out"):
            return v("too_slow", f"reference run hit the wall-clock limit ({m.get('execution_time_ms', 0):.0f} ms)")
        runs = [run1.passed, *[ok for ok in r.repeats if ok is not None]]
        if not any(runs):
            return v("broken", f"reference fails: {m.get('tests_passed', 0)}/{m.get('tests_total', 0)} tests pass"
                     + (f"; stderr: {m['stderr'][:200]}" if m.get("stderr") else ""))
        if not all(runs):
            return v("flaky", f"reference passed {sum(runs)} of {len(runs)} runs")
        if ms is not None and ms > cfg.max_reference_ms:
            return v("too_slow", f"reference took {ms:.0f} ms, over the budget of {cfg.max_reference_ms:.0f} ms")
    passing = [t for t, ok in zip(c.trivial, r.trivial) if ok]
    if passing:
        return v("trivial_passes", "trivial answer(s) pass every test: " + ", ".join(_short(t) for t in passing))
    if score is not None and score < cfg.mutation_threshold:
        survivors = [mm for mm, ok in zip(c.mutants, r.mutants) if ok]
        return v("weak_tests", f"tests kill {len(valid) - len(survivors)}/{len(valid)} mutants "
                 f"(score {score:.2f} < {cfg.mutation_threshold}); a survivor: {_short(survivors[0], 120)}")
    if run1 is None:
        return v("pass", "no reference solution: checked by trivial answers only (no flakiness or mutation testing)")
    return v("pass", "")


