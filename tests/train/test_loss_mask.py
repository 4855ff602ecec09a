"""Multi-turn trajectories: the loss covers the model's own tokens only, in every training path.

A hand-built episode a1 + o1 + a2 (the observation o1 is the sandbox's feedback, read by the
model but not written by it) next to a single-turn answer in the same group. The gradient of the
loss w.r.t. the logits is captured where the trainer computes it: exactly zero at every position
that predicts an observation token, non-zero at every position that predicts an action token,
for the group estimators (prompt-shared layout and plain layout) and GAE (plain layout, value
head), with the KL and entropy terms on, on the torch and the DeepSpeed backend.

    pytest tests/train/test_loss_mask.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ratchet.config import RLConfig, TrainConfig
from ratchet.train.batching import TrainSample, collate, collate_shared
from ratchet.train.policy import token_logprobs
from ratchet.train.torch_trainer import TorchTrainer
from tests.train import tiny

# an answer, the sandbox's observation, the revised answer (ending in EOS, as the engine samples it)
A1, O1, A2 = [20, 21, 22], [23, 24], [25]
SINGLE = [26, 27, 28]
PROMPT = [10, 11, 12, 13]


def episode_group(policy, multi_mask: bool = True) -> list[TrainSample]:
    """Group "g": a 2-turn episode (reward 1) and a single-turn answer (reward 0). Behaviour log-probs
    as the engine records them: the policy's on the model's tokens, 0.0 on observation tokens."""
    eos = tiny.tokenizer().eos_token_id
    multi = A1 + [eos] + O1 + A2 + [eos]
    mask = [1] * (len(A1) + 1) + [0] * len(O1) + [1] * (len(A2) + 1)
    samples = [TrainSample(PROMPT, multi, [], None, "g", reward=1.0, loss_mask=mask if multi_mask else None),
               TrainSample(PROMPT, SINGLE + [eos], [], None, "g", reward=0.0)]
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logp = token_logprobs(policy, ids, torch.ones_like(ids))[0][0, len(s.prompt_ids) - 1:]
            keep = torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * len(s.completion_ids))
            s.behavior_logprobs = torch.where(keep.bool(), logp, 0.0).tolist()
    return samples


def observation_positions(s: TrainSample) -> list[int]:
    return [j for j, m in enumerate(s.loss_mask or [1] * len(s.completion_ids)) if m == 0]


class CaptureLogits:
    """Mixed into a trainer: records each training forward's logits (with their gradient), the
    micro-batch they belong to, and the loss."""

    def _setup(self):
        super()._setup()
        self.seen: list[tuple[list[TrainSample], bool, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []

    def _micro_loss(self, micro, *a):
        self._micro = micro
        loss, m = super()._micro_loss(micro, *a)
        self.losses.append(loss.detach())
        return loss, m

    def _micro_loss_shared(self, micro, *a):
        self._micro = micro
        loss, m = super()._micro_loss_shared(micro, *a)
        self.losses.append(loss.detach())
        return loss, m

    def _forward(self, ids, attn, with_values, shared=None):
        logits, values = super()._forward(ids, attn, with_values, shared)
        if logits.requires_grad:
            logits.retain_grad()
            self.seen.append((self._micro, shared is not None, logits))
        return logits, values


class Capture(CaptureLogits, TorchTrainer):
    """The torch trainer capturing logits; the optimizer does not step (it records the parameters' gradient)."""

    def _setup(self):
        super()._setup()
        self.param_grads: list[torch.Tensor] = []

    def _optimizer_step(self, lr):
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.param_grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                           for p in params]))
        self.optimizer.zero_grad(set_to_none=True)
        return 0.0


def logit_grads(trainer) -> dict[tuple[int, ...], torch.Tensor]:
    """Per sample (by its completion), the gradient w.r.t. the logits that predict its completion tokens: [c, V]."""
    out = {}
    for micro, shared, logits in trainer.seen:
        for b, s in enumerate(micro):
            start = 0 if shared else len(s.prompt_ids) - 1    # shared: completion-aligned; plain: position t -> t+1
            out[tuple(s.completion_ids)] = logits.grad[b, start:start + len(s.completion_ids)]
    return out


