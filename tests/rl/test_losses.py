"""Losses: hand-computed values, a loop reference for policy_loss, clip-higher, KL estimators,
truncated IS, aggregation modes, gradient direction.

    .venv/bin/pytest tests/rl -q
"""

from __future__ import annotations

import math

import pytest
import torch

from ratchet.rl.losses import aggregate, entropy_from_logits, kl_in_reward, kl_penalty, policy_loss, value_loss

LN = math.log


def close(actual, expected, atol: float = 1e-5) -> None:
    actual = torch.as_tensor(actual)
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
    # pi = 0.5, pi_ref = 0.25: log r = log(0.25 / 0.5) = -0.6931472
    # k1 = -log r = 0.6931472 ; k2 = 0.5 * 0.4804530 = 0.2402265 ; k3 = (0.5 - 1) + 0.6931472 = 0.1931472
    lp, ref = torch.tensor([[LN(0.5)]]), torch.tensor([[LN(0.25)]])
    close(kl_penalty(lp, ref, "k1"), [[0.6931472]])
    close(kl_penalty(lp, ref, "k2"), [[0.2402265]])
    close(kl_penalty(lp, ref, "k3"), [[0.1931472]])
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(lp, ref, "k4")


def test_kl_estimators_expectation_exact():
    """Under x ~ q, E[k1] = E[k3] = KL(q || p) exactly; k2 is biased; k1 goes negative, k3 never does."""
    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    p = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    true_kl = float((q * (q / p).log()).sum())  # 0.5 ln2.5 + 0.3 ln0.6 + 0.2 ln(2/3) = 0.2238...
    expect = {e: float((q * kl_penalty(q.log(), p.log(), e)).sum()) for e in ("k1", "k2", "k3")}
    assert expect["k1"] == pytest.approx(true_kl, abs=1e-12)
    assert expect["k3"] == pytest.approx(true_kl, abs=1e-12)
    assert abs(expect["k2"] - true_kl) > 1e-3
    assert (kl_penalty(q.log(), p.log(), "k1") < 0).any()  # unbiased but not per-sample positive
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 32, generator=gen) * 3, torch.randn(64, 32, generator=gen) * 3
    assert (kl_penalty(a, b, "k3") >= 0).all()
    assert torch.isfinite(kl_penalty(a * 100, b, "k3")).all()  # clamped log-ratio


def test_kl_in_reward_by_hand():
    lp = torch.tensor([[LN(0.5), LN(0.5), LN(0.9)]])
    ref = torch.tensor([[LN(0.25), LN(0.5), LN(0.1)]])
    mask = torch.tensor([[1, 1, 0]])  # last token is padding: no penalty there
    # k1 = [ln 2, 0, -]: token rewards [0, 1, 0] - 0.1 * [0.6931472, 0, 0]
    close(kl_in_reward(torch.tensor([[0.0, 1.0, 0.0]]), lp, ref, mask, 0.1), [[-0.0693147, 1.0, 0.0]])
    # per-sequence reward 1.0 - 0.1 * (0.6931472 + 0) = 0.9306853
    close(kl_in_reward(torch.tensor([1.0]), lp, ref, mask, 0.1), [0.9306853])


# ---------------------------------------------------------------- aggregation


def test_aggregation_modes_by_hand():
    loss_mat = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])  # row 1 has 1 valid token
    close(aggregate(loss_mat, mask, "token_mean"), 1.4)  # (4 + 3) / 5 tokens
    close(aggregate(loss_mat, mask, "seq_mean_token_mean"), 2.0)  # (4/4 + 3/1) / 2: the short row weighs more
    close(aggregate(loss_mat, mask, "seq_mean_token_sum"), 3.5)  # (4 + 3) / 2
    close(aggregate(loss_mat, mask, "seq_mean_token_sum_norm"), 0.875)  # 7 / (2 * T=4)
    close(aggregate(loss_mat, mask, "seq_mean_token_sum_norm", max_len=7), 0.5)  # 7 / (2 * 7)
    close(aggregate(loss_mat, mask, "answer_mean_token_mean"), 2.0)  # one answer per row: seq_mean_token_mean
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(loss_mat, mask, "sum")


