"""Benchmark: ratchet's GRPO step against Hugging Face TRL's GRPOTrainer, same work, interleaved.

    pip install -e '.[bench]'             # trl: benchmark-only, ratchet never imports it
    python -m bench.train_step            # ~1-2 min on 2 CPU cores; prints one JSON object
    python -m bench.train_step --reward tests --steps 6     # reward = sandboxed test pass rate

Both sides start from the same tiny Llama-style policy (ratchet.model, hidden 192, 4 layers,
BPE tokenizer trained on python_functions tasks, warm-started with a short SFT so rewards vary)
and do the same work per RL step: B prompts x G samples, sampled at temperature 1 up to
`max_new_tokens`, scored by the SAME reward function, GRPO advantages (group mean/std), token-mean
clipped-surrogate loss (TRL: loss_type="dapo"), no KL, `updates` optimizer steps per batch
(TRL: num_iterations), AdamW at the same constant LR, grad-norm clip 1.0.

One RL step = generation + scoring + update(s). The two run interleaved in one process: a
TRL callback, after every `updates` TRL optimizer steps (one generation batch), runs one
ratchet step, so machine noise hits both alike. Medians after warm-up steps.

ratchet's side: TorchEngine.generate (KV cache, behaviour log-probs recorded while sampling, so
no extra forward for the old log-probs), the reward, TorchTrainer.train_wave on every sample.
The trainer computes the same gradient with less work: it forwards each distinct prompt once
and shares its KV cache (with gradients) across the group's G completions, packs micro-batches
by token budget instead of padding to the longest prompt + completion, and skips the
forward/backward of rows whose advantage is exactly 0 (kept in the loss normaliser).
Both sides run with `--threads` torch threads (default 1: on a shared 2-core machine, two
OpenMP threads per process fighting other processes were ~10x slower).

Also measured: the engine's generation tokens/s against `model.generate` on the same batch.

Default reward ("match"): the fraction of the reference solution's lines that the completion
reproduces in order (a line LCS), a cheap pure function; "tests" runs the hidden tests in
the sandbox (ratchet.verify.verify_many) for both sides, which adds the same ~constant
sandbox time to both.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import statistics
import sys
import time
import warnings

import torch


def lcs_lines(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def match_reward(completion: str, reference: str) -> float:
    """Share of the reference's lines reproduced in order; extra lines dilute it. In [0, 1]."""
    ref = [line.strip() for line in reference.strip().splitlines()]
    got = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return lcs_lines(got, ref) / max(len(ref), len(got), 1)


def make_reward(tasks, kind: str):
    """reward(task_indices, completions) -> list[float]; the one function both sides call."""
    if kind == "match":
        return lambda idx, comps: [match_reward(c, tasks[i].reference_solution) for i, c in zip(idx, comps)]
    from ratchet.verify import verify_many

    def tests(idx, comps):
        res = verify_many([(tasks[i], c) for i, c in zip(idx, comps)])
        return [0.0 if v.env_error else float(v.metrics["test_pass_rate"]) for v in res]

    return tests


