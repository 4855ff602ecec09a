"""A whole nightly flow on an S3-protocol store over HTTP, through a 30 s outage of the server.

A moto S3 server of our own on loopback (moto keeps its objects in this process, so stopping
it and starting it again on the same port is an outage, not a wipe). When wave 1's trajectories
land in the store the server goes down for 30 s; every store call of the run waits it out
(retries with backoff within `store.retry_budget_s`), and the run completes with every wave
once, its checkpoint and summary in S3.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from ratchet.store import open_store
from tests.flows.test_nightly import tiny
from tests.store.test_outage import own_server  # noqa: F401  (the fixture)

OUTAGE_S = 30.0


@pytest.mark.slow
def test_a_nightly_on_s3_survives_a_30_s_outage_mid_wave(prefect_harness, own_server):  # noqa: F811
    from flows.nightly import nightly

    uri = f"s3://nightly-{uuid.uuid4().hex[:8]}/prod"
    cfg = tiny(uri, run_id="s3")
    assert cfg.store.retry_budget_s >= 4 * OUTAGE_S
    down: dict[str, float] = {}
    # created here, not in the thread: moto's create_bucket checks then inserts, so the watcher's and
    # the run's preflight creating one bucket at once could replace it, marker and all (StoreLost)
    watcher = open_store(uri)

    def outage():
        deadline = time.monotonic() + 600
        while not watcher.exists("runs/s3/waves/000001/trajectories.parquet"):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        down["at"] = time.monotonic()
        own_server.stop()
        time.sleep(OUTAGE_S)
        own_server.start()
        down["back"] = time.monotonic()

    chaos = threading.Thread(target=outage, daemon=True)
    chaos.start()
    t0 = time.monotonic()
    summary = nightly(cfg)
    t_end = time.monotonic()
    chaos.join(timeout=60)
    assert down.get("back"), "the outage never happened (the run did not reach wave 1?)"
    assert t0 < down["at"] and down["back"] < t_end            # the whole outage fell inside the run

    store = open_store(uri)
    assert summary["summary"].startswith(uri) and summary["policy_version"] == cfg.steps
    saved = store.get_json("runs/s3/summary.json")
    assert [w["step"] for w in saved["history"]] == list(range(cfg.steps))   # every wave once
    assert [a["outcome"] for a in saved["attempts"]] == ["completed"]
    for step in range(cfg.steps):
        assert store.read_table(f"runs/s3/waves/{step:06d}/trained.parquet").height > 0
    latest = store.get_pointer("runs/s3/checkpoints/LATEST")
    assert latest.uri.startswith(uri) and store.get_json(latest)["files"]["model.safetensors"]["size"] > 0
