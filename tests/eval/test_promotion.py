"""The promotion rule the project is named for, on hand-built cases, and evaluation's "passed"."""

from __future__ import annotations

import pytest

from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, TaskSpec
from ratchet.config import EvalConfig, VerifyConfig
from ratchet.eval import evaluate, should_promote
from ratchet.rollout.engine import Rollout


def _solved(ids: range, n: int = 300) -> dict[str, bool | None]:
    return {f"t{i}": i in ids for i in range(n)}


@pytest.mark.parametrize("candidate, incumbent, min_gain, promote", [
    (_solved(range(120)), _solved(range(60)), 0.00, True),       # a clear win: +20 points, 60 more tasks
    (_solved(range(120)), _solved(range(60)), 0.30, False),      # a win, but below the asked-for margin
    (_solved(range(61)), _solved(range(60)), 0.00, False),       # one task out of 300: a tie within noise
    (_solved(range(60)), _solved(range(60)), 0.00, False),       # identical results
    (_solved(range(30)), _solved(range(60)), 0.00, False),       # a regression
    (_solved(range(0)), None, 0.00, True),                       # nothing promoted yet: the first candidate is
])
def test_should_promote_by_hand(candidate, incumbent, min_gain, promote):
    d = should_promote(candidate, incumbent, EvalConfig(min_gain=min_gain))
    assert d.promote is promote
    assert d.reason.startswith("Promote" if promote else "Keep the incumbent")


def test_tasks_without_a_verdict_on_either_side_are_left_out():
    cand = {**_solved(range(120)), "t0": None}           # t0's verification failed for the candidate
    inc = {**_solved(range(60)), "t1": None}
    d = should_promote(cand, inc, EvalConfig())
    assert "298 tasks" in d.reason and d.promote


def test_no_shared_task_keeps_the_incumbent_and_names_the_other_side():
    """Every candidate task an env_error: nothing says it is better, and the run goes on (it used to raise)."""
    cand = {f"t{i}": None for i in range(5)}
    d = should_promote(cand, _solved(range(3), n=5), EvalConfig(), against="the base model")
    assert not d.promote and d.method == "no shared task"
    assert d.reason == ("Keep the base model: the two share no held-out task with a verdict (0 tasks with one for "
                        "the candidate, 5 for the base model).")
    d = should_promote(_solved(range(120)), _solved(range(60)), EvalConfig(), against="the base model")
    assert d.promote and "points vs the base model" in d.reason


class _Engine:
    """Answers each prompt with a fixed completion, as a policy would, greedily."""

    def __init__(self, answers: dict[str, str]):
        self.answers = answers

    def generate(self, prompts, n=1, max_new_tokens=48, greedy=False, batch_size=128, **_):
        return [Rollout(i, [], [], [], self.answers[p], True) for i, p in enumerate(prompts)]


def _task(i: int, difficulty: int) -> TaskSpec:
    return TaskSpec(task_id=f"t{i}", family="handmade", prompt=f"# add {i}\ndef f(x):\n", difficulty=difficulty,
                    execution_steps=(OverwriteFile(path="/app/solution.py", content="def f(x):\n" + COMPLETION),
                                     CheckCalls(entry_point="f")),
                    tests=(CallTest(args="[1]", expected=str(1 + i)), CallTest(args="[2]", expected=str(2 + i))),
                    reference_solution=f"    return x + {i}\n")


def test_evaluate_counts_a_task_solved_only_when_every_hidden_test_passes():
    specs = [_task(1, 1), _task(2, 1), _task(3, 2), _task(4, 2)]
    answers = {specs[0].prompt: "    return x + 1\n",                       # passes both tests
               specs[1].prompt: "    return 3 if x == 1 else 0\n",          # passes one of two: not solved
               specs[2].prompt: "    return x + 3\n",                       # passes
               specs[3].prompt: "    while True:\n        pass\n"}           # times out: not solved
    result = evaluate(_Engine(answers), specs, VerifyConfig(timeout_s=1.0))
    assert result.rows["passed"].to_list() == [True, False, True, False]
    assert result.pass_rate == 0.5 and result.n_tasks == 4 and result.env_errors == 0
    assert result.summary()["by_difficulty"] == {1: 0.5, 2: 0.5}
    assert result.results == {"t1": [True], "t2": [False], "t3": [True], "t4": [False]}
