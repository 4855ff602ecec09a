"""Benchmark: the needle-in-a-haystack probe on the embedded model, without and with context extension.

    python -m bench.niah                        # ~5 CPU-minutes on one thread; the LAST line is one JSON object
    python -m bench.niah --digits 3 --short-steps 4000    # 3-digit keys: not yet copied after 1200 steps

One embedded model (ratchet.model: tokenizer on python_functions tasks, Llama-style weights; a
smaller width than `ModelConfig`'s default unless --hidden/--layers say otherwise, so it runs in
minutes on a shared CPU) goes through the stages of `warm_start` with context phases, probed after each:
  base      the warm-start SFT on task demonstrations (what `make run` builds: no phases)
  short     + a phase at model.max_seq_len (retrieval trained short, no RoPE scaling)
  extended  + a phase at `factor` x the positions with RoPE scaling (linear by default)
and, between the last two, the short model given the extended context's RoPE scaling untrained
(`scaled`: what the scaling alone does). All are probed at the same lengths (past their context
with beyond_limit) and depths; the tables are printed and each trained model is saved under --out
(`ratchet eval niah --model DIR --key-digits D` re-probes it). The phases train on retrieval
sequences only here (retrieval_share 1.0): the figure is about retrieval. The keys have 2 digits by
default (--digits; the loss is on the answer only): this 2-layer model copies 2 digits after ~1000
steps of 8 at lr 3e-3, 3 digits not yet after 1200, and 5 digits stayed at chance (250 x 16 at 2e-3).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from envs.registry import get_family
from ratchet.config import ContextPhase, ModelConfig, NiahConfig
from ratchet.eval.niah import probe
from ratchet.model import build_model, build_tokenizer, save_policy, set_context
from ratchet.train.sft import demonstrations, extend_context, sft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--warm-steps", type=int, default=30)
    ap.add_argument("--short-steps", type=int, default=2000)
    ap.add_argument("--long-steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--factor", type=float, default=4.0)
    ap.add_argument("--rope", default="linear")
    ap.add_argument("--lengths", default="120,250,500")
    ap.add_argument("--depths", default="0,0.5,1")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="/tmp/ratchet-niah")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fam = get_family("python_functions")
    specs = [fam.generate(fam.config(), 0, i, 1 + i % 3, "train") for i in range(600)]
    cfg = ModelConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                      max_seq_len=args.max_seq_len, sft_steps=args.warm_steps, sft_lr=args.lr)
    short = ContextPhase(seq_len=cfg.max_seq_len, steps=args.short_steps, batch=args.batch, retrieval_share=1.0,
                         key_digits=args.digits)
    long = ContextPhase(seq_len=int(cfg.max_seq_len * args.factor), steps=args.long_steps, retrieval_share=1.0,
                        batch=max(1, round(args.batch / 2)), rope_type=args.rope, factor=args.factor,
                        key_digits=args.digits)
    probe_cfg = NiahConfig(lengths=tuple(int(x) for x in args.lengths.split(",")), key_digits=args.digits,
                           depths=tuple(float(x) for x in args.depths.split(",")), trials=args.trials, beyond_limit=True)
    t0 = time.perf_counter()
    tokenizer = build_tokenizer([s.prompt + s.reference_solution for s in specs], cfg.vocab_size)
    model = build_model(cfg, tokenizer)
    demos = demonstrations(specs, cfg.sft_fraction, cfg.seed)
    sft(model, tokenizer, demos, cfg.sft_steps, cfg.sft_batch, cfg.sft_lr, seed=cfg.seed, log=print)
    out = {"config": {**vars(args), "params": sum(p.numel() for p in model.parameters())}}
    for i, (name, phase) in enumerate((("base", None), ("short", short), ("scaled", None), ("extended", long))):
        t1 = time.perf_counter()
        if name == "scaled":      # the short model, the extended context's RoPE scaling, no training
            set_context(model, long.seq_len, long.rope_type, long.factor, original=cfg.max_seq_len)
        losses = extend_context(model, tokenizer, phase, demos, cfg, seed=cfg.seed + i, log=print) if phase else []
        t2 = time.perf_counter()
        if name != "scaled":
            save_policy(model, tokenizer, Path(args.out) / name)
        result = probe(model, tokenizer, probe_cfg)
        print(f"\n== {name}{'' if name == 'scaled' else ': ' + str(Path(args.out) / name)}\n{result.text()}\n", flush=True)
        out[name] = {"train_s": round(t2 - t1, 1), "probe_s": round(time.perf_counter() - t2, 1),
                     "final_loss": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 3) if losses else None,
                     **{k: v for k, v in result.summary().items() if k != "table"}}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
