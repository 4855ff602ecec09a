"""Trainer backends on a tiny model: direction of a step, packing equivalence, exact resume.

    pytest tests/train -q
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from ratchet.config import RLConfig, TrainConfig
from ratchet.model import load_policy, save_policy
from ratchet.train.backend import lr_factor
from ratchet.train.batching import TrainSample
from ratchet.train.policy import token_logprobs
from ratchet.train.torch_trainer import TorchTrainer
from tests.train import tiny


def pad_id() -> int:
    return tiny.tokenizer().pad_token_id


def seq_logprob(model, s: TrainSample) -> float:
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return float(logp[0, len(s.prompt_ids) - 1:].sum())


def test_lr_schedule_by_hand():
    assert [lr_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(2, 2, "cosine", 4, 0.0) == 1.0                       # end of warm-up: cos(0)
    assert math.isclose(lr_factor(4, 2, "cosine", 4, 0.0), 0.5)           # half way: (1 + cos(pi/2)) / 2
    assert math.isclose(lr_factor(6, 2, "cosine", 4, 0.1), 0.1)           # floor
    assert math.isclose(lr_factor(99, 2, "cosine", 4, 0.1), 0.1)


def test_one_step_moves_logprobs_in_the_advantage_direction():
    model = tiny.model()
    samples = tiny.wave(model, seed=1, n_groups=1, group_size=2)
    samples[0].advantage, samples[1].advantage = 1.0, -1.0
    before = [seq_logprob(model, s) for s in samples]
    trainer = TorchTrainer(model, pad_id(), TrainConfig(lr=1e-2, updates_per_batch=1), RLConfig())
    metrics = trainer.train_wave(samples)
    after = [seq_logprob(model, s) for s in samples]
    assert metrics["optimizer_steps"] == 1 and trainer.step == 1
    assert after[0] > before[0] + 1e-3
    assert after[1] < before[1] - 1e-3


class GradCapture(TorchTrainer):
    """Records the gradient at each optimizer step instead of stepping."""

    grads: list[torch.Tensor]

    def _optimizer_step(self, lr):
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.grads = getattr(self, "grads", []) + [
            torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
        ]
        self.optimizer.zero_grad(set_to_none=True)
        return 0.0


class NoSkip(GradCapture):
    def _zero_grad_sample(self, s):
        return False


class Plain(NoSkip):
    """The reference: every row forwarded whole ([N, P + C]), nothing skipped or shared."""

    share_prompts = False


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "answer_mean_token_mean"])
def test_packed_micro_batches_give_the_one_big_batch_gradient(loss_agg):
    """Loop (one row per micro-batch) == packed (token budget) == one batch, plain or with the prompt
    forwarded once per group, and skipping the zero-advantage rows changes nothing."""
    model = tiny.model()
    samples = tiny.wave(model, seed=2, n_groups=4, group_size=4, zero_groups=1)
    if loss_agg == "answer_mean_token_mean":   # two answers a row where it can (one a row takes seq_mean_token_mean's code)
        samples = [replace(s, loss_mask=[1, 0] + [1] * (len(s.completion_ids) - 2)) if len(s.completion_ids) >= 3 else s
                   for s in samples]
        assert sum(s.loss_mask is not None for s in samples) >= len(samples) // 2
    rl = RLConfig(loss_agg=loss_agg, kl_coef=0.1 if loss_agg == "token_mean" else 0.0)
    grads = {}
    for name, cls, budget in [("one_batch", Plain, 10_000), ("loop", Plain, 1), ("packed", Plain, 70),
                              ("shared", NoSkip, 10_000), ("shared_packed", NoSkip, 40),
                              ("shared_packed_skip", GradCapture, 40), ("shared_skip", GradCapture, 10_000)]:
        train = TrainConfig(minibatch_prompts=4, updates_per_batch=1).model_copy(update={"token_budget": budget})
        t = cls(model, pad_id(), train, rl)  # budgets below the config's floor of 64 force tiny micro-batches
        t.train_wave(samples)
        grads[name] = t.grads[0]
    assert grads["one_batch"].abs().sum() > 0
    for name in grads:
        torch.testing.assert_close(grads[name], grads["one_batch"], rtol=1e-5, atol=1e-7)


def test_gae_trains_the_value_head_towards_the_returns():
    model = tiny.model()
    trainer = TorchTrainer(model, pad_id(), TrainConfig(lr=1e-2, minibatch_prompts=8), RLConfig(estimator="gae"))
    samples = tiny.wave(model, seed=3, n_groups=2, group_size=4)
    losses = [trainer.train_wave(trainer.assign_advantages(samples))["value_loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="reward"):
        trainer.assign_advantages([TrainSample([5, 6], [7], [-1.0], 0.5, "g")])
    with pytest.raises(ValueError, match="assign_advantages"):
        trainer.train_wave(samples)            # GAE's token advantages were never computed for these


def test_kl_in_reward_recomputes_group_advantages():
    model = tiny.model()
    rl = RLConfig(kl_coef=0.5, kl_in_reward=True, kl_estimator="k1")
    trainer = TorchTrainer(model, pad_id(), TrainConfig(), rl)
    samples = tiny.wave(model, seed=4, n_groups=2, group_size=4, zero_groups=1)
    for s in samples:  # pretend the rollout policy drifted from the reference: KL > 0
        s.behavior_logprobs = [lp + 0.1 * (i % 3) for i, lp in enumerate(s.behavior_logprobs)]
    adjusted = trainer.assign_advantages(samples)
    assert len(adjusted) == 4                                 # the equal-reward group is dropped (dynamic sampling)
    trainer = TorchTrainer(model, pad_id(), TrainConfig(), rl.model_copy(update={"drop_zero_variance": False}))
    adjusted = trainer.assign_advantages(samples)
    assert [s.advantage for s in adjusted[:4]] != [0.0] * 4  # the equal-reward group now varies by KL
    for g in range(2):
        assert abs(sum(s.advantage for s in adjusted[4 * g:4 * g + 4])) < 1e-4  # still group-centred


# -- exact resume, both backends --

def _trainer(backend: str, model, train: TrainConfig, rl: RLConfig):
    if backend == "deepspeed":
        from ratchet.train.deepspeed_trainer import DeepSpeedTrainer

        return DeepSpeedTrainer(model, pad_id(), train, rl)
    return TorchTrainer(model, pad_id(), train, rl)


def _weights(trainer) -> dict[str, torch.Tensor]:
    ctx = trainer.gathered() if hasattr(trainer, "gathered") else torch.no_grad()
    with ctx:
        return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


def _save(trainer, path):
    ctx = trainer.gathered() if hasattr(trainer, "gathered") else torch.no_grad()
    with ctx:
        save_policy(trainer.model, tiny.tokenizer(), path)
    torch.save(trainer.state_dict(), path / "trainer.pt")


def _resume_is_exact(tmp_path, backend: str, train: TrainConfig, rl: RLConfig, n: int = 4):
    waves = [tiny.wave(tiny.model(), seed=10 + i, n_groups=3, group_size=4, zero_groups=i % 2) for i in range(n)]
    straight = _trainer(backend, tiny.model(), train, rl)
    for w in waves:
        straight.train_wave(straight.assign_advantages(w))

    first = _trainer(backend, tiny.model(), train, rl)
    for w in waves[: n // 2]:
        first.train_wave(first.assign_advantages(w))
    _save(first, tmp_path)
    torch.manual_seed(1234)  # disturb the global RNG: the resumed run must not depend on it
    model, _ = load_policy(tmp_path)
    resumed = _trainer(backend, model, train, rl)
    resumed.load_state_dict(torch.load(tmp_path / "trainer.pt", weights_only=False))
    assert resumed.step == first.step
    for w in waves[n // 2:]:
        resumed.train_wave(resumed.assign_advantages(w))

    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    moved = _weights(_trainer(backend, tiny.model(), train, rl))
    assert any(not torch.equal(a[k], moved[k]) for k in a)  # training did something
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


@pytest.mark.parametrize("rl", [RLConfig(), RLConfig(estimator="gae", kl_coef=0.1, kl_in_reward=True),
                                RLConfig(estimator="rloo", kl_coef=0.1, entropy_coef=0.01)],
                         ids=["grpo", "gae+kl_in_reward", "rloo+kl+entropy"])
def test_torch_resume_is_bit_identical(tmp_path, rl):
    train = TrainConfig(minibatch_prompts=2, warmup_steps=3, token_budget=80, lr=1e-3)
    _resume_is_exact(tmp_path, "torch", train, rl)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_trains_saves_and_resumes_exactly(tmp_path, stage):
    pytest.importorskip("deepspeed")
    train = TrainConfig(backend="deepspeed", zero_stage=stage, minibatch_prompts=2, warmup_steps=3,
                        token_budget=80, lr=1e-3)
    rl = RLConfig(estimator="gae") if stage == 2 else RLConfig()  # plain layout + value head / prompt-shared
    _resume_is_exact(tmp_path, "deepspeed", train, rl)


def test_deepspeed_config_comes_from_train_config():
    pytest.importorskip("deepspeed")
    from ratchet.train.deepspeed_trainer import ds_config

    cfg = ds_config(TrainConfig(zero_stage=3, offload=True, bf16=True, max_grad_norm=0.5))
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == 0.5
    assert "offload_param" not in ds_config(TrainConfig(zero_stage=2, offload=True))["zero_optimization"]


def test_truncated_importance_weight_scales_the_gradient_by_hand():
    """Decoupled PPO: the ratio is taken against pi_old (this minibatch's weights), and each token's
    loss is weighted by min(pi_old / pi_behav, is_cap). With the behaviour log-probs shifted by
    log(w) on every token, the first update's gradient is exactly min(w, cap) x the on-policy one."""
    model = tiny.model()
    base = tiny.wave(model, seed=5, n_groups=1, group_size=2)
    base[0].advantage, base[1].advantage = 1.0, -1.0

    def grad(w: float, cap: float) -> torch.Tensor:
        shifted = [TrainSample(s.prompt_ids, s.completion_ids, [lp - math.log(w) for lp in s.behavior_logprobs],
                               s.advantage, s.group, s.reward) for s in base]
        t = GradCapture(model, pad_id(), TrainConfig(updates_per_batch=1), RLConfig(is_cap=cap))
        metrics = t.train_wave(shifted)
        return t.grads[0], metrics

    on_policy, m0 = grad(1.0, 2.0)
    assert on_policy.abs().sum() > 0 and m0["is_capped_frac"] == 0.0
    for w, cap, factor, capped in [(3.0, 2.0, 2.0, 1.0), (1.5, 2.0, 1.5, 0.0), (0.5, 2.0, 0.5, 0.0), (3.0, 1.0, 1.0, 1.0)]:
        g, m = grad(w, cap)
        torch.testing.assert_close(g, factor * on_policy, rtol=1e-4, atol=1e-7)
        assert m["is_capped_frac"] == capped and m["is_weight_mean"] == pytest.approx(factor, rel=1e-4)


@pytest.mark.parametrize("stage, offload, bf16", [(0, False, True), (2, False, True), (2, True, False), (3, True, True)],
                         ids=["zero0-bf16", "zero2-bf16", "zero2-offload", "zero3-offload-bf16"])
def test_deepspeed_offload_and_bf16_train_and_resume(tmp_path, stage, offload, bf16):
    """Not only the config dict: the engine really runs bf16 weights / CPU-offloaded optimizer
    state, takes steps, and resumes bit-identically."""
    pytest.importorskip("deepspeed")
    from ratchet.train.deepspeed_trainer import DeepSpeedTrainer

    train = TrainConfig(backend="deepspeed", zero_stage=stage, offload=offload, bf16=bf16, minibatch_prompts=2,
                        token_budget=80, lr=1e-3)
    t = DeepSpeedTrainer(tiny.model(), pad_id(), train, RLConfig())
    assert t.engine.bfloat16_enabled() is bf16 and t.engine.zero_cpu_offload() is offload
    with t.gathered():
        assert next(t.model.parameters()).dtype == (torch.bfloat16 if bf16 else torch.float32)
    metrics = t.train_wave(t.assign_advantages(tiny.wave(tiny.model(), seed=1, n_groups=2, group_size=4)))
    assert metrics["optimizer_steps"] == 2 and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    _resume_is_exact(tmp_path, "deepspeed", train, RLConfig())


def _gpt2_with_dropout(tmp_path, pdrop: float):
    """A brought model whose config has dropout (GPT-2's default 0.1), made confident as a trained LM is."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny.tokenizer()
    torch.manual_seed(0)
    m0 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                    resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop,
                                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    with torch.no_grad():
        m0.transformer.ln_f.weight.mul_(30)
    save_policy(m0, tok, tmp_path / "m")
    return load_policy(tmp_path / "m")


def test_a_model_with_dropout_trains_on_its_behaviour_policy_exactly(tmp_path):
    """Found by review: the trainer ran its forwards in train mode, so for a model with dropout pi_old was
    a noisy forward: with no step taken (lr 1e-12), importance weights 1.23, KL to the reference 0.56,
    ratios 1.98. In eval mode they are 1, 0 and 1, as without dropout."""
    model, tokenizer = _gpt2_with_dropout(tmp_path, 0.1)
    wave = tiny.wave(model.eval(), seed=3, n_groups=4, group_size=4)     # behaviour log-probs from this policy
    t = TorchTrainer(model, tokenizer.pad_token_id, TrainConfig(lr=1e-12, minibatch_prompts=4, updates_per_batch=2),
                     RLConfig(kl_coef=0.1))
    m = t.train_wave(t.assign_advantages(wave))
    assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m["is_capped_frac"] == 0
    assert m["kl"] == pytest.approx(0.0, abs=1e-5) and m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_approx_kl_measures_the_drift_after_a_minibatchs_first_pass():
    """Found by review: approx_kl averaged in each minibatch's first pass, where pi is pi_old (0 by
    construction): with one pass per minibatch it read 0 whatever the step did, and the KL monitor could not
    trip. Now the later passes alone; with one pass it is not recorded (nothing to compare)."""
    model = tiny.model()
    wave = tiny.wave(model, seed=3, n_groups=4, group_size=4)
    drift = {}
    for passes in (1, 3):
        t = TorchTrainer(tiny.model(), pad_id(), TrainConfig(lr=3e-2, minibatch_prompts=2, updates_per_batch=passes),
                         RLConfig())
        per_pass = []
        update = t._update
        t._update = lambda mb, old: per_pass.append(update(mb, old)) or per_pass[-1]
        drift[passes] = (t.train_wave(t.assign_advantages([replace(s) for s in wave])), per_pass)
    one, _ = drift[1]
    assert "approx_kl" not in one and "clip_frac" not in one and one["optimizer_steps"] == 2
    three, per_pass = drift[3]
    assert [round(p["approx_kl"], 12) for p in per_pass[::3]] == [0.0, 0.0]          # the first passes: pi is pi_old
    later = [p["approx_kl"] for i, p in enumerate(per_pass) if i % 3]
    assert min(later) > 0 and three["approx_kl"] == pytest.approx(sum(later) / 4)


def test_ppo_on_a_model_whose_last_hidden_state_is_projected(tmp_path):
    """Found by review: the value head was sized by config.hidden_size, but it reads the last hidden
    state, which OPT returns after project_out (OPT-350m: 512 wide, hidden_size 1024): PPO failed in
    train_epoch, after a wave had been sampled, with a shape error."""
    from transformers import OPTConfig, OPTForCausalLM

    tok = tiny.tokenizer()
    save_policy(OPTForCausalLM(OPTConfig(
        vocab_size=len(tok), hidden_size=32, word_embed_proj_dim=16, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=64, do_layer_norm_before=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)), tok, tmp_path / "m")
    model, tokenizer = load_policy(tmp_path / "m")
    t = TorchTrainer(model, tokenizer.pad_token_id, TrainConfig(), RLConfig(estimator="gae"))
    m = t.train_wave(t.assign_advantages(tiny.wave(model, seed=3, n_groups=2, group_size=4)))
    assert m["optimizer_steps"] >= 1 and math.isfinite(m["value_loss"])


def test_deepspeed_stage_0_reports_the_gradient_norm():
    """Found by review: at ZeRO stage 0 in fp32 DeepSpeed clips without recording the norm, and every
    wave's grad_norm read NaN. It is the torch backend's, on the same wave."""
    pytest.importorskip("deepspeed")
    train = TrainConfig(minibatch_prompts=4, updates_per_batch=1, lr=1e-3)
    wave = tiny.wave(tiny.model(), seed=5, n_groups=2, group_size=4)
    norms = {}
    for backend, cfg in (("torch", train), ("deepspeed", train.model_copy(update={"backend": "deepspeed", "zero_stage": 0}))):
        t = _trainer(backend, tiny.model(), cfg, RLConfig())
        norms[backend] = t.train_wave(t.assign_advantages([replace(s) for s in wave]))["grad_norm"]
    assert math.isfinite(norms["deepspeed"]) and norms["deepspeed"] == pytest.approx(norms["torch"], rel=1e-5)
