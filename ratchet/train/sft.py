"""Supervised warm start: teach the base policy the output format on demonstrations.

RL cannot discover a program shape the policy never produces, so the embedded model first
sees reference solutions for part of the training tasks (`ModelConfig.sft_fraction`).
The loss covers completion tokens (and EOS) only.
"""

from __future__ import annotations

import random

import torch

from ratchet.config import ModelConfig


def sft(model, tokenizer, examples: list[tuple[str, str]], steps: int, batch_size: int, lr: float,
        seed: int = 0, log=None) -> list[float]:
    """Train on (prompt, completion) pairs for `steps` steps; returns the loss per step."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = tokenizer([p for p, _ in examples], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, c in examples], add_special_tokens=False)["input_ids"]
    seqs = [([bos] + p, c + [eos]) for p, c in zip(prompts, completions)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / max(steps, 1)))
    model.train()
    losses = []
    for step in range(steps):
        batch = [seqs[rng.randrange(len(seqs))] for _ in range(batch_size)]
        T = max(len(p) + len(c) for p, c in batch)
        ids = torch.full((batch_size, T), pad, dtype=torch.long)
        labels = torch.full((batch_size, T), -100, dtype=torch.long)
        attn = torch.zeros((batch_size, T), dtype=torch.long)
        for b, (p, c) in enumerate(batch):
            ids[b, :len(p) + len(c)] = torch.tensor(p + c)
            labels[b, len(p):len(p) + len(c)] = torch.tensor(c)
            attn[b, :len(p) + len(c)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log and (step % 20 == 0 or step == steps - 1):
            log(f"sft step {step + 1}/{steps} loss {loss.item():.3f}")
    model.eval()
    return losses


def demonstrations(specs, fraction: float, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, reference) for a `fraction` of the tasks, drawn alike from every difficulty,
    so the base policy has seen every output shape (RL does not discover shapes it never
    produces) but solves few tasks: the rest is left to RL. Tasks without a reference are skipped."""
    rng = random.Random(f"demos:{seed}")
    return [(s.prompt, s.reference_solution) for s in specs
            if rng.random() < fraction and s.reference_solution is not None]


def warm_start(cfg: ModelConfig, specs, out_dir, log=None):
    """Build the embedded tiny model for `specs` (tokenizer, weights) and SFT it; save it in
    Hugging Face layout under `out_dir`. Returns the SFT losses."""
    from ratchet.model import build_model, build_tokenizer, save_policy

    corpus = [s.prompt + (s.reference_solution or "") for s in specs]
    tokenizer = build_tokenizer(corpus, cfg.vocab_size)
    model = build_model(cfg, tokenizer)
    demos = demonstrations(specs, cfg.sft_fraction, cfg.seed)
    losses = sft(model, tokenizer, demos, cfg.sft_steps, cfg.sft_batch, cfg.sft_lr, seed=cfg.seed, log=log)
    for i, phase in enumerate(cfg.context_phases):
        losses += extend_context(model, tokenizer, phase, demos, cfg, seed=cfg.seed + i + 1, log=log)
    save_policy(model, tokenizer, out_dir)
    return losses


def extend_context(model, tokenizer, phase, demos: list[tuple[str, str]], cfg: ModelConfig, seed: int = 0,
                   log=None) -> list[float]:
    """One context phase (`ModelConfig.context_phases`): set the model's context to phase.seq_len
    with its RoPE scaling, then SFT on needle-in-a-haystack retrieval sequences up to that length
    (a `retrieval_share` of the examples) mixed with the task demonstrations, so that the longer
    context is trained at, and the format the policy learnt is kept. Returns the losses."""
    from ratchet.eval.niah import retrieval_examples
    from ratchet.model import set_context

    set_context(model, phase.seq_len, phase.rope_type, phase.factor, original=cfg.max_seq_len)
    pool = max(1, min(phase.steps * phase.batch, 2048))       # examples to draw the batches from
    n_retrieval = round(pool * phase.retrieval_share) if demos else pool
    examples = retrieval_examples(tokenizer, n_retrieval, phase.seq_len, key_digits=phase.key_digits, seed=seed)
    if demos and n_retrieval < pool:
        rng = random.Random(f"phase-demos:{seed}")
        examples += [demos[rng.randrange(len(demos))] for _ in range(pool - n_retrieval)]
    if log:
        log(f"context phase: {phase.seq_len} positions, rope {phase.rope_type} x{phase.factor}, "
            f"{n_retrieval}/{len(examples)} retrieval examples, {phase.steps} steps")
    return sft(model, tokenizer, examples, phase.steps, phase.batch, cfg.sft_lr, seed=seed, log=log)
