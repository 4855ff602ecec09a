"""A run's tasks against its model's context: what the nightly drops before anything samples.

The environment audit judges tasks on their own, for every run and model alike (envs/<family>/
<version>/audit.parquet). Whether a prompt leaves the model room to answer depends on the run: its
model's tokenizer and context (`ratchet.model.PromptRoom`, counted as the rollout engine counts,
chat template included) and its `rollout.max_new_tokens`. So that check is the run's, after the
audits: the run's copy of each task table keeps the tasks that fit, and the others go to the run's
own quarantine (runs/<run_id>/context/too_long.parquet); the shared audit tables are untouched.

    fitted = fit_context(table, room)        # an audited task table, a PromptRoom
    fitted.kept                              # the rows that fit (same schema)
    fitted.quarantined                       # QUARANTINE_SCHEMA: task_id, family, split, prompt_tokens, reason
    require_tasks(fitted.kept, "heldout", "imported-x 2026-01-01", fitted.quarantined, room)   # None or NoTasksLeft
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:   # torch and transformers: only where a run has a model directory
    from ratchet.model import PromptRoom

QUARANTINE_SCHEMA = pl.Schema({"task_id": pl.String, "family": pl.String, "split": pl.String,
                               "prompt_tokens": pl.Int64, "reason": pl.String})

SPLIT_NAMES = {"train": "training", "heldout": "held-out"}


class NoTasksLeft(ValueError):
    """A source whose train or held-out table is empty once the prompts past the model's context are dropped."""


@dataclass(frozen=True)
class Fitted:
    kept: pl.DataFrame          # the table's rows whose prompt leaves room to answer
    quarantined: pl.DataFrame   # QUARANTINE_SCHEMA, one row per dropped task


def fit_context(table: pl.DataFrame, room: PromptRoom) -> Fitted:
    """Split a task table (task_id, family, split, prompt, ...) by whether each prompt's tokens +
    room.max_new_tokens fit the model's context; the reason names the token count."""
    tokens = room.tokens(table["prompt"].to_list()) if table.height else []
    why = [room.why(n) for n in tokens]
    over = pl.Series([w is not None for w in why], dtype=pl.Boolean)
    dropped = table.filter(over)
    quarantined = pl.DataFrame({
        "task_id": dropped["task_id"], "family": dropped["family"], "split": dropped["split"],
        "prompt_tokens": [n for n, w in zip(tokens, why) if w is not None],
        "reason": [w for w in why if w is not None],
    }, schema=QUARANTINE_SCHEMA)
    return Fitted(table.filter(~over), quarantined)


def require_tasks(kept: pl.DataFrame, split: str, source: str, quarantined: pl.DataFrame, room: PromptRoom,
                  where: str = "") -> None:
    """NoTasksLeft, naming the source and why, when dropping the prompts past the context left no task
    of `split` (a table that was empty before is the audit's task-table gate's to report)."""
    dropped = quarantined.filter(pl.col("split") == split)
    if kept.height or not dropped.height:
        return
    raise NoTasksLeft(
        f"source {source}: no {SPLIT_NAMES[split]} task left for this run's model: all {dropped.height} of its "
        f"{SPLIT_NAMES[split]} task(s) have prompts that leave no room for rollout.max_new_tokens "
        f"{room.max_new_tokens} in {room.limit} of {room.context} tokens (the shortest is "
        f"{dropped['prompt_tokens'].min()} tokens){f'; quarantined in {where}' if where else ''}. "
        f"{'Raise model.max_seq_len' if room.limit == 'model.max_seq_len' else 'Use a model with a longer context'}, "
        "lower rollout.max_new_tokens, or shorten the prompts.")
