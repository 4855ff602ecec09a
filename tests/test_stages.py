"""The stage functions the nightly tasks call: advantages with env_error and zero-variance groups."""

import math

import polars as pl

from ratchet.config import NightlyConfig, RLConfig, RolloutConfig
from ratchet.data.schemas import trajectories_frame
from ratchet.stages import advantages, train_samples


def _wave(rewards: dict[str, list[float | None]]) -> pl.DataFrame:
    rows = []
    for group, rs in rewards.items():
        for i, r in enumerate(rs):
            rows.append({"run_id": "r", "step": 0, "policy_version": 0, "task_id": f"t{group}", "family": "f",
                         "difficulty": 1, "group_id": group, "sample_idx": i, "prompt": "p", "completion": "c",
                         "prompt_tokens": 1, "completion_tokens": 1, "completion_ids": [5],
                         "behavior_logprobs": [-1.0], "reward": r, "env_error": r is None})
    return trajectories_frame(rows)


CFG = NightlyConfig(rollout=RolloutConfig(group_size=2), rl=RLConfig(estimator="grpo"))


def test_grpo_advantages_by_hand_and_excluded_groups():
    frame, stats = advantages(_wave({"a": [1.0, 0.0], "b": [0.5, 0.5], "c": [1.0, None]}), CFG)
    adv = dict(zip(zip(frame["group_id"], frame["sample_idx"]), frame["advantage"]))
    # group a: mean 0.5, sample std sqrt(0.5) = 0.7071 -> (1 - 0.5) / 0.7071 = +0.7071
    assert math.isclose(adv[("a", 0)], 0.5 / math.sqrt(0.5), rel_tol=1e-5)
    assert math.isclose(adv[("a", 1)], -0.5 / math.sqrt(0.5), rel_tol=1e-5)
    assert adv[("b", 0)] is None and adv[("b", 1)] is None      # zero variance: dropped
    assert adv[("c", 0)] is None and adv[("c", 1)] is None      # an env_error row: the whole group out
    assert stats == {"groups": 3, "groups_env_error": 1, "groups_zero_variance": 1}


def test_rloo_by_hand():
    cfg = NightlyConfig(rollout=RolloutConfig(group_size=2), rl=RLConfig(estimator="rloo"))
    frame, _ = advantages(_wave({"a": [1.0, 0.0]}), cfg)
    assert frame.sort("sample_idx")["advantage"].to_list() == [1.0, -1.0]   # r_i - mean of the others


def test_only_rows_with_an_advantage_are_trained_on():
    frame, _ = advantages(_wave({"a": [1.0, 0.0], "b": [0.5, 0.5], "c": [1.0, None]}), CFG)
    samples = train_samples(frame, lambda prompts: [[1, 2] for _ in prompts], "grpo")
    assert sorted(s.group for s in samples) == ["a", "a"]
    assert all(s.reward is not None for s in samples)
