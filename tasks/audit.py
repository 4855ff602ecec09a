"""Prefect task of layer 1: audit a family's snapshot in the sandbox, gate the tasks that passed.

    result = audit_envs(snapshot, AuditConfig(), VerifyConfig(), StoreConfig())
    result.passed        # Ref to the training tasks that passed the audit (AUDITED_TASK_SCHEMA)

Store keys: see envs/snapshot.py (envs/<family>/<version>/audit.parquet, passed.parquet,
heldout_passed.parquet, quarantine.parquet, regression.parquet); envs/runtimes/<key>.json for each
distinct runtime the tasks need, built before the audit runs them (envs/runtime.py).
"""

from __future__ import annotations

import re

import polars as pl
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

from envs.runtime import ensure_runtimes
from envs.snapshot import VERDICTS, load_specs, save_audit
from ratchet.audit import audit
from ratchet.config import AuditConfig, StoreConfig, VerifyConfig
from ratchet.data.gates import check_tasks
from ratchet.store import Ref, open_store
from tasks.produce import EnvSnapshot
from tasks.retry import transient_only


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


@task(retries=1, retry_delay_seconds=[5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def audit_envs(snapshot: EnvSnapshot, cfg: AuditConfig, verify: VerifyConfig, store: StoreConfig) -> AuditResult:
    """Audit every task of a snapshot in the sandbox; quarantine the failures with their reason.
    The tasks that passed go through the task-table gate (Great Expectations) before any
    rollout may sample them; a failed gate stops the flow with the report as an artifact."""
    specs = load_specs(snapshot.train) + load_specs(snapshot.heldout)
    st = open_store(store)
    for built in ensure_runtimes(specs, st).values():   # each runtime once, before any task runs in it
        if built.error:
            get_run_logger().warning("runtime %s: %s (its tasks become env_errors)", built.key, built.error)
    verdicts = audit(specs, cfg, verify)
    saved = save_audit(st, snapshot.family, snapshot.version, specs, verdicts)
    _artifacts(snapshot, saved.table, saved.counts, saved.changed)
    get_run_logger().info("audit %s %s: %s", snapshot.family, snapshot.version, saved.counts)
    for key in ("passed", "heldout_passed"):
        report = check_tasks(st.read_table(saved.refs[key]), source=saved.refs[key].uri)
        if not report.success:
            create_markdown_artifact(report.to_markdown(), key="gate-tasks", description=f"gate failed: {saved.refs[key].uri}")
        report.raise_if_failed()
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
