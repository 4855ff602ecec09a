"""Watching a run from the Prefect UI: the curves and the per-wave table are markdown artifacts on
the flow run's page (every `watch.every` waves and at the end), TensorBoard has every wave."""

from __future__ import annotations

import base64
import re

from ratchet.config import NightlyConfig, StoreConfig, WatchConfig
from ratchet.store import open_store
from ratchet.watch import scalars_table
from tests.test_watch import waves


def test_artifacts_on_the_flow_runs_page(prefect_harness, tmp_path):
    """A tiny flow that records three waves the way the nightly does: every 2 waves and at the end, the
    markdown artifact (table + inlined PNG) is on the flow run's page, and TensorBoard has each wave."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
    from prefect.runtime import flow_run

    from tasks.summary import record_wave as record_wave_task
    from tasks.watch import publish_curves, watch_wave

    cfg = NightlyConfig(steps=3, store=StoreConfig(uri=str(tmp_path / "store")), watch=WatchConfig(every=2))

    @flow
    def tiny_run() -> str:
        for stats in waves(3):
            step = stats.pop("step")
            record_wave_task("w-1", step, stats, cfg)
            watch_wave("w-1", step, stats, cfg)
        publish_curves("w-1", cfg)
        return str(flow_run.id)

    run_id = tiny_run()
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["curves-w-1"])),
                                      flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    assert len(found) == 2 and {a.type for a in found} == {"markdown"}     # after wave 2, and at the end
    by_waves = {a.data.splitlines()[0]: a.data for a in found}
    assert set(by_waves) == {"# Run w-1: 2 wave(s)", "# Run w-1: 3 wave(s)"}
    store = open_store(cfg.store.uri)
    final = by_waves["# Run w-1: 3 wave(s)"]
    inline = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)\)", final).group(1)
    assert base64.b64decode(inline) == store.get_bytes("runs/w-1/plots/curves.png")
    assert scalars_table([{"step": s["step"], **s} for s in waves(3)]) in final
    assert len(store.list("runs/w-1/tensorboard/")) == 3
