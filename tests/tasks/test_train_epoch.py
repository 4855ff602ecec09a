"""The training stage through its Prefect task's function (`.fn()`): the advantages it stores
beside the wave are exactly those the loss trains on, for a group estimator, GAE and KL-in-reward."""

from __future__ import annotations

import random

import polars as pl
import pytest
import torch

import ratchet.train.backend as backend
from ratchet.config import ModelConfig, NightlyConfig, RLConfig, RolloutConfig, StoreConfig, TrainConfig
from ratchet.model import save_policy
from ratchet.rollout.torch_engine import TorchEngine
from ratchet.rollout.wave import wave_frame
from ratchet.store import open_store
from ratchet.train.checkpoint import save_checkpoint
from ratchet.train.session import PolicyRef
from tasks.train import train_epoch
from tests.train import tiny


class _Spec:
    def __init__(self, i: int):
        self.task_id, self.family, self.difficulty, self.prompt = f"t{i}", "f", 1, tiny.CORPUS[i][:30]


def _setup(tmp_path, rl: RLConfig):
    cfg = NightlyConfig(store=StoreConfig(uri=str(tmp_path / "store")), model=tiny.TINY,
                        rollout=RolloutConfig(group_size=4, max_new_tokens=6),
                        train=TrainConfig(minibatch_prompts=2, updates_per_batch=1), rl=rl)
    model, tok = tiny.model(), tiny.tokenizer()
    store = open_store(cfg.store.uri)
    ckpt = save_checkpoint(store, "r", 0, lambda d: save_policy(model, tok, d))
    specs = [_Spec(i) for i in range(3)]
    rollouts = TorchEngine(model, tok).generate([s.prompt for s in specs], n=4, max_new_tokens=6, seed=0)
    frame = wave_frame("r", 0, 0, specs, rollouts, 4)
    rng = random.Random(0)
    rewards = [1.0, 1.0, 1.0, 1.0] + [float(rng.random() < 0.5) for _ in range(4)] + [1.0, 0.0, 0.5, 0.0]
    frame = frame.with_columns(
        pl.Series("reward", rewards, dtype=pl.Float64),
        # pretend the sampling policy drifted from the reference (the initial weights): KL > 0
        pl.Series("behavior_logprobs", [[lp + 0.1 * (r % 3) for lp in row]
                                        for r, row in enumerate(frame["behavior_logprobs"].to_list())],
                  dtype=pl.List(pl.Float32)))
    wave = store.write_table("runs/r/waves/000000/scored.parquet", frame)
    return cfg, PolicyRef(run_id="r", version=0, checkpoint=ckpt, checkpoint_version=0), wave, store


@pytest.mark.parametrize("rl", [RLConfig(), RLConfig(estimator="gae"),
                                RLConfig(kl_coef=0.5, kl_in_reward=True, kl_estimator="k1")],
                         ids=["grpo", "gae", "grpo+kl_in_reward"])
def test_stored_advantage_is_the_trained_one(tmp_path, monkeypatch, rl):
    cfg, policy, wave, store = _setup(tmp_path, rl)
    seen: list[list[float]] = []
    real = backend.policy_loss

    def spy(logprobs, old_logprobs, advantages, mask, **kw):
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)   # [N, T]
        for row, m in zip(adv, mask.bool()):
            seen.append([round(float(x), 5) for x in row[m]])
        return real(logprobs, old_logprobs, advantages, mask, **kw)

    monkeypatch.setattr(backend, "policy_loss", spy)
    new_policy, metrics = train_epoch.fn(policy, wave, cfg)
    trained = store.read_table(wave.sibling("trained.parquet"))
    if rl.estimator == "gae":
        stored = [[round(x, 5) for x in t] for t in trained["token_advantages"].drop_nulls().to_list()]
        assert trained["advantage"].is_null().all()
    else:
        stored = [[round(a, 5)] * n for a, n in zip(trained["advantage"], trained["completion_tokens"])
                  if a is not None and a != 0.0]             # rows with advantage 0 carry no gradient: skipped
        assert trained["token_advantages"].is_null().all()
        assert trained.filter(pl.col("group_id") == "0:t0")["advantage"].is_null().all()   # equal rewards: dropped
    assert stored and sorted(seen) == sorted(stored)
    assert new_policy.version == 1 and metrics["optimizer_steps"] >= 1
    if rl.kl_in_reward:  # the KL moved the advantages off the plain group-normalised rewards
        plain = trained.filter(pl.col("group_id") == "0:t2").sort("sample_idx")["advantage"].to_list()
        g = torch.tensor([1.0, 0.0, 0.5, 0.0])
        assert plain != pytest.approx(((g - g.mean()) / (g.std() + 1e-6)).tolist(), abs=1e-4)


