"""Prefect task: sample one rollout wave from the current policy."""

from __future__ import annotations

import time

import polars as pl
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from envs.snapshot import load_specs
from ratchet import stages, trace
from ratchet.config import NightlyConfig
from ratchet.rollout.behaviour import cpu_share
from ratchet.scale import executor_for
from ratchet.store import Ref, open_store
from ratchet.train import session as sessions
from tasks.retry import transient_only


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def rollout_wave(policy: sessions.PolicyRef, step: int, train: list[Ref], cfg: NightlyConfig) -> tuple[Ref, dict]:
    """`prompts_per_wave` tasks x `group_size` samples from policy `policy.version` (the wave's recorded
    behaviour policy), on the run's behaviour engine: the trainer's own weights (sync, torch), a copy of
    them (async), or a server given each version's weights (http, vllm); trajectories to the store, and
    the rollout's speed. Multi-turn (agent.turns > 1): every answer is verified here, turn by turn, on the
    run's sandbox executor; its counts go into the stats."""
    session = sessions.sampling_session(policy, cfg)
    behaviour = sessions.behaviour(session, cfg)
    syncs = behaviour.syncs
    specs = [load_specs(r) for r in train]
    executor = executor_for(cfg.verify)
    with cpu_share(cfg.rollout, session.trainer.device), behaviour.at(policy.version) as engine:
        t0 = time.perf_counter()
        frame = pl.concat([stages.rollout(engine, s, policy.run_id, step, policy.version, cfg, executor) for s in specs])
        stats = stages.rollout_stats(frame, time.perf_counter() - t0)
    if cfg.agent.turns > 1:
        stats.update(executor.stats)
    if behaviour.syncs != syncs:
        get_run_logger().info("wave %d: %s engine synced to policy v%d in %.3f s", step, cfg.rollout.engine,
                              policy.version, behaviour.last_sync_s)
    key = f"runs/{policy.run_id}/waves/{step:06d}/trajectories.parquet"
    return trace.write_wave_table(open_store(cfg.store), key, frame), stats
