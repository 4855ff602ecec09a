"""Registry-wide: every family is deterministic, its references pass, its trivial answers fail,
its mutation score is reported. A new family file is picked up here without editing this test."""

from __future__ import annotations

import pytest

from ratchet.audit import audit
from ratchet.config import AuditConfig
from envs.registry import all_family_names, get_family

FAMILIES = all_family_names()
# tasks audited per family (families whose runs start a shell are slower)
AUDITED = {"shell": 2}


def test_the_four_families_are_registered():
    assert {"python_functions", "bugfix", "arithmetic", "shell"} <= set(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_deterministic_and_well_formed(name):
    fam = get_family(name)
    cfg = fam.config()
    for split in ("train", "heldout"):
        for d in range(1, 6):
            a, b = fam.generate(cfg, 3, 11, d, split), fam.generate(cfg, 3, 11, d, split)
            assert a == b, f"{name}: generate is not deterministic at difficulty {d}"
            assert a.family == name and a.difficulty == d and a.split == split
            assert fam.generate(cfg, 4, 11, d, split) != a, "the seed changes the task"
        ids = {fam.generate(cfg, 0, i, 2, split).task_id for i in range(20)}
        assert len(ids) >= 15, f"{name}: task ids collide"
    if fam.curriculum is not None:   # weights per level; the share of the hardest level never falls
        shares = []
        for step in range(10):
            w = fam.curriculum(step, 10, 5)
            assert len(w) == 5 and min(w) >= 0 and sum(w) > 0
            shares.append(w[-1] / sum(w))
        assert shares == sorted(shares) and shares[-1] > shares[0], f"{name}: the curriculum does not move up"


@pytest.mark.parametrize("name", FAMILIES)
def test_references_pass_trivial_answers_fail(name, record_property):
    fam = get_family(name)
    n = AUDITED.get(name, 6)
    specs = [fam.generate(fam.config(), 0, i, 1 + i % 3, "train" if i % 2 == 0 else "heldout") for i in range(n)]
    cfg = AuditConfig(max_mutants=4 if name in AUDITED else 8, max_reference_ms=60_000)
    verdicts = audit(specs, cfg=cfg)
    for v in verdicts:
        assert v.verdict not in ("broken", "flaky", "env_error"), f"{name}: reference of {v.task_id}: {v.reason}"
        assert v.verdict != "trivial_passes", f"{name}: {v.task_id}: {v.reason}"
    scores = [v.mutation_score for v in verdicts if v.mutation_score is not None]
    assert scores, f"{name}: no mutation score could be computed"
    record_property("mutation_score", sum(scores) / len(scores))
    print(f"{name}: mean mutation score {sum(scores) / len(scores):.2f} over {len(scores)} task(s); "
          f"verdicts {[v.verdict for v in verdicts]}")


def test_python_functions_curriculum_by_hand():
    """Uniform at the start, weights 1..max at the end: the last waves see 3x more 3-op than 1-op tasks;
    pick_tasks follows the weights."""
    from ratchet.rollout.wave import pick_tasks

    curriculum = get_family("python_functions").curriculum
    assert curriculum(0, 10, 3) == [1.0, 1.0, 1.0]
    assert curriculum(9, 10, 3) == [1.0, 2.0, 3.0]
    assert curriculum(3, 7, 3) == [1.0, 1.5, 2.0]                    # half way: t = 3 / 6
    fam = get_family("python_functions")
    tasks = [fam.generate(fam.config(), 0, i, d, "train") for d in (1, 2, 3) for i in range(60)]
    first = [t.difficulty for t in pick_tasks(tasks, 60, 0, 100, curriculum, seed=0)]
    last = [t.difficulty for t in pick_tasks(tasks, 60, 99, 100, curriculum, seed=0)]
    assert sum(last) / len(last) > sum(first) / len(first) + 0.2   # expected means 2.0 and 2.33


def test_a_curriculum_that_weighs_fewer_tasks_than_a_wave_takes_them_all_and_fills_the_rest():
    """The shell family's curriculum weighs difficulty 1 alone at step 0. With fewer difficulty-1
    tasks than a wave's prompts, drawing by the weights until the wave was full never ended; with
    none (the audit removed them), the draw raised. Now the weighted levels' tasks all go in and the
    other levels fill the wave."""
    from ratchet.rollout.wave import pick_tasks

    curriculum = get_family("shell").curriculum
    assert curriculum(0, 10, 3) == [1.0, 0.0, 0.0]
    fam = get_family("python_functions")
    tasks = [fam.generate(fam.config(), 0, i, d, "train") for d in (1, 2, 3) for i in range(10)]
    picked = pick_tasks(tasks, 16, 0, 10, curriculum, seed=0)
    assert len({t.task_id for t in picked}) == 16
    assert sum(t.difficulty == 1 for t in picked) == 10
    no_easy = pick_tasks([t for t in tasks if t.difficulty > 1], 16, 0, 10, curriculum, seed=0)
    assert len({t.task_id for t in no_easy}) == 16


def test_a_bugfix_answer_that_fixes_nothing_passes_nothing():
    """Found by review: the hidden pytest file held the expected values and ran in the answer's own
    process, so an answer returning an object equal to everything, or one reading the expected values
    out of that file, passed every test. The cases are now compared outside the sandbox."""
    from envs.families.bugfix import Config, generate
    from ratchet.verify import verify_many

    spec = generate(Config(), 1, 0, 1, "train")
    tested = spec.metadata["tested"]
    always_equal = ("class _A:\n    def __eq__(s, o): return True\n    def __ne__(s, o): return False\n"
                    + "".join(f"def {f}(*a, **k): return _A()\n" for f in tested))
    reads_the_workdir = ("import glob\n_seen = {p: open(p).read() for p in glob.glob('/app/**', recursive=True) if p.endswith('.py')}\n"
                         + "".join(f"def {f}(*a): return len(_seen)\n" for f in tested))
    own_dispatcher = spec.metadata["buggy"] + "\n\ndef call(name, *args):\n    return True\n"
    results = verify_many([(spec, spec.reference_solution), (spec, spec.metadata["buggy"]), (spec, always_equal),
                           (spec, reads_the_workdir), (spec, own_dispatcher)])
    assert [r.passed for r in results] == [True, False, False, False, False]
    assert results[0].metrics["tests_passed"] == len(spec.tests) and results[2].metrics["tests_passed"] == 0
    assert not spec.test_files      # nothing in the sandbox holds an expected value
