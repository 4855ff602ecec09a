"""produce_envs -> audit_envs end to end under prefect_test_harness, on a small config."""

from __future__ import annotations

import asyncio

import polars as pl
import pytest

from ratchet.config import AuditConfig, EnvsConfig, StoreConfig, VerifyConfig
from ratchet.data.gates import check_tasks
from ratchet.data.schemas import AUDITED_TASK_SCHEMA
from ratchet.store import open_store


def _artifact_keys() -> set[str]:
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts()}
    return asyncio.run(read())


def test_produce_then_audit(prefect_harness, tmp_path):
    from flows.audit_envs import audit_envs_flow

    store = StoreConfig(uri=str(tmp_path / "store"))
    envs = EnvsConfig(n_train=40, n_heldout=12, max_difficulty=2)
    (result,) = audit_envs_flow(envs, AuditConfig(max_mutants=4), VerifyConfig(), store)
    st = open_store(store.uri)

    audit = st.read_table(result.audit)
    assert audit.height == 52 and sum(result.counts.values()) == 52
    assert set(audit["verdict"]) <= set(result.counts)
    passed = st.read_table(result.passed)
    assert passed.schema == AUDITED_TASK_SCHEMA and passed.height == result.counts["pass"] - st.read_table(result.heldout_passed).height
    assert set(passed["split"]) == {"train"} and set(passed["verdict"]) == {"pass"}
    assert check_tasks(passed).success
    quarantine = st.read_table(result.quarantine)
    assert quarantine.height == 52 - result.counts["pass"]
    assert quarantine.filter(pl.col("reason") == "").height == 0       # every quarantined task says why
    lineage = st.get_json(f"envs/python_functions/{result.version}/lineage.json")
    assert lineage["counts"]["train"]["kept"] == 40 and lineage["seed"] == 0
    assert {"audit-python-functions", "audit-python-functions-details"} <= _artifact_keys()
    assert result.regression is None                                    # first version of the family
    [runtime] = st.list("envs/runtimes/")                               # the one runtime, built before the audit
    assert st.get_json(runtime)["runtime"] == "python3.11" and st.get_json(runtime)["error"] is None

    # a second version (one more difficulty level: the shared tasks keep their ids), audited with a
    # runtime budget nobody meets: the regression audit lists the tasks whose verdict changed, and
    # the task gate stops the flow, since no task is left to train on
    from ratchet.data.gates import GateError

    with pytest.raises(GateError, match="tasks_not_empty"):
        audit_envs_flow(envs.model_copy(update={"max_difficulty": 3}),
                        AuditConfig(max_mutants=4, max_reference_ms=0.001), VerifyConfig(), store)
    versions = st.get_json("envs/python_functions/versions.json")
    assert len(versions) == 2 and versions[0] == result.version
    changed = st.read_table(f"envs/python_functions/{versions[1]}/regression.parquet")
    assert changed.columns == ["task_id", "split", "previous", "current", "reason"]
    assert changed.height > 0 and set(changed["current"]) == {"too_slow"}
    assert set(changed["task_id"]) <= set(audit["task_id"])
