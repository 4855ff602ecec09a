"""The whole nightly flow end to end on a tiny config, under a Prefect test harness."""

import json

import pytest

from ratchet.config import (EnvsConfig, EvalConfig, GateConfig, ModelConfig, MonitorConfig, NightlyConfig,
                            RolloutConfig, StoreConfig, TrainConfig)
from ratchet.store import open_store


def tiny(store_uri: str, **kw) -> NightlyConfig:
    return NightlyConfig(
        steps=3, checkpoint_every=2,
        store=StoreConfig(uri=store_uri),
        envs=EnvsConfig(n_train=60, n_heldout=12),
        model=ModelConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=200, sft_steps=20, sft_batch=16),
        rollout=RolloutConfig(prompts_per_wave=4, group_size=4, max_new_tokens=16),
        train=TrainConfig(minibatch_prompts=2),
        gate=GateConfig(max_zero_variance_frac=1.0),
        eval=EvalConfig(n_tasks=12, every=2, min_gain=1.0),   # min_gain 1.0: no checkpoint can be promoted
        **{"monitor": MonitorConfig(max_zero_variance_frac=None), **kw},   # the tiny model's groups are all-equal
    )


@pytest.fixture(scope="module")
def first_run(prefect_harness, tmp_path_factory):
    from flows.nightly import nightly

    store_uri = str(tmp_path_factory.mktemp("store"))
    return store_uri, nightly(tiny(store_uri, run_id="r1"))


def test_summary_and_store_layout(first_run):
    store_uri, summary = first_run
    store = open_store(store_uri)
    assert {"run_id", "summary", "base_pass_rate", "final_pass_rate", "promoted", "steps", "wall_s"} <= set(summary)
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    assert 0.0 <= summary["base_pass_rate"] <= 1.0 and 0.0 <= summary["final_pass_rate"] <= 1.0
    assert store.get_json("runs/r1/summary.json")["final_pass_rate"] == summary["final_pass_rate"]
    lo, hi = summary["final"]["ci"]
    assert lo <= summary["final_pass_rate"] <= hi and summary["final"]["pass_at"] == {"1": round(summary["final_pass_rate"], 4)}
    table = summary["eval_table"].splitlines()
    assert table[0].endswith("| base | candidate |") and table[3].startswith("| family python_functions | ")
    assert summary["promotion"].startswith("Keep the base model")    # min_gain 1.0; no incumbent yet: base is the bar
    for step in range(3):
        assert store.exists(f"runs/r1/waves/{step:06d}/trajectories.parquet")
        scored = store.read_table(f"runs/r1/waves/{step:06d}/scored.parquet")
        assert scored.height == 16 and scored["reward"].is_not_null().all()
        trained = store.read_table(f"runs/r1/waves/{step:06d}/trained.parquet")
        assert trained.drop("advantage", "token_advantages").equals(scored.drop("advantage", "token_advantages"))
        assert trained["advantage"].is_not_null().sum() == summary["history"][step]["train_samples"]
    assert [("heldout_pass_rate" in h) for h in summary["history"]] == [False, True, False]   # eval.every=2
    speed = {"rollout_tokens_per_s", "sandbox_p50_ms", "sandbox_p95_ms", "staleness", "reward_std", "pass_rate"}
    assert all(speed <= set(h) and h["staleness"] == 0 and h["rollout_tokens_per_s"] > 0 for h in summary["history"])
    assert len(store.list("runs/r1/tensorboard/")) == 3 and store.exists("runs/r1/plots/curves.png")
    latest = store.get_pointer("runs/r1/checkpoints/LATEST")
    ledger = json.loads(store.get_bytes(latest.sibling("ledger.json")))
    assert ledger["version"] == 3 and ledger["consumed_waves"] == [0, 1, 2]
    assert [int(k.split("/")[3]) for k in store.list("runs/r1/checkpoints/") if k.endswith("MANIFEST.json")] == [0, 2, 3]


def test_a_candidate_below_the_bar_is_not_promoted(first_run):
    """min_gain 1.0 puts the bar above any pass rate: the run must end unpromoted, the incumbent
    pointer untouched. (The rule itself is tested on hand-built cases in tests/eval, the promote
    task in tests/tasks.)"""
    store_uri, summary = first_run
    assert summary["promoted"] is False and summary["promotion"].startswith("Keep the base model")
    assert "points vs the base model" in summary["promotion"]
    assert "does not exceed the required gain of +100.0 points" in summary["promotion"]
    d = summary["decision"]
    assert d["ci"][0] <= d["estimate"] <= d["ci"][1] and d["method"] == "paired bootstrap + exact McNemar"
    assert open_store(store_uri).get_pointer("models/promoted/INCUMBENT") is None


def test_rerun_with_the_same_id_resumes_without_retraining(first_run):
    from flows.nightly import nightly

    store_uri, summary = first_run
    again = nightly(tiny(store_uri, run_id="r1"))
    assert again["policy_version"] == 3 and again["base_pass_rate"] == summary["base_pass_rate"]
    # the summary covers the whole run: every wave once, both attempts, the total wall time
    assert [h["step"] for h in again["history"]] == [0, 1, 2] and again["history"] == summary["history"]
    assert [a["outcome"] for a in again["attempts"]] == ["completed", "completed"]
    assert again["wall_s"] == pytest.approx(sum(a["wall_s"] for a in again["attempts"]), abs=0.2)
    assert open_store(store_uri).get_json("runs/r1/summary.json")["attempts"] == again["attempts"]


