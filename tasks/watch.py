"""Prefect tasks for watching a run: each wave's scalars to TensorBoard, and the curves with the
per-wave table as a markdown artifact on the flow run's page every `watch.every` waves and at the end."""

from __future__ import annotations

import re

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from ratchet import summary as summaries
from ratchet import watch
from ratchet.config import NightlyConfig
from ratchet.store import ArtifactStore, open_store
from tasks.retry import transient_only


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def watch_wave(run_id: str, step: int, stats: dict, cfg: NightlyConfig) -> None:
    """runs/<run_id>/tensorboard/: the wave's scalars; every `watch.every` waves, the curves and table."""
    store = open_store(cfg.store)
    if cfg.watch.tensorboard:
        watch.write_tensorboard(store, run_id, step, stats)
    if cfg.watch.every and (step + 1) % cfg.watch.every == 0 and step + 1 < cfg.steps:
        publish(store, run_id, step + 1, cfg)


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def publish_curves(run_id: str, cfg: NightlyConfig) -> dict[str, str]:
    """At the end of training: the whole run's curves and table (store URIs by name)."""
    return publish(open_store(cfg.store), run_id, cfg.steps, cfg)


def publish(store: ArtifactStore, run_id: str, upto: int, cfg: NightlyConfig) -> dict[str, str]:
    """Waves 0 to upto - 1: the curves and table as an artifact, drawn into the store (URIs by name)."""
    view = watch.render(store, run_id, summaries.history(store, run_id, upto), cfg.watch.plots)
    create_markdown_artifact(watch.report_markdown(run_id, view),
                             key=re.sub(r"[^a-z0-9-]+", "-", f"curves-{run_id.lower()}")[:100],
                             description=f"Per-wave scalars of run {run_id}, waves 0-{upto - 1}")
    return {name: ref.uri for name, ref in view.refs.items()}
