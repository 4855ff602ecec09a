"""Prefect tasks of layer 1: produce a family's environments (generate, dedup, decontaminate),
or import a task set named in `EnvsConfig.sources` (envs/sources.py) as a snapshot of the same kind.

    snapshot = produce_envs("python_functions", EnvsConfig(), StoreConfig())
    snapshot = import_envs("data/mytasks.jsonl", EnvsConfig(), StoreConfig())   # family "imported-mytasks"

Store keys: see envs/snapshot.py (envs/<family>/<version>/tasks.parquet, heldout.parquet, lineage.json).
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

from envs.production import produce
from envs.snapshot import save_production
from envs.sources import import_source, read_source, save_source
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
    imported: dict | None = Field(None, description="An imported task set: its source, name, version, counts (lines "
                                  "ok / bad, duplicates, contaminated, kept), bad_lines and dropped (URIs or None). None: a family.")


@task(retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def produce_envs(family: str, cfg: EnvsConfig, store: StoreConfig) -> EnvSnapshot:
    """Generate, dedup and decontaminate one family's tasks; a versioned snapshot with lineage.
    A version already in the store is reused (it is a pure function of its fingerprint)."""
    prod = produce(family, cfg)
    refs = save_production(open_store(store), prod)
    get_run_logger().info("%s %s: %s", family, prod.version, prod.lineage["counts"])
    return EnvSnapshot(family=family, version=prod.version, **refs)


@task(retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def import_envs(source: str, cfg: EnvsConfig, store: StoreConfig) -> EnvSnapshot:
    """Import one task file as a snapshot (dedup, split, decontaminated), its bad lines saved beside
    it; the flow then audits, trains on and evaluates it as it does a family's snapshot."""
    st = open_store(store)
    imp = import_source(source, read_source(source, store.uri), cfg)
    refs = save_source(st, imp)
    bad, dropped = refs.pop("bad_lines"), refs.pop("dropped")
    counts = imp.production.lineage["counts"]
    logger = get_run_logger()
    logger.info("%s %s from %s: %s", imp.name, imp.production.version, source, counts)
    if imp.bad:
        logger.warning("%s: %d bad line(s) quarantined in %s; first: %s", source, len(imp.bad), bad.uri,
                       imp.bad[0].messages()[0])
    if imp.dropped:
        logger.info("%s: %d task(s) left out by dedup and decontamination, each with why, in %s", source,
                    len(imp.dropped), dropped.uri)
    return EnvSnapshot(family=imp.name, version=imp.production.version, **refs, imported={
        "source": source, "name": imp.name, "version": imp.production.version, "counts": counts,
        "bad_lines": bad.uri if bad else None, "dropped": dropped.uri if dropped else None})
