"""Held-out evaluation and the promotion rule.

    result = evaluate(engine, heldout_specs, cfg.verify, max_new_tokens=48)   # pass@1, greedy
    promote, why = should_promote(result.pass_rate, incumbent=0.21, min_gain=0.0)

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
from ratchet.config import VerifyConfig
from ratchet.verify import verify_many


@dataclass
class EvalResult:
    pass_rate: float
    n_tasks: int
    env_errors: int
    by_difficulty: dict[int, float] = field(default_factory=dict)
    rows: pl.DataFrame | None = None


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


def should_promote(candidate: float, incumbent: float | None, min_gain: float = 0.0) -> tuple[bool, str]:
    """Promote only a checkpoint that beats the incumbent by more than `min_gain`."""
    if incumbent is None:
        return True, f"no incumbent; candidate pass@1 {candidate:.3f}"
    if candidate > incumbent + min_gain:
        return True, f"candidate {candidate:.3f} beats incumbent {incumbent:.3f} (+{min_gain:.3f} required)"
    return False, f"candidate {candidate:.3f} does not beat incumbent {incumbent:.3f} (+{min_gain:.3f} required)"
