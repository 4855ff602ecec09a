"""The promote task through `.fn()`: the incumbent pointer moves only for a winner."""

from __future__ import annotations

from prefect.logging import disable_run_logger

from ratchet.config import EvalConfig, NightlyConfig, StoreConfig
from ratchet.store import open_store
from ratchet.train.session import PolicyRef
from tasks.evaluate import INCUMBENT, promote


def test_promote_moves_the_incumbent_only_for_a_winner(tmp_path):
    cfg = NightlyConfig(store=StoreConfig(uri=str(tmp_path)), eval=EvalConfig(min_gain=0.05))
    store = open_store(cfg.store.uri)
    ckpt = store.put_json("runs/r/checkpoints/000003/MANIFEST.json", {"files": {}})
    policy = PolicyRef(run_id="r", version=3, checkpoint=ckpt, checkpoint_version=3)
    with disable_run_logger():
        lost = promote.fn(policy, candidate=0.24, incumbent=0.20, cfg=cfg)      # +0.04 < min_gain 0.05
        assert lost == {"promoted": False, "reason": lost["reason"], "checkpoint": None}
        assert store.get_pointer(INCUMBENT) is None
        won = promote.fn(policy, candidate=0.26, incumbent=0.20, cfg=cfg)
    assert won["promoted"] and won["checkpoint"] == ckpt.uri
    assert store.get_pointer(INCUMBENT).uri == ckpt.uri
