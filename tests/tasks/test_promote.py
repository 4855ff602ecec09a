"""The promote task through `.fn()`: the incumbent pointer moves only for a winner beyond noise."""

from __future__ import annotations

from prefect.logging import disable_run_logger

from ratchet.config import EvalConfig, NightlyConfig, StoreConfig
from ratchet.store import open_store
from ratchet.train.session import PolicyRef
from tasks.evaluate import INCUMBENT, promote


def _results(solved: int, n: int = 300) -> dict:
    return {"results": {f"t{i}": i < solved for i in range(n)}}


def test_promote_moves_the_incumbent_only_for_a_winner_beyond_noise(tmp_path):
    cfg = NightlyConfig(store=StoreConfig(uri=str(tmp_path)), eval=EvalConfig(min_gain=0.0))
    store = open_store(cfg.store)
    ckpt = store.put_json("runs/r/checkpoints/000003/MANIFEST.json", {"files": {}})
    policy = PolicyRef(run_id="r", version=3, checkpoint=ckpt, checkpoint_version=3)
    with disable_run_logger():
        tie = promote.fn(policy, _results(61), _results(60), cfg)      # one task more out of 300: noise
        assert tie["promoted"] is False and tie["checkpoint"] is None and tie["ci"][0] <= 0
        assert store.get_pointer(INCUMBENT) is None
        won = promote.fn(policy, _results(120), _results(60), cfg)     # +20 points, the 60 a subset
    assert won["promoted"] and won["checkpoint"] == ckpt.uri and won["ci"][0] > 0.1 and won["p_value"] < 1e-10
    assert store.get_pointer(INCUMBENT).uri == ckpt.uri
