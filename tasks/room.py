"""Prefect task of the nightly: drop the run's tasks whose prompt leaves its model no room to answer.

    fitted = fit_to_context(run_id, audits, cfg)
    fitted.train, fitted.heldout   # Refs to the task tables this run samples and evaluates
    fitted.quarantine              # Ref to runs/<run_id>/context/too_long.parquet (None: nothing checked)

Only a model directory (cfg.model.path) is checked, by its tokenizer as the rollout engine counts,
against the run's context: model.max_seq_len, at most the model's own (ratchet/room.py,
ratchet.model.PromptRoom); the embedded model's tokenizer is trained later, from the tasks. A
table that loses tasks is rewritten for this run only:
runs/<run_id>/context/<family>/<version>/{passed,heldout_passed}.parquet. The audit's shared tables
(envs/<family>/<version>/) are never written here.
"""

from __future__ import annotations

import re

import polars as pl
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

from ratchet.config import NightlyConfig
from ratchet.room import QUARANTINE_SCHEMA, fit_context, require_tasks
from ratchet.store import Ref, open_store
from tasks.audit import AuditResult
from tasks.retry import transient_only


class RunTasks(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    train: list[Ref] = Field(description="Per source, the training tasks this run samples.")
    heldout: list[Ref] = Field(description="Per source, the held-out tasks this run evaluates.")
    quarantine: Ref | None = Field(None, description="The tasks dropped (QUARANTINE_SCHEMA); None: no model directory.")
    too_long: int = Field(0, description="How many tasks were dropped.")


@task(retries=1, retry_delay_seconds=[5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def fit_to_context(run_id: str, audits: list[AuditResult], cfg: NightlyConfig) -> RunTasks:
    """Drop, for this run, every task whose prompt + rollout.max_new_tokens exceeds the run's context;
    quarantine them under runs/<run_id>/context/. A source left without training or held-out tasks
    stops the run with one error naming it."""
    train, heldout = [a.passed for a in audits], [a.heldout_passed for a in audits]
    if not cfg.model.path:
        return RunTasks(train=train, heldout=heldout)
    from ratchet.model import prompt_room   # torch and transformers: only for a model directory

    room = prompt_room(cfg.model, cfg.rollout.max_new_tokens)
    st = open_store(cfg.store)
    base = f"runs/{run_id}/context"
    checked = [(a, key, split, fit_context(st.read_table(getattr(a, key)), room))
               for a in audits for key, split in (("passed", "train"), ("heldout_passed", "heldout"))]
    table = pl.concat([out.quarantined for *_, out in checked]) if checked else QUARANTINE_SCHEMA.to_frame()
    where = st.write_table(f"{base}/too_long.parquet", table)
    _report(run_id, table, room)
    for a, _, split, out in checked:   # the quarantine first, so the error can point at it
        require_tasks(out.kept, split, f"{a.family} {a.version}", out.quarantined, room, where.uri)
    kept = {"passed": [], "heldout_passed": []}
    for a, key, _, out in checked:
        kept[key].append(st.write_table(f"{base}/{a.family}/{a.version}/{key}.parquet", out.kept)
                         if out.quarantined.height else getattr(a, key))
    return RunTasks(train=kept["passed"], heldout=kept["heldout_passed"], quarantine=where, too_long=table.height)


def _report(run_id: str, table: pl.DataFrame, room) -> None:
    logger, limit = get_run_logger(), f"{room.limit} of {room.context} tokens"
    if not table.height:
        logger.info("every task's prompt + max_new_tokens %d fits %s", room.max_new_tokens, limit)
        return
    logger.warning("%d task(s) dropped for this run: prompt + max_new_tokens %d over %s; first: %s (%d tokens)",
                   table.height, room.max_new_tokens, limit, table["task_id"][0], table["prompt_tokens"][0])
    create_table_artifact(table.head(50).to_dicts(), key=re.sub(r"[^a-z0-9-]+", "-", f"too-long-{run_id.lower()}")[:100],
                          description=f"Run {run_id}: {table.height} task(s) whose prompt + max_new_tokens "
                                      f"{room.max_new_tokens} exceeds {limit} (dropped for this run only).")
