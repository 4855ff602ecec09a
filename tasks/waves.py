"""Prefect tasks on a wave between rollout and training: score it, then gate it."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from envs.snapshot import load_specs
from ratchet import stages
from ratchet.config import NightlyConfig
from ratchet.data.gates import check_wave
from ratchet.reward import reward_bounds, score_frame
from ratchet.store import Ref, open_store


@task(retries=2, retry_delay_seconds=[1, 5], cache_policy=NO_CACHE)
def score_wave(wave: Ref, train: list[Ref], cfg: NightlyConfig) -> tuple[Ref, dict]:
    """Verify every completion in the sandbox, turn metrics into rewards and advantages."""
    specs = {s.task_id: s for r in train for s in load_specs(r)}
    store = open_store(cfg.store.uri)
    frame = stages.verify_frame(store.read_table(wave), specs, cfg)
    frame = score_frame(frame, {t: specs[t].reward_logic for t in frame["task_id"].unique()}, cfg.reward)
    frame, stats = stages.advantages(frame, cfg)
    stats.update(reward_mean=float(frame["reward"].mean() or 0.0),
                 env_error_rate=float(frame["env_error"].mean() or 0.0))
    return store.write_table(wave.sibling("scored.parquet"), frame), stats


@task(cache_policy=NO_CACHE)
def gate_wave(wave: Ref, train: list[Ref], cfg: NightlyConfig) -> Ref:
    """The wave's Great Expectations gate: a failure stops the flow before training; the wave
    stays in the store and the report is published as an artifact."""
    frame = open_store(cfg.store.uri).read_table(wave)
    logic = load_specs(train[0])[0].reward_logic
    report = check_wave(frame, cfg.gate, reward_bounds=reward_bounds(logic, cfg.reward),
                        max_tokens=cfg.model.max_seq_len, source=wave.uri)
    if not report.success:
        create_markdown_artifact(report.to_markdown(), key="gate-wave", description=f"gate failed: {wave.uri}")
        get_run_logger().error("gate failed for %s", wave.uri)
    report.raise_if_failed()
    return wave
