"""ratchet's RL framework: advantage estimators and losses as pure functions over tensors.

    advantages.py   outcome-level estimators behind a registry (grpo, dr_grpo, rloo,
                    reinforce_pp), per-turn credit, token-level GAE, dynamic sampling (zero-variance groups)
    losses.py       PPO clipped surrogate (clip-higher, truncated IS), aggregation modes,
                    KL estimators k1/k2/k3, value loss, entropy

Nothing here knows about Prefect, models or the store: the trainer hands in tensors and gets
tensors (and float metrics) back. Tests: `pytest tests/rl -q`.
"""

from ratchet.rl.advantages import (
    ESTIMATORS,
    TOKEN_LEVEL_ESTIMATORS,
    answer_count,
    compute_advantages,
    gae,
    keep_mask,
    masked_whiten,
    outcome_to_token_rewards,
    register_estimator,
    spread_over_turns,
    turn_advantages,
    zero_variance_groups,
)
from ratchet.rl.losses import aggregate, entropy_from_logits, kl_in_reward, kl_penalty, policy_loss, value_loss

__all__ = [
    "ESTIMATORS",
    "TOKEN_LEVEL_ESTIMATORS",
    "aggregate",
    "answer_count",
    "compute_advantages",
    "entropy_from_logits",
    "gae",
    "keep_mask",
    "masked_whiten",
    "outcome_to_token_rewards",
    "kl_in_reward",
    "kl_penalty",
    "policy_loss",
    "register_estimator",
    "spread_over_turns",
    "turn_advantages",
    "value_loss",
    "zero_variance_groups",
]
