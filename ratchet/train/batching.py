"""What a trainer eats: the sample type, micro-batch packing and tensor layouts.

    samples = [TrainSample(prompt_ids, completion_ids, behavior_logprobs, advantage, group, reward=r), ...]
    for micro in pack_by_prompt(samples, budget=8192): prompt_ids, ..., adv = collate_shared(micro, pad_id)
    # multi-turn: TrainSample(..., loss_mask=[1, 1, 0, 0, 1, ...]) (0 on observation tokens)

Two layouts: the plain one (`collate`: each row is prompt + completion, right-padded,
[N, L]) and the prompt-shared one (`collate_shared`: each distinct prompt once [U, P], the
completions [N, C]), which forwards a group's prompt once for its G samples.

Multi-turn episodes: `completion_ids` is everything after the prompt, a1 + o1 + a2 + ... + aK,
the observations (the sandbox's feedback, which the model read but did not write) included.
`loss_mask` is 1 on the model's own tokens and 0 on observation tokens (whose behaviour log-prob
is 0.0); None means all ones (single-turn). Every layout keeps attention on observation tokens
(they are context for the next answer) and puts the loss mask apart from it: the loss, KL,
entropy, values and every denominator count action tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TrainSample:
    prompt_ids: list[int]
    completion_ids: list[int]
    behavior_logprobs: list[float]   # one per completion token, from the rollout engine
    advantage: float | None          # outcome estimators; set by Trainer.assign_advantages
    group: str                       # prompt group id (whole groups stay in one minibatch)
    reward: float | None = None      # what the advantages are computed from
    row: int = -1                    # the sample's row in its wave's frame (to store what was trained on)
    token_advantages: list[float] | None = None   # "gae", per-turn credit: one per completion token
    returns: list[float] | None = None            # "gae": value-loss targets, one per token
    old_values: list[float] | None = None         # "gae": V(s_t) before the epoch, one per token
    loss_mask: list[int] | None = None            # one per completion token: 1 = the model's own (action)
                                                  # token, 0 = observation; None = all ones (single-turn)
    turn_rewards: list[float] | None = None       # per-turn credit: the episode's state value after each turn
    branch: int = 1                               # agent.branch: the group's rows come in tuples of this many
                                                  # that share their first answer (in `row` order)

    @property
    def action_tokens(self) -> int:
        """Completion tokens the loss covers (the model's own; all of them when loss_mask is None)."""
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)


def loss_mask_of(s: TrainSample) -> Tensor:
    """The sample's loss mask as floats [c], checked against its completion (one clear error)."""
    c = len(s.completion_ids)
    if s.loss_mask is None:
        return torch.ones(c)
    if len(s.loss_mask) != c or any(m not in (0, 1) for m in s.loss_mask):
        where = f"sample of group {s.group!r}" + (f" (wave row {s.row})" if s.row >= 0 else "")
        problem = (f"{len(s.loss_mask)} entries for {c} completion tokens" if len(s.loss_mask) != c
                   else f"values {sorted(set(s.loss_mask) - {0, 1})} (only 0 and 1 are allowed)")
        raise ValueError(f"loss_mask of the {where}: {problem}")
    return torch.tensor(s.loss_mask, dtype=torch.float32)


# What a micro-batch costs beyond its padded tokens, in tokens: a forward and backward of the
# embedded model on one thread take about 15 ms + 0.18 ms per token (2026-12-06), so ~100.
MICRO_OVERHEAD_TOKENS = 100
MAX_MICRO_ROWS = 256


def pack_rows(lengths: list[int], budget: int, overhead: int = MICRO_OVERHEAD_TOKENS) -> list[list[int]]:
    """Rows of these lengths cut into micro-batches (their indices), each padded to its longest row:
    rows * longest <= budget (a longer row alone), the least padded size in all with `overhead`
    counted per micro-batch. Rows go in order of length; the plain layout and SFT batches."""
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    return _cheapest_cuts(order, [0] * n, [0] * n, lengths, budget, overhead)[1]


