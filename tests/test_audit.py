"""The audit's verdicts on hand-made tasks, and the batched probe against one run per candidate."""

from __future__ import annotations

import json

import polars as pl
import pytest

from envs.mutation import mutants, python_mutants, text_mutants
from envs.registry import get_family
from envs.snapshot import regression
from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, RunCommand, TaskSpec
from ratchet.audit import audit, task_mutants
from ratchet.config import AuditConfig

FAST = AuditConfig(max_reference_ms=60_000)   # verdicts here must not depend on machine load


def fn_task(task_id: str, reference: str, cases: list[tuple[list, object]], **meta) -> TaskSpec:
    """def f(x): <completion>  with call tests."""
    return TaskSpec(
        task_id=task_id, family="handmade", prompt="def f(x):\n",
        execution_steps=(OverwriteFile(path="/app/solution.py", content="def f(x):\n" + COMPLETION),
                         CheckCalls(entry_point="f")),
        tests=tuple(CallTest(args=json.dumps(a), expected=json.dumps(e)) for a, e in cases),
        reference_solution=reference,
        metadata={"trivial_answers": ["", "    pass\n", "    return x\n", "    return 0\n", "    raise ValueError\n"], **meta},
    )


GOOD = fn_task("good", "    return 3 * x + 1\n", [([0], 1), ([2], 7), ([-4], -11), ([5], 16)])
BROKEN = fn_task("broken", "    return 3 * x\n", [([0], 1), ([2], 7)])
TRIVIAL = fn_task("trivial", "    return x * 0\n", [([1], 0), ([5], 0)])          # `return 0` passes
WEAK = fn_task("weak", "    if x > 100:\n        return x - 1\n    return x + 1\n", [([0], 1)])   # one test, misses most mutants
FLAKY = fn_task("flaky", "    import os\n    return x + os.urandom(1)[0] % 2\n", [([10], 10)])   # passes 1 run in 2
LOOPY = fn_task("loopy", "    i = 0\n    while i < x:\n        i += 1\n    return i + 1\n", [([0], 1), ([3], 4), ([7], 8)])


def by_id(verdicts):
    return {v.task_id: v for v in verdicts}


@pytest.mark.parametrize("batch", [True, False], ids=["probe", "one-run-each"])
def test_verdicts(batch):
    v = by_id(audit([GOOD, BROKEN, TRIVIAL, WEAK, LOOPY], cfg=FAST.model_copy(update={"batch_probes": batch})))
    assert v["good"].verdict == "pass" and v["good"].reason == "" and v["good"].mutation_score >= 0.8
    assert v["broken"].verdict == "broken" and "tests pass" in v["broken"].reason
    assert v["trivial"].verdict == "trivial_passes" and "'    return 0\\n'" in v["trivial"].reason
    assert v["weak"].verdict == "weak_tests" and v["weak"].mutation_score < 0.8 and "survivor" in v["weak"].reason
    # dropping `i += 1` loops forever: that mutant is killed (by the probe's alarm / the run's limit)
    assert v["loopy"].verdict == "pass" and v["loopy"].mutation_score == 1.0


def test_flaky_reference():
    (v,) = audit([FLAKY], cfg=FAST.model_copy(update={"reference_runs": 10, "max_mutants": 0}))
    assert v.verdict == "flaky" and "of 10 runs" in v.reason    # P(10 equal coin flips) = 2/1024


def test_budgets_and_env_errors():
    slow, long_, unrunnable = audit(
        [GOOD, GOOD.model_copy(update={"task_id": "long", "prompt": "x" * 50}),
         GOOD.model_copy(update={"task_id": "ls", "execution_steps": (
             OverwriteFile(path="/app/a.sh", content=COMPLETION), RunCommand(command="ls 'unclosed"))})],
        cfg=AuditConfig(max_reference_ms=0.001, max_prompt_chars=20, max_mutants=0))
    assert slow.verdict == "too_slow" and "budget" in slow.reason
    assert long_.verdict == "too_long" and "50 chars" in long_.reason
    assert unrunnable.verdict == "env_error" and "cannot parse" in unrunnable.reason


