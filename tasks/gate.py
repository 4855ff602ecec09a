"""Prefect tasks that stop a run: the wave's Great Expectations gate (between scoring and
training) and the health monitors (after each wave is recorded, before anything is promoted)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from envs.snapshot import load_specs
from ratchet import monitor, stages
from ratchet import summary as summaries
from ratchet.config import NightlyConfig
from ratchet.data.gates import check_wave
from ratchet.store import Ref, open_store
from tasks.retry import transient_only
from tasks.watch import publish


@task(cache_policy=NO_CACHE)
def gate_wave(wave: Ref, train: list[Ref], cfg: NightlyConfig) -> Ref:
    """A failure stops the flow before training; the wave stays in the store and the report is
    published as an artifact."""
    frame = open_store(cfg.store).read_table(wave)
    logic = load_specs(train[0])[0].reward_logic
    report = check_wave(frame, cfg.gate, reward_bounds=stages.reward_range(logic, cfg), max_tokens=cfg.model.max_seq_len,
                        source=wave.uri, signal=stages.learning_signal(frame, cfg))
    if not report.success:
        create_markdown_artifact(report.to_markdown(), key="gate-wave", description=f"gate failed: {wave.uri}")
        get_run_logger().error("gate failed for %s", wave.uri)
    report.raise_if_failed()
    return wave


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def check_health(run_id: str, step: int, cfg: NightlyConfig) -> None:
    """The health monitors (`ratchet.monitor`) over the run's recorded waves up to `step`. A tripped
    one is written into the wave's stats.json (`alarms`) and the run's summary.json (`health`),
    published as an artifact beside the curves up to the wave, and raised: `HealthCheckFailed`
    stops the run before promotion."""
    if not cfg.monitor.enabled:
        return
    store = open_store(cfg.store)
    history = summaries.history(store, run_id, step + 1)
    if not history or history[-1]["step"] != step:
        raise RuntimeError(f"check_health: wave {step} of run {run_id} is not recorded (record_wave first)")
    alarms = monitor.check_health(history, cfg.monitor)
    if not alarms:
        return
    failed = monitor.HealthCheckFailed(alarms)
    found = [a.to_dict() for a in alarms]
    summaries.record_wave(store, run_id, step, {**history[-1], "alarms": found})
    summaries.write_summary(store, run_id, {   # waves up to this one: an earlier attempt may have recorded later ones
        "run_id": run_id, "steps": cfg.steps, "policy_version": step + 1, "promoted": False,
        "promotion": f"not evaluated: the run stopped at wave {step}: {failed}", "health": found,
        "config": cfg.model_dump(mode="json")}, step + 1)
    publish(store, run_id, step + 1, cfg)     # the curves up to the stop (watch.every may be 0: only at the end)
    create_markdown_artifact("\n".join([f"# Health check failed: run {run_id}, wave {step}", "",
                                         *[f"- **{a.monitor}** {a.message()}" for a in alarms]]),
                             key="health-check", description=f"run {run_id} stopped at wave {step}")
    get_run_logger().error("run %s stopped at wave %d: %s", run_id, step, failed)
    raise failed
