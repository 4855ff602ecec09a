"""Supervised warm start: teach the base policy the output format on demonstrations.

RL cannot discover a program shape the policy never produces, so the embedded model first
sees reference solutions for part of the training tasks (`ModelConfig.sft_fraction`).
The loss covers completion tokens (and EOS) only.

Revision demonstrations (multi-turn episodes) have the layout of an episode: after the prompt,
segments that alternate answer, observation, answer, ...:

    (prompt, [(wrong_attempt, False), (observation, False), (reference, True)])
    -> <bos> prompt | wrong <eos> | observation | reference <eos>     loss on "reference <eos>" only

Every answer ends with EOS, as a sampled answer does in an episode; the loss covers the trainable
answers and their EOS; an untrainable answer (a wrong attempt: context, not a target) and every
observation are context only. `demo_sequence` gives a demo's ids and loss mask (the
`TrainSample.loss_mask` convention: 1 = trained).
"""

from __future__ import annotations

import random
from typing import Callable, Sequence, Union

import torch

from ratchet.config import ModelConfig
from ratchet.train.batching import pack_rows

Segments = Sequence[tuple[str, bool]]
Demo = tuple[str, Union[str, Segments]]
"""(prompt, completion) or (prompt, [(text, trainable), ...]): answers and observations alternating."""


def demo_sequence(tokenizer, demo: Demo, where: str = "demo") -> tuple[list[int], list[int]]:
    """One demonstration -> (ids: <bos> + prompt + segments, each answer + <eos>; loss mask, 1 on the
    tokens trained on: the trainable answers and their EOS). A (prompt, completion) pair is the
    one-answer case. Raises ValueError naming `where` for a demo that is not of that shape."""
    prompt, rest = demo
    segments = [(rest, True)] if isinstance(rest, str) else list(rest)
    if not isinstance(prompt, str) or not segments or len(segments) % 2 == 0:
        raise ValueError(f"{where}: expected (prompt, completion) or (prompt, [(answer, trainable), (observation, "
                         f"False), ..., (answer, trainable)]): an odd number of segments, answers and observations "
                         f"alternating; got {len(segments)} segment(s)")
    from ratchet.model import text_ids
    ids = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for k, seg in enumerate(segments):
        if not (isinstance(seg, (tuple, list)) and len(seg) == 2 and isinstance(seg[0], str)
                and isinstance(seg[1], bool)):
            raise ValueError(f"{where}: segment {k} is {seg!r}, not (text, trainable)")
        text, trainable = seg
        answer = k % 2 == 0
        if not answer and trainable:
            raise ValueError(f"{where}: segment {k} is an observation (segments alternate answer, observation, "
                             f"answer, ...) and cannot be trainable: the model reads it, it does not write it")
        if answer:
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        else:   # as an episode encodes an observation: "<eos>" an answer printed into it is text, not that token
            tokens = text_ids(tokenizer, text)
        ids += tokens
        mask += [int(trainable)] * len(tokens)
    if not any(mask):
        raise ValueError(f"{where}: no trainable answer (nothing to learn from)")
    return ids, mask


def sft(model, tokenizer, examples: Sequence[Demo], steps: int, batch_size: int, lr: float,
        seed: int = 0, log=None, token_budget: int = 8192,
        pack: Callable[[list[int], int], list[list[int]]] = pack_rows) -> list[float]:
    """Train on demonstrations for `steps` steps; returns the loss per step. An example is a (prompt,
    completion) pair or a revision demo (prompt, [(text, trainable), ...]) (see `demo_sequence`).
    A step's batch is cut into micro-batches of rows of like length (`pack_rows`, at most
    `token_budget` padded tokens each: a revision demo is several times a plain one's length, and
    one micro-batch padded every row to the longest; `pack(lengths, budget)` -> micro-batches of
    row indices); the loss is the mean over the batch's trained tokens, so the gradient is the
    one of the whole batch at once."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    seqs = [demo_sequence(tokenizer, ex, where=f"sft example {i}") for i, ex in enumerate(examples)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / max(steps, 1)))
    model.train()
    losses = []
    for step in range(steps):
        batch = [seqs[rng.randrange(len(seqs))] for _ in range(batch_size)]
        targets = max(1, sum(sum(mask[1:]) for _, mask in batch))   # tokens predicted (the first is never)
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for micro in pack([len(ids) for ids, _ in batch], token_budget):
            ids, attn, labels = sft_batch([batch[i] for i in micro], pad)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]                # [B, T-1, V]
            part = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels[:, 1:].flatten(),
                                                     ignore_index=-100, reduction="sum") / targets
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss)
        if log and (step % 20 == 0 or step == steps - 1):
            log(f"sft step {step + 1}/{steps} loss {loss:.3f}")
    model.eval()
    return losses


def sft_batch(seqs: list[tuple[list[int], list[int]]], pad: int):
    """(ids, loss mask) sequences -> right-padded ids, attention, labels [B, T] (-100 where not trained)."""
    T = max(len(ids) for ids, _ in seqs)
    ids_t = torch.full((len(seqs), T), pad, dtype=torch.long)
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, (ids, mask) in enumerate(seqs):
        row = torch.tensor(ids)
        ids_t[b, :len(ids)] = row
        labels[b, :len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), row, -100)
        attn[b, :len(ids)] = 1
    return ids_t, attn, labels


def demonstrations(specs, fraction: float, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, reference) for a `fraction` of the tasks, drawn alike from every difficulty,
    so the base policy has seen every output shape (RL does not discover shapes it never
    produces) but solves few tasks: the rest is left to RL. Tasks without a reference are skipped."""
    rng = random.Random(f"demos:{seed}")
    return [(s.prompt, s.reference_solution) for s in specs
            if rng.random() < fraction and s.reference_solution is not None]