def test_a_run_whose_lease_is_taken_over_stops_at_its_next_wave(prefect_harness, tmp_path, monkeypatch):
    """Found by review: a run whose heartbeat found its lease taken over went on sampling and training
    until its next checkpoint (checkpoint_every waves later), beside the new holder. The flow now
    checks its lease (no I/O) before each wave."""
    import time

    import flows.nightly
    from ratchet.store import LeaseLost, RunLease
    from ratchet.store.lease import lease_key

    store_uri = str(tmp_path / "store")
    leases, start_heartbeat = [], RunLease.start_heartbeat
    monkeypatch.setattr(RunLease, "start_heartbeat", lambda self, interval_s=None: (leases.append(self),
                                                                                       start_heartbeat(self, 0.05)))
    real_check_health = flows.nightly.check_health

    def taken_over_after_wave_0(run_id, step, cfg):
        if step == 0:      # another process takes the lease over; this run's heartbeat finds it
            store = open_store(store_uri)
            store.put_json(lease_key(run_id), {**store.get_json(lease_key(run_id)), "token": "theirs",
                                               "owner": "another-process"})
            deadline = time.monotonic() + 60
            while leases[0]._error is None and time.monotonic() < deadline:
                time.sleep(0.05)
        return real_check_health(run_id, step, cfg)

    monkeypatch.setattr(flows.nightly, "check_health", taken_over_after_wave_0)
    with pytest.raises(LeaseLost, match="another-process"):
        flows.nightly.nightly(tiny(store_uri, run_id="r-lost").model_copy(update={"steps": 4, "checkpoint_every": 10}))
    store = open_store(store_uri)
    assert store.exists("runs/r-lost/waves/000000/trajectories.parquet")
    assert not store.exists("runs/r-lost/waves/000001/trajectories.parquet")      # stopped before wave 1


# -- faults, injected into the finished run r1 (these tests run after the ones above) --

def test_a_second_writer_on_the_same_run_id_is_refused(first_run):
    from flows.nightly import nightly
    from ratchet.store import LeaseHeld, RunLease

    store_uri, _ = first_run
    with RunLease(open_store(store_uri), "r1", owner="another-process"):
        with pytest.raises(LeaseHeld, match="another-process"):
            nightly(tiny(store_uri, run_id="r1"))


def test_garbage_latest_falls_back_to_the_newest_good_checkpoint(first_run):
    from flows.nightly import nightly

    store_uri, summary = first_run
    open_store(store_uri).put_bytes("runs/r1/checkpoints/LATEST", b"\x00garbage")
    again = nightly(tiny(store_uri, run_id="r1"))
    assert again["policy_version"] == 3 and again["final_pass_rate"] == summary["final_pass_rate"]


def test_a_run_resumed_past_two_corrupt_checkpoints_trains_on_and_keeps_them(first_run):
    """Versions 3 (LATEST) and 2 rot: the run resumes from 0 and trains versions 2 and 3 again, to the
    same figures. It used to stop at its first checkpoint for good (CheckpointBehindLatest: LATEST was
    at 3); the rotten ones are now set aside under checkpoints/rejected/."""
    from flows.nightly import nightly

    store_uri, summary = first_run
    store = open_store(store_uri)
    for v in (2, 3):
        store.path(f"runs/r1/checkpoints/{v:06d}/model.safetensors").write_bytes(b"not the weights")
    again = nightly(tiny(store_uri, run_id="r1"))
    assert again["policy_version"] == 3 and again["final_pass_rate"] == summary["final_pass_rate"]
    rejected = {k.split("/")[4] for k in store.list("runs/r1/checkpoints/rejected/")}
    assert rejected == {"000002-0", "000003-0"}
    assert store.get_pointer("runs/r1/checkpoints/LATEST").key == "runs/r1/checkpoints/000003/MANIFEST.json"


def test_with_every_checkpoint_corrupt_the_run_stops_and_keeps_its_history(first_run):
    from flows.nightly import nightly
    from ratchet.train.checkpoint import NoUsableCheckpoint

    store_uri, _ = first_run
    store = open_store(store_uri)
    before = store.get_json("runs/r1/summary.json")
    waves = {k: store.ref(k).sha256 for k in store.list("runs/r1/waves/")}
    for k in store.list("runs/r1/checkpoints/"):
        if k.endswith("model.safetensors"):
            store.path(k).write_bytes(b"not the weights")                # bytes changed behind the store's back
    with pytest.raises(NoUsableCheckpoint, match="r1"):
        nightly(tiny(store_uri, run_id="r1"))
    after = store.get_json("runs/r1/summary.json")                        # nothing written over but the attempts
    assert {k: v for k, v in after.items() if k not in ("attempts", "wall_s", "fields_from_attempt")} == {
        k: v for k, v in before.items() if k not in ("attempts", "wall_s")}
    assert after["attempts"][:-1] == before["attempts"] and after["fields_from_attempt"] == len(before["attempts"]) - 1
    assert {k: store.ref(k).sha256 for k in store.list("runs/r1/waves/")} == waves
    attempts = store.get_json("runs/r1/attempts.json")
    assert attempts[-1]["outcome"].startswith("failed: NoUsableCheckpoint")
