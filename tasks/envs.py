"""Prefect tasks of layer 1: produce a family's environments, audit them.

    snapshot = produce_envs("python_functions", EnvsConfig(), StoreConfig())
    result = audit_envs(snapshot, VerifyConfig(), StoreConfig())
    result.passed        # Ref to the training tasks that passed the audit (AUDITED_TASK_SCHEMA)

Store keys: see envs/snapshot.py (envs/<family>/<version>/tasks.parquet, heldout.parquet,
lineage.json, audit.parquet, passed.parquet, quarantine.parquet, regression.parquet).
"""

from __future__ import annotations

import re
from typing import Callable

import polars as pl
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

from envs.audit import VERDICTS, AuditConfig, audit, limits_for
from envs.production import produce
from envs.runtime import resolve
from envs.snapshot import load_specs, save_audit, save_production
from ratchet.config import EnvsConfig, StoreConfig, VerifyConfig
from ratchet.store import Ref, open_store


class EnvSnapshot(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    family: str
    version: str = Field(description="<EnvsConfig.version>-<fingerprint of family code + configs>.")
    train: Ref
    heldout: Ref
    lineage: Ref


class AuditResult(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    family: str
    version: str
    audit: Ref = Field(description="Every task (train and held-out) with verdict, reason, mutation_score.")
    passed: Ref = Field(description="Training tasks that passed (AUDITED_TASK_SCHEMA).")
    heldout_passed: Ref = Field(description="Held-out tasks that passed (AUDITED_TASK_SCHEMA).")
    quarantine: Ref = Field(description="Tasks that did not pass, with the reason.")
    regression: Ref | None = Field(None, description="Tasks whose verdict changed since the previous version.")
    counts: dict[str, int] = Field(description="Tasks per verdict (train and held-out together).")


@task(retries=2, retry_delay_seconds=[5, 30], cache_policy=NO_CACHE)
def produce_envs(family: str, cfg: EnvsConfig, store: StoreConfig) -> EnvSnapshot:
    """Generate, dedup and decontaminate one family's tasks; a versioned snapshot with lineage.
    A version already in the store is reused (it is a pure function of its fingerprint)."""
    prod = produce(family, cfg)
    refs = save_production(open_store(store.uri), prod)
    get_run_logger().info("%s %s: %s", family, prod.version, prod.lineage["counts"])
    return EnvSnapshot(family=family, version=prod.version, **refs)


@task(retries=1, retry_delay_seconds=[5], cache_policy=NO_CACHE)
def audit_envs(snapshot: EnvSnapshot, verify: VerifyConfig, store: StoreConfig,
               cfg: AuditConfig | None = None, count_tokens: Callable[[str], int] | None = None) -> AuditResult:
    """Audit every task of a snapshot in the sandbox; quarantine the failures with their reason.
    count_tokens (e.g. the policy tokenizer's) with cfg.max_prompt_tokens checks the context fit."""
    specs = load_specs(snapshot.train) + load_specs(snapshot.heldout)
    verdicts = audit(specs, limits_for(verify), cfg, concurrency=verify.concurrency,
                     retries=verify.env_error_retries, count_tokens=count_tokens, runtime_python=resolve)
    saved = save_audit(open_store(store.uri), snapshot.family, snapshot.version, specs, verdicts)
    _artifacts(snapshot, saved.table, saved.counts, saved.changed)
    get_run_logger().info("audit %s %s: %s", snapshot.family, snapshot.version, saved.counts)
    return AuditResult(family=snapshot.family, version=snapshot.version, counts=saved.counts, **saved.refs)


def _artifacts(snapshot: EnvSnapshot, table: pl.DataFrame, counts: dict[str, int], changed: pl.DataFrame | None) -> None:
    key = "audit-" + re.sub(r"[^a-z0-9-]+", "-", snapshot.family.lower())   # artifact keys: a-z, 0-9, dashes
    rows = [{"family": snapshot.family, "version": snapshot.version, "split": split,
             **{name: int(((table["verdict"] == name) & (table["split"] == split)).sum()) for name in VERDICTS}}
            for split in ("train", "heldout")]
    create_table_artifact(rows, key=key, description=f"Environment audit of {snapshot.family} {snapshot.version}: tasks per verdict.")
    bad = table.filter(pl.col("verdict") != "pass").head(20)
    md = [f"# Audit of {snapshot.family} {snapshot.version}", "", " · ".join(f"{k}: {v}" for k, v in counts.items()), ""]
    if bad.height:
        md += ["| task | verdict | reason |", "|---|---|---|"]
        md += [f"| {r['task_id']} | {r['verdict']} | {r['reason'][:160].replace('|', '/')} |" for r in bad.iter_rows(named=True)]
    if changed is not None:
        md += ["", f"## Regression: {changed.height} task(s) changed verdict since the previous version"]
        md += [f"- {r['task_id']}: {r['previous']} -> {r['current']}" for r in changed.head(20).iter_rows(named=True)]
    create_markdown_artifact("\n".join(md), key=f"{key}-details", description="Quarantined tasks and regressions.")