def warm_start(cfg: ModelConfig, specs, out_dir, log=None,
               revisions: Sequence[Demo] | Callable[[object], Sequence[Demo]] | None = None,
               own_revisions: Callable[[object, object], Sequence[Demo]] | None = None, own_steps: int = 0):
    """Build the embedded tiny model for `specs` (tokenizer, weights) and SFT it; save it in
    Hugging Face layout under `out_dir`. Returns the SFT losses. `revisions`: revision demos
    (prompt, [(wrong, False), (observation, False), (fix, True)]) mixed into the demonstrations;
    their text joins the tokenizer's corpus, so that observations tokenize as compactly as code.
    A callable `revisions(tokenizer)` gives them for the tokenizer built here (None: for its corpus),
    so that their observations are cut to a token budget as an episode's are (`ratchet.agent.demos_from`).
    `own_revisions(model, tokenizer)` with `own_steps`: after the SFT, revision demos built from what
    the model now answers (`ratchet.agent.own_attempts`), then `own_steps` more steps on them with
    the demonstrations, in the proportion the first SFT mixed the two (`own_phase`)."""
    from ratchet.model import build_model, build_tokenizer, save_policy

    demos_for = revisions if callable(revisions) else (lambda tokenizer: revisions or [])
    corpus = [s.prompt + (s.reference_solution or "") for s in specs]
    corpus += [rest if isinstance(rest, str) else "".join(str(seg[0]) for seg in rest) for _, rest in demos_for(None)]
    tokenizer = build_tokenizer(corpus, cfg.vocab_size)
    revisions = list(demos_for(tokenizer))
    for i, demo in enumerate(revisions):   # a malformed demo is named here, not as an sft example index
        demo_sequence(tokenizer, demo, where=f"revision demo {i}")
    model = build_model(cfg, tokenizer)
    plain = demonstrations(specs, cfg.sft_fraction, cfg.seed)
    demos = plain + revisions
    losses = sft(model, tokenizer, demos, cfg.sft_steps, cfg.sft_batch, cfg.sft_lr, seed=cfg.seed, log=log)
    if own_revisions is not None and own_steps > 0:
        own = list(own_revisions(model, tokenizer))
        mix = own_phase(plain, len(revisions), own, cfg.seed)
        if log:
            log(f"own-mistake revision demos: {len(own)} (with {len(mix) - len(own)} demonstrations), {own_steps} steps")
        seed = cfg.seed + len(cfg.context_phases) + 1                      # not a context phase's
        losses += sft(model, tokenizer, mix, own_steps, cfg.sft_batch, cfg.sft_lr, seed=seed, log=log)
        demos = demos + own                                                # the context phases keep them
    for i, phase in enumerate(cfg.context_phases):
        losses += extend_context(model, tokenizer, phase, demos, cfg, seed=cfg.seed + i + 1, log=log)
    save_policy(model, tokenizer, out_dir)
    return losses


def own_phase(plain: Sequence[Demo], n_revisions: int, own: Sequence[Demo], seed: int = 0) -> list[Demo]:
    """The examples of the own-mistake phase: `own` revision demos and as many of the `plain`
    demonstrations as keep the first SFT's proportion (len(plain) to `n_revisions`; every one at
    most, and every one when the first SFT had no revision demos), drawn with `seed`."""
    if not own:
        raise ValueError("own-mistake revision demos: none were built (every sampled first answer passed, was "
                         "empty or an env_error); turn agent.own_revision_steps off or give it tasks the model fails")
    k = len(plain) if not n_revisions else min(len(plain), round(len(own) * len(plain) / n_revisions))
    return random.Random(f"own-phase:{seed}").sample(list(plain), k) + list(own)


def extend_context(model, tokenizer, phase, demos: Sequence[Demo], cfg: ModelConfig, seed: int = 0,
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