def test_answer_mean_weighs_each_answer_of_an_episode_as_a_sequence():
    """Row 0 is an episode of two answers (tokens 0-1, then 3-5; token 2 an observation), row 1 one answer:
    three answers, each its own token mean, then their mean. Each token's gradient is 1 / (its answer's
    length * 3); seq_mean_token_mean would give row 0's tokens 1 / (5 * 2), a revision half a sequence."""
    loss_mat = torch.tensor([[1.0, 2.0, 9.0, 3.0, 5.0, 0.0], [4.0, 4.0, 0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    loss = aggregate(loss_mat, mask, "answer_mean_token_mean")
    close(loss, (1.5 + 8 / 3 + 4) / 3)
    loss.backward()
    close(loss_mat.grad, [[1 / 6, 1 / 6, 0, 1 / 9, 1 / 9, 1 / 9], [1 / 6, 1 / 6, 0, 0, 0, 0]])
    parts = sum(aggregate(loss_mat[i:i + 1], mask[i:i + 1], "answer_mean_token_mean", denom=3) for i in range(2))
    close(parts, float(loss))                                         # micro-batches: denom = the minibatch's answers
    one = torch.tensor([[2.0]])                                       # one column: answer 1 needs a slot past T
    close(aggregate(one, torch.ones(1, 1), "answer_mean_token_mean"), 2.0)
    close(aggregate(one, torch.zeros(1, 1), "answer_mean_token_mean"), 0.0)


def test_aggregation_ignores_nan_on_padding_and_denom_splits_micro_batches():
    loss_mat = torch.tensor([[1.0, float("nan")], [2.0, 4.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    close(aggregate(loss_mat, mask, "token_mean"), 7.0 / 3)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "answer_mean_token_mean"):
        whole = aggregate(loss_mat, mask, mode)
        denom = 3 if mode == "token_mean" else 2  # whole minibatch's tokens / sequences
        parts = sum(aggregate(loss_mat[i : i + 1], mask[i : i + 1], mode, max_len=2, denom=denom) for i in range(2))
        close(parts, float(whole))


# ---------------------------------------------------------------- policy loss

# seq 0: ratios [1.1, 1.5], advantage +1 ; seq 1: ratios [0.5, 0.9], advantage -1 (old logprobs 0)
RATIOS = torch.tensor([[1.1, 1.5], [0.5, 0.9]])
ADV = torch.tensor([1.0, -1.0])
MASK = torch.ones(2, 2)


def test_policy_loss_by_hand():
    # r=1.1,A=+1: -min(1.1, 1.1) = -1.1 ; r=1.5,A=+1: -min(1.5, 1.2) = -1.2 (clipped high)
    # r=0.5,A=-1: -min(-0.5, -0.8) = 0.8 (clipped low) ; r=0.9,A=-1: -min(-0.9, -0.9) = 0.9
    # token_mean = (-1.1 - 1.2 + 0.8 + 0.9) / 4 = -0.15
    loss, m = policy_loss(RATIOS.log(), torch.zeros(2, 2), ADV, MASK)
    close(loss, -0.15)
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["clip_frac_low"] == pytest.approx(0.25)
    assert m["clip_frac_high"] == pytest.approx(0.25)
    assert m["is_weight_mean"] == 1.0 and m["kl"] == 0.0
    assert set(m) >= {"clip_frac", "approx_kl", "kl", "entropy", "is_weight_mean", "pg_loss"}
    # same loss with per-token advantages [N, T]
    close(policy_loss(RATIOS.log(), torch.zeros(2, 2), ADV[:, None].expand(2, 2), MASK)[0], -0.15)


def test_policy_loss_kl_and_entropy_terms_by_hand():
    lp = torch.zeros(1, 2)  # pi = 1 -> ratio 1, pg = -A = -1 per token
    ref = torch.tensor([[LN(0.5), 0.0]])  # k2 = [0.5 * ln(2)^2, 0] = [0.2402265, 0]; k3 = [0.5 - 1 + ln 2, 0]
    ent = torch.tensor([[2.0, 4.0]])
    # per token: -1 + 0.1 * [0.2402265, 0] - 0.01 * [2, 4] -> mean = -1 + 0.0120113 - 0.03 = -1.0179887
    loss, m = policy_loss(lp, lp, torch.tensor([1.0]), torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.1,
                          entropy=ent, entropy_coef=0.01)
    close(loss, -1.0179887)
    assert m["kl"] == pytest.approx(0.0965736) and m["entropy"] == pytest.approx(3.0)  # the metric is k3's value
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, torch.tensor([1.0]), torch.ones(1, 2), kl_coef=0.1)
    with pytest.raises(ValueError, match="'k1' in the loss has zero expected gradient"):
        policy_loss(lp, lp, torch.tensor([1.0]), torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.1, kl_estimator="k1")


def test_kl_in_the_loss_follows_the_gradient_it_names():
    """Exact expectation over a 5-way softmax pi, x ~ pi (Tang & Munos 2025): the gradient of the KL term in
    the loss is grad KL(pi || ref) for k2, grad KL(ref || pi) for k3 and 0 for k1 (why k1 is refused there)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, generator=gen, dtype=torch.float64)
    ref = torch.log_softmax(torch.randn(5, generator=gen, dtype=torch.float64), -1)

    def grad(f):
        x = logits.clone().requires_grad_(True)
        f(torch.log_softmax(x, -1)).backward()
        return x.grad

    pi = torch.softmax(logits, -1)  # the sampling distribution, no gradient
    expected = {e: grad(lambda lp, e=e: (pi * kl_penalty(lp, ref, e)).sum()) for e in ("k1", "k2", "k3")}
    forward = grad(lambda lp: (lp.exp() * (lp - ref)).sum())   # KL(pi || ref)
    reverse = grad(lambda lp: (ref.exp() * (ref - lp)).sum())  # KL(ref || pi)
    torch.testing.assert_close(expected["k2"], forward)
    torch.testing.assert_close(expected["k3"], reverse)
    torch.testing.assert_close(expected["k1"], torch.zeros(5, dtype=torch.float64))
    assert (forward - reverse).abs().max() > 0.05  # the two directions differ here


def test_clip_higher_is_asymmetric():
    old = torch.zeros(1, 2)
    # token 0: r = 1.25, A = +1 ; token 1: r = 0.75, A = -1 (per-token advantages)
    adv = torch.tensor([[1.0, -1.0]])
    for clip_high, expect_grad0 in ((0.2, 0.0), (0.28, -1.25 / 2)):
        lp = torch.tensor([[LN(1.25), LN(0.75)]], requires_grad=True)
        loss, m = policy_loss(lp, old, adv, torch.ones(1, 2), clip_low=0.2, clip_high=clip_high)
        loss.backward()
        # high side: 1.25 > 1.2 is clipped (no gradient) but 1.25 < 1.28 is not: d(-r/2)/dlogp = -r/2
        assert lp.grad[0, 0].item() == pytest.approx(expect_grad0)
        # low side: 0.75 < 0.8 with A < 0 is clipped either way
        assert lp.grad[0, 1].item() == 0.0
        assert m["clip_frac_low"] == pytest.approx(0.5)
        assert m["clip_frac_high"] == pytest.approx(0.5 if clip_high == 0.2 else 0.0)
    # loss: symmetric -(1.2) + 0.8 -> -0.2 ; clip-higher -(1.25) + 0.8 -> -0.225 (means over 2 tokens)
    close(policy_loss(torch.tensor([[LN(1.25), LN(0.75)]]), old, adv, torch.ones(1, 2), clip_high=0.28)[0], -0.225)


def test_truncated_importance_weight_caps_and_is_detached():
    old = torch.zeros(1, 2, requires_grad=True)
    behavior = torch.tensor([[-LN(3.0), LN(2.0)]], requires_grad=True)  # w = pi_old/pi_behav = [3, 0.5]
    lp = torch.zeros(1, 2, requires_grad=True)  # ratio 1, A = +1: pg = -1 per token
    loss, m = policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), behavior_logprobs=behavior, is_cap=2.0)
    # weights min(3, 2) = 2 and 0.5: (-2 - 0.5) / 2 = -1.25
    close(loss, -1.25)
    assert m["is_weight_mean"] == pytest.approx(1.25)
    assert m["is_capped_frac"] == pytest.approx(0.5)
    loss.backward()
    close(lp.grad, [[-1.0, -0.25]])  # gradient scaled by the (capped) weight / 2 tokens
    assert old.grad is None and behavior.grad is None  # the weight is a constant
    # no behaviour logprobs = on-policy = weight 1
    close(policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2))[0], -1.0)


@pytest.mark.parametrize("adv_sign", [1.0, -1.0])
def test_gradient_direction_follows_advantage(adv_sign):
    """One SGD step on the logits raises a positive-advantage token's logprob and lowers a negative one's."""
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 5, requires_grad=True)  # [N, T, V]
    tokens = torch.tensor([[1, 4, 2]])
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)  # [N, T]
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor([adv_sign]), torch.ones(1, 3))
    loss.backward()
    assert (torch.sign(-logits.grad.gather(-1, tokens[..., None])) == adv_sign).all()  # descent direction
    with torch.no_grad():
        new_lp = torch.log_softmax(logits - 0.1 * logits.grad, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert (torch.sign(new_lp - lp.detach()) == adv_sign).all()


def policy_loss_loop(lp, old, adv, mask, behav, ref, ent, *, clip_low, clip_high, mode, kl_coef, ent_coef, is_cap):
    """Naive per-element reference: python floats, one token at a time."""
    n, t = len(lp), len(lp[0])
    per_tok = [[0.0] * t for _ in range(n)]
    clipped = tokens = 0
    for i in range(n):
        for j in range(t):
            if not mask[i][j]:
                continue
            a = adv[i][j] if isinstance(adv[i], list) else adv[i]
            r = math.exp(lp[i][j] - old[i][j])
            unclipped, clipped_term = r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a
            w = min(math.exp(old[i][j] - behav[i][j]), is_cap)
            log_r = ref[i][j] - lp[i][j]
            k3 = math.exp(log_r) - 1 - log_r
            per_tok[i][j] = -min(unclipped, clipped_term) * w + kl_coef * k3 - ent_coef * ent[i][j]
            clipped += clipped_term < unclipped
            tokens += 1
    lens = [sum(row) for row in mask]
    sums = [sum(row) for row in per_tok]
    if mode == "token_mean":
        loss = sum(sums) / tokens
    elif mode == "seq_mean_token_mean":
        loss = sum(s / l for s, l in zip(sums, lens)) / n
    elif mode == "seq_mean_token_sum":
        loss = sum(sums) / n
    else:
        loss = sum(sums) / (n * t)
    return loss, clipped / tokens


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("token_adv", [False, True])
def test_policy_loss_matches_loop(mode, token_adv):
    gen = torch.Generator().manual_seed(11)
    n, t = 5, 7
    def rnd(*shape, s=0.3):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * s
    old = rnd(n, t) - 1.0
    lp, behav, ref = old + rnd(n, t), old + rnd(n, t, s=0.8), old + rnd(n, t)
    adv, ent = rnd(n, t, s=1.0) if token_adv else rnd(n, s=1.0), rnd(n, t).abs()
    mask = (torch.rand(n, t, generator=gen) > 0.3).long()
    mask[:, 0] = 1
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05, is_cap=1.5)
    loss, m = policy_loss(lp, old, adv, mask, loss_agg=mode, ref_logprobs=ref, kl_estimator="k3",
                          entropy=ent, entropy_coef=0.01, behavior_logprobs=behav, **kw)
    ref_loss, ref_clip = policy_loss_loop(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), behav.tolist(),
                                          ref.tolist(), ent.tolist(), mode=mode, ent_coef=0.01, **kw)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(ref_clip)
    assert 0 < m["is_capped_frac"] < 1 and 0 < m["clip_frac"] < 1  # the random draw exercises both


# ---------------------------------------------------------------- value loss, entropy


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 7.0]], requires_grad=True)
    old, returns = torch.tensor([[0.5, 2.0, 0.0]]), torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # t0: (1-2)^2 = 1 ; clipped V = 0.5 + clip(0.5, +-0.2) = 0.7, (0.7-2)^2 = 1.69 -> 0.5 * 1.69 = 0.845
    # t1: (2-1)^2 = 1 ; clipped V = 2 + 0 = 2 -> 0.5 * 1 = 0.5      ; mean = (0.845 + 0.5) / 2 = 0.6725
    loss = value_loss(values, returns, old, mask, clip=0.2)
    close(loss, 0.6725)
    loss.backward()
    close(values.grad, [[0.0, 0.5, 0.0]])  # t0's max is the clipped term: no gradient; t1: (2-1)/2


def test_entropy_from_logits_by_hand():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [5.0, 5.0, -1e9, -1e9]]])  # uniform over 4, over 2
    close(entropy_from_logits(logits), [[1.3862944, 0.6931472]])  # ln 4, ln 2
    z = torch.randn(3, 4, 11)
    close(entropy_from_logits(z), torch.distributions.Categorical(logits=z).entropy().tolist())
