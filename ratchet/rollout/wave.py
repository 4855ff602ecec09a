"""A rollout wave: pick prompts (curriculum), sample groups, lay them out as trajectory rows.

    specs = pick_tasks(tasks, n=64, step=3, total=40, curriculum=family.curriculum, seed=0)
    rollouts = engine.generate([s.prompt for s in specs], n=8, ...)
    frame = wave_frame(run_id, step, version, specs, rollouts, group_size=8)
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import polars as pl

from envs.spec import TaskSpec
from ratchet.data.schemas import trajectories_frame
from ratchet.rollout.torch_engine import Rollout


def pick_tasks(tasks: Sequence[TaskSpec], n: int, step: int, total: int,
               curriculum: Callable[[int, int, int], list[float]] | None, seed: int) -> list[TaskSpec]:
    """`n` distinct tasks for wave `step`, difficulties weighted by the family's curriculum
    (`envs.sources.curriculum_for`: an imported set's weighs its declared difficulties)."""
    rng = random.Random(f"wave:{seed}:{step}")
    if curriculum is None or len(tasks) <= n:
        return rng.sample(list(tasks), min(n, len(tasks)))
    max_d = max(t.difficulty for t in tasks)
    weights = curriculum(step, total, max_d)
    by_d: dict[int, list[TaskSpec]] = {}
    for t in tasks:
        by_d.setdefault(t.difficulty, []).append(t)
    levels = sorted(by_d)
    weighted = [t for d in levels if weights[d - 1] > 0 for t in by_d[d]]
    if len(weighted) < n:   # the curriculum's levels hold fewer than n tasks (or none): all of them, the rest at random
        rest = [t for d in levels if weights[d - 1] <= 0 for t in by_d[d]]
        return weighted + rng.sample(rest, n - len(weighted))
    picked: dict[str, TaskSpec] = {}
    while len(picked) < n:
        d = rng.choices(levels, weights=[weights[d - 1] for d in levels])[0]
        t = rng.choice(by_d[d])
        picked.setdefault(t.task_id, t)
    return list(picked.values())


def group_id(step: int, spec: TaskSpec) -> str:
    """The GRPO group of a task's samples in wave `step`. Named by the task, not its place in the wave:
    a wave samples each of its sources apart (tasks/rollout.py), each numbering its prompts from 0, and
    task ids are distinct across sources (an imported set's carry its name), so groups never merge."""
    return f"{step}:{spec.task_id}"


def wave_frame(run_id: str, step: int, version: int, specs: Sequence[TaskSpec],
               rollouts: Sequence[Rollout], group_size: int) -> pl.DataFrame:
    """Trajectory rows (TRAJECTORY_SCHEMA), unscored; rollouts grouped by prompt, in order."""
    rows = []
    for i, r in enumerate(rollouts):
        spec = specs[r.prompt_index]
        rows.append({
            "run_id": run_id, "step": step, "policy_version": version,
            "task_id": spec.task_id, "family": spec.family, "difficulty": spec.difficulty,
            "group_id": group_id(step, spec), "sample_idx": i % group_size,
            "prompt": spec.prompt, "completion": r.text,
            "prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.completion_ids),
            "completion_ids": r.completion_ids, "behavior_logprobs": r.logprobs,
            "env_error": False,
        })
    return trajectories_frame(rows)

