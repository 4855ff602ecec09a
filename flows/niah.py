"""Flow: the needle-in-a-haystack probe of a checkpoint (long-context recall, depth x length).

    python -m flows.niah /path/to/checkpoint      # a local Hugging Face directory
    python -m flows.niah                          # the promoted incumbent of the default store

From Python: `from flows.niah import niah; niah("runs/r1/checkpoints/000090", NiahConfig(trials=8))`.
The recall table is the flow's result and a markdown artifact; `ratchet eval niah` is the same
probe without Prefect.
"""

from __future__ import annotations

import sys

from prefect import flow

from flows.settings import deployment_settings, require_store
from ratchet.config import NiahConfig, StoreConfig
from tasks.niah import probe_niah


@flow(name="niah", log_prints=True, validate_parameters=False)   # flows.settings validates
def niah(model: str | None = None, probe: NiahConfig = NiahConfig(), store: StoreConfig = StoreConfig()) -> dict:
    """Bury a key at several depths in contexts of several lengths; recall per cell. `model`: a local
    Hugging Face directory, a checkpoint's key in the store, or empty for the promoted incumbent."""
    model, probe, store = deployment_settings(model=model, probe=probe, store=store)   # a partial override keeps the deployment's store
    require_store(store)
    return probe_niah(model, probe, store)


if __name__ == "__main__":
    print(niah(sys.argv[1] if len(sys.argv) > 1 else None)["table"])
