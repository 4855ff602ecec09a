"""A tiny policy and synthetic scored waves, shared by the trainer tests (seconds on 2 cores)."""

from __future__ import annotations

import random

import torch

from ratchet.config import ModelConfig
from ratchet.model import build_model, build_tokenizer
from ratchet.train.batching import TrainSample
from ratchet.train.policy import token_logprobs

CORPUS = [f"# add {i}, then negate it\ndef f(x):\n    x = x + {i}\n    x = -x\n    return x\n" for i in range(10)]
TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=128, max_seq_len=64)

_TOKENIZER = None


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = build_tokenizer(CORPUS, TINY.vocab_size)
    return _TOKENIZER


def model(seed: int = 0):
    return build_model(TINY.model_copy(update={"seed": seed}), tokenizer()).eval()


def wave(policy, seed: int, n_groups: int = 3, group_size: int = 4, zero_groups: int = 0) -> list[TrainSample]:
    """Random prompts/completions scored with random rewards; behaviour log-probs from `policy`.
    The first `zero_groups` groups have equal rewards (advantage exactly 0)."""
    rng = random.Random(seed)
    vocab = range(len(tokenizer().all_special_ids), len(tokenizer()))
    samples = []
    for g in range(n_groups):
        prompt = [rng.choice(vocab) for _ in range(rng.randint(3, 8))]
        rewards = [1.0] * group_size if g < zero_groups else [float(rng.random() < 0.5) for _ in range(group_size)]
        if g >= zero_groups and len(set(rewards)) == 1:
            rewards[0] = 1.0 - rewards[0]
        mean = sum(rewards) / group_size
        for r in rewards:
            completion = [rng.choice(vocab) for _ in range(rng.randint(2, 9))]
            samples.append(TrainSample(prompt, completion, [], r - mean, f"w{seed}g{g}", reward=r))
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logp, _ = token_logprobs(policy, ids, torch.ones_like(ids))
            s.behavior_logprobs = logp[0, len(s.prompt_ids) - 1:].tolist()
    return samples
