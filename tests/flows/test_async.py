"""The nightly flow in async mode (rollout.mode: async) on the tiny config: each wave records the
policy that sampled it, max_staleness versions behind the trainer, and trains within that bound."""

import pytest

from ratchet.config import RolloutConfig
from ratchet.store import open_store
from tests.flows.test_nightly import tiny


@pytest.mark.slow   # a whole (tiny) flow: ~45 s of CPU, ~100 s on a busy machine
def test_async_waves_are_sampled_ahead_by_older_policies(prefect_harness, tmp_path):
    from flows.nightly import nightly

    rollout = RolloutConfig(prompts_per_wave=4, group_size=4, max_new_tokens=16, mode="async", max_staleness=2)
    summary = nightly(tiny(str(tmp_path), run_id="a1").model_copy(update={"steps": 4, "rollout": rollout}))
    store = open_store(str(tmp_path))
    versions = [store.read_table(f"runs/a1/waves/{s:06d}/trajectories.parquet")["policy_version"].unique().to_list()
                for s in range(4)]
    assert versions == [[0], [0], [0], [1]]                    # wave k by version max(0, k - 2)
    assert [h["staleness"] for h in summary["history"]] == [0, 1, 2, 2]
    assert summary["policy_version"] == 4 and summary["history"][-1]["step"] == 3
