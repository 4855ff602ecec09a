"""Prefect task: sample one rollout wave from the current policy."""

from __future__ import annotations

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
def rollout_wave(policy: sessions.PolicyRef, step: int, train: list[Ref], cfg: NightlyConfig) -> Ref:
    """`prompts_per_wave` tasks x `group_size` samples; trajectories to the store."""
    session = sessions.open_session(policy, cfg)
    frames = [stages.rollout(session.engine, load_specs(r), policy.run_id, step, policy.version, cfg)
              for r in train]
    key = f"runs/{policy.run_id}/waves/{step:06d}/trajectories.parquet"
    return open_store(cfg.store).write_table(key, pl.concat(frames))
