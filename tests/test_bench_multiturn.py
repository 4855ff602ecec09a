"""bench.multiturn's curriculum clock: a run bounded by sampled tokens reaches the curriculum's end
at its last wave, as a nightly does at wave `steps` - 1."""

import pytest

from bench.multiturn import planned_waves
from envs.families.python_functions import curriculum


def test_planned_waves_projects_the_budget_from_the_waves_so_far():
    assert planned_waves(0, 0, 900_000) == 1                  # wave 0: the curriculum's start
    assert planned_waves(1, 10_000, 900_000) == 90
    assert planned_waves(45, 450_000, 900_000) == 90
    assert planned_waves(89, 899_000, 900_000) == 90          # the last wave is wave 89 of 90
    assert planned_waves(10, 950_000, 900_000) == 11          # past the budget: never behind itself


def test_a_budget_bounded_run_walks_the_whole_curriculum():
    """10,000 tokens a wave for 900,000: wave 0 weighs every difficulty alike, the last favours the
    hardest three to one, as the family's curriculum does over a 90-wave nightly."""
    sampled, weights = 0, []
    for step in range(90):
        total = planned_waves(step, sampled, 900_000)
        weights.append(curriculum(step, total, 3))
        sampled += 10_000
    assert weights[0] == [1.0, 1.0, 1.0]
    assert weights[-1] == [1.0, 2.0, 3.0]
    assert weights[45] == curriculum(45, 90, 3)


@pytest.mark.parametrize("sizes", [(20_000, 5_000), (5_000, 20_000), (9_000, 11_000, 30_000, 2_000)])
def test_the_clock_stays_within_the_curriculum_when_waves_change_size(sizes):
    """Waves that grow, shrink or jump (a K-turn run's episodes end sooner as it learns): progress
    step / (steps - 1) never passes 1, never goes back, and the last wave is at 0.9 or more."""
    sampled, step, progress = 0, 0, []
    while sampled < 900_000:
        total = planned_waves(step, sampled, 900_000)
        progress.append(step / max(total - 1, 1))
        sampled += sizes[step * len(sizes) // 200 % len(sizes)]
        step += 1
    assert all(0 <= p <= 1 for p in progress) and progress == sorted(progress)
    assert progress[-1] >= 0.9