def quiet_and_pinned(threads: int) -> None:
    """What every benchmark does first: no warnings or log noise, fixed threads and seed."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(threads)
    torch.manual_seed(0)


def build_policy(args):
    from envs.registry import get_family
    from ratchet.config import ModelConfig
    from ratchet.model import build_model, build_tokenizer
    from ratchet.train.sft import sft

    family = get_family("python_functions")
    cfg = family.config()
    tasks = [family.generate(cfg, 0, i, 1 + i % 3, "train") for i in range(args.n_tasks)]
    mcfg = ModelConfig()
    tokenizer = build_tokenizer([t.prompt + t.reference_solution for t in tasks], mcfg.vocab_size)
    model = build_model(mcfg, tokenizer)
    sft(model, tokenizer, [(t.prompt, t.reference_solution) for t in tasks[: args.n_tasks // 2]],
        steps=args.sft_steps, batch_size=32, lr=2e-3, seed=0)
    return model.eval(), tokenizer, tasks


def ratchet_side(model, tokenizer, tasks, reward, args):
    """-> step() that runs one ratchet GRPO step and returns its timings."""
    from ratchet.config import RLConfig, TrainConfig
    from ratchet.rl import compute_advantages
    from ratchet.rollout.torch_engine import TorchEngine
    from ratchet.train.batching import TrainSample
    from ratchet.train.torch_trainer import TorchTrainer

    engine = TorchEngine(model, tokenizer)
    trainer = TorchTrainer(
        model, tokenizer.pad_token_id,
        TrainConfig(lr=args.lr, minibatch_prompts=args.prompts, updates_per_batch=args.updates, max_grad_norm=1.0,
                    token_budget=args.token_budget),
        RLConfig(estimator="grpo", loss_agg="token_mean", clip_low=0.2, clip_high=0.2, kl_coef=0.0),
        temperature=1.0,
    )
    rng = random.Random(1)

    def step() -> dict:
        idx = rng.sample(range(len(tasks)), args.prompts)
        t0 = time.perf_counter()
        rollouts = engine.generate([tasks[i].prompt for i in idx], n=args.group, max_new_tokens=args.max_new_tokens,
                                   temperature=1.0, batch_size=args.prompts * args.group)
        t1 = time.perf_counter()
        rewards = torch.tensor(reward([idx[r.prompt_index] for r in rollouts], [r.text for r in rollouts]))
        adv = compute_advantages("grpo", rewards, args.group)                           # [B*G]
        t2 = time.perf_counter()
        samples = [TrainSample(r.prompt_ids, r.completion_ids, r.logprobs, float(a), str(r.prompt_index), float(rw))
                   for r, a, rw in zip(rollouts, adv, rewards)]
        trainer.train_wave(samples)
        t3 = time.perf_counter()
        longest = max(len(r.completion_ids) for r in rollouts)
        return {"s": t3 - t0, "gen": t1 - t0, "reward": t2 - t1, "train": t3 - t2,
                "row_use": sum(len(r.completion_ids) for r in rollouts) / (len(rollouts) * longest),
                "tokens": sum(len(r.completion_ids) for r in rollouts), "mean_reward": float(rewards.mean())}

    return step


def generation_speed(model, tokenizer, tasks, args, reps: int = 3) -> dict:
    """Tokens/s of TorchEngine.generate vs model.generate, same prompts, batch, sampling, cap."""
    from ratchet.rollout.torch_engine import TorchEngine

    engine = TorchEngine(model, tokenizer)
    rng = random.Random(2)
    engine_tps, hf_tps = [], []
    for _ in range(reps):
        prompts = [tasks[i].prompt for i in rng.sample(range(len(tasks)), args.prompts)]
        t0 = time.perf_counter()
        out = engine.generate(prompts, n=args.group, max_new_tokens=args.max_new_tokens,
                              batch_size=args.prompts * args.group)
        engine_tps.append(sum(len(r.completion_ids) for r in out) / (time.perf_counter() - t0))

        enc = tokenizer([tokenizer.bos_token + p for p in prompts for _ in range(args.group)],
                        add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        t0 = time.perf_counter()
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        dt = time.perf_counter() - t0
        new = gen[:, enc["input_ids"].shape[1]:]
        is_eos = (new == tokenizer.eos_token_id).int()
        after_eos = is_eos.cumsum(1) - is_eos > 0                     # tokens past the first EOS are padding
        hf_tps.append(int((~after_eos).sum()) / dt)
    return {"ratchet_tokens_per_s": statistics.median(engine_tps), "hf_generate_tokens_per_s": statistics.median(hf_tps)}


def trl_side(model, tokenizer, tasks, reward, args, on_rl_step):
    """A TRL GRPOTrainer on the same work; `on_rl_step(trl_seconds)` after each generation batch."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list([{"prompt": tokenizer.bos_token + t.prompt, "task": i} for i, t in enumerate(tasks)])

    def trl_reward(prompts, completions, task, **_):
        return reward(list(task), list(completions))

    class Interleave(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.n = 0

        def on_step_begin(self, a, state, control, **kw):
            if self.t0 is None:
                self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.n += 1
            if self.n % args.updates == 0:                   # one generation batch fully used
                on_rl_step(time.perf_counter() - self.t0)
                self.t0 = time.perf_counter()

    config = GRPOConfig(
        output_dir=os.path.join(args.tmp, "trl"), use_cpu=True, report_to="none", save_strategy="no",
        logging_strategy="no", disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0,
        per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, steps_per_generation=1, num_iterations=args.updates,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=(args.warmup + args.steps) * args.updates, bf16=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Interleave()])
    return trainer


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="B: prompts per RL step")
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per batch (TRL num_iterations)")
    p.add_argument("--steps", type=int, default=10, help="measured RL steps per side")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured RL steps per side")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--reward", choices=["match", "tests"], default="match")
    p.add_argument("--n-tasks", type=int, default=1200)
    p.add_argument("--sft-steps", type=int, default=90)
    p.add_argument("--token-budget", type=int, default=512, help="ratchet micro-batch size in tokens")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for both sides (1: robust on a shared 2-core machine)")
    p.add_argument("--tmp", default=os.environ.get("TMPDIR", "/tmp") + "/ratchet-bench")
    args = p.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("bench.train_step needs TRL, the peer it compares against: pip install -e '.[bench]'")

    quiet_and_pinned(args.threads)
    t_start = time.perf_counter()
    model, tokenizer, tasks = build_policy(args)
    reward = make_reward(tasks, args.reward)
    gen = generation_speed(model, tokenizer, tasks, args)

    ours = ratchet_side(copy.deepcopy(model), tokenizer, tasks, reward, args)
    ratchet_steps, trl_steps = [], []

    def on_rl_step(trl_seconds: float) -> None:
        trl_steps.append(trl_seconds)
        ratchet_steps.append(ours())

    trl_side(copy.deepcopy(model), tokenizer, tasks, reward, args, on_rl_step).train()

    r = ratchet_steps[args.warmup:]
    t = trl_steps[args.warmup:]
    ratchet_s = statistics.median(x["s"] for x in r)
    trl_s = statistics.median(t)
    result = {
        "ratchet_s_per_step": round(ratchet_s, 4),
        "trl_s_per_step": round(trl_s, 4),
        "ratio": round(ratchet_s / trl_s, 3),
        **{k: round(v, 1) for k, v in gen.items()},
        "generate_speedup": round(gen["ratchet_tokens_per_s"] / gen["hf_generate_tokens_per_s"], 2),
        "ratchet_gen_s": round(statistics.median(x["gen"] for x in r), 4),
        "ratchet_reward_s": round(statistics.median(x["reward"] for x in r), 4),
        "ratchet_train_s": round(statistics.median(x["train"] for x in r), 4),
        "ratchet_mean_completion_tokens": round(statistics.mean(x["tokens"] for x in r) / (args.prompts * args.group), 1),
        # share of decoded row-steps that produce a real token (finished rows keep decoding pad)
        "engine_row_utilisation": round(statistics.mean(x["row_use"] for x in r), 3),
        "ratchet_mean_reward": round(statistics.mean(x["mean_reward"] for x in r), 3),
        "work": {"prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
                 "updates_per_batch": args.updates, "steps": len(r), "reward": args.reward},
        "torch_threads": torch.get_num_threads(),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
