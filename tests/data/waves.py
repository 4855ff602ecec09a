"""Builders of small trajectory and task tables for the data tests."""

from __future__ import annotations

from typing import Any

import polars as pl

from envs.spec import CallTest, CheckCalls, TaskSpec
from ratchet.data import tasks_frame, trajectories_frame


def traj_row(group: int, idx: int, reward: float | None, **kw: Any) -> dict[str, Any]:
    """One verified, scored trajectory; kw overrides any column."""
    env_error = kw.get("env_error", False)
    row = dict(
        run_id="run0", step=3, policy_version=2, task_id=f"task{group}", family="python_functions",
        difficulty=1 + group % 3, group_id=f"g{group}", sample_idx=idx, prompt=f"Write f{group}.",
        completion=f"def f{group}(x):\n    return x + {idx}\n", prompt_tokens=20, completion_tokens=6,
        completion_ids=[5, 6, 7, 8, 9, 2], behavior_logprobs=[-0.5, -0.25, -1.0, -0.125, -2.0, -0.0625],
        metrics=None if env_error else dict(
            test_pass_rate=reward, tests_passed=int(4 * (reward or 0)), tests_total=4, syntax_ok=True,
            execution_time_ms=12.5, peak_memory_mb=9.0, timed_out=False, format_ok=True, output_bytes=0,
            security_flags=[]),
        reward=None if env_error else reward, env_error=False, env_error_kind=None, advantage=None,
    )
    row.update(kw)
    return row


def clean_rows(groups: int = 8, size: int = 4) -> list[dict[str, Any]]:
    """A healthy wave: rewards vary inside every group, no env_errors."""
    return [traj_row(g, i, [0.0, 0.25, 1.0, 0.5][(g + i) % 4]) for g in range(groups) for i in range(size)]


def clean_wave(**kw) -> pl.DataFrame:
    return trajectories_frame(clean_rows(**kw))


def spec(i: int, **kw: Any) -> TaskSpec:
    fields = dict(task_id=f"python_functions/{i}", family="python_functions", difficulty=1 + i % 3,
                  prompt=f"Write a function f{i}(x) that returns x + {i}.",
                  execution_steps=(CheckCalls(entry_point=f"f{i}"),), tests=(CallTest(args="[1]", expected=str(1 + i)),),
                  reference_solution=f"def f{i}(x):\n    return x + {i}\n")
    fields.update(kw)
    return TaskSpec(**fields)


def task_table(n: int = 6, audited: bool = False) -> pl.DataFrame:
    specs = [spec(i, split="heldout" if i % 3 == 0 else "train") for i in range(n)]
    verdicts = [("pass", "") for _ in specs] if audited else None
    return tasks_frame(specs, verdicts)
