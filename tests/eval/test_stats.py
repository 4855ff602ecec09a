"""Evaluation statistics: hand-computed pass@k and McNemar values, bootstrap determinism, the promotion rule.

    .venv/bin/pytest tests/eval -q
"""

from __future__ import annotations

import itertools
import math

import pytest

from ratchet.eval.stats import PromotionDecision, decide, mcnemar, paired_bootstrap, pass_at_k, sign_test


def solved(n_tasks: int, which) -> list[list[bool]]:
    """[n_tasks][1]: task i solved iff which(i)."""
    return [[bool(which(i))] for i in range(n_tasks)]


# ---------------------------------------------------------------- pass@k

@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),     # pass@1 is c/n
    (5, 2, 2, 0.7),     # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 0, 3, 0.0),     # nothing correct
    (5, 3, 3, 1.0),     # n - c = 2 < k = 3: every 3-subset holds a correct sample
    (10, 1, 10, 1.0),   # k = n with one correct
    (4, 1, 2, 0.5),     # 1 - C(3,2)/C(4,2) = 1 - 3/6
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def _pass_at_k_by_enumeration(n: int, c: int, k: int) -> float:
    """The definition: the fraction of k-subsets of the n samples that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_enumeration_and_binomial_formula(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            by_comb = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_by_enumeration(n, c, k), abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(by_comb, abs=1e-12)


def test_pass_at_k_stable_for_large_n():
    # C(1000, 100) overflows a float; the product form does not. pass@1 must still be c/n.
    assert pass_at_k(1000, 37, 1) == pytest.approx(0.037, abs=1e-12)
    assert 0.0 < pass_at_k(1000, 3, 100) < 1.0


@pytest.mark.parametrize("n, c, k, field", [
    (5, 2, 6, "k"), (5, 2, 0, "k"), (5, 6, 1, "c"), (5, -1, 1, "c"), (0, 0, 1, "n"),
])
def test_pass_at_k_rejects_bad_arguments(n, c, k, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        pass_at_k(n, c, k)


# ---------------------------------------------------------------- McNemar

def test_mcnemar_small_case_matches_hand_computed_binomial():
    # 8 tasks only the candidate solves, 2 only the incumbent solves, 5 both, 5 neither.
    cand = [True] * 8 + [False] * 2 + [True] * 5 + [False] * 5
    inc = [False] * 8 + [True] * 2 + [True] * 5 + [False] * 5
    res = mcnemar(cand, inc)
    assert (res.b, res.c) == (8, 2)
    # 2 * (C(10,0) + C(10,1) + C(10,2)) / 2^10 = 2 * (1 + 10 + 45) / 1024 = 0.109375
    assert res.p_value == pytest.approx(0.109375, abs=1e-15)


def test_mcnemar_is_symmetric_and_capped_at_one():
    assert mcnemar([True, False], [False, True]).p_value == 1.0   # b = c = 1: 2 * 3/4 capped
    assert mcnemar([True] * 3, [True] * 3).p_value == 1.0          # no discordant tasks
    a, b = [True] * 6 + [False], [False] * 6 + [True]
    assert mcnemar(a, b).p_value == mcnemar(b, a).p_value == pytest.approx(2 * 8 / 128)  # (1 + 7) / 2^7


def test_mcnemar_length_mismatch():
    with pytest.raises(ValueError, match="3 tasks.*2"):
        mcnemar([True] * 3, [True] * 2)


# ---------------------------------------------------------------- paired bootstrap

WIN_CAND = [1.0 if i < 120 else 0.0 for i in range(300)]
WIN_INC = [1.0 if i < 60 else 0.0 for i in range(300)]


def test_bootstrap_is_deterministic_for_a_seed():
    assert paired_bootstrap(WIN_CAND, WIN_INC, seed=3) == paired_bootstrap(WIN_CAND, WIN_INC, seed=3)


def test_bootstrap_ci_close_to_normal_approximation():
    # differences: 60 ones and 240 zeros, mean 0.2, sd sqrt(0.2 * 0.8) = 0.4, se = 0.4 / sqrt(300) = 0.0231;
    # 95% normal interval 0.2 +- 1.96 * 0.0231 = (0.155, 0.245). Any seed should land within 1.5 points.
    for seed in (0, 1, 2):
        est, lo, hi = paired_bootstrap(WIN_CAND, WIN_INC, seed=seed)
        assert est == pytest.approx(0.2)
        assert lo == pytest.approx(0.155, abs=0.015) and hi == pytest.approx(0.245, abs=0.015)


def test_bootstrap_wider_at_higher_confidence():
    _, lo90, hi90 = paired_bootstrap(WIN_CAND, WIN_INC, confidence=0.90)
    _, lo99, hi99 = paired_bootstrap(WIN_CAND, WIN_INC, confidence=0.99)
    assert lo99 < lo90 < 0.2 < hi90 < hi99


def test_bootstrap_is_paired():
    # Both models vary hugely across tasks but the candidate is always exactly 0.1 better:
    # unpaired, that would be noise; paired, every resample's mean difference is 0.1.
    inc = [(i % 10) / 10 * 0.9 for i in range(50)]
    cand = [x + 0.1 for x in inc]
    est, lo, hi = paired_bootstrap(cand, inc)
    assert est == pytest.approx(0.1) and lo == pytest.approx(0.1) and hi == pytest.approx(0.1)


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="3 tasks.*2"):
        paired_bootstrap([1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match="no tasks"):
        paired_bootstrap([], [])
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap([1], [0], confidence=1.0)


# ---------------------------------------------------------------- decide

def test_clear_win_is_promoted():
    # 300 tasks; the candidate solves 120, the incumbent 60, and the incumbent's 60 are among the 120.
    d = decide(solved(300, lambda i: i < 120), solved(300, lambda i: i < 60))
    assert isinstance(d, PromotionDecision)
    assert d.promote
    assert d.estimate == pytest.approx(0.2)
    assert 0.0 < d.ci_low < 0.2 < d.ci_high
    assert d.method == "paired bootstrap + exact McNemar"
    assert d.p_value == pytest.approx(2 / 2**60)   # b=60, c=0: 2 * C(60,0) / 2^60
    assert "+20.0 points" in d.reason and "Promote" in d.reason


def test_tie_within_noise_is_not_promoted():
    # 300 tasks, the candidate solves exactly one more: +0.3 points, McNemar b=1, c=0, p=1.
    d = decide(solved(300, lambda i: i < 61), solved(300, lambda i: i < 60))
    assert not d.promote
    assert d.estimate == pytest.approx(1 / 300)
    assert d.ci_low <= 0.0
    assert d.p_value == 1.0
    assert "Keep the incumbent" in d.reason and "+0.3 points" in d.reason


def test_regression_is_not_promoted():
    d = decide(solved(300, lambda i: i < 60), solved(300, lambda i: i < 120))
    assert not d.promote
    assert d.estimate == pytest.approx(-0.2) and d.ci_high < 0
    assert "-20.0 points" in d.reason and "does not exceed" in d.reason


def test_identical_results_are_not_promoted_with_zero_ci():
    same = solved(300, lambda i: i % 3 == 0)
    d = decide(same, [list(r) for r in same])
    assert not d.promote
    assert (d.estimate, d.ci_low, d.ci_high) == (0.0, 0.0, 0.0)
    assert d.p_value == 1.0


def test_mcnemar_can_veto_a_small_sample_bootstrap():
    # 30 tasks, the candidate alone solves 5: the bootstrap lower bound is above 0 (a resample misses
    # all 5 with probability (25/30)^30 = 0.4%), but exact McNemar p = 2 / 2^5 = 0.0625 >= 0.05.
    cand, inc = solved(30, lambda i: i < 5), solved(30, lambda i: False)
    auto = decide(cand, inc)
    assert auto.ci_low > 0 and auto.p_value == pytest.approx(0.0625)
    assert not auto.promote and "p is not below 0.05" in auto.reason
    boot = decide(cand, inc, method="bootstrap")
    assert boot.promote and boot.p_value is None and boot.method == "paired bootstrap"


def test_min_gain_raises_the_bar():
    cand, inc = solved(300, lambda i: i < 120), solved(300, lambda i: i < 60)   # +20 points, CI ~ (15.5, 24.5)
    assert decide(cand, inc, min_gain=0.10).promote
    d = decide(cand, inc, min_gain=0.18)
    assert not d.promote and "+18.0 points" in d.reason


def test_several_samples_per_task_use_per_task_rates_and_the_sign_test():
    # k=2: candidate rates [1, 0.5, 0.5, 0] x 50, incumbent [0.5, 0.5, 0, 0] x 50 -> mean difference 0.25;
    # 100 tasks higher, none lower: sign test p = 2 / 2^100
    cand = [[True, True], [True, False], [False, True], [False, False]] * 50
    inc = [[True, False], [False, True], [False, False], [False, False]] * 50
    d = decide(cand, inc)
    assert d.estimate == pytest.approx(0.25)
    assert d.p_value == pytest.approx(2 / 2**100) and d.method == "paired bootstrap + exact sign test"
    assert d.promote and "x 2 samples" in d.reason and "exact sign test p=" in d.reason and "b=100, c=0" in d.reason


@pytest.mark.parametrize("n", [1, 3, 5])
def test_a_few_tasks_do_not_promote_with_several_samples(n):
    """k = 8, each task 1/8 against 0/8: every resample gives +12.5, so the bootstrap interval has no width
    and its lower bound clears 0 on one task; the sign test over tasks (p = 2 / 2^n) keeps the incumbent."""
    d = decide([[True] + [False] * 7] * n, [[False] * 8] * n)
    assert d.ci_low == pytest.approx(0.125) and d.p_value == pytest.approx(min(1.0, 2 / 2**n))
    assert not d.promote and "p is not below 0.05" in d.reason
    assert decide([[True] + [False] * 7] * 6, [[False] * 8] * 6).promote      # six: p = 1/32


def test_the_sign_test_is_mcnemar_at_one_sample():
    cand, inc = solved(40, lambda i: i % 3 == 0), solved(40, lambda i: i % 4 == 0)
    assert sign_test([float(x[0]) for x in cand], [float(x[0]) for x in inc]) == mcnemar([x[0] for x in cand],
                                                                                        [x[0] for x in inc])


def test_no_incumbent_promotes_and_says_so():
    d = decide(solved(10, lambda i: i < 4), None)
    assert d.promote and d.p_value is None and d.method == "no incumbent"
    assert d.estimate == pytest.approx(0.4)
    assert "no incumbent" in d.reason


def test_decide_is_deterministic_for_a_seed():
    cand, inc = solved(100, lambda i: i % 3 == 0), solved(100, lambda i: i % 4 == 0)
    assert decide(cand, inc, seed=7) == decide(cand, inc, seed=7)


def test_shape_mismatch_names_both_lengths():
    with pytest.raises(ValueError, match=r"candidate has 300 tasks but incumbent has 299"):
        decide(solved(300, lambda i: True), solved(299, lambda i: True))


def test_sample_count_mismatches_are_named():
    with pytest.raises(ValueError, match=r"candidate has 2 samples per task but incumbent has 1"):
        decide([[True, False]] * 3, [[True]] * 3)
    with pytest.raises(ValueError, match=r"incumbent task 0 has 1 samples but task 2 has 2"):
        decide([[True]] * 3, [[True], [False], [True, True]])
    with pytest.raises(ValueError, match=r"candidate has no tasks"):
        decide([], [])


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="method"):
        decide([[True]], [[False]], method="t-test")
