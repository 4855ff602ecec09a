"""Advantage estimators: pure functions behind a small registry, plus GAE and dynamic sampling.

Outcome-level estimators map one scalar reward per sequence to one advantage per sequence;
`turn_advantages` applies one per turn of multi-turn episodes (per-turn credit: a revision against
the other revisions of its task) and `spread_over_turns` lays an episode's per-turn advantages on its
answers' tokens (`answer_count` counts them).
Rewards arrive grouped contiguously: `rewards[b * G + g]` is sample g of prompt b, so
`rewards.view(B, G)` recovers the groups. A new estimator is a function registered with
`@register_estimator("name")`; the trainer selects it by `RLConfig.estimator`:

    adv = compute_advantages(cfg.rl.estimator, rewards, group_size)      # [B*G] -> [B*G]

GAE is token-level (it needs a value head), so it is not in the registry: PPO calls `gae()`
directly on `outcome_to_token_rewards(...)`. `TOKEN_LEVEL_ESTIMATORS` names such estimators.

Tests: `pytest tests/rl -q`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

ESTIMATORS: dict[str, Callable[..., Tensor]] = {}
TOKEN_LEVEL_ESTIMATORS: tuple[str, ...] = ("gae",)


def register_estimator(name: str) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Register `fn(rewards [B*G], group_size, **kw) -> advantages [B*G]` under `name`."""

    def deco(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        old = ESTIMATORS.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(
                f"advantage estimator {name!r} is already registered by {old.__module__}.{old.__qualname__}"
            )
        ESTIMATORS[name] = fn
        return fn

    return deco


def compute_advantages(name: str, rewards: Tensor, group_size: int, **kw) -> Tensor:
    """Advantages [B*G] from rewards [B*G] with the estimator registered as `name`."""
    if name not in ESTIMATORS:
        if name in TOKEN_LEVEL_ESTIMATORS:
            raise KeyError(
                f"advantage estimator {name!r} is token-level (it needs a value head): call "
                f"ratchet.rl.advantages.gae(token_rewards, values, mask, gamma, lam); "
                f"outcome-level estimators: {sorted(ESTIMATORS)}"
            )
        raise KeyError(
            f"unknown advantage estimator {name!r}; known: {sorted(ESTIMATORS)} "
            f"(token-level: {list(TOKEN_LEVEL_ESTIMATORS)})"
        )
    return ESTIMATORS[name](rewards, group_size, **kw)


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """rewards [B*G] -> [B, G] as floats, with a clear error on a ragged batch."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B*G], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    return rewards.view(-1, group_size)  # [B, G]


def _centred(g: Tensor) -> Tensor:
    """g [B, G] minus each group's mean, exactly 0 in a group whose rewards are all equal: in float32 the
    mean of eight 0.9s is one ulp off 0.9, and GRPO's std division would turn that 6e-8 into an
    advantage of 0.06 group-stds, one sign for the whole group."""
    tied = _tied(g).unsqueeze(1)  # [B, 1]
    return torch.where(tied, torch.zeros_like(g), g - g.mean(dim=1, keepdim=True))  # [B, G]


def _tied(g: Tensor) -> Tensor:
    """g [B, G] -> bool [B]: the groups whose rewards are all equal."""
    return (g == g[:, :1]).all(dim=1)  # [B]


@register_estimator("grpo")
def grpo(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps) (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    std is the unbiased (n-1) sample std, as in the reference implementations (verl, TRL).
    A group whose rewards are all equal gets advantage 0.
    """
    g = _grouped(rewards, group_size)  # [B, G]
    std = g.std(dim=1, keepdim=True) if group_size > 1 else g.new_zeros(g.shape[0], 1)  # [B, 1]
    return (_centred(g) / (std + eps)).flatten()  # [B*G]


@register_estimator("dr_grpo")
def dr_grpo(rewards: Tensor, group_size: int) -> Tensor:
    """Dr. GRPO: A_i = r_i - mean_g, no std scaling (Liu et al. 2025, arXiv:2503.20783).

    Dividing by the group std up-weights near-unanimous groups (a difficulty bias); the paper
    drops it, and pairs it with no per-sequence length normalisation in the loss:
    use `loss_agg="seq_mean_token_sum_norm"` (or "token_mean") with it.
    """
    return _centred(_grouped(rewards, group_size)).flatten()  # [B*G]


@register_estimator("rloo")
def rloo(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019).

    The leave-one-out baseline does not depend on r_i, so the estimate stays unbiased;
    it equals G/(G-1) * (r_i - mean_g). Needs group_size >= 2.
    """
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2, got {group_size}")
    return (_centred(_grouped(rewards, group_size)) * (group_size / (group_size - 1))).flatten()  # [B*G]


@register_estimator("reinforce_pp")
def reinforce_pp(rewards: Tensor, group_size: int, eps: float = 1e-6, baseline: bool = False) -> Tensor:
    """REINFORCE++: global batch normalisation A = (r - mean_batch) / (std_batch + eps) (Hu 2025, arXiv:2501.03262).

    Default: the paper's REINFORCE++ — no per-prompt baseline, the mean/std are taken over the
    whole batch (every prompt, every sample), which is what makes it robust to reward scale
    without GRPO's per-group std. The paper's token-wise KL term (r - beta * sum KL) lives in
    `losses.kl_in_reward` when `RLConfig.kl_in_reward` is on. `baseline=True` is the paper's
    REINFORCE++-baseline variant: subtract the group mean first, then normalise globally.
    The statistics depend on the rows passed in, so drop zero-variance groups first if you drop them.
    """
    g = _grouped(rewards, group_size)  # [B, G]
    if baseline:
        g = _centred(g)  # [B, G]
    flat = g.flatten()  # [B*G]
    std = flat.std() if flat.numel() > 1 else torch.zeros((), dtype=flat.dtype, device=flat.device)  # []
    return _centred(flat[None])[0] / (std + eps)  # [B*G] a batch whose rewards are all equal: exactly 0


def turn_advantages(name: str, states: Tensor, group_size: int, answers: Tensor, branch: int = 1) -> Tensor:
    """Per-turn credit for multi-turn episodes (`AgentConfig.credit` "turn"): states [B*G, K], the value
    of each episode's state after turn k (its latest answer's reward so far; an episode that ended
    keeps its last), answers [B*G] how many answers each episode gave -> advantages [B*G, K].

    Column 1 is the estimator `name` over the group's first answers: single-turn credit. Column k > 1
    is the estimator over the group's episodes that answered turn k, the revisions of the same task
    after a failed answer, on their states after turn k: a revision is credited with how it did against
    the other revisions, not against episodes that passed earlier (those would make every revision look
    bad: on the bench's waves they put the mean advantage of second answers at -0.3 to -0.4 and of third
    answers at -0.6 to -0.7, in group-std units). A revision with no other revision of its task to
    compare with gets 0, as a group of one does; an episode's columns past its last answer are 0.
    `name` must be a per-task group estimator (grpo, dr_grpo, rloo): reinforce_pp normalises over the
    batch, which here would be the revisions of groups with as many revisions as its own.

    `branch` b > 1 (`agent.branch`: each group's rows come in b-tuples that share their first answer,
    rows [b*j, b*j + b) of a group): the second answers are judged within their tuple, the revisions
    of ONE failed answer against each other, so that a revision is not credited for the answer it
    revised (a near miss's repeat against another answer's rewrite); later answers, which revise
    answers of their own, against the task's other revisions at their turn, as without branches."""
    if states.dim() != 2:
        raise ValueError(f"turn_advantages: states must be 2-D [B*G, K], got shape {tuple(states.shape)}")
    if answers.shape != states.shape[:1]:
        raise ValueError(f"turn_advantages: answers must be [B*G] = [{states.shape[0]}], got {tuple(answers.shape)}")
    first = compute_advantages(name, states[:, 0].contiguous(), group_size)  # [B*G]
    out = first.new_zeros(states.shape)  # [B*G, K]
    out[:, 0] = first
    if branch < 1 or group_size % branch:
        raise ValueError(f"turn_advantages: group_size ({group_size}) must be a multiple of branch ({branch})")
    rows = torch.arange(states.shape[0], device=states.device).view(-1, group_size)  # [B, G]
    answers = answers.to(states.device)
    for k in range(1, states.shape[1]):
        by_size: dict[int, list[Tensor]] = {}   # the groups' revisions at turn k, by how many (one call per size)
        for group in (rows.reshape(-1, branch) if k == 1 and branch > 1 else rows):   # [G] or a tuple [b]
            live = group[answers[group] > k]  # [g]
            if live.numel() > 1:
                by_size.setdefault(live.numel(), []).append(live)
        for size, groups in by_size.items():
            idx = torch.cat(groups)  # [n * size]
            out[idx, k] = compute_advantages(name, states[idx, k].contiguous(), size).to(out.dtype)
    return out