def pack_by_tokens(samples: list[TrainSample], budget: int) -> list[list[TrainSample]]:
    """Micro-batches for the plain layout: rows * longest row <= budget (a longer row alone), the
    least padded size in all (`pack_rows`)."""
    return [[samples[i] for i in micro]
            for micro in pack_rows([len(s.prompt_ids) + len(s.completion_ids) for s in samples], budget)]


def collate(samples: list[TrainSample], pad_id: int):
    """Right-padded ids [N, L], attention [N, L] (1 on every real token, observations included);
    completion-aligned loss mask (1 on action tokens only) / behaviour [N, L-1], the advantages
    (`advantages_of`: [N], or [N, L-1] aligned like the mask)."""
    L = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    N = len(samples)
    ids = torch.full((N, L), pad_id, dtype=torch.long)
    attn = torch.zeros((N, L), dtype=torch.long)
    mask = torch.zeros((N, L - 1))
    behavior = torch.zeros((N, L - 1))
    for b, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[b, :p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attn[b, :p + c] = 1
        mask[b, p - 1:p + c - 1] = loss_mask_of(s)         # position t predicts token t+1
        behavior[b, p - 1:p + c - 1] = torch.tensor(s.behavior_logprobs)
    return ids, attn, mask, behavior, advantages_of(samples, [len(s.prompt_ids) - 1 for s in samples], L - 1)


def pack_by_prompt(samples: list[TrainSample], budget: int,
                   overhead: int = MICRO_OVERHEAD_TOKENS) -> list[list[TrainSample]]:
    """Micro-batches for the prompt-shared layout, each of padded size (prompts * P + rows * C)
    <= budget (a row larger than the budget alone), with the least padded size in all, `overhead`
    counted per micro-batch: the cheapest cut of one of two orders, whole prompt groups in a row
    (a prompt forwarded once) or every row by its length (little padding: a multi-turn group holds
    episodes of one turn and of three, and one micro-batch padded every row to the longest, 2.5x
    the real tokens of a 3-turn wave). Deterministic: the same samples give the same micro-batches."""
    if not samples:
        return []
    keys: dict[tuple[int, ...], int] = {}
    prompt = [keys.setdefault(tuple(s.prompt_ids), len(keys)) for s in samples]
    size = lambda i: len(samples[i].prompt_ids) + len(samples[i].completion_ids)   # noqa: E731
    by_group: dict[int, list[int]] = {}
    for i in sorted(range(len(samples)), key=lambda i: (len(samples[i].completion_ids), i)):
        by_group.setdefault(prompt[i], []).append(i)
    grouped = [i for g in sorted(by_group.values(), key=lambda g: (max(size(i) for i in g), g[0])) for i in g]
    by_length = sorted(range(len(samples)), key=lambda i: (len(samples[i].completion_ids), prompt[i], i))
    heads, tails = [len(s.prompt_ids) for s in samples], [len(s.completion_ids) for s in samples]
    _, cuts = min((_cheapest_cuts(order, prompt, heads, tails, budget, overhead) for order in (grouped, by_length)),
                  key=lambda plan: plan[0])
    return [[samples[i] for i in micro] for micro in cuts]


def _cheapest_cuts(order: list[int], key: list[int], head: list[int], tail: list[int], budget: int,
                   overhead: int) -> tuple[int, list[list[int]]]:
    """The cut of `order` into consecutive micro-batches of the least total padded size plus
    `overhead` each, item i being a shared head (`key[i]`: forwarded once per micro-batch, padded to
    the longest, `head[i]` tokens) and a tail of its own (`tail[i]`, padded to the longest): dynamic
    programming over the cut points, a micro-batch at most MAX_MICRO_ROWS rows (the work is then
    n * MAX_MICRO_ROWS). Returns (that total, the micro-batches' items)."""
    n = len(order)
    best, back = [0] + [None] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        seen: set[int] = set()
        longest_head = longest_tail = 0
        for i in range(j - 1, max(j - MAX_MICRO_ROWS, 0) - 1, -1):   # the micro-batch order[i:j]
            item = order[i]
            seen.add(key[item])
            longest_head, longest_tail = max(longest_head, head[item]), max(longest_tail, tail[item])
            padded = len(seen) * longest_head + (j - i) * longest_tail
            if padded > budget and i < j - 1:
                break                                         # it only grows as the micro-batch does
            total = best[i] + padded + overhead
            if best[j] is None or total < best[j]:
                best[j], back[j] = total, i
    cuts, j = [], n
    while j > 0:
        cuts.append(order[back[j]:j])
        j = back[j]
    return best[n], cuts[::-1]


def collate_shared(samples: list[TrainSample], pad_id: int):
    """Prompt-shared layout: unique prompts left-padded [U, P] (+ attention), the row -> prompt
    index [N], completions right-padded [N, C] (+ attention [N, C], 1 on every real token: observations
    are attended to), the loss mask [N, C] (1 on action tokens only), behaviour [N, C], the advantages
    (`advantages_of`: [N] or [N, C])."""
    prompts: dict[tuple[int, ...], int] = {}
    index = [prompts.setdefault(tuple(s.prompt_ids), len(prompts)) for s in samples]
    U, P = len(prompts), max(len(p) for p in prompts)
    N, C = len(samples), max(len(s.completion_ids) for s in samples)
    prompt_ids = torch.full((U, P), pad_id, dtype=torch.long)
    prompt_attn = torch.zeros((U, P), dtype=torch.long)
    for p, u in prompts.items():
        prompt_ids[u, P - len(p):] = torch.tensor(p)
        prompt_attn[u, P - len(p):] = 1
    comp_ids = torch.full((N, C), pad_id, dtype=torch.long)
    comp_attn = torch.zeros((N, C), dtype=torch.long)
    mask = torch.zeros((N, C))
    behavior = torch.zeros((N, C))
    for b, s in enumerate(samples):
        c = len(s.completion_ids)
        comp_ids[b, :c] = torch.tensor(s.completion_ids)
        comp_attn[b, :c] = 1
        mask[b, :c] = loss_mask_of(s)
        behavior[b, :c] = torch.tensor(s.behavior_logprobs)
    adv = advantages_of(samples, [0] * N, C)
    return prompt_ids, prompt_attn, torch.tensor(index), comp_ids, comp_attn, mask, behavior, adv


def advantages_of(samples: list[TrainSample], starts: list[int], width: int) -> Tensor:
    """The loss's advantages: one per sequence [N]; or, when any sample carries per-token ones (GAE,
    per-turn credit), [N, width] with each sample's completion from its `starts` column (a sample
    without them has its sequence advantage on every completion token)."""
    if all(s.token_advantages is None for s in samples):
        return torch.tensor([s.advantage or 0.0 for s in samples])                           # [N]
    per_token = [torch.tensor(s.token_advantages) if s.token_advantages is not None
                 else torch.full((len(s.completion_ids),), s.advantage or 0.0) for s in samples]
    return place_tokens(samples, per_token, width, starts)                                   # [N, width]


def place_tokens(samples: list[TrainSample], values: list[Tensor], width: int, starts: list[int] | None = None) -> Tensor:
    """Per-sample completion vectors ([c] each) -> [N, width], sample b's from column starts[b]
    (default: aligned like `collate`'s mask, from its prompt length - 1)."""
    starts = starts if starts is not None else [len(s.prompt_ids) - 1 for s in samples]
    out = torch.zeros((len(samples), width))
    for b, (v, start) in enumerate(zip(values, starts)):
        out[b, start:start + v.numel()] = v
    return out
