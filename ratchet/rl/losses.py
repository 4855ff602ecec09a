"""Policy and value losses, KL estimators, aggregation: pure functions over [N, T] token tensors.

N sequences (micro-batch rows), T completion positions, `mask` [N, T] is 1 on the tokens the
policy generated (0 on padding and on tool/environment output). The trainer computes
`logprobs` [N, T] with gradients and passes the rest detached:

    loss, metrics = policy_loss(logprobs, old_logprobs, adv, mask, clip_high=cfg.rl.clip_high,
                                loss_agg=cfg.rl.loss_agg, ref_logprobs=ref, kl_coef=cfg.rl.kl_coef)

Gradient accumulation: pass `denom` (the whole minibatch's valid-token count for "token_mean",
its sequence count for the seq_* modes) so that the micro-batch losses sum to the minibatch loss.

Tests: `pytest tests/rl -q`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from ratchet.rl.advantages import answer_index

KLEstimator = Literal["k1", "k2", "k3"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
                  "answer_mean_token_mean"]
IN_LOSS: tuple[str, ...] = ("k2", "k3")
"""KL estimators whose gradient in the loss controls a KL (k2: KL(pi || pi_ref), k3: KL(pi_ref || pi))."""
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps ratios finite on garbage tokens (as verl does)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL divergence").

    With log r = log pi_ref(x) - log pi(x):  k1 = -log r (unbiased, can be negative per token),
    k2 = (log r)^2 / 2 (biased, low variance), k3 = (r - 1) - log r (unbiased, always >= 0).
    The log-ratio is clamped to +-20 before k3's exp. Returns [N, T].

    As values they estimate the same KL; as a loss term, differentiated through log pi, they do not
    (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL", arXiv:2506.09477):
    under x ~ pi the expected gradient of k2 is that of KL(pi || pi_ref), k3's is that of the reverse
    KL(pi_ref || pi) (DeepSeekMath's GRPO term), and k1's is E[grad log pi] = 0: no KL control at all,
    only variance. `policy_loss` refuses k1 (`IN_LOSS`); `kl_in_reward` uses the value, where all three work.
    """
    log_r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    if estimator == "k1":
        return -log_r  # [N, T]
    if estimator == "k2":
        return 0.5 * log_r.square()  # [N, T]
    if estimator == "k3":
        return torch.expm1(log_r) - log_r  # [N, T]
    raise ValueError(f"unknown KL estimator {estimator!r}; known: ['k1', 'k2', 'k3']")


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: LossAgg = "token_mean",
    max_len: int | None = None,
    denom: float | Tensor | None = None,
) -> Tensor:
    """Reduce per-token losses [N, T] over the valid tokens to a scalar.

    token_mean               sum / #tokens: every token weighs the same (DAPO, arXiv:2503.14476)
    seq_mean_token_mean      mean over sequences of each sequence's token mean (GRPO, arXiv:2402.03300);
                             long sequences' tokens weigh less — the length bias Dr. GRPO points out
    seq_mean_token_sum       mean over sequences of each sequence's token sum
    seq_mean_token_sum_norm  sum / (N * max_len), a constant normaliser (Dr. GRPO, arXiv:2503.20783);
                             max_len defaults to T
    answer_mean_token_mean   mean over answers of each answer's token mean, an answer being a run of 1s
                             in the mask (a multi-turn episode's answers, observations between them):
                             seq_mean_token_mean with every answer a sequence of its own, so that a
                             revision weighs as much as a first answer, not 1/K of one episode
    `denom` overrides the #tokens (token_mean), N (seq_* modes) or the #answers for gradient accumulation.
    """
    valid = mask.to(torch.bool)  # [N, T]
    masked = torch.where(valid, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))  # [N, T]
    if mode == "token_mean":
        return masked.sum() / (denom if denom is not None else valid.sum().clamp(min=1))
    if mode == "answer_mean_token_mean":
        answer = answer_index(valid)  # [N, T] 1, 2, .. on each answer's tokens, 0 elsewhere
        lengths = answer.new_zeros(answer.shape[0], answer.shape[1] + 1).scatter_add_(-1, answer, valid.long())  # [N, T+1] answer j's tokens at j
        per_token = lengths.gather(-1, answer).clamp(min=1).to(loss_mat.dtype)  # [N, T] its answer's length
        return (masked / per_token).sum() / (denom if denom is not None else answer.amax(dim=-1).sum().clamp(min=1))
    n_seq = denom if denom is not None else loss_mat.shape[0]
    if mode == "seq_mean_token_mean":
        per_seq = masked.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)  # [N]
        return per_seq.sum() / n_seq
    if mode == "seq_mean_token_sum":
        return masked.sum() / n_seq
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / (n_seq * (max_len if max_len is not None else loss_mat.shape[-1]))
    raise ValueError(f"unknown loss_agg {mode!r}; known: {list(LossAgg.__args__)}")