def trained(cls, rl: RLConfig, samples, share_prompts: bool = True, **train):
    policy = tiny.model()
    t = cls(policy, tiny.tokenizer().pad_token_id, TrainConfig(updates_per_batch=1, **train), rl)
    t.share_prompts = share_prompts
    if t.ref_model is not None:   # a reference apart from the policy: the KL term has a gradient everywhere
        with torch.no_grad():
            for p in t.ref_model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    t.train_wave(t.assign_advantages(samples))
    return t


FAMILIES = [("grpo", True), ("grpo", False), ("gae", False)]
FAMILY_IDS = ["grpo-shared-layout", "grpo-plain-layout", "gae-plain-layout"]


@pytest.mark.parametrize("estimator, shared", FAMILIES, ids=FAMILY_IDS)
def test_no_gradient_reaches_observation_tokens(estimator, shared):
    rl = RLConfig(estimator=estimator, kl_coef=0.1, entropy_coef=0.01)
    samples = episode_group(tiny.model())
    t = trained(Capture, rl, samples, share_prompts=shared)
    assert [sh for _, sh, _ in t.seen] == [shared]            # the layout under test is the one that ran
    grads = logit_grads(t)
    multi, single = samples
    g = grads[tuple(multi.completion_ids)]                     # [c, V]
    obs = observation_positions(multi)
    assert obs == [4, 5]
    for j in range(len(multi.completion_ids)):
        if j in obs:
            assert torch.count_nonzero(g[j]) == 0, f"gradient reached observation token {j}"
        else:
            assert g[j].abs().sum() > 1e-6, f"no gradient at action token {j}"
    assert all(grads[tuple(single.completion_ids)][j].abs().sum() > 1e-6 for j in range(len(single.completion_ids)))

    # the same episode without its mask: the observation positions do get a gradient (the test can fail)
    unmasked = trained(Capture, rl, episode_group(tiny.model(), multi_mask=False), share_prompts=shared)
    g_unmasked = logit_grads(unmasked)[tuple(multi.completion_ids)]
    assert all(g_unmasked[j].abs().sum() > 1e-6 for j in obs)


def test_gae_skips_observation_tokens_and_whitens_over_action_tokens():
    samples = episode_group(tiny.model())
    t = Capture(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), RLConfig(estimator="gae"))
    multi, single = t.assign_advantages(samples)
    for field in ("token_advantages", "returns", "old_values"):
        values = getattr(multi, field)
        assert len(values) == len(multi.completion_ids)
        assert [values[j] for j in observation_positions(multi)] == [0.0, 0.0], field
    action = [a for s in (multi, single) for a, m in zip(s.token_advantages, s.loss_mask or [1] * 99) if m]
    assert len(action) == 6 + 4
    mean = sum(action) / len(action)
    std = (sum((a - mean) ** 2 for a in action) / (len(action) - 1)) ** 0.5
    assert abs(mean) < 1e-5 and abs(std - 1) < 1e-4         # whitened over the action tokens only
    # V = 0 before the value head learns (its last layer starts at zero), gamma = 1: the return of an action
    # token is lam^k, k = the action tokens after it up to the reward on the last one. The observation's
    # two tokens are skipped (no step, no discount): the first token's return is lam^5, not lam^7
    lam = RLConfig().lam
    action_positions = [j for j, m in enumerate(multi.loss_mask) if m]
    assert [multi.returns[j] for j in action_positions] == pytest.approx([lam ** k for k in (5, 4, 3, 2, 1, 0)])
    assert single.returns == pytest.approx([0.0] * 4)


@pytest.mark.parametrize("loss_agg, by_hand", [
    # advantages +-1/sqrt(2) (GRPO, rewards 1 and 0); on the first pass ratio = 1, so pg = -A per token
    ("token_mean", -(6 - 4) / (6 + 4) / 2 ** 0.5),                 # over the 10 action tokens (not 12)
    ("seq_mean_token_sum_norm", -(6 - 4) / (2 * 6) / 2 ** 0.5),    # N * max_len, max_len = 6 action tokens (not 8)
    ("seq_mean_token_mean", 0.0),                                  # each sequence's mean over its action tokens
    ("answer_mean_token_mean", -(2 - 1) / 3 / 2 ** 0.5),           # each answer's mean: two answers at +A, one at -A
])
def test_denominators_count_action_tokens(loss_agg, by_hand):
    samples = episode_group(tiny.model())
    for shared in (True, False):
        t = Capture(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(updates_per_batch=1),
                    RLConfig(loss_agg=loss_agg))
        t.share_prompts = shared
        metrics = t.train_wave(t.assign_advantages(samples))
        assert metrics["pg_loss"] == pytest.approx(by_hand, abs=1e-6)


