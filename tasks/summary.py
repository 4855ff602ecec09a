"""Prefect tasks of a run's record: each wave's figures as it ends, the summary at the end."""

from __future__ import annotations

import re

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from ratchet import summary as summaries
from ratchet.config import NightlyConfig
from ratchet.store import open_store
from tasks.retry import transient_only


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def record_wave(run_id: str, step: int, stats: dict, cfg: NightlyConfig) -> None:
    """runs/<run_id>/waves/<step>/stats.json: the wave's scoring and training figures."""
    summaries.record_wave(open_store(cfg.store), run_id, step, stats)


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def write_summary(run_id: str, fields: dict, cfg: NightlyConfig) -> dict:
    """runs/<run_id>/summary.json over every attempt of the run, also published as an artifact."""
    ref, summary = summaries.write_summary(open_store(cfg.store), run_id, fields, cfg.steps)
    rows = [f"| {a['attempt']} | {a['started_at']} | {a['wall_s']} | {a['outcome']} |" for a in summary["attempts"]]
    create_markdown_artifact("\n".join([
        f"# Run {run_id}", "",
        f"held-out pass@1 {fields['base_pass_rate']:.3f} -> {fields['final_pass_rate']:.3f}; "
        f"promoted: {fields['promoted']} ({fields['promotion']})", "",
        *([fields["eval_table"], ""] if fields.get("eval_table") else []),
        "| attempt | started | wall s | outcome |", "|---|---|---|---|", *rows]),
        key=re.sub(r"[^a-z0-9-]+", "-", f"summary-{run_id.lower()}")[:100],
        description=f"Summary of run {run_id}")
    return {**summary, "summary": ref.uri}
