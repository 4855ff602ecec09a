"""Advantage estimators: hand-computed values, loop-vs-vectorised references, registry-wide checks.

    .venv/bin/pytest tests/rl -q
"""

from __future__ import annotations

import math

import pytest
import torch

from ratchet.rl.advantages import (
    ESTIMATORS,
    compute_advantages,
    dr_grpo,
    gae,
    grpo,
    keep_mask,
    masked_whiten,
    outcome_to_token_rewards,
    register_estimator,
    reinforce_pp,
    rloo,
    zero_variance_groups,
)

# two groups of G=4: [1, 0, 0, 1] and [3, 0, 0, 0]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0])


def close(actual: torch.Tensor, expected: list[float], atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------- hand-computed values


def test_grpo_by_hand():
    # group 1: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503 -> +-0.5 / 0.5773503 = +-0.8660254
    # group 2: mean 0.75, var = (2.25^2 + 3 * 0.75^2) / 3 = (5.0625 + 1.6875) / 3 = 2.25, std = 1.5
    #          -> 2.25 / 1.5 = 1.5, -0.75 / 1.5 = -0.5
    close(grpo(REWARDS, 4), [0.8660254, -0.8660254, -0.8660254, 0.8660254, 1.5, -0.5, -0.5, -0.5])


def test_grpo_zero_variance_group_is_zero():
    close(grpo(torch.tensor([2.0, 2.0, 2.0]), 3), [0.0, 0.0, 0.0])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("value", [0.9, 1 / 3, 0.95, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tied_group_is_exactly_zero(name, value, dtype):
    """A group of equal rewards that are not exact in binary (a revision's 0.9 after a turn penalty, 2 of 6
    tests passed) gets exactly 0: the group mean is an ulp off, and GRPO divided that by a std of the same
    order, giving every sample of the group one nonzero advantage (-0.056 for eight 0.9s in float32)."""
    tied = torch.full((8,), value, dtype=dtype)
    assert compute_advantages(name, tied, 8).abs().max().item() == 0.0
    mixed = torch.cat([tied, torch.tensor([0.0, 1.0] * 4, dtype=dtype)])  # a tied group beside a mixed one
    adv = compute_advantages(name, mixed, 8)
    assert adv[:8].abs().max().item() == 0.0 and adv[8:].abs().min().item() > 0.1


@pytest.mark.parametrize("value", [0.9, 1 / 3, 0.3])
def test_reinforce_pp_on_a_tied_batch_is_exactly_zero(value):
    """Found by review: REINFORCE++ normalises over the batch with no tie guard, so a batch of equal
    rewards (drop_zero_variance off) gave every sample -0.056 (eight 0.9s, float32), and it trained."""
    assert compute_advantages("reinforce_pp", torch.full((16,), value), 8).abs().max().item() == 0.0


def test_dr_grpo_by_hand():
    # r - group mean, no std: group 1 mean 0.5, group 2 mean 0.75
    close(dr_grpo(REWARDS, 4), [0.5, -0.5, -0.5, 0.5, 2.25, -0.75, -0.75, -0.75])


def test_rloo_by_hand():
    # group 1: 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3
    # group 2: 3 - (0+0+0)/3 = 3    ; 0 - (3+0+0)/3 = -1
    close(rloo(REWARDS, 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 3.0, -1.0, -1.0, -1.0])


def test_reinforce_pp_by_hand():
    # global batch: mean = 5/8 = 0.625; deviations 0.375 (x2), -0.625 (x5), 2.375 (x1)
    # unbiased var = (2*0.140625 + 5*0.390625 + 5.640625) / 7 = 7.875 / 7 = 1.125, std = 1.0606602
    # 0.375/1.0606602 = 0.3535534, -0.625/1.0606602 = -0.5892557, 2.375/1.0606602 = 2.2391686
    a, b, c = 0.3535534, -0.5892557, 2.2391686
    close(reinforce_pp(REWARDS, 4), [a, b, b, a, c, b, b, b])


def test_reinforce_pp_baseline_variant_by_hand():
    # group-centred first (= dr_grpo): [.5, -.5, -.5, .5, 2.25, -.75, -.75, -.75], mean 0
    # unbiased var = (4*0.25 + 5.0625 + 3*0.5625) / 7 = 7.75 / 7 = 1.1071429, std = 1.0522086
    # 0.5/1.0522086 = 0.4751909, 2.25/1.0522086 = 2.1383590, -0.75/1.0522086 = -0.7127863
    a, c, d = 0.4751909, 2.1383590, -0.7127863
    close(reinforce_pp(REWARDS, 4, baseline=True), [a, -a, -a, a, c, d, d, d])


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 5.0], [1.0, 9.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    # row 0 (gamma=1, lam=0.5): t2: delta = 1 - 0.7 = 0.3, A = 0.3
    #   t1: delta = 0.7 - 0.6 = 0.1, A = 0.1 + 0.5*0.3 = 0.25 ; t0: delta = 0.6 - 0.5 = 0.1, A = 0.1 + 0.5*0.25 = 0.225
    #   returns = A + V = [0.725, 0.85, 1.0]
    adv, ret = gae(rewards[:1], values[:1], mask[:1], gamma=1.0, lam=0.5)
    close(adv, [[0.225, 0.25, 0.3]])
    close(ret, [[0.725, 0.85, 1.0]])
    # row 1 (gamma=0.5, lam=1), t2 is padding: t1: delta = 2 + 0.5*0 - 1 = 1, A = 1
    #   t0: delta = 0 + 0.5*1 - 1 = -0.5, A = -0.5 + 0.5*1*1 = 0 ; returns [1, 2, 0]
    adv, ret = gae(rewards[1:2], values[1:2], mask[1:2], gamma=0.5, lam=1.0)
    close(adv, [[0.0, 1.0, 0.0]])
    close(ret, [[1.0, 2.0, 0.0]])
    # row 2 (gamma=1, lam=1), t1 is a hole (tool output): t2: delta = 3 - 2 = 1, A = 1
    #   t0 bootstraps from V at t2: delta = 0 + 2 - 1 = 1, A = 1 + 1 = 2 ; returns [3, 0, 3]
    adv, ret = gae(rewards[2:], values[2:], mask[2:], gamma=1.0, lam=1.0)
    close(adv, [[2.0, 0.0, 1.0]])
    close(ret, [[3.0, 0.0, 3.0]])


def test_outcome_to_token_rewards_puts_reward_on_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = outcome_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    close(out, [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])


def test_gae_on_a_multi_turn_episode_steps_over_the_observation():
    """a1 (2 tokens) + o1 (2 observation tokens, mask 0) + a2 (1 token), outcome reward 1 on the last
    action token. The observation is the environment's transition: the recursion goes from a1's last
    token straight to a2's first, whose V has read the observation; no discount over its tokens."""
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    values = torch.tensor([[0.2, 0.4, 9.0, 9.0, 0.5]])       # V on observation positions is never used
    rewards = outcome_to_token_rewards(torch.tensor([1.0]), mask)
    close(rewards, [[0.0, 0.0, 0.0, 0.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # t4: delta = 1 - 0.5 = 0.5, A = 0.5
    # t1: delta = 0 + 0.9 * 0.5 - 0.4 = 0.05, A = 0.05 + 0.45 * 0.5 = 0.275
    # t0: delta = 0.9 * 0.4 - 0.2 = 0.16, A = 0.16 + 0.45 * 0.275 = 0.28375
    close(adv, [[0.28375, 0.275, 0.0, 0.0, 0.5]])
    close(ret, [[0.48375, 0.675, 0.0, 0.0, 1.0]])


def test_masked_whiten_by_hand():
    # valid [1, 2, 3]: mean 2, unbiased var 1 -> [-1, 0, 1]; padding stays 0
    out = masked_whiten(torch.tensor([[1.0, 2.0], [3.0, 100.0]]), torch.tensor([[1, 1], [1, 0]]))
    close(out, [[-1.0, 0.0], [1.0, 0.0]], atol=1e-4)


def test_zero_variance_groups_dropped_and_counted():
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 2, 2, 2, 0, 0, 1])  # G=3: [1,1,1] [0,1,0] [2,2,2] [0,0,1]
    assert zero_variance_groups(rewards, 3).tolist() == [True, False, True, False]
    mask, n_dropped = keep_mask(rewards, 3)
    assert mask.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert n_dropped == 2
    assert keep_mask(torch.tensor([0.0, 1.0, 1.0, 0.0]), 2).n_dropped_groups == 0


# ---------------------------------------------------------------- loop references


def grpo_loop(r: list[float], g: int, eps: float = 1e-6) -> list[float]:
    out = []
    for b in range(len(r) // g):
        grp = r[b * g : (b + 1) * g]
        mean = sum(grp) / g
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (g - 1))
        out += [(x - mean) / (std + eps) for x in grp]
    return out


def dr_grpo_loop(r: list[float], g: int) -> list[float]:
    out = []
    for b in range(len(r) // g):
        grp = r[b * g : (b + 1) * g]
        out += [x - sum(grp) / g for x in grp]
    return out


def rloo_loop(r: list[float], g: int) -> list[float]:
    out = []
    for b in range(len(r) // g):
        grp = r[b * g : (b + 1) * g]
        for i in range(g):
            others = [grp[j] for j in range(g) if j != i]
            out.append(grp[i] - sum(others) / len(others))
    return out


def reinforce_pp_loop(r: list[float], g: int, eps: float = 1e-6) -> list[float]:
    mean = sum(r) / len(r)
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
    return [(x - mean) / (std + eps) for x in r]


LOOPS = {"grpo": grpo_loop, "dr_grpo": dr_grpo_loop, "rloo": rloo_loop, "reinforce_pp": reinforce_pp_loop}


@pytest.mark.parametrize("name", sorted(LOOPS))
@pytest.mark.parametrize("group_size", [2, 5])
def test_estimator_matches_loop(name, group_size):
    gen = torch.Generator().manual_seed(7)
    n = 6 * group_size
    rewards = torch.randint(0, 3, (n,), generator=gen).double() + torch.rand(n, generator=gen, dtype=torch.float64)
    fast = compute_advantages(name, rewards, group_size)
    torch.testing.assert_close(fast, torch.tensor(LOOPS[name](rewards.tolist(), group_size), dtype=torch.float64))


def gae_loop(r: list[list[float]], v: list[list[float]], m: list[list[int]], gamma: float, lam: float):
    """Per row, run the textbook recursion over the valid positions only."""
    adv = [[0.0] * len(row) for row in r]
    for n in range(len(r)):
        idx = [t for t in range(len(r[n])) if m[n][t]]
        a_next, v_next = 0.0, 0.0
        for t in reversed(idx):
            delta = r[n][t] + gamma * v_next - v[n][t]
            a_next = delta + gamma * lam * a_next
            adv[n][t], v_next = a_next, v[n][t]
    ret = [[(adv[n][t] + v[n][t]) if m[n][t] else 0.0 for t in range(len(r[n]))] for n in range(len(r))]
    return adv, ret


def test_gae_matches_loop():
    gen = torch.Generator().manual_seed(3)
    n, t = 6, 9
    rewards = torch.randn(n, t, generator=gen, dtype=torch.float64)
    values = torch.randn(n, t, generator=gen, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=gen) > 0.3).long()
    mask[:, 0] = 1
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    ref_adv, ref_ret = gae_loop(rewards.tolist(), values.tolist(), mask.tolist(), 0.97, 0.9)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))


# ---------------------------------------------------------------- registry


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimator_on_cpu(name):
    """Every registered estimator: random batch -> finite [B*G] advantages, zero for a constant group."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 4, generator=gen)
    rewards[:4] = 0.5  # one zero-variance group
    adv = compute_advantages(name, rewards, 4)
    assert adv.shape == (24,)
    assert torch.isfinite(adv).all()
    assert adv.abs().sum() > 0
    assert torch.isfinite(compute_advantages(name, torch.tensor([1, 0, 1, 1]), 2)).all()  # int rewards


def test_registry_has_the_config_estimators():
    from ratchet.config import RLConfig

    names = set(RLConfig.model_fields["estimator"].annotation.__args__)
    assert names - {"gae"} == set(ESTIMATORS)


def test_unknown_estimator_lists_known_ones():
    with pytest.raises(KeyError, match="grpo.*rloo"):
        compute_advantages("ppo2", REWARDS, 4)
    with pytest.raises(KeyError, match=r"token-level.*gae\("):
        compute_advantages("gae", REWARDS, 4)


def test_ragged_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="not a multiple of group_size=3"):
        grpo(REWARDS, 3)


def test_register_estimator_adds_and_refuses_a_clash():
    @register_estimator("_test_sign")
    def sign(rewards, group_size):
        return torch.sign(rewards.view(-1, group_size) - 0.5).flatten()

    try:
        close(compute_advantages("_test_sign", torch.tensor([1.0, 0.0]), 2), [1.0, -1.0])
        with pytest.raises(ValueError, match="already registered"):
            register_estimator("grpo")(sign)
    finally:
        ESTIMATORS.pop("_test_sign")
