"""Micro-batch packing for the prompt-shared layout: every row once, within the budget, and the
least padding (the gradient's independence of the packing is test_trainers' equivalence test).

    pytest tests/train/test_batching.py -q
"""

from __future__ import annotations

import random

from ratchet.train.batching import TrainSample, pack_by_prompt


def sample(prompt: int, prompt_len: int, completion_len: int) -> TrainSample:
    return TrainSample([prompt] * prompt_len, [7] * completion_len, [0.0] * completion_len, 1.0, f"g{prompt}")


def padded(micros: list[list[TrainSample]]) -> int:
    """What the micro-batches forward: each distinct prompt once at the longest prompt, each row at the longest completion."""
    return sum(len({tuple(s.prompt_ids) for s in m}) * max(len(s.prompt_ids) for s in m)
               + len(m) * max(len(s.completion_ids) for s in m) for m in micros)


def test_every_row_once_within_the_budget_and_the_same_plan_twice():
    rng = random.Random(0)
    samples = [sample(p, rng.randint(20, 60), rng.randint(1, 300)) for p in range(12) for _ in range(8)]
    for budget in (64, 500, 8192, 1_000_000):
        micros = pack_by_prompt(samples, budget)
        assert sorted(id(s) for m in micros for s in m) == sorted(id(s) for s in samples)
        assert all(len(m) == 1 or padded([m]) <= budget for m in micros), budget
        assert [[id(s) for s in m] for m in micros] == [[id(s) for s in m] for m in pack_by_prompt(samples, budget)]
    assert pack_by_prompt([], 8192) == []


def test_a_multi_turn_group_is_not_padded_to_its_longest_episode():
    """Episodes that passed at turn 1 (40 tokens) beside episodes that took three turns (300): one
    micro-batch would forward 16 x 300 completion tokens for 5,440 real ones."""
    samples = [sample(p, 50, 40 if i % 2 else 300) for p in range(2) for i in range(8)]
    micros = pack_by_prompt(samples, 8192)
    assert padded(micros) < 0.7 * padded([samples])
    assert all(len({len(s.completion_ids) for s in m}) == 1 for m in micros)   # short with short, long with long


def test_groups_of_like_rows_keep_their_prompt_forwarded_once():
    samples = [sample(p, 60, 30 + p) for p in range(8) for _ in range(8)]
    micros = pack_by_prompt(samples, 8192)
    prompts = [tuple(s.prompt_ids) for m in micros for s in m]
    assert sum(len({tuple(s.prompt_ids) for s in m}) for m in micros) == 8   # no prompt split across micro-batches
    assert padded(micros) <= padded([samples])
    assert len(prompts) == 64
