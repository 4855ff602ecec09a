"""Generation decoupled from training: the behaviour engine samples from the version a wave was
given while the trainer moves on, and the loss corrects the gap with truncated importance sampling.

    .venv/bin/python -m pytest tests/rollout/test_async.py -q
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ratchet.config import RLConfig, RolloutConfig, TrainConfig
from ratchet.rollout.behaviour import Shared, TorchCopy, check_staleness, cpu_share
from ratchet.rollout.torch_engine import TorchEngine
from ratchet.train.batching import TrainSample
from ratchet.train.policy import token_logprobs
from ratchet.train.torch_trainer import TorchTrainer
from tests.train import tiny

LN = math.log
PROMPTS = ["# add 3, then negate it\ndef f(x):\n", "# add 7\n"]


def completion_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return logp[0, len(prompt_ids) - 1:]                                            # [c]


def test_tis_weight_on_a_stale_wave_by_hand():
    """The trainer's policy (version 1) is uniform over its V = 259 tokens (final norm zeroed: logits
    0), so pi_old = 1/V on every token; the wave was sampled by version 0 with the probabilities below.
    Per token w = min(pi_old / pi_behav, is_cap = 2):
        sample a (A = +1): behaviour 2/V, 1/(4V)    -> w = 0.5, min(4, 2) = 2
        sample b (A = -1): behaviour 1/V, 4/(3V)    -> w = 1, 0.75
    is_weight_mean = (0.5 + 2 + 1 + 0.75) / 4 = 1.0625, capped 1 of 4 tokens. The (only) pass's
    ratio pi / pi_old is 1, so the per-token loss is -A * w and token_mean gives
    pg_loss = (-0.5 - 2 + 1 + 0.75) / 4 = -0.1875."""
    model = tiny.model()
    with torch.no_grad():
        model.model.norm.weight.zero_()                                              # logits 0: uniform
    V = model.config.vocab_size
    assert V == 259
    prompt = [5, 6, 7]
    a = TrainSample(prompt, [10, 11], [LN(2 / V), LN(1 / (4 * V))], 1.0, "g0", reward=1.0)
    b = TrainSample(prompt, [12, 13], [LN(1 / V), LN(4 / (3 * V))], -1.0, "g0", reward=0.0)
    trainer = TorchTrainer(model, tiny.tokenizer().pad_token_id, TrainConfig(updates_per_batch=1), RLConfig(is_cap=2.0))
    metrics = trainer.train_wave([a, b])
    assert metrics["is_weight_mean"] == pytest.approx(1.0625, abs=1e-6)
    assert metrics["is_capped_frac"] == pytest.approx(0.25)
    assert "ratio_mean" not in metrics          # one pass: pi is pi_old, nothing to compare (DRIFT_METRICS)
    assert metrics["pg_loss"] == pytest.approx(-0.1875, abs=1e-6)
    # on-policy (behaviour = pi_old) the same wave has weight 1 everywhere and loss -mean(A) = 0
    a2, b2 = (TrainSample(s.prompt_ids, s.completion_ids, [-LN(V)] * 2, s.advantage, "g1", reward=s.reward)
              for s in (a, b))
    fresh = tiny.model()
    with torch.no_grad():
        fresh.model.norm.weight.zero_()
    on = TorchTrainer(fresh, tiny.tokenizer().pad_token_id, TrainConfig(updates_per_batch=1), RLConfig()).train_wave([a2, b2])
    assert on["is_weight_mean"] == pytest.approx(1.0) and on["is_capped_frac"] == 0.0
    assert on["pg_loss"] == pytest.approx(0.0, abs=1e-6)


def test_the_copy_samples_the_version_asked_for_while_the_trainer_moves_on():
    """Version 0 published, the trainer steps to version 1: a wave asked of version 0 is sampled by
    version 0's weights (its behaviour log-probs are v0's, not the live model's), and the trainer's
    importance weights on that stale wave are min(pi_v1 / pi_v0, cap) per token."""
    model, tok = tiny.model(), tiny.tokenizer()
    v0 = copy.deepcopy(model)
    behaviour = TorchCopy(TorchEngine(model, tok), keep=2)
    behaviour.publish(0, model, tok)
    trainer = TorchTrainer(model, tok.pad_token_id, TrainConfig(lr=3e-2, updates_per_batch=1, token_budget=100_000,
                                                                minibatch_prompts=64), RLConfig(is_cap=1.5))
    trainer.train_wave(tiny.wave(model, seed=3, n_groups=2, group_size=4))
    behaviour.publish(1, model, tok)
    assert behaviour.published() == [0, 1]

    with behaviour.at(0) as engine:
        rollouts = engine.generate(PROMPTS, n=4, max_new_tokens=8, seed=0)
    assert engine.policy_version == 0 and behaviour.syncs == 1 and engine.model is not model
    samples, gaps = [], 0
    for k, r in enumerate(rollouts):
        behav = torch.tensor(r.logprobs)
        assert torch.allclose(behav, completion_logprobs(v0, r.prompt_ids, r.completion_ids), atol=1e-4)
        live = completion_logprobs(model, r.prompt_ids, r.completion_ids)
        gaps += int(not torch.allclose(behav, live, atol=1e-3))
        samples.append(TrainSample(r.prompt_ids, r.completion_ids, r.logprobs, 1.0 if k % 2 else -1.0,
                                   f"p{r.prompt_index}", reward=float(k % 2)))
    assert gaps == len(rollouts)                                   # the trainer's weights did move

    expected = torch.cat([completion_logprobs(model, s.prompt_ids, s.completion_ids) - torch.tensor(s.behavior_logprobs)
                          for s in samples]).exp().clamp(max=1.5)  # min(pi_v1 / pi_v0, cap) per token
    check = TorchTrainer(copy.deepcopy(model), tok.pad_token_id,
                         TrainConfig(updates_per_batch=1, token_budget=100_000, minibatch_prompts=64), RLConfig(is_cap=1.5))
    metrics = check.train_wave(samples)
    assert metrics["is_weight_mean"] == pytest.approx(float(expected.mean()), rel=1e-4)
    assert metrics["is_capped_frac"] == pytest.approx(float((expected >= 1.5 - 1e-6).float().mean()), abs=1e-6)

    with behaviour.at(1) as engine:                                # moving on: the copy now holds version 1
        r = engine.generate(PROMPTS[:1], n=1, max_new_tokens=6, seed=1)[0]
    assert torch.allclose(torch.tensor(r.logprobs), completion_logprobs(model, r.prompt_ids, r.completion_ids), atol=1e-4)
    assert behaviour.syncs == 2 and behaviour.last_sync_s > 0


def test_versions_are_kept_until_keep_newer_exist():
    model, tok = tiny.model(), tiny.tokenizer()
    behaviour = TorchCopy(TorchEngine(model, tok), keep=2)
    for v in range(4):
        behaviour.publish(v, model, tok)
    assert behaviour.published() == [2, 3]
    with pytest.raises(LookupError, match="version 1 was never published or was dropped"):
        with behaviour.at(1):
            pass


def test_sync_mode_samples_only_the_trainers_current_version():
    model, tok = tiny.model(), tiny.tokenizer()
    engine = TorchEngine(model, tok)
    shared = Shared(engine)
    shared.publish(4, model, tok)
    with shared.at(4) as e:
        assert e is engine and e.model is model and e.policy_version == 4
    shared.publish(5, model, tok)
    with pytest.raises(LookupError, match="version 4"):
        with shared.at(4):
            pass


def test_staleness_is_bounded_per_mode():
    sync, async2 = RolloutConfig(), RolloutConfig(mode="async", max_staleness=2)
    assert check_staleness(3, 3, sync, step=3) == 0
    assert check_staleness(1, 3, async2, step=3) == 2
    assert check_staleness(2, 3, sync, step=3) == 1           # sync: recorded, not refused (a wave trained again)
    with pytest.raises(ValueError, match=r"wave 3: sampled by policy version 4, trained at version 3: staleness -1 "
                                         r"is outside 0\.\.any \(rollout.mode sync"):
        check_staleness(4, 3, sync, step=3)
    with pytest.raises(ValueError, match="staleness 3 is outside 0..2"):
        check_staleness(0, 3, async2, step=3)
    with pytest.raises(ValueError, match="staleness -1"):
        check_staleness(4, 3, async2, step=3)


def test_async_on_cpu_gives_each_side_half_the_threads_of_its_own_thread():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(6)
        with cpu_share(RolloutConfig(mode="async")):
            assert torch.get_num_threads() == 3
            with cpu_share(RolloutConfig(mode="async")):        # nested in one thread: the outer share holds
                assert torch.get_num_threads() == 3
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 6
        torch.set_num_threads(1)
        with cpu_share(RolloutConfig(mode="async")):
            assert torch.get_num_threads() == 1
        with cpu_share(RolloutConfig()):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cpu_share_in_two_overlapping_threads_gives_each_half_of_the_total():
    """The sampler (a worker thread) and the trainer (the flow's thread) overlap, leaving in either
    order: each runs on T // 2 while inside, whatever the other did, and gets its own T back."""
    import threading

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(6)                          # the main thread's: what fresh threads inherit
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        seen = {}

        def a():
            with cpu_share(RolloutConfig(mode="async")):
                a_in.set()
                b_in.wait(5)
                seen["a_inside"] = torch.get_num_threads()
            seen["a_after"] = torch.get_num_threads()
            a_out.set()

        a_thread = threading.Thread(target=a)
        a_thread.start()
        a_in.wait(5)
        with cpu_share(RolloutConfig(mode="async")):     # the main thread enters second, leaves last
            seen["main_inside"] = torch.get_num_threads()
            b_in.set()
            a_out.wait(5)
            seen["main_after_a_left"] = torch.get_num_threads()
        a_thread.join(10)
        assert seen == {"a_inside": 3, "a_after": 6, "main_inside": 3, "main_after_a_left": 3}
        assert torch.get_num_threads() == 6
    finally:
        torch.set_num_threads(before)
