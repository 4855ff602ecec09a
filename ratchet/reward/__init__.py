"""ratchet.reward: verifier metrics -> rewards, pure (the metrics come from `ratchet.verify`).

    from ratchet.reward import score, score_frame, reward_bounds
    r = score(verification.metrics, spec.reward_logic, cfg.reward)   # None for env_error rows
    scored = score_frame(wave, {s.task_id: s.reward_logic for s in specs}, cfg.reward)

Modules: `metrics` (how each metric scores; the registry and validate_logic are `envs.spec`'s,
so a task's rules are checked at import), `composite` (the scalar reward of a
task's reward_logic), `frame` (a whole wave at once).
"""

from envs.spec import METRICS, RewardLogicError, register_metric, validate_logic
from ratchet.reward.composite import reward_bounds, score
from ratchet.reward.frame import score_frame

__all__ = ["METRICS", "RewardLogicError", "register_metric", "reward_bounds", "score", "score_frame", "validate_logic"]
