"""Rewards for a whole wave (a TRAJECTORY_SCHEMA frame).

    scored = score_frame(wave, {s.task_id: s.reward_logic for s in specs}, cfg.reward)
    scored = score_frame(wave, logic, cfg.reward, turn_penalty=cfg.agent.turn_penalty,   # multi-turn episodes
                         repeat_reward=cfg.agent.repeat_reward, cap=cfg.rollout.max_new_tokens)

A multi-turn episode's reward is its final state's: the last answer's metrics, as a single-turn
row's (`turn_penalty` > 0 subtracts that much per turn after the first: solving sooner is worth
more). Each turn in `turns` gets the reward its own answer would have had, for reading a run,
and for per-turn credit (`turn_states`: the value of the episode's state after each turn);
with `repeat_reward` set, a revision that repeats the failed answer before it gets that reward
instead (`envs.episode.repeats`), and so does the episode when its last answer is one.

Length: with `cfg.overlong_buffer` on, every answer's reward (a single-turn row's, each turn's,
and the episode's, by its last answer) loses `composite.overlong_penalty` of its own sampled
tokens against `cap` (rollout.max_new_tokens), after the shaping above (a repeat pays it too):
an answer that runs to the cap stops paying. With `agent.credit` "trajectory" only the episode's
reward trains, so only the last answer's length counts; with "turn" every answer's does.

Reward noise: a row whose verification failed for infrastructure reasons (`env_error`) keeps
`reward` null, never 0, so it is excluded from advantages instead of punishing the model.
"""

from __future__ import annotations

import polars as pl

from envs.episode import repeats
from envs.spec import RewardLogic, validate_logic
from ratchet.config import RewardConfig
from ratchet.reward.composite import overlong_penalty, score


def row_reward(row: dict, logic: RewardLogic, cfg: RewardConfig) -> float | None:
    """One row's reward: null for env_error or unverified rows; an empty completion never scores > 0."""
    if row.get("env_error") or row.get("metrics") is None:
        return None
    r = score(row["metrics"], logic, cfg)
    if not (row.get("completion") or "").strip():
        r = min(r, 0.0)
    return r


def score_frame(frame: pl.DataFrame, logic_by_task: dict[str, RewardLogic], cfg: RewardConfig,
                turn_penalty: float = 0.0, repeat_reward: float | None = None, cap: int | None = None) -> pl.DataFrame:
    """`frame` with `reward` filled from `metrics` by each row's task's reward logic (other columns
    unchanged); rows of multi-turn episodes also get each turn's reward in `turns`. `cap`: the
    length cap the answers were sampled under, needed when cfg.overlong_buffer is on."""
    if cfg.overlong_buffer > (cap or 0):
        raise ValueError(f"score_frame: reward.overlong_buffer {cfg.overlong_buffer} needs the length cap the answers "
                         f"were sampled under, at least as long (cap={cap}: rollout.max_new_tokens)")
    missing = sorted(set(frame["task_id"].unique().to_list()) - set(logic_by_task))
    if missing:
        raise KeyError(f"score_frame: no reward_logic for task(s) {missing[:10]}"
                       + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))
    for task_id in set(frame["task_id"].unique().to_list()):
        try:
            validate_logic(logic_by_task[task_id])
        except ValueError as e:
            raise ValueError(f"task {task_id!r}: {e}") from e
    rows = frame.select("task_id", "completion", "completion_tokens", "metrics", "env_error", "turns").to_dicts()
    plain = [row_reward(r, logic_by_task[r["task_id"]], cfg) for r in rows]
    episodic = [r for r in rows if r["turns"] and r["turns"][0]["metrics"] is not None]
    if not episodic:
        rewards = [final_reward(p, r, cap, cfg) for p, r in zip(plain, rows)]
        return frame.with_columns(pl.Series("reward", rewards, dtype=pl.Float64))
    rewards, turns = [], []
    for p, r in zip(plain, rows):
        for k, t in enumerate(r["turns"] or []):
            own = row_reward({"metrics": t["metrics"], "completion": t["action"], "env_error": t["env_error"]},
                             logic_by_task[r["task_id"]], cfg)
            t["reward"] = less_overlong(_unless_repeated(own, r["turns"], k, repeat_reward), t["action_tokens"], cap, cfg)
        rewards.append(final_reward(p, r, cap, cfg, turn_penalty, repeat_reward))
        turns.append(r["turns"])
    return frame.with_columns(pl.Series("reward", rewards, dtype=pl.Float64),
                              pl.Series("turns", turns, dtype=frame.schema["turns"]))


