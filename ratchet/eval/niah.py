"""Needle in a haystack: can the model recall a key buried at some depth in a long context?

    ratchet eval niah --model DIR [--lengths 64,128,248] [--depths 0,0.5,1] [--trials 4]
    python -m flows.niah                                   # the same, as a Prefect flow

    result = probe(model, tokenizer, NiahConfig(lengths=(64, 128), depths=(0.0, 0.5, 1.0)))
    print(result.text())                                   # depth x length recall table

A haystack is filler sentences drawn from a fixed word list (no digits, never the word "key"),
deterministic by (seed, length, depth, trial). The needle "The key is <digits>." is put at the
sentence boundary nearest to `depth` (the fraction of the haystack's tokens before it), and the
prompt ends with the question "What is the key? The key is", so a base LM answers by completing
it. Lengths count the prompt's tokens as the rollout engine feeds them (BOS included), with the
model's own tokenizer, and a prompt is never longer than its length (it falls short by at most
one sentence). The answer is greedy, `key_digits + 3` new tokens at most (the answer room); it
is recalled when the first run of digits in it is exactly the key.

By default the lengths must leave the answer room inside the model's max_position_embeddings;
`beyond_limit` allows longer ones (marked `*` in the table) to show how the model extrapolates.
The same haystack builder makes the retrieval sequences of the context-extension phases
(`ratchet.train.sft.extend_context`), so the probe measures what those phases teach: it is an
in-distribution test of long-range retrieval, not a general long-context benchmark.
"""

from __future__ import annotations

import random
import re
from itertools import accumulate
from dataclasses import dataclass

import polars as pl

from ratchet.config import NiahConfig

QUESTION = "\nWhat is the key? The key is"
SUBJECTS = ("the grass", "the sky", "a river", "the old road", "my neighbour", "the small boat", "a tall tree",
            "the market", "the village", "a quiet cat", "the north wind", "the garden", "a red bird", "the baker")
VERBS = ("looks", "moves", "stays", "turns", "waits", "sings", "grows", "rests", "shines", "drifts", "falls", "rises")
ENDINGS = ("in the morning", "near the hill", "after the rain", "all day long", "by the water", "under the bridge",
           "at night", "without a sound", "in the cold", "before noon", "along the wall", "for a while")


@dataclass(frozen=True)
class Haystack:
    prompt: str
    key: str
    length: int        # tokens the engine feeds (BOS + prompt), <= the length asked for
    depth: float       # asked: fraction of the haystack before the needle
    needle_at: float   # measured: haystack tokens before the needle / haystack tokens


def filler_sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(ENDINGS)}."
    return s[0].upper() + s[1:]


def make_key(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(1, 10)) + "".join(str(rng.randrange(10)) for _ in range(digits - 1))


def _count(tokenizer, texts: list[str]) -> list[int]:
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def build_haystack(tokenizer, length: int, depth: float, key: str, seed: int | str = 0) -> Haystack:
    """A prompt of at most `length` tokens (BOS included) with the needle at `depth` (0..1)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a fraction in [0, 1], got {depth}")
    rng = random.Random(f"niah:{seed}:{length}:{depth}")
    bos = int(tokenizer.bos_token_id is not None)
    needle = f"The key is {key}."
    budget = length - bos - sum(_count(tokenizer, [" " + needle, QUESTION]))
    if budget < 0:
        raise ValueError(f"length {length} leaves no room for the needle and the question")
    sentences, counts = [], []    # filler, and each sentence's tokens (with its leading space)
    while sum(counts) <= budget * 1.1 + 32:    # past the budget: the counts only estimate the prompt's
        batch = [filler_sentence(rng) for _ in range(32)]
        sentences += batch
        counts += _count(tokenizer, [" " + s for s in batch])
    cum = list(accumulate(counts, initial=0))                                   # cum[k]: tokens of the first k

    def assemble(k: int) -> tuple[str, int, int]:
        """The prompt with the first k sentences, the needle's boundary, its exact token count."""
        at = min(range(k + 1), key=lambda i: abs(cum[i] - depth * cum[k]))     # the boundary nearest depth
        prompt = " ".join(sentences[:at] + [needle] + sentences[at:k]) + QUESTION
        return prompt, at, bos + _count(tokenizer, [prompt])[0]

    k = max(0, max(i for i in range(len(cum)) if cum[i] <= budget))    # the estimate; then exact counts decide
    while k + 1 < len(sentences) and assemble(k + 1)[2] <= length:
        k += 1
    while k > 0 and assemble(k)[2] > length:
        k -= 1
    prompt, at, n = assemble(k)
    if n > length:
        raise ValueError(f"length {length} leaves no room for the needle and the question")
    sentences = sentences[:k]
    n_head, n_tail = _count(tokenizer, [" ".join(sentences[:at]), " ".join(sentences[at:])])
    needle_at = n_head / (n_head + n_tail) if n_head + n_tail else depth
    return Haystack(prompt, key, n, depth, needle_at)


def recalled(completion: str, key: str) -> bool:
    """The first run of digits in the answer is exactly the key."""
    found = re.search(r"\d+", completion)
    return found is not None and found.group() == key


def default_lengths(limit: int, answer_room: int, n: int = 4, least: int = 64) -> tuple[int, ...]:
    """n lengths evenly up to the model's context less the answer room; none under `least` tokens
    (a shorter prompt holds little more than the needle and the question) unless nothing else fits."""
    top = limit - answer_room
    spread = sorted({round(top * (i + 1) / n) for i in range(n)})
    return tuple(x for x in spread if x >= least) or (top,)


