"""A tripped health monitor stops the nightly before promotion, with one error that names the
signal, the wave and the values, recorded in the wave's stats.json, the summary and the attempt.
(The rules themselves: tests/test_monitor.py.)"""

import pytest

from ratchet.config import MonitorConfig
from ratchet.monitor import HealthCheckFailed
from ratchet.store import open_store
from tests.flows.test_nightly import tiny


@pytest.mark.slow
def test_a_tripped_monitor_stops_the_run_before_promotion(prefect_harness, tmp_path):
    from flows.nightly import nightly

    # The tiny untrained model samples near-uniformly (~5.5 nats per token); a floor of 6 is
    # deliberately tight: it breaches at every wave, and patience 2 lets it trip at wave 1.
    monitor = MonitorConfig(entropy_floor=6.0, patience=2, max_zero_variance_frac=None)
    cfg = tiny(str(tmp_path), run_id="sick", monitor=monitor)
    with pytest.raises(HealthCheckFailed, match=r"^entropy collapse at wave 1: sampled_entropy 5\.\d+ < floor 6 "
                                                r"for 2 waves in a row \(waves 0-1: 5\.\d+, 5\.\d+\)$"):
        nightly(cfg)

    store = open_store(cfg.store)
    assert "alarms" not in store.get_json("runs/sick/waves/000000/stats.json")       # wave 0 alone: patience
    [alarm] = store.get_json("runs/sick/waves/000001/stats.json")["alarms"]
    assert (alarm["monitor"], alarm["signal"], alarm["wave"], alarm["waves"]) == ("entropy_collapse", "sampled_entropy", 1, [0, 1])
    assert all(5.0 < v < 6.0 for v in alarm["values"]) and alarm["threshold"] == 6.0
    assert not store.exists("runs/sick/waves/000002/stats.json")                     # no wave after it
    summary = store.get_json("runs/sick/summary.json")
    assert summary["promoted"] is False and summary["health"] == [alarm]
    assert summary["promotion"].startswith("not evaluated: the run stopped at wave 1: entropy collapse at wave 1")
    assert [h["step"] for h in summary["history"]] == [0, 1]
    assert store.exists("runs/sick/plots/curves.png")           # the curves up to the stop (watch.every 10: none yet)
    assert "| 1 |" in store.get_bytes("runs/sick/plots/scalars.md").decode()
    [attempt] = store.get_json("runs/sick/attempts.json")
    assert attempt["outcome"].startswith("failed: HealthCheckFailed: entropy collapse at wave 1: sampled_entropy")
    [closed] = summary["attempts"]                                          # closed in the summary too
    assert closed["outcome"] == attempt["outcome"] and summary["wall_s"] == closed["wall_s"] == attempt["wall_s"] > 0
    # stopped before the final evaluation and promotion: nothing promoted, no checkpoint past v0
    assert store.get_pointer("models/promoted/INCUMBENT") is None
    assert [k for k in store.list("runs/sick/checkpoints/") if k.endswith("MANIFEST.json")] == [
        "runs/sick/checkpoints/000000/MANIFEST.json"]
