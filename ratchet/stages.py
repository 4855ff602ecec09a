"""The nightly cycle's stages as plain functions: what each Prefect task in `tasks/` calls.

Every function here takes frames, specs and configs and returns frames or plain values;
none touches Prefect or the store. Read a nightly run from `flows/nightly.py` (the order),
through `tasks/` (load, call one of these, save), to here.
"""

from __future__ import annotations

import polars as pl
import torch

from envs.sources import curriculum_for
from envs.spec import RewardLogic, TaskSpec
from ratchet.config import NightlyConfig
from ratchet.data.schemas import FEEDBACK
from ratchet.reward.composite import most_overlong, reward_bounds
from ratchet.reward.frame import turn_states
from ratchet.rl import answer_count, turn_advantages
from ratchet.rollout.engine import naming_tasks
from ratchet.rollout.wave import pick_tasks, wave_frame
from ratchet.scale import executor_for
from ratchet.train.batching import TrainSample, loss_mask_of
from ratchet.verify import passed, verify_many


def rollout(engine, tasks: list[TaskSpec], run_id: str, step: int, version: int, cfg: NightlyConfig,
            executor=None) -> pl.DataFrame:
    """Sample one wave: `prompts_per_wave` tasks (by the family curriculum; an imported set's: by
    declared difficulty) x `group_size`. The tasks and the samples are a function of (weights,
    train.seed, step) alone, so a wave redone after a resume from the same checkpoint draws the same
    completions. No tasks (an imported set that is all held out): no rows.

    `agent.turns` of 2 or more: each sample is an episode (`ratchet.agent.run_episodes`): answer, the
    sandbox's feedback as an observation, revise, up to `agent.turns` answers; every answer is verified
    here, on `executor`, so the rows come back verified (scoring only rewards them)."""
    if not tasks:
        return wave_frame(run_id, step, version, [], [], cfg.rollout.group_size)
    curriculum = curriculum_for(tasks[0].family)
    specs = pick_tasks(tasks, cfg.rollout.prompts_per_wave, step, cfg.steps, curriculum, cfg.train.seed)
    sampling = dict(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                    batch_size=cfg.rollout.batch_size, seed=wave_seed(cfg.train.seed, step))
    if cfg.agent.turns > 1:
        from ratchet.agent import episode_frame, run_episodes

        results = run_episodes(engine, specs, cfg.rollout.group_size, cfg.agent, cfg.verify, greedy=False,
                               branch=cfg.agent.branch, executor=executor or executor_for(cfg.verify), **sampling)
        return episode_frame(run_id, step, version, specs, results, cfg.rollout.group_size)
    with naming_tasks([s.task_id for s in specs]):
        rollouts = engine.generate([s.prompt for s in specs], n=cfg.rollout.group_size, **sampling)
    return wave_frame(run_id, step, version, specs, rollouts, cfg.rollout.group_size)


def wave_seed(seed: int, step: int) -> int:
    """The sampling seed of wave `step`: distinct per wave, the same on every machine and attempt."""
    return (seed * 1_000_003 + step) % 2**63


def verify_frame(frame: pl.DataFrame, specs_by_id: dict[str, TaskSpec], cfg: NightlyConfig,
                 executor=None) -> pl.DataFrame:
    """Fill `metrics`, `env_error`, `env_error_kind` and `feedback` (what the sandbox said: output
    tails, failed tests; `ratchet trace` shows it) by running every completion in the sandbox.
    Rows verified already (multi-turn episodes: verified turn by turn while sampled) keep theirs.
    `executor`: where (`ratchet.scale.executor_for(cfg.verify)`, made here if None); pass one to
    read its `stats` afterwards (sandbox runs launched, reaped, orphaned; nodes)."""
    todo = (frame["metrics"].is_null() & ~frame["env_error"]).to_list()
    items = [(specs_by_id[t], c) for t, c, n in zip(frame["task_id"], frame["completion"], todo) if n]
    found = iter(verify_many(items, cfg.verify.sandbox_limits(), cfg.verify.concurrency, cfg.verify.env_error_retries,
                             feedback_bytes=cfg.verify.feedback_bytes, executor=executor or executor_for(cfg.verify)))
    results = [next(found) if n else None for n in todo]
    keep = frame.select("metrics", "env_error", "env_error_kind", "feedback").rows()
    merged = [(r.metrics or None, r.env_error, r.env_error_kind, r.feedback) if r is not None else old
              for r, old in zip(results, keep)]
    metrics, env_error, kind, feedback = map(list, zip(*merged)) if merged else ([], [], [], [])
    return frame.with_columns(
        pl.Series("metrics", metrics, dtype=frame.schema["metrics"]),
        pl.Series("env_error", env_error, dtype=pl.Boolean),
        pl.Series("env_error_kind", kind, dtype=pl.String),
        pl.Series("feedback", feedback, dtype=FEEDBACK),
    )


