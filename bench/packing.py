"""Benchmark: one wave's training with micro-batches cut for the least padding, against the greedy packing before it.

    python -m bench.packing              # ~2 min on 2 CPU cores; prints one JSON object
    python -m bench.packing --repeats 5

The trainer forwards each distinct prompt once for its group (`pack_by_prompt`, the prompt-shared
layout), every row padded to the longest completion of its micro-batch. A 3-turn group holds
episodes that passed at turn 1 (~25 tokens) beside episodes of three answers and two observations
(~150), and the greedy packing (kept below as the baseline, the code before 2026-12-06) put a
whole minibatch of them in one micro-batch: 2.5x the real tokens of a saved 3-turn wave. Now
each minibatch is cut where the padded tokens plus a per-micro-batch overhead are least.

Two waves shaped like the saved waves of `bench.multiturn` (seed 0, warm start 3; live rows only,
as the trainer forwards them): single-turn, 8 rows a group, prompts ~30 tokens, answers 12-39;
3-turn, the rows ending after 1 / 2 / 3 answers in the proportions 50 / 10 / 40, answers 12-39
tokens, observations 38-48. The embedded model's architecture (hidden 192, 4 layers) at random
weights; the same rows and advantages for both packings, trained from the same weights,
interleaved, one torch thread; medians. Both packings give the same gradient (checked: the
largest difference of the trained weights, printed, is float rounding).

Also the warm start's SFT (`ratchet.train.sft.sft`): a step's batch of 32 demos, half plain
answers and half revision demos (one or two wrong answers, each with its feedback, then the fix:
2-3x a plain demo's length), as one padded batch (the code before 2026-12-06) against
micro-batches of like length (`pack_rows`, the default); the same
steps from the same weights, interleaved; the last losses, printed, agree to float rounding.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time

import torch


def greedy_pack(samples, budget: int):
    """The packing before 2026-12-06: whole groups ordered by length, a micro-batch filled until the budget."""
    groups: dict[tuple[int, ...], list] = {}
    for s in samples:
        groups.setdefault(tuple(s.prompt_ids), []).append(s)
    ordered = sorted(groups.values(), key=lambda g: len(g[0].prompt_ids) + max(len(s.completion_ids) for s in g))
    batches, current, n_prompts, P, C = [], [], 0, 0, 0
    for g in ordered:
        for s in sorted(g, key=lambda s: len(s.completion_ids)):
            new_prompt = not current or current[-1].prompt_ids != s.prompt_ids
            p, c = max(P, len(s.prompt_ids)), max(C, len(s.completion_ids))
            if current and (n_prompts + new_prompt) * p + (len(current) + 1) * c > budget:
                batches.append(current)
                current, n_prompts, new_prompt, p, c = [], 0, True, len(s.prompt_ids), len(s.completion_ids)
            current.append(s)
            n_prompts, P, C = n_prompts + new_prompt, p, c
    if current:
        batches.append(current)
    return batches


def wave(rng: random.Random, vocab: int, groups: int, turns: int):
    """Live rows of one wave (every advantage nonzero), shaped like bench.multiturn's."""
    from ratchet.train.batching import TrainSample

    token = lambda: rng.randrange(4, vocab)   # noqa: E731
    rows = []
    for g in range(groups):
        prompt = [token() for _ in range(rng.randint(20, 40))]
        for _ in range(8):
            k = 1 if turns == 1 else rng.choices((1, 2, 3), weights=(50, 10, 40))[0]
            completion, mask = [], []
            for j in range(k):
                answer = rng.randint(12, 39)
                completion += [token() for _ in range(answer)]
                mask += [1] * answer
                if j < k - 1:
                    seen = rng.randint(38, 48)
                    completion += [token() for _ in range(seen)]
                    mask += [0] * seen
            rows.append(TrainSample(prompt, completion, [-1.0 * m for m in mask], rng.choice((-1.0, 1.0)), f"g{g}",
                                    loss_mask=None if turns == 1 else mask))
    return rows