def _masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / valid.sum().clamp(min=1)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: LossAgg = "token_mean",
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k2",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    behavior_logprobs: Tensor | None = None,
    is_cap: float = 2.0,
    max_len: int | None = None,
    denom: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with DAPO's decoupled clip
    1 - clip_low <= ratio <= 1 + clip_high ("clip-higher", Yu et al. 2025, arXiv:2503.14476).

    ratio = pi / pi_old, pi_old the proximal policy (`old_logprobs`). When the samples came from
    an older behaviour policy (`behavior_logprobs`, the rollout engine's), each token's loss is
    multiplied by the truncated importance weight min(pi_old / pi_behav, is_cap), detached — the
    decoupled objective of Hilton et al. 2021 (arXiv:2110.00641) with IMPALA's truncation
    (arXiv:1802.01561), cf. "Your efficient RL framework secretly brings you off-policy RL training"
    (Yao et al. 2025). Plus kl_coef * `kl_estimator` of KL to the reference (k2, the default: its gradient is
    that of KL(pi || pi_ref); k3: of KL(pi_ref || pi); see `kl_penalty`) and minus entropy_coef * entropy,
    per token; all aggregated by `loss_agg`. advantages: [N] (one per sequence) or [N, T].
    Metrics (floats): pg_loss, clip_frac(_low/_high), approx_kl (KL(pi_old || pi), k3), kl (KL(pi || pi_ref)
    by k3, the unbiased value, whatever the loss's estimator; 0 if no ref), entropy (0 if none),
    is_weight_mean / is_capped_frac (1 / 0 if on-policy), ratio_mean.
    """
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("policy_loss: kl_coef > 0 needs ref_logprobs")
    if kl_coef > 0 and kl_estimator not in IN_LOSS:
        raise ValueError(f"policy_loss: kl_estimator {kl_estimator!r} in the loss has zero expected gradient (no KL "
                         f"control); use one of {list(IN_LOSS)}, or put the KL in the reward")
    if entropy_coef > 0 and entropy is None:
        raise ValueError("policy_loss: entropy_coef > 0 needs entropy")
    valid = mask.to(torch.bool)  # [N, T]
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [N, 1] or [N, T]
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    ratio = log_ratio.exp()  # [N, T]
    surr = ratio * adv  # [N, T]
    surr_clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv  # [N, T]
    pg = -torch.minimum(surr, surr_clipped)  # [N, T]
    is_w, capped = torch.ones_like(pg), torch.zeros_like(valid)  # [N, T], [N, T]
    if behavior_logprobs is not None:
        log_w = (old_logprobs - behavior_logprobs).detach()  # [N, T] log(pi_old / pi_behav)
        is_w, capped = log_w.clamp(max=math.log(is_cap)).exp(), log_w >= math.log(is_cap)  # [N, T] min(w, cap)
    loss_mat = pg * is_w  # [N, T]
    if kl_coef > 0:
        loss_mat = loss_mat + kl_coef * kl_penalty(logprobs, ref_logprobs, kl_estimator)  # [N, T]
    if entropy_coef > 0:
        loss_mat = loss_mat - entropy_coef * entropy  # [N, T]
    loss = aggregate(loss_mat, mask, loss_agg, max_len, denom)  # []

    with torch.no_grad():
        clipped = surr_clipped < surr  # [N, T] the clipped branch is the active one
        stats = {
            "pg_loss": aggregate(pg * is_w, mask, loss_agg, max_len, denom),
            "clip_frac": clipped,
            "clip_frac_low": clipped & (ratio < 1),
            "clip_frac_high": clipped & (ratio > 1),
            "approx_kl": kl_penalty(old_logprobs, logprobs, "k3"),  # KL(pi_old || pi), samples from pi_old
            "kl": kl_penalty(logprobs, ref_logprobs, "k3") if ref_logprobs is not None else torch.zeros_like(pg),
            "entropy": entropy if entropy is not None else torch.zeros_like(pg),
            "is_weight_mean": is_w,
            "is_capped_frac": capped,
            "ratio_mean": ratio,
        }
        means = [v if v.dim() == 0 else _masked_mean(v.to(pg.dtype), valid) for v in stats.values()]  # [] each
        values = torch.stack([m.detach().float() for m in means]).tolist()  # one device sync
    return loss, dict(zip(stats, values))


def value_loss(
    values: Tensor,
    returns: Tensor,
    old_values: Tensor,
    mask: Tensor,
    clip: float = 0.2,
    denom: float | Tensor | None = None,
) -> Tensor:
    """PPO value loss with value clipping (Schulman et al. 2017, arXiv:1707.06347; as in OpenAI baselines' ppo2).

    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2), token mean over the mask.
    values [N, T] carry gradients; returns and old_values (from `gae`) are treated as constants.
    """
    returns, old_values = returns.detach(), old_values.detach()
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)  # [N, T]
    loss_mat = 0.5 * torch.maximum((values - returns).square(), (v_clipped - returns).square())  # [N, T]
    return aggregate(loss_mat, mask, "token_mean", denom=denom)  # []


@torch.no_grad()
def kl_in_reward(
    rewards: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kl_coef: float, estimator: KLEstimator = "k1"
) -> Tensor:
    """Subtract the KL penalty from the reward instead of the loss (Ziegler et al. 2019, arXiv:1909.08593;
    REINFORCE++, arXiv:2501.03262). For `RLConfig.kl_in_reward`.

    rewards [N, T] (token rewards, e.g. for GAE): r_t - kl_coef * KL_t on valid tokens.
    rewards [N] (one per sequence, for the group estimators): r - kl_coef * sum_t KL_t.
    Detached: the reward is a constant to the policy gradient.
    """
    kl = torch.where(mask.to(torch.bool), kl_penalty(logprobs, ref_logprobs, estimator), 0.0)  # [N, T]
    if rewards.dim() == 1:
        return rewards - kl_coef * kl.sum(dim=-1)  # [N]
    return rewards - kl_coef * kl  # [N, T]


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution: logsumexp(z) - sum softmax(z) * z. [N, T, V] -> [N, T].

    Computed in float32 (bf16 logits lose the small probabilities). Gradients flow (entropy bonus).
    """
    z = logits.float()  # [N, T, V]
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)  # [N, T]