def rollout_stats(frame: pl.DataFrame, wall_s: float) -> dict:
    """How fast a wave was sampled: sampled tokens (the model's own: a multi-turn episode's observation
    tokens are not sampled) per second of the rollout's wall time, and how many."""
    tokens = sampled_tokens(frame)
    return {"rollout_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0, "rollout_s": wall_s,
            "sampled_tokens": tokens}


def sampled_tokens(frame: pl.DataFrame) -> int:
    """Tokens the policy sampled in a wave: completion tokens, less observation tokens (loss_mask 0) and
    the copies of a shared first answer (`agent.branch`: sampled once, by another row of the group)."""
    return _sampled(frame)[0]


def _sampled(frame: pl.DataFrame) -> tuple[int, float]:
    """`sampled_tokens`, and their behaviour log-probs summed (observation tokens' are 0.0). The copies of
    a shared first answer (`turns[0].shared`) are left out of both; a wave written before agent.branch
    has none."""
    masked = frame["loss_mask"].list.sum().fill_null(frame["completion_tokens"].cast(pl.Int64))
    tokens, logprobs = int(masked.sum() or 0), float(frame["behavior_logprobs"].list.sum().sum() or 0.0)
    if "shared" not in {f.name for f in frame.schema["turns"].inner.fields}:
        return tokens, logprobs
    first = pl.col("turns").list.first().struct
    n = pl.when(first.field("shared").fill_null(False)).then(first.field("action_tokens")).otherwise(0)
    copied = frame.select(tokens=n.sum(), logprobs=pl.col("behavior_logprobs").list.head(n).list.sum().sum()).row(0)
    return tokens - int(copied[0] or 0), logprobs - float(copied[1] or 0.0)


def sandbox_stats(frame: pl.DataFrame) -> dict:
    """Wall time of the wave's verification runs, p50 and p95 in ms: each distinct (task, completion)
    that ran once (not an empty completion, which is not run, nor an env_error, which has no metrics)."""
    ran = (frame.filter(pl.col("metrics").is_not_null() & ~pl.col("env_error"))
           .unique(["task_id", "completion"])
           .select(ms=pl.col("metrics").struct.field("execution_time_ms"))
           .filter(pl.col("ms") > 0)["ms"])
    if ran.len() == 0:
        return {"sandbox_p50_ms": 0.0, "sandbox_p95_ms": 0.0}
    return {"sandbox_p50_ms": float(ran.quantile(0.5, "linear")), "sandbox_p95_ms": float(ran.quantile(0.95, "linear"))}


def staleness(frame: pl.DataFrame, version: int) -> int:
    """How many policy versions the trainer (at `version`) is ahead of the oldest behaviour policy
    that sampled the wave: 0 when each wave is sampled by the weights that then train on it."""
    return version - int(frame["policy_version"].min())


def _complete_groups(frame: pl.DataFrame, group_size: int) -> pl.Series:
    """Groups whose every one of `group_size` rows was verified and scored (no env_error)."""
    ok = frame.group_by("group_id", maintain_order=True).agg(
        good=~pl.col("env_error").any() & pl.col("reward").is_not_null().all() & (pl.len() == group_size))
    return ok.filter(pl.col("good"))["group_id"]