def test_leaky_tests_are_quarantined_before_anything_runs():
    """A hidden test that the prompt shows (call and expected value) teaches the answer: not fit to train on."""
    leaky = GOOD.model_copy(update={"task_id": "leaky", "prompt": "# f(2) == 7\ndef f(x):\n"})
    (v,) = audit([leaky], cfg=FAST)
    assert v.verdict == "leaky_tests" and "hidden test 1" in v.reason and v.reference_ms is None


def test_unreadable_visible_examples_quarantine_their_task_not_the_audit():
    """A malformed metadata.visible_tests is that task's fault: it is "broken" with the reason, the rest is audited."""
    bad_item = GOOD.model_copy(update={"task_id": "vis", "metadata": {**GOOD.metadata, "visible_tests": [{"args": 1}]}})
    not_list = GOOD.model_copy(update={"task_id": "vis2", "metadata": {**GOOD.metadata, "visible_tests": 5}})
    good, vis, vis2 = audit([GOOD, bad_item, not_list], cfg=FAST.model_copy(update={"max_mutants": 2}))
    assert good.verdict == "pass"
    assert vis.verdict == "broken" and "metadata.visible_tests.0" in vis.reason and "\n" not in vis.reason
    assert "args: Input should be a valid string" in vis.reason and "expected: Field required" in vis.reason
    assert vis2.verdict == "broken" and "metadata.visible_tests: must be a list" in vis2.reason


def test_a_task_without_reference_is_audited_by_its_other_probes():
    no_ref = GOOD.model_copy(update={"task_id": "no_ref", "reference_solution": None})
    trivial = TRIVIAL.model_copy(update={"reference_solution": None})
    ok, bad = audit([no_ref, trivial], cfg=FAST)
    assert ok.verdict == "pass" and ok.reason.startswith("no reference solution") and ok.mutation_score is None
    assert bad.verdict == "trivial_passes"


def test_probe_matches_one_run_per_candidate():
    """Reference-vs-fast: the batched probe gives the same verdicts and scores as verify_many per candidate."""
    fam = get_family("python_functions")
    specs = [fam.generate(fam.config(), 7, i, 1 + i % 3, "train") for i in range(24)]
    fast = audit(specs, cfg=FAST)
    slow = audit(specs, cfg=FAST.model_copy(update={"batch_probes": False}))
    assert [(v.verdict, v.mutation_score) for v in fast] == [(v.verdict, v.mutation_score) for v in slow]


def test_mutants_by_hand():
    got = python_mutants("    x = x + 3\n    return x\n", prefix="def f(x):\n")
    assert got == ["    pass\n    return x\n", "    x = x + 3\n    pass\n", "    x = (x - 3)\n    return x\n",
                   "    x = x + (4)\n    return x\n", "    x = x + (2)\n    return x\n"]
    assert python_mutants("not python (", "") is None
    assert text_mutants("echo 5 > a\nls -1\n") == ["echo 6 > a\nls -1\n", "echo 4 > a\nls -1\n", "ls -1\n", "echo 5 > a\n"]
    many = mutants("    return " + " + ".join(str(i) for i in range(2, 30)) + "\n", "def f():\n", limit=5, seed="s")
    assert len(many) == 5 and many == mutants("    return " + " + ".join(str(i) for i in range(2, 30)) + "\n",
                                             "def f():\n", limit=5, seed="s")
    assert all("def f" not in m for m in task_mutants(GOOD, 50))    # only the completion is mutated


def test_regression_reports_changed_verdicts():
    prev = pl.DataFrame({"task_id": ["a", "b", "c"], "verdict": ["pass", "pass", "broken"], "reason": ["", "", "x"]})
    cur = pl.DataFrame({"task_id": ["a", "b", "d"], "split": ["train"] * 3, "verdict": ["pass", "weak_tests", "pass"],
                        "reason": ["", "tests kill 1/4 mutants", ""]})
    changed = regression(prev, cur)
    assert changed.to_dicts() == [{"task_id": "b", "split": "train", "previous": "pass", "current": "weak_tests",
                                   "reason": "tests kill 1/4 mutants"}]
