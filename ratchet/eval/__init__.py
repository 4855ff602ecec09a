"""Held-out evaluation and the promotion rule.

    result = evaluate(engine, heldout_specs, cfg.verify, max_new_tokens=48)   # pass@1, greedy
    decision = should_promote(result.results, incumbent_results, cfg.eval)      # paired, with a CI

pass@1 counts a task as solved when its greedy completion passed (`Verification.passed`, the
verifier's one definition, the audit's too: every hidden test, within the time limit).
Tasks whose verification hit an infrastructure error are excluded from the denominator
(and counted), never scored as failures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import polars as pl

from envs.spec import TaskSpec
from ratchet.config import EvalConfig, VerifyConfig
from ratchet.eval.stats import PromotionDecision, decide
from ratchet.verify import verify_many


@dataclass
class EvalResult:
    pass_rate: float
    n_tasks: int
    env_errors: int
    by_difficulty: dict[int, float] = field(default_factory=dict)
    rows: pl.DataFrame | None = None

    @property
    def results(self) -> dict[str, bool | None]:
        """{task_id: passed}, None where verification was an env_error: what promotion pairs."""
        return {t: (None if e else p) for t, e, p in self.rows.select("task_id", "env_error", "passed").iter_rows()}


def evaluate(engine, specs: Sequence[TaskSpec], verify: VerifyConfig = VerifyConfig(), max_new_tokens: int = 48,
             batch_size: int = 128) -> EvalResult:
    """Greedy pass@1 of `engine` on `specs`, verified as training verifies (same limits, retries)."""
    rollouts = engine.generate([s.prompt for s in specs], n=1, max_new_tokens=max_new_tokens,
                               greedy=True, batch_size=batch_size)
    results = verify_many([(specs[r.prompt_index], r.text) for r in rollouts], verify.sandbox_limits(),
                          verify.concurrency, verify.env_error_retries)
    rows = pl.DataFrame({
        "task_id": [s.task_id for s in specs],
        "difficulty": [s.difficulty for s in specs],
        "completion": [r.text for r in rollouts],
        "env_error": [v.env_error for v in results],
        "passed": [v.passed for v in results],
    })
    scored = rows.filter(~pl.col("env_error"))
    by_d = scored.group_by("difficulty").agg(pl.col("passed").mean()).sort("difficulty")
    return EvalResult(
        pass_rate=float(scored["passed"].mean() or 0.0),
        n_tasks=scored.height,
        env_errors=rows.height - scored.height,
        by_difficulty={int(d): round(float(p), 4) for d, p in by_d.iter_rows()},
        rows=rows,
    )


def should_promote(candidate: dict[str, bool | None], incumbent: dict[str, bool | None] | None,
                   cfg: EvalConfig = EvalConfig()) -> PromotionDecision:
    """The promotion rule: candidate and incumbent judged on the same held-out tasks, paired.

    candidate / incumbent: {task_id: passed} (None: that task's verification was an env_error;
    a task is compared only where both have a verdict). Promote only when the lower bound of the
    `cfg.confidence` interval of the pass-rate gain exceeds `cfg.min_gain` and (one sample per
    task) McNemar's exact test agrees: `ratchet.eval.stats.decide`. No incumbent: promote.
    """
    cand = {t: p for t, p in candidate.items() if p is not None}
    if incumbent is None:
        return decide([[p] for p in cand.values()], None, confidence=cfg.confidence, min_gain=cfg.min_gain)
    tasks = [t for t in cand if incumbent.get(t) is not None]
    if not tasks:
        raise ValueError("should_promote: candidate and incumbent share no task with a verdict")
    return decide([[cand[t]] for t in tasks], [[incumbent[t]] for t in tasks],
                  confidence=cfg.confidence, min_gain=cfg.min_gain)