def demos(rng: random.Random, n: int):
    """Plain demos (prompt, body) and revision demos (prompt, [(wrong, False), (feedback, False), ..., (fix, True)])."""
    def body() -> str:
        return "".join(f"    x = x + {rng.randint(0, 99)}\n" for _ in range(rng.randint(2, 5))) + "    return x\n"
    out = []
    for i in range(n):
        prompt = f"# add some numbers to x ({i})\ndef f(x):\n"
        if i % 2 == 0:
            out.append((prompt, body()))
            continue
        segments = []
        for _ in range(rng.randint(1, 2)):
            wrong = body()
            feedback = (f"Tests: {rng.randint(0, 5)} of 6 passed.\n- f({rng.randint(0, 9)}): expected {rng.randint(0, 99)}, "
                        f"got {rng.randint(0, 99)}\nRevise your answer.\ndef f(x):\n")
            segments += [(wrong, False), (feedback, False)]
        out.append((prompt, segments + [(body(), True)]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=32, help="groups (prompts) per wave, 8 rows each")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sft-steps", type=int, default=20, help="SFT steps per timing")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from ratchet.config import ModelConfig, RLConfig, TrainConfig
    from ratchet.model import build_model, build_tokenizer
    from ratchet.train.torch_trainer import TorchTrainer

    cfg = ModelConfig(max_seq_len=384)
    tokenizer = build_tokenizer([f"def f(x):\n    return x + {i}\n" for i in range(200)], cfg.vocab_size)
    model = build_model(cfg, tokenizer).eval()
    class Greedy(TorchTrainer):
        pack_shared = staticmethod(greedy_pack)

    rng = random.Random(0)
    out = {}
    for name, turns in (("single_turn", 1), ("three_turn", 3)):
        rows = wave(rng, len(tokenizer), args.groups, turns)
        times: dict[str, list[float]] = {"greedy": [], "least_padding": []}
        weights = {}
        for _ in range(args.repeats):
            for packing, Trainer in (("greedy", Greedy), ("least_padding", TorchTrainer)):
                policy = copy.deepcopy(model)
                trainer = Trainer(policy, tokenizer.pad_token_id, TrainConfig(),
                                  RLConfig(loss_agg="answer_mean_token_mean"))
                t0 = time.perf_counter()
                trainer.train_wave(rows)
                times[packing].append(time.perf_counter() - t0)
                weights[packing] = torch.cat([q.detach().flatten() for q in policy.parameters()])
        real = sum(len(s.prompt_ids) + len(s.completion_ids) for s in rows)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[name] = {"rows": len(rows), "real_tokens": real,
                     "greedy_s": round(med["greedy"], 3), "least_padding_s": round(med["least_padding"], 3),
                     "ratio": round(med["least_padding"] / med["greedy"], 3),
                     "max_weight_diff": float(f"{(weights['greedy'] - weights['least_padding']).abs().max():.3g}")}
    from ratchet.train.batching import pack_rows
    from ratchet.train.sft import sft

    examples = demos(rng, 512)
    sft_tokenizer = build_tokenizer([p + (r if isinstance(r, str) else "".join(t for t, _ in r)) for p, r in examples],
                                    cfg.vocab_size)
    sft_model = build_model(cfg, sft_tokenizer)
    times = {"one_batch": [], "least_padding": []}
    last = {}
    for _ in range(args.repeats):
        for name, pack in (("one_batch", lambda lengths, budget: [list(range(len(lengths)))]), ("least_padding", pack_rows)):
            policy = copy.deepcopy(sft_model)
            t0 = time.perf_counter()
            last[name] = sft(policy, sft_tokenizer, examples, steps=args.sft_steps, batch_size=32, lr=3e-3, pack=pack)[-1]
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    out["sft"] = {"steps": args.sft_steps, "batch": 32, "one_batch_s": round(med["one_batch"], 3),
                  "least_padding_s": round(med["least_padding"], 3), "ratio": round(med["least_padding"] / med["one_batch"], 3),
                  "last_loss": {k: round(v, 5) for k, v in last.items()}}
    print(json.dumps({**out, "repeats": args.repeats, "threads": args.threads, "cpus": os.cpu_count(),
                      "load_avg": [round(x, 1) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