def test_single_turn_without_a_mask_is_unchanged_bit_for_bit():
    """loss_mask None (every row before multi-turn) and an explicit all-ones mask: the same tensors,
    the same loss and the same gradient, in both layouts and for GAE."""
    policy = tiny.model()
    base = tiny.wave(policy, seed=7, n_groups=2, group_size=3)
    ones = [replace(s, loss_mask=[1] * len(s.completion_ids)) for s in base]
    for a, b in zip(collate(base, 0), collate(ones, 0)):
        assert torch.equal(a, b)
    for a, b in zip(collate_shared(base, 0), collate_shared(ones, 0)):
        assert torch.equal(a, b)
    for rl, shared in [(RLConfig(kl_coef=0.1, entropy_coef=0.01), True),
                       (RLConfig(loss_agg="token_mean", kl_coef=0.1), False),
                       (RLConfig(estimator="gae", kl_coef=0.1, kl_in_reward=True), False)]:
        runs = [trained(Capture, rl, [replace(s) for s in wave], share_prompts=shared, minibatch_prompts=2)
                for wave in (base, ones)]
        assert runs[0].losses and len(runs[0].losses) == len(runs[1].losses)
        for x, y in zip(runs[0].losses, runs[1].losses):
            assert torch.equal(x, y)
        for x, y in zip(runs[0].param_grads, runs[1].param_grads):
            assert torch.equal(x, y) and x.abs().sum() > 0
    # rl.loss_agg answer_mean_token_mean (the default) on rows of one answer each: seq_mean_token_mean, bit for bit
    for shared in (True, False):
        runs = [trained(Capture, RLConfig(loss_agg=agg, kl_coef=0.1), [replace(s) for s in base], share_prompts=shared,
                        minibatch_prompts=2) for agg in ("answer_mean_token_mean", "seq_mean_token_mean")]
        for x, y in zip(runs[0].losses + runs[0].param_grads, runs[1].losses + runs[1].param_grads):
            assert torch.equal(x, y)


def test_shared_layout_attends_to_observations_like_the_plain_one():
    """The prompt-shared layout forwards observation tokens with attention 1 (they are context for the
    next answer) and masks only the loss: its gradient equals the plain [N, P + C] forward's."""
    grads = {}
    for shared in (True, False):
        t = trained(Capture, RLConfig(kl_coef=0.1, entropy_coef=0.01), episode_group(tiny.model()),
                    share_prompts=shared)
        grads[shared] = t.param_grads[0]
    assert grads[True].abs().sum() > 0
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-5, atol=1e-7)


def test_a_mask_that_does_not_fit_is_named():
    s = TrainSample(PROMPT, [1, 2, 3], [0.0] * 3, 0.5, "task-7:0", row=12, loss_mask=[1, 0])
    with pytest.raises(ValueError, match=r"loss_mask of the sample of group 'task-7:0' \(wave row 12\): "
                                         r"2 entries for 3 completion tokens"):
        collate([s], 0)
    with pytest.raises(ValueError, match=r"values \[2\]"):
        collate_shared([replace(s, loss_mask=[1, 2, 1])], 0)


def test_deepspeed_path_masks_observation_tokens():
    pytest.importorskip("deepspeed")
    from ratchet.train.deepspeed_trainer import DeepSpeedTrainer

    class DSCapture(CaptureLogits, DeepSpeedTrainer):
        pass

    samples = episode_group(tiny.model())
    t = trained(DSCapture, RLConfig(kl_coef=0.1, entropy_coef=0.01), samples, backend="deepspeed", zero_stage=0)
    g = logit_grads(t)[tuple(samples[0].completion_ids)]
    assert [j for j in range(g.shape[0]) if torch.count_nonzero(g[j]) == 0] == observation_positions(samples[0])
