"""ratchet.reward: verification in the sandbox, and verifier metrics -> rewards (pure).

    from ratchet.reward import verify_many, score, score_frame, reward_bounds, env_error_report
    results = verify_many([(spec, completion), ...])               # sandboxed, retried, env_error marked
    r = score(results[0].metrics, spec.reward_logic, cfg.reward)    # None for env_error rows

Modules: `metrics` (the metric registry, validate_logic), `score` (the scalar and its
components), `frame` (a wave at once, env_error report), `guards` (reward-hacking checks),
`verify` (the single call site into the sandbox).
"""

from ratchet.reward.frame import env_error_report, score_frame
from ratchet.reward.guards import hidden_test_leaks, leaks_hidden_tests, special_cased
from ratchet.reward.metrics import METRICS, RewardLogicError, register_metric, validate_logic
from ratchet.reward.score import reward_bounds, score, score_components
from ratchet.reward.verify import Verification, verify_many

__all__ = [
    "METRICS", "RewardLogicError", "Verification", "env_error_report", "hidden_test_leaks",
    "leaks_hidden_tests", "register_metric", "reward_bounds", "score", "score_components",
    "score_frame", "special_cased", "validate_logic", "verify_many",
]
