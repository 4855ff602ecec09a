"""Prefect task: sample one rollout wave from the current policy."""

from __future__ import annotations

import time

import polars as pl
from prefect import task
from prefect.cache_policies import NO_CACHE

from envs.snapshot import load_specs
from ratchet import stages
from ratchet.config import NightlyConfig
from ratchet.store import Ref, open_store
from ratchet.train import session as sessions
from tasks.retry import transient_only


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def rollout_wave(policy: sessions.PolicyRef, step: int, train: list[Ref], cfg: NightlyConfig) -> tuple[Ref, dict]:
    """`prompts_per_wave` tasks x `group_size` samples; trajectories to the store, and the rollout's speed."""
    session = sessions.open_session(policy, cfg)
    specs = [load_specs(r) for r in train]
    t0 = time.perf_counter()
    frame = pl.concat([stages.rollout(session.engine, s, policy.run_id, step, policy.version, cfg) for s in specs])
    stats = stages.rollout_stats(frame, time.perf_counter() - t0)
    key = f"runs/{policy.run_id}/waves/{step:06d}/trajectories.parquet"
    return open_store(cfg.store).write_table(key, frame), stats