def reward_range(logic: RewardLogic, cfg: NightlyConfig) -> tuple[float, float]:
    """(low, high) every reward of a wave scored with `cfg` lies in (the wave gate's bounds): the reward
    logic's (`reward_bounds`, the overlong penalty included), widened by the agent's shaping: a repeat's
    `repeat_reward` (less the overlong penalty, which a long repeat pays too) and `turn_penalty` per turn
    after the first."""
    low, high = reward_bounds(logic, cfg.reward)
    if cfg.agent.repeat_reward is not None:
        low, high = min(low, cfg.agent.repeat_reward - most_overlong(cfg.reward)), max(high, cfg.agent.repeat_reward)
    return low - cfg.agent.turn_penalty * (cfg.agent.turns - 1), high


def learning_signal(frame: pl.DataFrame, cfg: NightlyConfig) -> pl.Series:
    """Per row, what the trainer's zero-variance rule compares within a group (`rl.drop_zero_variance`),
    equal on every row of a group that gives it nothing to learn: the reward, or with per-turn credit
    the advantage of each of the row's turns (`turn_advantages` over its group, as the trainer computes
    them): a group whose episodes all end on one reward but reach it at different turns still trains,
    and one whose turn states differ only where nothing is compared (after an episode's last answer, a
    lone revision, across `agent.branch` tuples) does not. A group that an env_error leaves incomplete,
    which the trainer never sees, by its episodes' turn states (`turn_states`). Null where no reward."""
    if not (cfg.agent.turns > 1 and cfg.agent.credit == "turn"):
        return frame["reward"].alias("signal")
    turns = frame["turns"].to_list()
    signal = [None if r is None or not ts else turn_states(ts, cfg.agent.turns, cfg.agent.turn_penalty)
              for r, ts in zip(frame["reward"], turns)]
    size = cfg.rollout.group_size
    complete = frame.with_row_index("_row").filter(pl.col("group_id").is_in(_complete_groups(frame, size).implode()))
    for rows in complete.group_by("group_id", maintain_order=True).agg("_row")["_row"].to_list():
        if any(signal[i] is None for i in rows):   # a row without turns: the trainer refuses the wave by name
            continue
        adv = turn_advantages(cfg.rl.estimator, torch.tensor([signal[i] for i in rows]), size,
                              torch.tensor([len(turns[i]) for i in rows]), cfg.agent.branch)  # [G, K]
        for i, a in zip(rows, adv.tolist()):
            signal[i] = a
    return pl.Series("signal", signal, dtype=pl.List(pl.Float64))


def group_stats(frame: pl.DataFrame, cfg: NightlyConfig) -> dict:
    """How many groups a scored wave has, how many an env_error (or a missing row) excludes, and
    how many of the rest give the trainer nothing to learn from (`learning_signal` all equal)."""
    complete = frame.with_columns(learning_signal(frame, cfg)).filter(
        pl.col("group_id").is_in(_complete_groups(frame, cfg.rollout.group_size).implode()))
    equal = complete.group_by("group_id").agg(pl.col("signal").n_unique() == 1)["signal"].sum()
    groups = frame["group_id"].n_unique()
    return {"groups": groups, "groups_env_error": groups - complete["group_id"].n_unique(),
            "groups_zero_variance": int(equal or 0)}


