"""The promotion rule the project is named for, on hand-built cases, and evaluation's "passed"."""

from __future__ import annotations

import pytest

from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, TaskSpec
from ratchet.config import VerifyConfig
from ratchet.eval import evaluate, should_promote


@pytest.mark.parametrize("candidate, incumbent, min_gain, promote", [
    (0.40, 0.20, 0.00, True),      # a clear win
    (0.21, 0.20, 0.00, True),      # any win, with no margin asked
    (0.21, 0.20, 0.05, False),     # a win smaller than the margin
    (0.20, 0.20, 0.00, False),     # a tie never promotes
    (0.10, 0.20, 0.00, False),     # a regression
    (0.00, None, 0.00, True),      # nothing promoted yet: the first candidate is
])
def test_should_promote_by_hand(candidate, incumbent, min_gain, promote):
    ok, why = should_promote(candidate, incumbent, min_gain)
    assert ok is promote
    assert ("no incumbent" in why) if incumbent is None else (f"{candidate:.3f}" in why and f"{incumbent:.3f}" in why)


class _Engine:
    """Answers each prompt with a fixed completion, as a policy would, greedily."""

    def __init__(self, answers: dict[str, str]):
        self.answers = answers

    def generate(self, prompts, n=1, max_new_tokens=48, greedy=False, batch_size=128, **_):
        class R:
            def __init__(self, i, text):
                self.prompt_index, self.text = i, text
        return [R(i, self.answers[p]) for i, p in enumerate(prompts)]


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
    assert result.by_difficulty == {1: 0.5, 2: 0.5}
