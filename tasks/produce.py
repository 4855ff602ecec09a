"""Prefect task of layer 1: produce a family's environments (generate, dedup, decontaminate).

    snapshot = produce_envs("python_functions", EnvsConfig(), StoreConfig())

Store keys: see envs/snapshot.py (envs/<family>/<version>/tasks.parquet, heldout.parquet, lineage.json).
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

from envs.production import produce
from envs.snapshot import save_production
from ratchet.config import EnvsConfig, StoreConfig
from ratchet.store import Ref, open_store
from tasks.retry import transient_only


class EnvSnapshot(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    family: str
    version: str = Field(description="<EnvsConfig.version>-<fingerprint of family code + configs>.")
    train: Ref
    heldout: Ref
    lineage: Ref


@task(retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def produce_envs(family: str, cfg: EnvsConfig, store: StoreConfig) -> EnvSnapshot:
    """Generate, dedup and decontaminate one family's tasks; a versioned snapshot with lineage.
    A version already in the store is reused (it is a pure function of its fingerprint)."""
    prod = produce(family, cfg)
    refs = save_production(open_store(store), prod)
    get_run_logger().info("%s %s: %s", family, prod.version, prod.lineage["counts"])
    return EnvSnapshot(family=family, version=prod.version, **refs)