def _answer_starts(loss_mask: Tensor) -> Tensor:
    """[..., c] 1 where an answer begins in a multi-turn episode's loss mask [..., c] (a run of 1s is one answer)."""
    m = loss_mask.to(torch.long)  # [..., c]
    return m * (1 - torch.nn.functional.pad(m[..., :-1], (1, 0)))  # [..., c]


def answer_index(loss_mask: Tensor) -> Tensor:
    """[..., c] the answer each action token of a loss mask [..., c] belongs to, 1, 2, ... (the k-th run
    of 1s is answer k); 0 on the other tokens."""
    return torch.cumsum(_answer_starts(loss_mask), dim=-1) * loss_mask.to(torch.long)  # [..., c]


def answer_count(loss_mask: Tensor) -> int:
    """How many answers an episode gave: the runs of 1s in its loss mask [c]."""
    return int(_answer_starts(loss_mask).sum())


def spread_over_turns(turn_adv: Tensor, loss_mask: Tensor) -> Tensor:
    """Token advantages [c] of one episode: the k-th run of action tokens (1s of `loss_mask` [c], the
    answer of turn k) gets turn_adv[k] ([K]); observation tokens get 0."""
    answer = answer_index(loss_mask)  # [c] the turn (1-based) of each action token, 0 elsewhere
    n_runs = int(answer.max()) if answer.numel() else 0
    if n_runs > turn_adv.numel():
        raise ValueError(f"spread_over_turns: the loss mask has {n_runs} answers but there are advantages for "
                         f"{turn_adv.numel()} turns")
    return torch.where(answer > 0, turn_adv.to(torch.get_default_dtype())[(answer - 1).clamp(min=0)], 0.0)  # [c]