def wave_stats(frame: pl.DataFrame, cfg: NightlyConfig) -> dict:
    """A scored wave's figures, as the health monitors (`ratchet.monitor`) read them: `group_stats`,
    and reward mean/std and pass rate over the verified rows, `zero_variance_frac` (of the whole
    groups), `env_error_rate` (of all rows), `completion_tokens_mean` (sampled tokens per row), and
    `sampled_entropy`: the sampling policy's entropy in nats per token, estimated over every sampled
    token of the wave as the mean of -log pi_behav(token) (E_x~p[-log p(x)] = H(p); no extra forward
    pass; an observation token's log-prob is 0 and is not counted, nor is a copy of a shared first
    answer). Multi-turn waves add the episode figures (`ratchet.agent.episode_metrics`: pass rate
    after each turn, fix rate, repeat rate, turns per episode)."""
    stats = group_stats(frame, cfg)
    verified = frame.filter(~pl.col("env_error"))
    judged = stats["groups"] - stats["groups_env_error"]
    tokens = sampled_tokens(frame)
    stats.update(
        reward_mean=float(frame["reward"].mean() or 0.0),
        reward_std=float(verified["reward"].std() or 0.0),
        pass_rate=sum(passed(m) for m in verified["metrics"]) / verified.height if verified.height else 0.0,
        zero_variance_frac=stats["groups_zero_variance"] / judged if judged else 0.0,
        env_error_rate=float(frame["env_error"].mean() or 0.0),
        completion_tokens_mean=tokens / frame.height if frame.height else 0.0,
    )
    with_logprobs = frame.filter(pl.col("behavior_logprobs").is_not_null())
    sampled, logprobs = _sampled(with_logprobs)
    if sampled:
        stats["sampled_entropy"] = -logprobs / sampled
    if cfg.agent.turns > 1:
        from ratchet.agent import episode_metrics

        figures = episode_metrics(frame["turns"].to_list(), cfg.agent.turns)
        stats.update({k: v for k, v in figures.items() if k != "ends"},
                     **{f"episodes_ended_{k}": v for k, v in figures["ends"].items()})
    return stats


def train_samples(frame: pl.DataFrame, encode_prompts, cfg: NightlyConfig) -> list[TrainSample]:
    """The rows a trainer may learn from: whole groups, every row verified and scored. Their
    advantages are set by `Trainer.assign_advantages` (which also drops zero-variance groups).
    Multi-turn episodes with `agent.credit` "turn" carry the value of their state after each turn
    (`turn_rewards`), from which the trainer credits each answer on its own."""
    indexed = frame.with_row_index("_row")
    usable = indexed.filter(pl.col("group_id").is_in(_complete_groups(frame, cfg.rollout.group_size).implode()))
    if usable.height == 0:
        return []
    prompt_ids = encode_prompts(usable["prompt"].to_list())
    per_turn = cfg.agent.turns > 1 and cfg.agent.credit == "turn"
    return [_sample(ids, row, cfg, per_turn) for ids, row in zip(prompt_ids, usable.iter_rows(named=True))]


def _sample(prompt_ids: list[int], row: dict, cfg: NightlyConfig, per_turn: bool) -> TrainSample:
    """One row's TrainSample; with per-turn credit, its state values after each turn (`turn_states`),
    once its loss mask is seen to hold one run of action tokens per turn: the trainer finds answer k
    as the k-th run (`loss_mask_of` checks the mask itself)."""
    s = TrainSample(prompt_ids, row["completion_ids"], row["behavior_logprobs"], None, row["group_id"],
                    reward=row["reward"], row=row["_row"], loss_mask=row.get("loss_mask"), branch=cfg.agent.branch)
    if not (per_turn and row["turns"]):
        return s
    turns = len(row["turns"])
    where = f"wave row {s.row} (group {s.group!r}): {turns} turn(s)"
    if s.loss_mask is None and turns > 1:
        raise ValueError(f"{where} but no loss_mask, so per-turn credit cannot find its answers")
    answers = 1 if s.loss_mask is None else answer_count(loss_mask_of(s))
    if answers != turns:
        raise ValueError(f"{where} but its loss_mask holds {answers} run(s) of action tokens, so per-turn credit "
                         f"cannot tell its answers apart" + (" (an observation of no tokens runs two answers together)"
                                                             if answers < turns else ""))
    s.turn_rewards = turn_states(row["turns"], cfg.agent.turns, cfg.agent.turn_penalty)
    return s


def with_advantages(frame: pl.DataFrame, samples: list[TrainSample]) -> pl.DataFrame:
    """`frame` with the advantages the trainer will use: `advantage` (group estimators) and
    `token_advantages` (GAE; per-turn credit) of the trained rows; null on rows that are not trained on."""
    adv: list[float | None] = [None] * frame.height
    tokens: list[list[float] | None] = [None] * frame.height
    for s in samples:
        adv[s.row], tokens[s.row] = s.advantage, s.token_advantages
    return frame.with_columns(pl.Series("advantage", adv, dtype=pl.Float64),
                              pl.Series("token_advantages", tokens, dtype=pl.List(pl.Float64)))
