"""Prefect task between rollout and the gate: verify a wave in the sandbox and score it."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from envs.snapshot import load_specs
from ratchet import stages, trace
from ratchet.config import NightlyConfig
from ratchet.reward import score_frame
from ratchet.scale import executor_for
from ratchet.store import Ref, open_store
from tasks.retry import transient_only


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def score_wave(wave: Ref, train: list[Ref], cfg: NightlyConfig) -> tuple[Ref, dict]:
    """Verify every completion in the sandbox and turn its metrics into a reward (advantages
    are the training stage's: they are computed once, by the trainer, and stored there)."""
    specs = {s.task_id: s for r in train for s in load_specs(r)}
    store = open_store(cfg.store)
    store.put_json(wave.sibling(trace.SCORING), trace.scoring_record(train, cfg))   # what `ratchet trace replay` needs
    executor = executor_for(cfg.verify)       # this process, or Ray tasks over a cluster (verify.executor)
    frame = stages.verify_frame(store.read_table(wave), specs, cfg, executor)
    frame = score_frame(frame, {t: specs[t].reward_logic for t in frame["task_id"].unique()}, cfg.reward,
                        turn_penalty=cfg.agent.turn_penalty, repeat_reward=cfg.agent.repeat_reward,
                        cap=cfg.rollout.max_new_tokens)
    stats = {**stages.wave_stats(frame, cfg), **stages.sandbox_stats(frame)}   # ratchet.monitor reads the first
    stats.update(executor.stats)               # sandbox runs launched / reaped / orphaned, nodes used
    return trace.write_wave_table(store, wave.sibling("scored.parquet"), frame), stats
