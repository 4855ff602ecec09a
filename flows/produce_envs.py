"""Flow: produce environment snapshots, one per family.

    python -m flows.produce_envs          # the default EnvsConfig, local store

From Python: `from flows.produce_envs import produce_envs_flow; produce_envs_flow(EnvsConfig(n_train=500))`.
"""

from __future__ import annotations

from prefect import flow

from flows.settings import deployment_settings, require_store
from ratchet.config import EnvsConfig, StoreConfig
from tasks.produce import EnvSnapshot, import_envs, produce_envs


@flow(name="produce_envs", log_prints=True, validate_parameters=False)   # flows.settings validates
def produce_envs_flow(envs: EnvsConfig = EnvsConfig(), store: StoreConfig = StoreConfig()) -> list[EnvSnapshot]:
    """Generate, dedup and decontaminate every configured family (and import every configured
    task source); write versioned snapshots."""
    envs, store = deployment_settings(envs=envs, store=store)
    require_store(store)
    return ([produce_envs(family, envs, store) for family in envs.families]
            + [import_envs(source, envs, store) for source in envs.sources])


if __name__ == "__main__":
    for snap in produce_envs_flow():
        print(snap.model_dump_json())
