"""Benchmark: generation tokens/s of ratchet's TorchEngine against Hugging Face `model.generate`.

    python -m bench.rollout                   # ~1-2 min on 2 CPU cores; the LAST line is one JSON object
    python -m bench.rollout --prompts 8 --group 8 --max-new-tokens 48 --reps 7
    python -m bench.rollout --episodes --prompts 16   # 3-turn episodes: the engine's cache vs torch.cat's

The policy is the embedded tiny model built the way bench.train_step builds it (ratchet.model:
Llama-style, hidden 192, 4 layers, BPE tokenizer trained on python_functions tasks) and
warm-started with a short SFT, so completions end with EOS the way they do in a real run.

Both sides do the same work: B prompts x G samples, sampled at temperature 1 (no top-k/top-p),
up to `max_new_tokens`, KV cache on, one batch of B*G sequences, the same EOS and pad token.
The engine gets the B distinct prompts and n=G; `model.generate` gets the B*G left-padded rows
(each prompt repeated G times), which is how one calls it for a GRPO group. Generated tokens are
counted up to and including the first EOS on both sides (HF pads finished rows; those pads are
not counted). Both run in this one process at the same torch thread count (`--threads`), under
`no_grad` for `generate` (as HF sets it; the engine picks `inference_mode` itself). Each repeat
draws a fresh batch of prompts, runs both sides on it, alternating which goes first, so machine
noise hits both alike; the figures are medians over repeats after one unmeasured warm-up repeat.

Also measured, same way: the engine with its generic decode (HFDecoder: the model's own forward,
prompt prefilled once and its cache copied to the samples) instead of the hand-written Llama
decode, to show what each part is worth.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import types

import torch


def ratchet_run(engine, prompts: list[str], args) -> tuple[int, float]:
    t0 = time.perf_counter()
    out = engine.generate(prompts, n=args.group, max_new_tokens=args.max_new_tokens, temperature=1.0,
                          batch_size=args.prompts * args.group)
    return sum(len(r.completion_ids) for r in out), time.perf_counter() - t0


def generic_decode_run(engine, prompts: list[str], args) -> tuple[int, float]:
    from ratchet.rollout import decoders

    supports = decoders.LlamaDecoder.supports
    decoders.LlamaDecoder.supports = staticmethod(lambda model: False)
    try:
        return ratchet_run(engine, prompts, args)
    finally:
        decoders.LlamaDecoder.supports = supports


def hf_run(model, tokenizer, prompts: list[str], args) -> tuple[int, float]:
    rows = [tokenizer.bos_token + p for p in prompts for _ in range(args.group)]
    enc = tokenizer(rows, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, use_cache=True,
                             max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    dt = time.perf_counter() - t0
    new = gen[:, enc["input_ids"].shape[1]:]                                   # [B*G, T]
    is_eos = (new == tokenizer.eos_token_id).int()
    after_eos = is_eos.cumsum(1) - is_eos > 0                                  # past the first EOS: padding
    return int((~after_eos).sum()), dt


OBSERVATION = ("Tests failed:\n- f(3): expected 7, got 5\n- f(11): expected 3, got raised ZeroDivisionError: "
               "division by zero\nFix the function and answer again.\n")


EPISODE_SIDES = ("ratchet", "no_parking", "concat")


def episodes_run(engine, prompts: list[str], observation: str, args, seed: int, side: str) -> tuple[list, float]:
    """3-turn episodes (by default) of every prompt x group in one batch: after each turn an episode ends
    with probability 0.4 (it passed), else gets `observation` (`seed` fixes which, and the samples).
    side: "ratchet" (the cache grown in place, rows whose answer ended set aside), "no_parking" (grown
    in place, every row forwarded every step), "concat" (DynamicLayer's torch.cat per step, which
    cannot park either: the baseline, as the engine was before 2026-12-06)."""
    from transformers.cache_utils import DynamicCache

    from ratchet.rollout import episodes

    rng = random.Random(seed)
    respond = lambda k, live: [None if rng.random() < 0.4 else observation for _ in live]  # noqa: E731
    growing, can_park = episodes._growing_cache, episodes._Conversations.can_park
    if side == "concat":
        episodes._growing_cache = lambda model: DynamicCache(config=model.config)
    if side == "no_parking":
        episodes._Conversations.can_park = property(lambda self: False)
    try:
        t0 = time.perf_counter()
        out = episodes.generate_episodes(engine, prompts, n=args.group, respond=respond, max_turns=args.turns,
                                         max_new_tokens=args.max_new_tokens, seed=seed,
                                         batch_size=args.prompts * args.group)
        return out, time.perf_counter() - t0
    finally:
        episodes._growing_cache, episodes._Conversations.can_park = growing, can_park


def same_work(ours: list, base: list, where: str) -> int:
    """Both sides sampled the same episodes, or an episode went its own way at a near-tie: the log-probs
    agree (1e-4) up to the first token that differs (a row's logits move in their last bits with its
    batch, DESIGN.md "Determinism"). Returns how many diverged; anything else raises."""
    diverged = 0
    for i, (a, b) in enumerate(zip(ours, base, strict=True)):
        if a.completion_ids == b.completion_ids:
            continue
        j = next(k for k, (x, y) in enumerate(zip(a.completion_ids + [None], b.completion_ids + [None])) if x != y)
        if not all(abs(x - y) <= 1e-4 for x, y in zip(a.logprobs[:j], b.logprobs[:j])):
            raise AssertionError(f"{where}: episode {i}'s log-probs differ before its tokens do")
        diverged += 1
    return diverged


def episodes_main(engine, tokenizer, tasks, args, t_start: float) -> dict:
    """--episodes: multi-turn episode sampling as the engine does it against the KV cache grown by
    concatenation (and, to show what each part is worth, grown in place without parking); every side
    samples the same tokens (checked: `same_work`), so the ratio is of time alone."""
    from ratchet.rollout.episodes import prefill_figure

    cut = tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"][:args.observation_tokens]
    observation = tokenizer.decode(cut)                  # as agent.observation_tokens cuts a real one
    rng = random.Random(2)
    tps: dict[str, list[float]] = {name: [] for name in EPISODE_SIDES}
    figures, diverged = [], 0
    for rep in range(args.reps + 1):
        prompts = [tasks[i].prompt for i in rng.sample(range(len(tasks)), args.prompts)]
        runs = {}
        for name in (EPISODE_SIDES if rep % 2 else EPISODE_SIDES[::-1]):
            eps, dt = episodes_run(engine, prompts, observation, args, seed=rep, side=name)
            runs[name] = eps
            if rep > 0:
                tps[name].append(sum(len(t.action_ids) for e in eps for t in e.turns) / dt)
        for name in EPISODE_SIDES:
            diverged += same_work(runs[name], runs["concat"], f"repeat {rep}, {name} against concat")
        figures.append(prefill_figure(eps))
    ours, base = statistics.median(tps["ratchet"]), statistics.median(tps["concat"])
    result = {
        "work": {"mode": "episodes", "prompts": args.prompts, "group": args.group, "turns": args.turns,
                 "max_new_tokens": args.max_new_tokens, "reps": args.reps,
                 "respond": "each turn: ends with p 0.4, else an observation"},
        "observation_tokens": len(tokenizer(observation, add_special_tokens=False)["input_ids"]),
        "mean_turns": round(statistics.mean(f["mean_turns"] for f in figures), 2),
        "prefill_tokens_reuse": round(statistics.mean(f["prefill_tokens_reuse"] for f in figures), 1),
        "prefill_tokens_recompute": round(statistics.mean(f["prefill_tokens_recompute"] for f in figures), 1),
        "torch_threads": torch.get_num_threads(),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "episodes_diverged_at_a_tie": diverged,
        "no_parking_tokens_per_s": round(statistics.median(tps["no_parking"]), 1),
        "ratchet_tokens_per_s": round(ours, 1),
        "concat_tokens_per_s": round(base, 1),
        "ratio": round(ours / base, 2),
    }
    print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="B: distinct prompts per batch")
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=7, help="measured repeats per side (after one warm-up)")
    p.add_argument("--n-tasks", type=int, default=1200)
    p.add_argument("--sft-steps", type=int, default=90)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: robust on a shared 2-core machine)")
    p.add_argument("--episodes", action="store_true",
                   help="multi-turn episodes (generate_episodes): the engine's KV cache (grown in place, "
                   "finished rows set aside) vs grown by concatenation")
    p.add_argument("--turns", type=int, default=3, help="with --episodes: turns per episode at most")
    p.add_argument("--observation-tokens", type=int, default=48, help="with --episodes: the observation's budget "
                   "(agent.observation_tokens)")
    args = p.parse_args(argv)

    from bench.train_step import build_policy, quiet_and_pinned

    quiet_and_pinned(args.threads)
    from ratchet.rollout.torch_engine import TorchEngine

    t_start = time.perf_counter()
    model, tokenizer, tasks = build_policy(types.SimpleNamespace(n_tasks=args.n_tasks, sft_steps=args.sft_steps))
    engine = TorchEngine(model, tokenizer)
    if args.episodes:
        return episodes_main(engine, tokenizer, tasks, args, t_start)
    rng = random.Random(2)
    sides = {"ratchet": lambda ps: ratchet_run(engine, ps, args),
             "ratchet_generic_decode": lambda ps: generic_decode_run(engine, ps, args),
             "hf": lambda ps: hf_run(model, tokenizer, ps, args)}
    tps: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list[int]] = {name: [] for name in sides}
    for rep in range(args.reps + 1):
        prompts = [tasks[i].prompt for i in rng.sample(range(len(tasks)), args.prompts)]
        for name in (list(sides) if rep % 2 else list(sides)[::-1]):
            n_tok, dt = sides[name](prompts)
            if rep > 0:
                tps[name].append(n_tok / dt)
                tokens[name].append(n_tok)
    ours, hf = statistics.median(tps["ratchet"]), statistics.median(tps["hf"])
    result = {
        "work": {"prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
                 "reps": args.reps, "sampling": "temperature 1, no top-k/top-p"},
        "mean_completion_tokens": {k: round(statistics.mean(v) / (args.prompts * args.group), 1)
                                   for k, v in tokens.items()},
        "ratchet_generic_decode_tokens_per_s": round(statistics.median(tps["ratchet_generic_decode"]), 1),
        "torch_threads": torch.get_num_threads(),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "ratchet_tokens_per_s": round(ours, 1),
        "hf_generate_tokens_per_s": round(hf, 1),
        "ratio": round(ours / hf, 2),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