def test_a_failed_epoch_is_retried_from_the_last_good_state(tmp_path, monkeypatch):
    """A transient error after the first optimizer step of an epoch: the weights in memory are
    half-updated. The retry must not train on them: it restores version 0 from its checkpoint and
    ends bit-identical to an epoch that never failed."""
    from ratchet.errors import TransientError
    from ratchet.train import session as sessions

    cfg, policy, wave, _ = _setup(tmp_path, RLConfig())
    clean, _ = train_epoch.fn(policy, wave, cfg)
    expected = {k: v.clone() for k, v in sessions.open_session(clean, cfg).model.state_dict().items()}
    sessions.discard("r")

    from ratchet.train.torch_trainer import TorchTrainer

    real, calls = TorchTrainer._optimizer_step, []

    def flaky(self, lr):
        calls.append(lr)
        out = real(self, lr)
        if len(calls) == 1:
            raise TransientError("store blinked mid-epoch")
        return out

    monkeypatch.setattr(TorchTrainer, "_optimizer_step", flaky)
    with pytest.raises(TransientError):
        train_epoch.fn(policy, wave, cfg)
    retried, _ = train_epoch.fn(policy, wave, cfg)                  # what Prefect's retry does
    got = sessions.open_session(retried, cfg).model.state_dict()
    assert retried.version == 1 and all(torch.equal(got[k], expected[k]) for k in expected)
    sessions.discard("r")


def test_async_a_wave_sampled_during_a_retried_epoch_reads_the_clean_version(tmp_path, monkeypatch):
    """Async: an epoch fails after a step and is dropped; its retry restores version 0 and trains it
    in place. A wave of version 0 that starts sampling while the retry trains must sample version 0's
    weights (the checkpoint's), not weights the retry has already stepped: the retry's session had
    no behaviour engine, and the rollout opened one on the live, training model."""
    from ratchet.errors import TransientError
    from ratchet.train import session as sessions
    from ratchet.train.torch_trainer import TorchTrainer

    cfg, policy, wave, _ = _setup(tmp_path, RLConfig())
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"mode": "async", "max_staleness": 2})})
    start = {k: v.clone() for k, v in tiny.model().state_dict().items()}            # version 0: the checkpoint's
    real, calls, sampled = TorchTrainer._optimizer_step, [], {}

    def flaky(self, lr):
        calls.append(lr)
        out = real(self, lr)
        if len(calls) == 1:
            raise TransientError("store blinked mid-epoch")
        if len(calls) == 2:                        # the retry has taken a step: a rollout of v0 starts now
            session = sessions.sampling_session(policy, cfg)
            with sessions.behaviour(session, cfg).at(0) as engine:
                sampled.update({k: v.clone() for k, v in engine.model.state_dict().items()})
        return out

    monkeypatch.setattr(TorchTrainer, "_optimizer_step", flaky)
    with pytest.raises(TransientError):
        train_epoch.fn(policy, wave, cfg)
    retried, _ = train_epoch.fn(policy, wave, cfg)
    assert retried.version == 1 and len(calls) >= 2 and sampled
    assert all(torch.equal(sampled[k], start[k]) for k in start)
    sessions.discard("r")


def test_a_failed_epoch_past_the_checkpoint_stops_instead_of_reusing_weights(tmp_path, monkeypatch):
    from ratchet.errors import TransientError
    from ratchet.train import session as sessions

    cfg, policy, wave, _ = _setup(tmp_path, RLConfig())
    from ratchet.train.torch_trainer import TorchTrainer

    v1, _ = train_epoch.fn(policy, wave, cfg)                       # version 1, checkpoint still v0
    monkeypatch.setattr(TorchTrainer, "_optimizer_step", lambda self, lr: (_ for _ in ()).throw(TransientError("x")))
    with pytest.raises(TransientError):
        train_epoch.fn(v1, wave, cfg)
    with pytest.raises(sessions.StaleSession, match="resume the run from its LATEST"):
        train_epoch.fn(v1, wave, cfg)