@torch.no_grad()
def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv:1506.02438).

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1};  R_t = A_t + V_t.
    Positions where mask == 0 (padding, or tool output inside a multi-turn completion) are
    skipped: the recursion carries over them, V after the last valid token is 0. Returns
    (advantages [N, T], returns [N, T]), zero where mask == 0, not whitened (see `masked_whiten`).
    """
    values = values.detach()
    m = mask.to(values.dtype)  # [N, T]
    next_value = values.new_zeros(values.shape[0])  # [N]
    last_adv = values.new_zeros(values.shape[0])  # [N]
    adv = torch.zeros_like(values)  # [N, T]
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]  # [N]
        step_adv = delta + gamma * lam * last_adv  # [N]
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value  # [N]
        last_adv = m[:, t] * step_adv + (1 - m[:, t]) * last_adv  # [N]
        adv[:, t] = last_adv
    adv = adv * m  # [N, T]
    return adv, (adv + values) * m  # [N, T], [N, T]


def outcome_to_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's scalar reward [N] on its last valid token -> token rewards [N, T] (for GAE)."""
    m = mask.to(torch.bool)  # [N, T]
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m)  # [N, T]
    last = torch.where(m, pos, -1).max(dim=1).values  # [N], -1 for an empty row
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    out = torch.zeros(m.shape, dtype=dtype, device=m.device)  # [N, T]
    rows = torch.nonzero(last >= 0).flatten()  # [N']
    out[rows, last[rows]] = rewards[rows].to(out.dtype)
    return out  # [N, T]


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the valid tokens (PPO's advantage normalisation); zero where mask == 0."""
    m = mask.to(x.dtype)  # [N, T]
    n = m.sum().clamp(min=1)  # []
    mean = (x * m).sum() / n  # []
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)  # [] unbiased
    return (x - mean) * torch.rsqrt(var + eps) * m  # [N, T]


def zero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Groups whose rewards are all equal -> bool [B] (DAPO's dynamic sampling, Yu et al. 2025, arXiv:2503.14476).

    Such a group has zero advantage under every group-baselined estimator, so it contributes no
    gradient and only dilutes the batch; DAPO filters it out (and counts it).
    """
    return _tied(_grouped(rewards, group_size))  # [B]


class KeepMask(NamedTuple):
    """`keep_mask`'s answer: unpacks as `mask, n_dropped = keep_mask(...)`."""

    mask: Tensor  # [B*G] bool, True = train on this row
    n_dropped_groups: int  # groups dropped for zero variance


def keep_mask(rewards: Tensor, group_size: int) -> KeepMask:
    """Rows to keep after dropping zero-variance groups -> (bool [B*G], number of groups dropped)."""
    zero = zero_variance_groups(rewards, group_size)  # [B]
    return KeepMask((~zero).repeat_interleave(group_size), int(zero.sum()))  # [B*G], int
