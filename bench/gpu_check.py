"""GPU check: everything ratchet does on a GPU, in one run, printing one JSON line.

On a machine with a CUDA GPU, from the repository root, with ratchet's venv (torch with CUDA) and
vLLM installed in a venv of its own (its pins conflict with Prefect's: never in ratchet's venv):

    python3 -m venv /opt/vllm && /opt/vllm/bin/pip install vllm          # once
    .venv/bin/python -m bench.gpu_check --vllm-python /opt/vllm/bin/python
    .venv/bin/python -m bench.gpu_check --vllm-python /opt/vllm/bin/python --model /models/Qwen2.5-0.5B  # any local HF model
    .venv/bin/python -m bench.gpu_check --skip vllm,nightly              # without vLLM: the torch parts only

Checks, each on its own (a failure is recorded, the next check still runs); ~3-6 min on one GPU:
- `torch_bf16`: the torch rollout engine on CUDA with the policy in bf16: sampled tokens/s, and
  that its behaviour log-probs are finite and agree with a bf16 forward of the same tokens.
- `deepspeed_zero2_bf16`: one DeepSpeed ZeRO-2 bf16 training step (single process) on a synthetic
  wave: the loss is finite and the weights moved.
- `vllm`: vLLM started from `--vllm-python` (prefix caching on), a generation, then a weight sync
  (rollout.vllm_sync: reload) to a different checkpoint: its greedy log-probs follow the new
  weights (compared with the torch engine on them); start, sync and generation times.
- `nightly_vllm`: a 3-wave nightly flow with `rollout.engine: vllm` on the tiny model (the weights
  published to vLLM after every epoch), ending with its summary's pass rates.
The model is ratchet's embedded tiny model (built here, no download) unless `--model` names a
local Hugging Face model directory (then the vLLM sync reloads the same weights: it checks the
mechanism and its time, not a change of weights). The last line printed is one JSON object:
`{"ok": bool, "checks": {name: {"ok": bool, ...figures or "error"}}, "device": ...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from tests.train import tiny

PROMPTS = ["# add 3, then negate it\ndef f(x):\n", "# add 7\ndef f(x):\n", "def f(x):\n    x = x + 1\n"]


def tiny_checkpoint(path: Path, seed: int) -> Path:
    from ratchet.model import build_model, build_tokenizer, save_policy

    tok = build_tokenizer(tiny.CORPUS, 300)
    return save_policy(build_model(tiny.TINY.model_copy(update={"seed": seed, "max_seq_len": 256}), tok), tok, path)


def check_torch_bf16(model_dir: Path) -> dict:
    from ratchet.model import load_policy
    from ratchet.rollout.torch_engine import TorchEngine
    from ratchet.train.policy import token_logprobs

    model, tok = load_policy(model_dir)
    model = model.to("cuda", torch.bfloat16).eval()
    engine = TorchEngine(model, tok)                                # runs where the weights are
    engine.generate(PROMPTS, n=2, max_new_tokens=8, seed=0)            # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(PROMPTS * 8, n=8, max_new_tokens=48, seed=1)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(r.completion_ids) for r in out)
    r = max(out, key=lambda r: len(r.completion_ids))
    ids = torch.tensor([r.prompt_ids + r.completion_ids], device="cuda")
    with torch.no_grad():
        ref, _ = token_logprobs(model, ids, torch.ones_like(ids))
    ref = ref[0, len(r.prompt_ids) - 1:].float().cpu()
    diff = float((torch.tensor(r.logprobs) - ref).abs().max())
    finite = all(torch.isfinite(torch.tensor(x.logprobs)).all() for x in out)
    return {"ok": bool(finite and diff < 0.1), "tokens_per_s": round(tokens / dt), "max_logprob_diff": round(diff, 4),
            "dtype": str(next(model.parameters()).dtype)}


def check_deepspeed_zero2(model_dir: Path) -> dict:
    from ratchet.config import RLConfig, TrainConfig
    from ratchet.model import load_policy
    from ratchet.train.deepspeed_trainer import DeepSpeedTrainer

    # No rendezvous variables set here: the trainer starts its one-process group as a run does
    # (ratchet.train.deepspeed_trainer.init_distributed: an in-memory store, no port)
    model, tok = load_policy(model_dir)
    wave = tiny.wave(model, seed=0, n_groups=2, group_size=4)   # token ids < 259: inside any model's vocabulary
    before = {k: v.detach().float().clone() for k, v in model.named_parameters()}
    trainer = DeepSpeedTrainer(model, tok.pad_token_id, TrainConfig(backend="deepspeed", zero_stage=2, bf16=True,
                                                                    updates_per_batch=1, lr=1e-3), RLConfig())
    t0 = time.perf_counter()
    metrics = trainer.train_wave(wave)
    dt = time.perf_counter() - t0
    moved = max(float((p.detach().float().cpu() - before[k].cpu()).abs().max()) for k, p in model.named_parameters())
    finite = all(v == v and abs(v) != float("inf") for v in metrics.values() if isinstance(v, float))
    return {"ok": bool(finite and moved > 0), "step_s": round(dt, 3), "max_weight_change": moved,
            "grad_norm": metrics.get("grad_norm"), "device": str(trainer.device)}


def check_vllm(vllm_python: str, a: Path, b: Path, args: list[str]) -> dict:
    from ratchet.model import load_policy
    from ratchet.rollout.torch_engine import TorchEngine
    from ratchet.rollout.vllm import vllm_engine

    t0 = time.perf_counter()
    engine = vllm_engine(vllm_python, str(a), args)
    start_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        first = engine.generate(PROMPTS, n=8, max_new_tokens=32, seed=0)
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.set_policy_version(1, path=str(b))
        sync_s = time.perf_counter() - t0
        got = engine.generate(PROMPTS, n=1, max_new_tokens=8, greedy=True)
        model, tok = load_policy(b)
        want = TorchEngine(model.eval(), tok).generate(PROMPTS, n=1, max_new_tokens=8, greedy=True)
        same = [g.completion_ids == w.completion_ids for g, w in zip(got, want)]
        diffs = [max(abs(x - y) for x, y in zip(g.logprobs, w.logprobs)) for g, w, s in zip(got, want, same) if s]
        followed = any(same) and max(diffs) < 0.05
        return {"ok": bool(followed and len(first) == len(PROMPTS) * 8), "start_s": round(start_s, 1),
                "generate_s": round(gen_s, 2), "sync_s": round(sync_s, 2), "sync": engine.sync,
                "greedy_same_tokens": same, "max_logprob_diff": round(max(diffs), 4) if diffs else None}
    finally:
        engine.server.stop()


def check_nightly_vllm(vllm_python: str, store: Path, args: list[str], model_dir: Path | None) -> dict:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    from flows.nightly import nightly
    from ratchet.config import (EnvsConfig, EvalConfig, GateConfig, ModelConfig, MonitorConfig, NightlyConfig,
                                RolloutConfig, StoreConfig, TrainConfig)

    cfg = NightlyConfig(
        run_id="gpu-check", steps=3, checkpoint_every=3, store=StoreConfig(uri=str(store)),
        envs=EnvsConfig(n_train=60, n_heldout=12),
        model=ModelConfig(path=str(model_dir) if model_dir else None, hidden_size=32, num_layers=1, num_heads=2,
                          vocab_size=200, sft_steps=20, sft_batch=16),
        rollout=RolloutConfig(prompts_per_wave=4, group_size=4, max_new_tokens=16, engine="vllm",
                              vllm_python=vllm_python, vllm_args=tuple(args)),
        train=TrainConfig(minibatch_prompts=2), gate=GateConfig(max_zero_variance_frac=1.0),
        eval=EvalConfig(n_tasks=12, min_gain=1.0), monitor=MonitorConfig(max_zero_variance_frac=None),
    )
    t0 = time.perf_counter()
    with prefect_test_harness(server_startup_timeout=180):
        summary = nightly(cfg)
    return {"ok": summary["policy_version"] == 3 and len(summary["history"]) == 3, "wall_s": round(time.perf_counter() - t0, 1),
            "base_pass_rate": summary["base_pass_rate"], "final_pass_rate": summary["final_pass_rate"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=os.environ.get("RATCHET_VLLM_PYTHON"),
                   help="python of vLLM's own venv [env RATCHET_VLLM_PYTHON]")
    p.add_argument("--model", type=Path, default=None, help="a local HF model directory (default: the embedded tiny model)")
    p.add_argument("--vllm-arg", action="append", default=["--gpu-memory-utilization", "0.3", "--max-model-len", "256"],
                   help="extra vLLM server argument (repeatable)")
    p.add_argument("--skip", default="", help="comma-separated checks to skip: torch_bf16,deepspeed,vllm,nightly")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    checks: dict[str, dict] = {}

    def attempt(name: str, fn) -> None:
        if name.split("_")[0] in skip or name in skip:
            checks[name] = {"ok": None, "skipped": True}
            return
        t0 = time.perf_counter()
        try:
            checks[name] = fn()
        except Exception as e:   # recorded; the next check still runs
            checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                            "where": traceback.format_exc(limit=3)[-1500:]}
        checks[name]["check_s"] = round(time.perf_counter() - t0, 1)

    with tempfile.TemporaryDirectory(prefix="ratchet-gpu-check-") as tmp:
        tmp = Path(tmp)
        a = args.model or tiny_checkpoint(tmp / "a", 0)
        b = tiny_checkpoint(tmp / "b", 1) if args.model is None else args.model
        if not torch.cuda.is_available():
            checks["cuda"] = {"ok": False, "error": "no CUDA device visible to torch"}
        else:
            attempt("torch_bf16", lambda: check_torch_bf16(a))
            attempt("deepspeed_zero2_bf16", lambda: check_deepspeed_zero2(a))
            if args.vllm_python:
                attempt("vllm", lambda: check_vllm(args.vllm_python, a, b, args.vllm_arg))
                attempt("nightly_vllm", lambda: check_nightly_vllm(args.vllm_python, tmp / "store", args.vllm_arg, args.model))
            else:
                checks["vllm"] = checks["nightly_vllm"] = {"ok": False, "error": "no --vllm-python (or RATCHET_VLLM_PYTHON)"}
    ran = [c["ok"] for c in checks.values() if c.get("ok") is not None]
    print(json.dumps({"ok": bool(ran) and all(ran), "checks": checks,
                      "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
