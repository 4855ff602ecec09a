"""Prefect task between scoring and training: the wave's Great Expectations gate."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from envs.snapshot import load_specs
from ratchet.config import NightlyConfig
from ratchet.data.gates import check_wave
from ratchet.reward import reward_bounds
from ratchet.store import Ref, open_store


@task(cache_policy=NO_CACHE)
def gate_wave(wave: Ref, train: list[Ref], cfg: NightlyConfig) -> Ref:
    """A failure stops the flow before training; the wave stays in the store and the report is
    published as an artifact."""
    frame = open_store(cfg.store).read_table(wave)
    logic = load_specs(train[0])[0].reward_logic
    report = check_wave(frame, cfg.gate, reward_bounds=reward_bounds(logic, cfg.reward),
                        max_tokens=cfg.model.max_seq_len, source=wave.uri)
    if not report.success:
        create_markdown_artifact(report.to_markdown(), key="gate-wave", description=f"gate failed: {wave.uri}")
        get_run_logger().error("gate failed for %s", wave.uri)
    report.raise_if_failed()
    return wave
