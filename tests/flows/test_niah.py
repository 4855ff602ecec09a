"""The niah flow under prefect_test_harness: probes the promoted incumbent, publishes the table."""

from __future__ import annotations

import asyncio

import pytest

from envs.registry import get_family
from ratchet.config import ModelConfig, NiahConfig, StoreConfig
from ratchet.model import build_model, build_tokenizer, save_policy
from ratchet.store import open_store
from tasks.evaluate import INCUMBENT


def _artifacts() -> dict[str, str]:
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return {a.key: a.description for a in await client.read_artifacts()}
    return asyncio.run(read())


def test_niah_flow_probes_the_incumbent(prefect_harness, tmp_path):
    from flows.niah import niah

    store_cfg = StoreConfig(uri=str(tmp_path / "store"))
    probe = NiahConfig(lengths=(100,), depths=(0.0, 1.0), trials=1)
    with pytest.raises(ValueError, match="nothing is promoted yet"):
        niah(None, probe, store_cfg)
    fam = get_family("python_functions")
    specs = [fam.generate(fam.config(), 0, i, 1 + i % 3, "train") for i in range(40)]
    tok = build_tokenizer([s.prompt + s.reference_solution for s in specs], 256)
    save_policy(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, max_seq_len=128), tok), tok, tmp_path / "m")
    store = open_store(store_cfg)
    store.set_pointer(INCUMBENT, store.put_dir("runs/r/checkpoints/000001", tmp_path / "m"))
    out = niah(None, probe, store_cfg)
    assert out["limit"] == 128 and [c[:2] for c in out["cells"]] == [[0.0, 100], [1.0, 100]]
    assert out["model"].endswith("runs/r/checkpoints/000001/MANIFEST.json")
    published = {k: v for k, v in _artifacts().items() if k and k.startswith("niah-")}
    assert [k for k in published if k.endswith("runs-r-checkpoints-000001-manifest-json")], published
