"""Statistics for evaluation you can trust: pass@k, paired confidence intervals, a promotion rule.

Two checkpoints scored on the same held-out tasks differ by chance as well as by skill: on 300
tasks a gap of one task is noise. This module turns per-task, per-sample results into a
decision with its uncertainty attached, instead of comparing two point estimates:

    d = decide(candidate, incumbent, confidence=0.95)   # each: [n_tasks][k] bools, same tasks
    if d.promote: ...                                    # d.reason: one sentence with the figures
    print(d.estimate, d.ci_low, d.ci_high, d.p_value)    # difference in pass rate, CI, McNemar p

What it computes:
- `pass_at_k`: the unbiased pass@k estimator of Chen et al. 2021, "Evaluating Large Language
  Models Trained on Code" (arXiv:2107.03374), in their numerically stable product form.
- `bootstrap_mean`: the percentile CI of one model's mean pass rate over tasks (per-family tables).
- `paired_bootstrap`: percentile bootstrap (Efron & Tibshirani 1993, "An Introduction to the
  Bootstrap", ch. 13) over tasks of the per-task difference, i.e. paired bootstrap resampling as
  in Koehn 2004, "Statistical Significance Tests for Machine Translation Evaluation" (EMNLP).
  Pairing removes the between-task variance both models share; resampling whole tasks keeps the
  k samples of one task together (Miller 2024, "Adding Error Bars to Evals", arXiv:2411.00640).
  The percentile interval is somewhat too narrow for a few dozen tasks or fewer.
- `sign_test`: the exact (binomial) two-sided sign test over tasks on the per-task pass rates; it
  uses only the tasks whose rates differ. With one sample per task it is McNemar's exact test
  (McNemar 1947, Psychometrika 12:153; `mcnemar`). It is what keeps a few tasks from promoting: with
  k samples all on one side, the bootstrap interval of three tasks has no width at all, while the
  sign test gives p = 0.25. No scipy: `math.comb`.

Pure Python, no dependencies. Tests: `pytest tests/eval -q`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple, Sequence

METHODS = ("auto", "bootstrap")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Chen et al. 2021 (arXiv:2107.03374), fig. 3: the ratio of binomials is computed as the product
    prod_{i=n-c+1}^{n} (1 - k/i), which never forms the (huge) binomials themselves.
    """
    if n < 1:
        raise ValueError(f"pass_at_k: n (samples per task) must be >= 1, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c (correct samples) must be in [0, n={n}], got c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n={n}], got k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class Bootstrap(NamedTuple):
    estimate: float  # observed mean of (candidate - incumbent) over tasks
    ci_low: float  # lower percentile bound of the mean difference
    ci_high: float  # upper percentile bound of the mean difference


def bootstrap_mean(values: Sequence[float], iters: int = 2000, seed: int = 0,
                   confidence: float = 0.95) -> Bootstrap:
    """Percentile CI of mean(values), resampling the values (tasks) with replacement.
    Deterministic for a given seed."""
    if not values:
        raise ValueError("bootstrap: no tasks")
    if iters < 1 or not 0.0 < confidence < 1.0:
        raise ValueError(f"bootstrap: need iters >= 1 and 0 < confidence < 1, "
                         f"got iters={iters}, confidence={confidence}")
    values = [float(v) for v in values]
    n, rng = len(values), random.Random(seed)
    means = sorted(math.fsum(rng.choices(values, k=n)) / n for _ in range(iters))  # [iters]
    alpha = 1.0 - confidence
    return Bootstrap(math.fsum(values) / n, _percentile(means, alpha / 2), _percentile(means, 1 - alpha / 2))


def paired_bootstrap(candidate: Sequence[float], incumbent: Sequence[float], iters: int = 2000,
                     seed: int = 0, confidence: float = 0.95) -> Bootstrap:
    """Percentile CI of mean(candidate - incumbent), resampling tasks with replacement.

    candidate, incumbent: per-task success rates (or 0/1) on the same tasks in the same order.
    Resampling the per-task differences is resampling tasks, both models together (paired).
    Deterministic for a given seed.
    """
    if len(candidate) != len(incumbent):
        raise ValueError(f"paired_bootstrap: candidate has {len(candidate)} tasks but incumbent has "
                         f"{len(incumbent)}; both must cover the same tasks in the same order")
    if not candidate:
        raise ValueError("paired_bootstrap: no tasks to compare")
    return bootstrap_mean([float(a) - float(b) for a, b in zip(candidate, incumbent)], iters, seed, confidence)


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 1]."""
    pos = q * (len(sorted_values) - 1)
    lo, frac = int(math.floor(pos)), pos - math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + frac * (sorted_values[hi] - sorted_values[lo])


class McNemar(NamedTuple):
    b: int  # tasks the candidate solved and the incumbent did not
    c: int  # tasks the incumbent solved and the candidate did not
    p_value: float  # exact two-sided p under H0: b ~ Binomial(b + c, 1/2)


def mcnemar(candidate: Sequence[bool], incumbent: Sequence[bool]) -> McNemar:
    """Exact two-sided McNemar test on paired pass/fail results (one sample per task): the sign test
    on 0/1 outcomes."""
    return sign_test([float(bool(x)) for x in candidate], [float(bool(y)) for y in incumbent])


def sign_test(candidate: Sequence[float], incumbent: Sequence[float]) -> McNemar:
    """Exact two-sided sign test on paired per-task pass rates: b tasks where the candidate's rate is
    higher, c where it is lower, ties left out.

    p = min(1, 2 * sum_{i <= min(b, c)} C(b+c, i) / 2^(b+c)); p = 1 when no task differs.
    Integer arithmetic until the final (correctly rounded) division.
    """
    if len(candidate) != len(incumbent):
        raise ValueError(f"sign test: candidate has {len(candidate)} tasks but incumbent has "
                         f"{len(incumbent)}; both must cover the same tasks in the same order")
    b = sum(1 for x, y in zip(candidate, incumbent) if x > y)
    c = sum(1 for x, y in zip(candidate, incumbent) if x < y)
    n = b + c
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return McNemar(b, c, min(1.0, 2 * tail / 2**n))


@dataclass(frozen=True)
class PromotionDecision:
    promote: bool  # True only when the evidence says the candidate is better
    estimate: float  # mean per-task pass-rate difference, candidate - incumbent (fraction, not points);
    #                  with no incumbent, the candidate's own mean pass rate
    ci_low: float  # lower bound of the `confidence` percentile bootstrap CI of `estimate`
    ci_high: float  # upper bound of that CI
    method: str  # "paired bootstrap + exact McNemar" (k = 1), "... + exact sign test" (k > 1), "paired
    #              bootstrap" (method="bootstrap"), or "no incumbent"
    p_value: float | None  # the exact test's p-value when used (method="auto"), else None
    reason: str  # one human sentence with the figures


def decide(candidate: Sequence[Sequence[bool]], incumbent: Sequence[Sequence[bool]] | None, *,
           confidence: float = 0.95, min_gain: float = 0.0, method: str = "auto",
           seed: int = 0, against: str = "the incumbent") -> PromotionDecision:
    """Promote only if the CI lower bound of mean(candidate - incumbent) exceeds `min_gain`.

    candidate, incumbent: [n_tasks][k] per-sample pass/fail, same tasks in the same order.
    With method="auto", the exact sign test's p over tasks (McNemar's at k = 1) must also be below
    1 - confidence.
    min_gain is a fraction (0.02 = 2 points). incumbent=None promotes (nothing to beat). `against`
    names the incumbent side in the reason ("the base model").
    """
    if method not in METHODS:
        raise ValueError(f"decide: method must be one of {METHODS}, got {method!r}")
    k = _samples_per_task(candidate, "candidate")
    cand_rates = [sum(map(bool, row)) / k for row in candidate]  # [n_tasks]
    pct = f"{confidence:.0%}"
    if incumbent is None:
        est, lo, hi = bootstrap_mean(cand_rates, seed=seed, confidence=confidence)
        return PromotionDecision(True, est, lo, hi, "no incumbent", None,
                                 f"Promote: there is no incumbent; candidate pass rate {_pts(est)}% "
                                 f"({pct} CI {_pts(lo)}% to {_pts(hi)}%, {len(cand_rates)} tasks).")
    _check_same_shape(candidate, incumbent, k)
    inc_rates = [sum(map(bool, row)) / k for row in incumbent]  # [n_tasks]
    est, lo, hi = paired_bootstrap(cand_rates, inc_rates, seed=seed, confidence=confidence)
    test = sign_test(cand_rates, inc_rates) if method == "auto" else None
    ci_ok, p_ok = lo > min_gain, test is None or test.p_value < 1.0 - confidence
    promote = ci_ok and p_ok
    name = "paired bootstrap" + (f" + {_test_name(k)}" if test else "")
    return PromotionDecision(promote, est, lo, hi, name, test.p_value if test else None,
                             _reason(promote, est, lo, hi, name, len(cand_rates), k, test, ci_ok, p_ok,
                                     min_gain, confidence, against))


def _samples_per_task(results: Sequence[Sequence[bool]], who: str) -> int:
    """k, the common number of samples per task; a ValueError naming the first task that differs."""
    if len(results) == 0:
        raise ValueError(f"decide: {who} has no tasks")
    k = len(results[0])
    if k == 0:
        raise ValueError(f"decide: {who} task 0 has no samples; every task needs k >= 1 samples")
    for i, row in enumerate(results):
        if len(row) != k:
            raise ValueError(f"decide: {who} task 0 has {k} samples but task {i} has {len(row)}; "
                             f"every task needs the same k >= 1 samples")
    return k


def _check_same_shape(candidate: Sequence[Sequence[bool]], incumbent: Sequence[Sequence[bool]], k: int) -> None:
    if len(candidate) != len(incumbent):
        raise ValueError(f"decide: candidate has {len(candidate)} tasks but incumbent has {len(incumbent)}; "
                         f"both must cover the same tasks in the same order")
    k_inc = _samples_per_task(incumbent, "incumbent")
    if k_inc != k:
        raise ValueError(f"decide: candidate has {k} samples per task but incumbent has {k_inc}; "
                         f"compare checkpoints under the same protocol")


def _test_name(k: int) -> str:
    return "exact McNemar" if k == 1 else "exact sign test"


def _pts(x: float, sign: bool = False) -> str:
    """A fraction as percentage points, e.g. 0.2 -> '20.0' ('+20.0' with sign)."""
    return f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}"


def _reason(promote: bool, est: float, lo: float, hi: float, name: str, n: int, k: int,
            test: McNemar | None, ci_ok: bool, p_ok: bool, min_gain: float, confidence: float,
            against: str = "the incumbent") -> str:
    """One sentence: the verdict, the figures, and the condition(s) that decided it."""
    samples = f"{k} sample{'s' if k > 1 else ''}"
    figures = (f"candidate is {_pts(est, True)} points vs {against} ({confidence:.0%} CI {_pts(lo, True)} "
               f"to {_pts(hi, True)}, paired bootstrap over {n} tasks x {samples}")
    if test:
        figures += f"; {_test_name(k)} p={test.p_value:.3g}, b={test.b}, c={test.c}"
    ci = (f"the CI lower bound {'exceeds' if ci_ok else 'does not exceed'} the required gain of "
          f"{_pts(min_gain, True)} points")
    p = f"p {'<' if p_ok else 'is not below'} {1 - confidence:.3g}" if test else ""
    # promoted: every condition held, say them all; kept: say only the ones that failed
    why = [w for w, ok in ((ci, ci_ok), (p, p_ok)) if w and (promote or not ok)]
    return f"{'Promote' if promote else 'Keep ' + against}: {figures}); {' and '.join(why)}."
