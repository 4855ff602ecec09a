"""The nightly cycle's stages as plain functions: what each Prefect task in `tasks/` calls.

Every function here takes frames, specs and configs and returns frames or plain values;
none touches Prefect or the store. Read a nightly run from
`flows/nightly.py` (the order), through `tasks/` (load, call one of these, save), to here.
"""

from __future__ import annotations

import polars as pl
import torch

from envs.registry import get_family
from envs.runtime import resolve
from envs.spec import TaskSpec
from ratchet.config import NightlyConfig
from ratchet.rl import TOKEN_LEVEL_ESTIMATORS, compute_advantages, zero_variance_groups
from ratchet.rollout.wave import pick_tasks, wave_frame
from ratchet.reward.verify import verify_many
from ratchet.sandbox import Limits
from ratchet.train.torch_trainer import TrainSample


def limits(cfg: NightlyConfig) -> Limits:
    return Limits(wall_s=cfg.verify.timeout_s, cpu_s=cfg.verify.timeout_s, memory_mb=cfg.verify.memory_mb)


def rollout(engine, tasks: list[TaskSpec], run_id: str, step: int, version: int, cfg: NightlyConfig) -> pl.DataFrame:
    """Sample one wave: `prompts_per_wave` tasks (by the family curriculum) x `group_size`."""
    family = get_family(tasks[0].family)
    specs = pick_tasks(tasks, cfg.rollout.prompts_per_wave, step, cfg.steps, family.curriculum, cfg.train.seed)
    rollouts = engine.generate(
        [s.prompt for s in specs], n=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature, batch_size=cfg.rollout.batch_size,
    )
    return wave_frame(run_id, step, version, specs, rollouts, cfg.rollout.group_size)


def verify_frame(frame: pl.DataFrame, specs_by_id: dict[str, TaskSpec], cfg: NightlyConfig) -> pl.DataFrame:
    """Fill `metrics`, `env_error`, `env_error_kind` by running every completion in the sandbox."""
    items = [(specs_by_id[t], c) for t, c in zip(frame["task_id"], frame["completion"])]
    results = verify_many(items, limits(cfg), cfg.verify.concurrency, cfg.verify.env_error_retries,
                          runtime_python=resolve)
    metrics = pl.Series("metrics", [r.metrics or None for r in results], dtype=frame.schema["metrics"])
    return frame.with_columns(
        metrics,
        pl.Series("env_error", [r.env_error for r in results], dtype=pl.Boolean),
        pl.Series("env_error_kind", [r.env_error_kind for r in results], dtype=pl.String),
    )


def advantages(frame: pl.DataFrame, cfg: NightlyConfig) -> tuple[pl.DataFrame, dict]:
    """Group advantages by the configured estimator. Groups with an env_error row, and (with
    dynamic sampling) groups whose rewards are all equal, get a null advantage: not trained on."""
    G = cfg.rollout.group_size
    frame = frame.sort(["group_id", "sample_idx"])
    broken = frame.group_by("group_id").agg(bad=pl.col("env_error").any() | (pl.len() != G))
    ok = frame.join(broken, on="group_id").filter(~pl.col("bad"))["group_id"].unique(maintain_order=True)
    sub = frame.filter(pl.col("group_id").is_in(ok.implode()))
    stats = {"groups": frame["group_id"].n_unique(), "groups_env_error": frame["group_id"].n_unique() - len(ok)}
    if sub.height == 0 or cfg.rl.estimator in TOKEN_LEVEL_ESTIMATORS:
        stats["groups_zero_variance"] = 0
        return frame.with_columns(pl.lit(None, pl.Float64).alias("advantage")), stats
    rewards = torch.tensor(sub["reward"].to_list(), dtype=torch.float64)            # [B*G]
    adv = compute_advantages(cfg.rl.estimator, rewards, G)                          # [B*G]
    if cfg.rl.drop_zero_variance:
        flat = zero_variance_groups(rewards, G).repeat_interleave(G)                # [B*G]
        adv = torch.where(flat, torch.full_like(adv, float("nan")), adv)
        stats["groups_zero_variance"] = int(flat.sum()) // G
    scored = sub.with_columns(pl.Series("advantage", adv.tolist(), dtype=pl.Float64).fill_nan(None))
    out = frame.drop("advantage").join(scored.select("group_id", "sample_idx", "advantage"),
                                       on=["group_id", "sample_idx"], how="left")
    return out.select(frame.columns), stats


def train_samples(frame: pl.DataFrame, encode_prompts, estimator: str) -> list[TrainSample]:
    """The rows a trainer learns from: scored, not env_error, with an advantage (token-level
    estimators such as GAE compute theirs in the trainer, from the reward)."""
    usable = frame.filter(~pl.col("env_error") & pl.col("reward").is_not_null())
    if estimator not in TOKEN_LEVEL_ESTIMATORS:
        usable = usable.filter(pl.col("advantage").is_not_null())
    if usable.height == 0:
        return []
    prompt_ids = encode_prompts(usable["prompt"].to_list())
    out = []
    for ids, row in zip(prompt_ids, usable.iter_rows(named=True)):
        adv = row["advantage"] if row["advantage"] is not None else 0.0
        out.append(TrainSample(ids, row["completion_ids"], row["behavior_logprobs"], adv, row["group_id"],
                               reward=row["reward"]))
    return out

