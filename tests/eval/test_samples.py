"""k samples per held-out task: unbiased pass@1 / pass@k, tables per family, difficulty and source
with their confidence intervals, the vertical table, and promotion on k-sample results.

Completions are verified in the real sandbox; only the policy is replaced by fixed answers per
(task, sample), so every figure below can be computed by hand.
"""

from __future__ import annotations

import math

import pytest

from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, TaskSpec
from ratchet.config import EvalConfig, VerifyConfig
from ratchet.eval import evaluate, should_promote
from ratchet.eval.report import vertical_table
from ratchet.eval.stats import pass_at_k
from ratchet.rollout.engine import Rollout


class _Engine:
    """Answers prompt p's j-th sample with answers[p][j]; records how it was asked to sample."""

    def __init__(self, answers: dict[str, list[str]]):
        self.answers, self.calls = answers, []

    def generate(self, prompts, n=1, max_new_tokens=48, greedy=False, temperature=1.0, batch_size=128, seed=None, **_):
        self.calls.append({"n": n, "greedy": greedy, "temperature": temperature, "seed": seed})
        return [Rollout(i, [], [], [], self.answers[p][j], True) for i, p in enumerate(prompts) for j in range(n)]


def _task(i: int, family: str, difficulty: int, source: str | None = None) -> TaskSpec:
    return TaskSpec(task_id=f"t{i}", family=family, prompt=f"# add {i}\ndef f(x):\n", difficulty=difficulty,
                    execution_steps=(OverwriteFile(path="/app/solution.py", content="def f(x):\n" + COMPLETION),
                                     CheckCalls(entry_point="f")),
                    tests=(CallTest(args="[1]", expected=str(1 + i)),),
                    metadata={"source": source} if source else {})


RIGHT, WRONG = (lambda i: f"    return x + {i}\n"), "    return 0\n"


def test_k_samples_give_unbiased_pass_at_1_and_pass_at_k_per_task_and_group():
    specs = [_task(1, "a", 1), _task(2, "a", 2), _task(3, "b", 1, source="mine.jsonl"), _task(4, "b", 2)]
    right = [3, 1, 0, 4]                     # samples (of 4) that pass, per task
    engine = _Engine({s.prompt: [RIGHT(i + 1)] * r + [WRONG] * (4 - r) for i, (s, r) in enumerate(zip(specs, right))})
    result = evaluate(engine, specs, VerifyConfig(), samples=4, temperature=0.7, seed=11)

    assert engine.calls == [{"n": 4, "greedy": False, "temperature": 0.7, "seed": 11}]
    assert result.results["t1"] == [True, True, True, False] and result.results["t3"] == [False] * 4
    assert result.pass_rate == pytest.approx((3 / 4 + 1 / 4 + 0 + 1) / 4)
    assert result.pass_at(2) == pytest.approx(sum(pass_at_k(4, c, 2) for c in right) / 4)
    assert result.pass_at(2) == pytest.approx((1 + 0.5 + 0 + 1) / 4)       # 1 - C(4-c,2)/C(4,2) by hand
    s = result.summary()
    assert s["samples"] == 4 and s["pass_at"] == {"1": round(result.pass_rate, 4), "2": 0.625, "4": 0.75}
    fam = {r["family"]: r for r in s["tables"]["family"]}
    assert fam["a"]["pass_at_1"] == pytest.approx(0.5) and fam["a"]["n_tasks"] == 2
    assert fam["b"]["pass_at_1"] == pytest.approx(0.5)
    lo, hi = fam["a"]["ci"]
    assert 0.25 <= lo <= 0.5 <= hi <= 0.75                                  # the bootstrap over the two tasks' rates
    assert {r["source"] for r in s["tables"]["source"]} == {"a", "b", "mine.jsonl"}
    assert s["by_difficulty"] == {1: pytest.approx(3 / 8), 2: pytest.approx(5 / 8)}


def test_a_task_with_an_env_error_on_any_sample_leaves_every_denominator():
    spec = _task(1, "a", 1).model_copy(update={"environment_config": {"runtime": "python3.0"}})  # cannot be built
    good = _task(2, "a", 1)
    result = evaluate(_Engine({spec.prompt: [RIGHT(1)] * 2, good.prompt: [RIGHT(2), WRONG]}), [spec, good],
                      VerifyConfig(env_error_retries=0), samples=2, seed=0)
    assert result.env_errors == 1 and result.n_tasks == 1 and result.results["t1"] is None
    assert result.pass_rate == 0.5 and result.summary()["tables"]["family"][0]["n_tasks"] == 1