@dataclass
class NiahResult:
    rows: pl.DataFrame     # one row per haystack: length, depth, trial, key, answer, recalled, ...
    limit: int             # the model's max_position_embeddings
    answer_room: int = 0   # new tokens the answer may take after the prompt

    def table(self) -> pl.DataFrame:
        """Recall per depth (rows) and length (columns), the mean over trials; a length marked `*`
        puts the prompt or its answer past the model's context (what `check_lengths` refuses
        without beyond_limit)."""
        cells = self.rows.group_by("depth", "length").agg(pl.col("recalled").mean().alias("recall"))
        wide = cells.sort("length").pivot(on="length", index="depth", values="recall").sort("depth")
        return wide.rename({c: f"{c}*" if int(c) + self.answer_room > self.limit else c
                            for c in wide.columns if c != "depth"})

    def text(self) -> str:
        table = self.table()
        cols = [c for c in table.columns if c != "depth"]
        trials = self.rows["trial"].n_unique()
        lines = [f"needle-in-a-haystack recall ({trials} trials per cell; model context {self.limit} positions"
                 + ("; * past it" if any(c.endswith("*") for c in cols) else "") + ")",
                 "depth \\ length " + "".join(f"{c:>8}" for c in cols)]
        for row in table.iter_rows(named=True):
            lines.append(f"{row['depth']:<15.2f}" + "".join(f"{row[c]:>8.2f}" for c in cols))
        means = self.rows.group_by("length").agg(pl.col("recalled").mean()).sort("length")["recalled"]
        lines.append(f"{'mean':<15}" + "".join(f"{m:>8.2f}" for m in means))
        return "\n".join(lines)

    def markdown(self) -> str:
        table = self.table()
        cols = [c for c in table.columns if c != "depth"]
        out = ["| depth \\ length | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        out += [f"| {r['depth']:.2f} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |" for r in table.iter_rows(named=True)]
        return "\n".join(out)

    def summary(self) -> dict:
        return {"limit": self.limit, "recall": float(self.rows["recalled"].mean()), "table": self.text(),
                "cells": [list(r) for r in self.rows.group_by("depth", "length").agg(pl.col("recalled").mean()).sort("depth", "length").rows()]}


def check_lengths(lengths: tuple[int, ...], limit: int, answer_room: int, beyond_limit: bool) -> None:
    """Raise ValueError naming the first length that does not fit the model's context."""
    for n in lengths:
        if n < 16:
            raise ValueError(f"length {n}: at least 16 tokens")
        if not beyond_limit and n + answer_room > limit:
            raise ValueError(f"length {n} + {answer_room} answer tokens exceeds the model's context of {limit} "
                             f"positions (at most {limit - answer_room}; beyond_limit allows it)")


def probe(model, tokenizer, cfg: NiahConfig = NiahConfig(), engine=None, progress=None) -> NiahResult:
    """Greedy recall of the key at every (depth, length) cell, `cfg.trials` haystacks each.
    `progress(done, total)`, if given, is called after each length (in haystacks)."""
    from ratchet.rollout.torch_engine import TorchEngine

    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    answer_room = cfg.key_digits + 3
    lengths = tuple(cfg.lengths) or default_lengths(limit, answer_room)
    check_lengths(lengths, limit, answer_room, cfg.beyond_limit)
    engine = engine or TorchEngine(model, tokenizer)
    rows, total = [], len(lengths) * len(cfg.depths) * cfg.trials
    for length in lengths:
        stacks = []
        for depth in cfg.depths:
            for trial in range(cfg.trials):
                key = make_key(random.Random(f"key:{cfg.seed}:{length}:{depth}:{trial}"), cfg.key_digits)
                stacks.append((trial, build_haystack(tokenizer, length, depth, key, seed=f"{cfg.seed}:{trial}")))
        outs = engine.generate([h.prompt for _, h in stacks], n=1, max_new_tokens=answer_room, greedy=True,
                               batch_size=cfg.batch_size)
        for (trial, h), out in zip(stacks, outs):
            rows.append({"length": length, "depth": h.depth, "trial": trial, "tokens": h.length,
                         "needle_at": h.needle_at, "key": h.key, "answer": out.text, "recalled": recalled(out.text, h.key)})
        if progress:
            progress(len(rows), total)
    return NiahResult(pl.DataFrame(rows), limit, answer_room)


def retrieval_examples(tokenizer, n: int, max_len: int, key_digits: int = 5, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, " <key>.") training pairs: haystacks of random length in [max_len/8, max_len - answer room]
    (at least the needle and question and a few tokens more)
    and random depth, with filler and keys from a seed stream apart from the probe's."""
    rng = random.Random(f"retrieval:{seed}")
    top = max_len - key_digits - 3
    least = max(top // 8, 1 + sum(_count(tokenizer, [" The key is " + "0" * key_digits + ".", QUESTION])) + 8)
    if least > top:
        raise ValueError(f"a context of {max_len} tokens leaves no room for a retrieval sequence (needs {least + key_digits + 3})")
    out = []
    for i in range(n):
        key = make_key(rng, key_digits)
        h = build_haystack(tokenizer, rng.randint(least, top), rng.random(), key, seed=f"train:{seed}:{i}")
        out.append((h.prompt, f" {key}."))
    return out
