"""Flow: produce and audit environments; the audited tasks are what training may use.

    python -m flows.audit_envs            # the default EnvsConfig, local store

From Python: `from flows.audit_envs import audit_envs_flow; audit_envs_flow(EnvsConfig(families=("arithmetic",)))`.
Each family gets a Prefect table artifact (tasks per verdict) and a markdown artifact (the
quarantined tasks and the regression against the family's previous version).
"""

from __future__ import annotations

from prefect import flow

from flows.settings import deployment_settings, require_store
from ratchet.config import AuditConfig, EnvsConfig, StoreConfig, VerifyConfig
from tasks.audit import AuditResult, audit_envs
from tasks.produce import import_envs, produce_envs


@flow(name="audit_envs", log_prints=True, validate_parameters=False)   # flows.settings validates
def audit_envs_flow(envs: EnvsConfig = EnvsConfig(), audit: AuditConfig = AuditConfig(),
                    verify: VerifyConfig = VerifyConfig(), store: StoreConfig = StoreConfig()) -> list[AuditResult]:
    """Produce each family's snapshot, then audit it in the sandbox. The parameters are the
    nightly config's own sections (`NightlyConfig.envs/.audit/.verify/.store`): the same
    values give the same snapshot and the same verdicts as the nightly's audit."""
    envs, audit, verify, store = deployment_settings(envs=envs, audit=audit, verify=verify, store=store)
    require_store(store)
    snapshots = [produce_envs(family, envs, store) for family in envs.families]
    snapshots += [import_envs(source, envs, store) for source in envs.sources]
    return [audit_envs(snapshot, audit, verify, store) for snapshot in snapshots]


if __name__ == "__main__":
    for result in audit_envs_flow():
        print(result.model_dump_json())