def test_k_turn_figures_leave_out_the_tasks_pass_at_1_leaves_out():
    """A task with an env_error on any sample is out of pass@1; the K-turn figures (pass_turn1, pass_last) of the
    same evaluation drop the whole task too, not only its failed episode, so pass_last at k samples is pass@1."""
    import polars as pl
    from ratchet.eval import EvalResult

    turn = lambda passed: {"passed": passed, "action_tokens": 4, "observation_tokens": 3}  # noqa: E731
    rows = pl.DataFrame([
        {"task_id": "t0", "sample": 0, "env_error": False, "passed": True, "turns": [turn(True)]},
        {"task_id": "t0", "sample": 1, "env_error": True, "passed": False, "turns": [turn(False)]},
        {"task_id": "t1", "sample": 0, "env_error": False, "passed": False, "turns": [turn(False), turn(False)]},
        {"task_id": "t1", "sample": 1, "env_error": False, "passed": True, "turns": [turn(False), turn(True)]},
    ]).with_columns(family=pl.lit("a"), source=pl.lit("a"), difficulty=pl.lit(1), completion=pl.lit(""))
    s = EvalResult(rows, samples=2, turns=2).summary()
    assert s["pass_rate"] == 0.5 and s["n_tasks"] == 1
    assert s["turns"]["episodes"] == 2 and s["turns"]["env_errors"] == 1   # t0's other episode is left out, not an error
    assert s["turns"]["pass_turn1"] == 0.0 and s["turns"]["pass_last"] == s["pass_rate"]


def test_one_sample_is_greedy():
    spec = _task(1, "a", 1)
    engine = _Engine({spec.prompt: [RIGHT(1)]})
    assert evaluate(engine, [spec]).pass_rate == 1.0 and engine.calls[0]["greedy"] is True


def _summary(rates: dict[str, list[bool]]):
    """A hand-built `EvalResult.summary()`-shaped record for the table."""
    return {"pass_rate": 0.5, "ci": [0.25, 0.75], "n_tasks": 10, "tables": {
        "family": [{"family": f, "pass_at_1": sum(v) / len(v), "ci": [0.0, 1.0], "n_tasks": len(v)} for f, v in rates.items()],
        "difficulty": [{"difficulty": 1, "pass_at_1": 0.5, "ci": [0.0, 1.0], "n_tasks": 10}],
        "source": [{"source": f, "pass_at_1": sum(v) / len(v), "ci": [0.0, 1.0], "n_tasks": len(v)} for f, v in rates.items()]}}


def test_the_vertical_table_lines_up_base_candidate_incumbent_per_family():
    base = _summary({"a": [True, False], "b": [False, False]})
    cand = _summary({"a": [True, True], "b": [True, False]})
    text = vertical_table({"base": base, "candidate": cand, "incumbent": None})
    lines = text.splitlines()
    assert lines[0] == "| held-out pass@1, % [95% CI] (tasks) | base | candidate |"
    assert lines[2] == "| all | 50.0 [25.0, 75.0] (10) | 50.0 [25.0, 75.0] (10) |"
    assert lines[3] == "| family a | 50.0 [0.0, 100.0] (2) | 100.0 [0.0, 100.0] (2) |"
    assert lines[4].startswith("| family b | 0.0") and len(lines) == 5     # sources = families, one difficulty: left out


@pytest.mark.parametrize("cand, inc, promote", [
    ([[True] * 4] * 80 + [[False] * 4] * 120, [[True, False, False, False]] * 80 + [[False] * 4] * 120, True),   # clear win
    ([[True, True, False, False]] * 200, [[True, False, True, False]] * 200, False),                           # tie
    ([[False] * 4] * 200, [[True, False, False, False]] * 200, False),                                          # regression
    ([[True, False, True, False]] * 200, [[True, False, True, False]] * 200, False),                           # identical
])
def test_should_promote_on_k_samples(cand, inc, promote):
    ids = [f"t{i}" for i in range(len(cand))]
    d = should_promote(dict(zip(ids, cand)), dict(zip(ids, inc)), EvalConfig())
    assert d.promote is promote and d.method == "paired bootstrap + exact sign test" and d.p_value is not None
    assert "x 4 samples" in d.reason
    assert math.isclose(d.estimate, sum(sum(c) - sum(i) for c, i in zip(cand, inc)) / 4 / len(cand))
