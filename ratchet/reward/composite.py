"""Verifier metrics -> one scalar reward, exactly as the task's reward_logic says.

    r = score(verification.metrics, spec.reward_logic, cfg.reward)    # None for env_error rows
    lo, hi = reward_bounds(spec.reward_logic, cfg.reward)             # what the wave gate allows

The scalar, in order (every step is one small function below):

1. rule scores sᵢ from the metric registry (`ratchet.reward.metrics`); with
   `cfg.partial_credit` off a completion rule scores 1.0 only when it is full, else 0;
   efficiency and security rules score 0 when the run passed no test (a program that does
   nothing is fast, small and harmless: that must not earn reward);
2. composite  c = Σ wᵢ·sᵢ / Σ wᵢ       (the spec's example: 0.7·pass_rate + 0.3·clip(1 − t/5000, 0, 1));
3. format mix m = (1 − f)·c + f·format_ok,  f = cfg.format_weight;
4. timeout    r = cfg.timeout_reward if the run timed out, else m;
5. security   r = min(r, cfg.security_penalty) if any penalised security flag was raised
              (security_penalty None: flags do not change the reward).

So every reward lies in [min(0, timeout_reward, security_penalty), max(1, timeout_reward)].
A wave's scoring (`ratchet.reward.frame`) may then subtract `overlong_penalty` (at most
cfg.overlong_penalty, for an answer that ran to the length cap), and the bounds say so.
"""

from __future__ import annotations

from envs.spec import METRICS, RewardLogic, RewardRule, validate_logic
from ratchet.config import RewardConfig
from ratchet.reward.metrics import flag_runs, measurements, metric_score, penalised_flags

_GATED = {"efficiency", "security"}


def passed_something(metrics: dict) -> bool:
    """True when some hidden test passed (best run); metrics without test counts are not gated."""
    rates = measurements(metrics.get("test_pass_rate"))
    if rates:
        return max(float(v) for v in rates) > 0
    passed = measurements(metrics.get("tests_passed"))
    return max(passed) > 0 if passed else True


def rule_score(rule: RewardRule, metrics: dict, cfg: RewardConfig) -> float:
    """sᵢ: the metric's score, with partial credit and the no-work gate applied."""
    dim = METRICS[rule.metric].dimension if rule.metric in METRICS else None
    s = metric_score(rule, metrics)
    if dim == "completion" and not cfg.partial_credit:
        s = 1.0 if s >= 1.0 else 0.0
    if dim in _GATED and not passed_something(metrics):
        s = 0.0
    return s


def composite(metrics: dict, logic: RewardLogic, cfg: RewardConfig) -> float:
    """c = Σ wᵢ·sᵢ / Σ wᵢ over the logic's rules."""
    total = sum(r.weight for r in logic.rules)
    return sum(r.weight * rule_score(r, metrics, cfg) for r in logic.rules) / total


def format_ok(metrics: dict) -> float:
    """1.0 when every run's completion was well-formed, else 0 (unmeasured: 0)."""
    values = measurements(metrics.get("format_ok"))
    return 1.0 if values and all(values) else 0.0


def timed_out(metrics: dict) -> bool:
    """True when any run hit its wall-clock limit."""
    return any(measurements(metrics.get("timed_out")))


def security_flags(metrics: dict) -> list[str]:
    """The penalised flags raised by any run (sandbox events such as network_attempt, verifier
    flags such as special_cased_examples); reported-only flags (metrics.FLAGS) are left out."""
    return penalised_flags([f for run in flag_runs(metrics.get("security_flags")) for f in run])


def score(metrics: dict | None, logic: RewardLogic, cfg: RewardConfig) -> float | None:
    """The scalar reward (module docstring, steps 1-5); None when there are no metrics (env_error)."""
    if metrics is None:
        return None
    validate_logic(logic)
    c = composite(metrics, logic, cfg)
    r = (1.0 - cfg.format_weight) * c + cfg.format_weight * format_ok(metrics)
    if timed_out(metrics):
        r = cfg.timeout_reward
    if cfg.security_penalty is not None and security_flags(metrics):
        r = min(r, cfg.security_penalty)
    return float(r)


def overlong_penalty(tokens: int, cap: int, cfg: RewardConfig) -> float:
    """DAPO's soft overlong punishment (arXiv:2503.14476, section 3.4), as a positive amount to subtract:
    0 for an answer of `tokens` sampled tokens (EOS included) that ends before the last
    `cfg.overlong_buffer` tokens under `cap` (rollout.max_new_tokens), rising linearly to
    `cfg.overlong_penalty` at the cap; 0 with the buffer 0 (off)."""
    if cfg.overlong_buffer == 0:
        return 0.0
    into = min(max(tokens - (cap - cfg.overlong_buffer), 0), cfg.overlong_buffer)
    return cfg.overlong_penalty * into / cfg.overlong_buffer


def most_overlong(cfg: RewardConfig) -> float:
    """The most `overlong_penalty` takes off a reward (an answer at the cap); 0 with the buffer off."""
    return cfg.overlong_penalty if cfg.overlong_buffer else 0.0


def reward_bounds(logic: RewardLogic, cfg: RewardConfig) -> tuple[float, float]:
    """(lo, hi) every reward of this logic lies in: composite and format mix are in [0, 1];
    a timeout replaces it by timeout_reward; a security flag can only lower it, to security_penalty;
    the overlong penalty (when on) can take up to overlong_penalty off any of them."""
    validate_logic(logic)
    lows = [0.0, cfg.timeout_reward] + ([cfg.security_penalty] if cfg.security_penalty is not None else [])
    return float(min(lows)) - most_overlong(cfg), float(max(1.0, cfg.timeout_reward))
