"""Environment snapshots in the store: what `produce` and `audit` made, under stable keys.

    refs = save_production(store, prod)                 # train / heldout / lineage Refs
    saved = save_audit(store, family, version, specs, verdicts)

Keys, per family and version (`envs/<family>/<version>/`): tasks.parquet (train),
heldout.parquet, lineage.json (written last: its presence marks a complete snapshot),
audit.parquet (every task: verdict, reason, mutation_score, reference_ms), passed.parquet and
heldout_passed.parquet (AUDITED_TASK_SCHEMA), quarantine.parquet (every task that did not
pass, with its reason), regression.parquet (verdicts changed since the previous audited
version). `envs/<family>/versions.json` lists the versions in the order they were produced.
Used by the Prefect tasks (tasks/produce.py, tasks/audit.py) and `ratchet envs import` alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import polars as pl

from envs.production import Production
from envs.spec import TaskSpec
from ratchet.data.schemas import AUDITED_TASK_SCHEMA, tasks_frame
from ratchet.store import ArtifactStore, Ref, store_for


VerdictName = Literal["pass", "flaky", "weak_tests", "broken", "trivial_passes", "leaky_tests", "too_slow",
                      "too_long", "env_error"]
VERDICTS: tuple[str, ...] = VerdictName.__args__


@dataclass(frozen=True)
class Verdict:
    """The audit's word on one task (`ratchet.audit` says how each verdict is reached)."""

    task_id: str
    verdict: VerdictName
    reason: str                       # why; empty when it passed with every probe
    mutation_score: float | None      # killed / mutants; None when no mutant could be made or run
    reference_ms: float | None = None


def regression(previous: pl.DataFrame, current: pl.DataFrame) -> pl.DataFrame:
    """Tasks (by task_id, in both audit tables) whose verdict changed: task_id, split, previous,
    current, reason (the current one)."""
    prev = previous.select("task_id", pl.col("verdict").alias("previous"))
    cur = current.select("task_id", "split", pl.col("verdict").alias("current"), "reason")
    return (cur.join(prev, on="task_id", how="inner")
            .filter(pl.col("previous") != pl.col("current"))
            .select("task_id", "split", "previous", "current", "reason"))


def prefix(family: str, version: str) -> str:
    return f"envs/{family}/{version}"


@functools.lru_cache(maxsize=32)
def _specs(ref_json: str) -> tuple[TaskSpec, ...]:
    ref = Ref.model_validate_json(ref_json)
    return tuple(TaskSpec.model_validate_json(j) for j in store_for(ref).read_table(ref)["spec_json"])


def load_specs(ref: Ref) -> list[TaskSpec]:
    """The task specs of a task table; parsed once per process per Ref (content-addressed)."""
    return list(_specs(ref.model_dump_json()))


def versions(st: ArtifactStore, family: str) -> list[str]:
    key = f"envs/{family}/versions.json"
    return st.get_json(key) if st.exists(key) else []


def save_production(st: ArtifactStore, prod: Production) -> dict[str, Ref]:
    """Write a production (once: an existing complete snapshot of that version is kept)."""
    p = prefix(prod.family, prod.version)
    if not st.exists(f"{p}/lineage.json"):
        st.write_table(f"{p}/tasks.parquet", tasks_frame(prod.train))
        st.write_table(f"{p}/heldout.parquet", tasks_frame(prod.heldout))
        st.put_json(f"{p}/lineage.json", prod.lineage)
    known = versions(st, prod.family)
    if prod.version not in known:
        st.put_json(f"envs/{prod.family}/versions.json", known + [prod.version])
    return {"train": st.ref(f"{p}/tasks.parquet"), "heldout": st.ref(f"{p}/heldout.parquet"),
            "lineage": st.ref(f"{p}/lineage.json")}


@dataclass
class SavedAudit:
    refs: dict[str, Ref | None]
    counts: dict[str, int]
    table: pl.DataFrame
    changed: pl.DataFrame | None


def audit_table(specs: list[TaskSpec], verdicts: list[Verdict]) -> pl.DataFrame:
    return tasks_frame(specs, [(v.verdict, v.reason) for v in verdicts]).with_columns(
        pl.Series("mutation_score", [v.mutation_score for v in verdicts], dtype=pl.Float64),
        pl.Series("reference_ms", [v.reference_ms for v in verdicts], dtype=pl.Float64),
    )


def save_audit(st: ArtifactStore, family: str, version: str, specs: list[TaskSpec], verdicts: list[Verdict]) -> SavedAudit:
    table = audit_table(specs, verdicts)
    p = prefix(family, version)
    ok = pl.col("verdict") == "pass"
    audited = list(AUDITED_TASK_SCHEMA)
    refs: dict[str, Ref | None] = {
        "audit": st.write_table(f"{p}/audit.parquet", table),
        "passed": st.write_table(f"{p}/passed.parquet", table.filter(ok & (pl.col("split") == "train")).select(audited)),
        "heldout_passed": st.write_table(f"{p}/heldout_passed.parquet",
                                         table.filter(ok & (pl.col("split") == "heldout")).select(audited)),
        "quarantine": st.write_table(f"{p}/quarantine.parquet", table.filter(~ok)),
    }
    changed = None
    known = versions(st, family)
    before = known[: known.index(version)] if version in known else known
    for prev in reversed(before):   # the latest earlier version that was audited
        key = f"{prefix(family, prev)}/audit.parquet"
        if st.exists(key):
            changed = regression(st.read_table(key), table)
            refs["regression"] = st.write_table(f"{p}/regression.parquet", changed)
            break
    refs.setdefault("regression", None)
    counts = {name: int((table["verdict"] == name).sum()) for name in VERDICTS}
    return SavedAudit(refs, counts, table, changed)
