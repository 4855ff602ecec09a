"""Prefect task: the needle-in-a-haystack probe of a checkpoint, published as a markdown artifact."""

from __future__ import annotations

import re
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from ratchet.config import NiahConfig, StoreConfig
from ratchet.eval.niah import probe
from ratchet.model import load_policy
from ratchet.scratch import scratch_dir
from ratchet.store import open_store
from tasks.evaluate import INCUMBENT
from tasks.retry import transient_only


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def probe_niah(model: str | None, cfg: NiahConfig, store: StoreConfig) -> dict:
    """Recall by depth x length of `model`: a local Hugging Face directory, a checkpoint's key in the
    store (runs/<id>/checkpoints/<version>), or None for the promoted incumbent."""
    with scratch_dir("niah") as tmp:
        if model is not None and Path(model).is_dir():
            where = model
        else:
            ref = open_store(store).get_pointer(INCUMBENT) if model is None else model
            if ref is None:
                raise ValueError(f"no model to probe: nothing is promoted yet ({INCUMBENT} in {store.uri})")
            where = open_store(store).get_dir(ref, Path(tmp))
            model = getattr(ref, "uri", ref)
        policy, tokenizer = load_policy(where)
        result = probe(policy, tokenizer, cfg)
    get_run_logger().info("needle in a haystack, %s:\n%s", model, result.text())
    create_markdown_artifact(
        f"# Needle in a haystack: {model}\n\nRecall of the key by depth (rows) and prompt length in tokens "
        f"(columns; `*` past the model's {result.limit} positions), {cfg.trials} trials per cell.\n\n{result.markdown()}",
        key="niah-" + re.sub(r"[^a-z0-9-]+", "-", str(model).lower())[-90:].strip("-"),
        description=f"Needle-in-a-haystack recall of {model}")
    return {"model": str(model), **result.summary()}
