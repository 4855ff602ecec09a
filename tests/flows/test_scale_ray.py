"""Sessions across workers: a tiny flow whose wave verification fans out to two Ray worker
nodes (`verify.executor: ray`) while rollout, training and checkpointing stay in the flow's
process, which owns the policy session. Two waves train in a row (the second one needs the
session the first left in memory: a stage placed on another worker would meet StaleSession)."""

from __future__ import annotations

import pytest
from prefect import flow

from ratchet.config import EnvsConfig, ModelConfig, NightlyConfig, RolloutConfig, StoreConfig, TrainConfig, VerifyConfig
from ratchet.model import build_model, save_policy
from tasks.produce import produce_envs
from tasks.rollout import rollout_wave
from tasks.score import score_wave
from tasks.train import bootstrap_policy, checkpoint_policy, train_epoch
from tests.train import tiny

pytest.importorskip("ray")


@flow(name="tiny-ray-cycle")
def tiny_cycle(cfg: NightlyConfig):
    snapshot = produce_envs("python_functions", cfg.envs, cfg.store)
    train = [snapshot.train]
    policy = bootstrap_policy("ray-run", cfg, train)
    waves = []
    for step in range(2):
        wave, _ = rollout_wave(policy, step, train, cfg)
        scored, stats = score_wave(wave, train, cfg)          # sandbox runs: Ray tasks on the worker nodes
        policy, _ = train_epoch(policy, scored, cfg)           # the session: here
        waves.append(stats)
    return checkpoint_policy(policy, cfg), waves


@pytest.mark.slow
def test_verification_on_ray_workers_training_in_the_flow_process(prefect_harness, ray_cluster, tmp_path):
    address, workers = ray_cluster
    model = build_model(tiny.TINY.model_copy(update={"max_seq_len": 256}), tiny.tokenizer())   # room for the prompts
    save_policy(model, tiny.tokenizer(), tmp_path / "model")
    cfg = NightlyConfig(
        store=StoreConfig(uri=str(tmp_path / "store")), envs=EnvsConfig(n_train=20, n_heldout=2),
        model=ModelConfig(path=str(tmp_path / "model")),
        rollout=RolloutConfig(prompts_per_wave=4, group_size=2, max_new_tokens=8),
        train=TrainConfig(minibatch_prompts=2),
        verify=VerifyConfig(executor="ray", ray_address=address, ray_chunk=2))
    policy, waves = tiny_cycle(cfg)
    assert policy.version == 2 and policy.checkpoint_version == 2      # two epochs on one live session
    for stats in waves:
        assert stats["sandbox_nodes"] == 2                            # both worker nodes verified the wave
        assert 0 < stats["sandbox_launched"] <= 8 and stats["sandbox_orphaned"] == stats["sandbox_reaped"] == 0