def final_reward(plain: float | None, row: dict, cap: int | None, cfg: RewardConfig, turn_penalty: float = 0.0,
                 repeat_reward: float | None = None) -> float | None:
    """A trajectory row's reward from its last answer's `row_reward` (`plain`; None stays None): the
    agent's shaping over its `turns` (`episode_reward`), then the overlong penalty of its last answer
    (`row`: `turns`, `completion_tokens`), after the shaping, so that a repeat does not escape it.
    score_frame and `ratchet trace replay` both end here."""
    shaped = episode_reward(plain, row["turns"], turn_penalty, repeat_reward) if row.get("turns") else plain
    return less_overlong(shaped, last_answer_tokens(row), cap, cfg)


def last_answer_tokens(row: dict) -> int:
    """The sampled tokens of a trajectory row's last answer: its last turn's `action_tokens` (a
    single-turn row's one turn has its `completion_tokens`), or `completion_tokens` where `turns` is null."""
    return row["turns"][-1]["action_tokens"] if row.get("turns") else row["completion_tokens"]


def less_overlong(reward: float | None, tokens: int, cap: int | None, cfg: RewardConfig) -> float | None:
    """`reward` less the overlong penalty of an answer of `tokens` sampled tokens (module docstring);
    None (env_error) stays None; unchanged with the buffer off or no cap."""
    if reward is None or cap is None:
        return reward
    return reward - overlong_penalty(tokens, cap, cfg)


def episode_reward(final: float | None, turns: list[dict], turn_penalty: float = 0.0,
                   repeat_reward: float | None = None) -> float | None:
    """A multi-turn episode's reward from its last answer's (`row_reward`; None stays None) and its
    turns (`action`, `passed`): `repeat_reward` in its place when the last answer repeats the failed
    one before it, less `turn_penalty` per turn after the first."""
    final = _unless_repeated(final, turns, len(turns) - 1, repeat_reward)
    return None if final is None else final - turn_penalty * (len(turns) - 1)


def _unless_repeated(reward: float | None, turns: list[dict], k: int, repeat_reward: float | None) -> float | None:
    """Answer k's (0-based) reward, or `repeat_reward` when it is set and the answer repeats the failed
    answer before it (an empty one, as in `row_reward`, never above 0); None (env_error) stays None."""
    if reward is None or repeat_reward is None or k == 0:
        return reward
    before, action = turns[k - 1], turns[k]["action"]
    if before["passed"] or not repeats(action, before["action"]):
        return reward
    return repeat_reward if action.strip() else min(repeat_reward, 0.0)


def turn_states(turns: list[dict], max_turns: int, turn_penalty: float = 0.0) -> list[float]:
    """The value of a scored episode's state after turn k, k = 1..max_turns (per-turn credit,
    `AgentConfig.credit` "turn"): the reward of its latest answer so far less `turn_penalty` per turn
    taken after the first; after its last turn it keeps its final state, whose value is the episode's
    reward (`score_frame`'s)."""
    if not turns or len(turns) > max_turns:
        raise ValueError(f"turn_states: an episode needs 1..{max_turns} turns, got {len(turns)}")
    if any(t.get("reward") is None for t in turns):
        raise ValueError("turn_states: every turn needs its reward (score the frame first; env_error episodes are not trained on)")
    return [turns[j]["reward"] - turn_penalty * j for j in (min(k, len(turns)) - 1 for k in range(1, max_turns + 1))]
