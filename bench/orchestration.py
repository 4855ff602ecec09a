"""Benchmark: what Prefect's orchestration costs on a small nightly cycle, interleaved with a bare loop.

    python -m bench.orchestration                 # ~3-6 min on 2 CPU cores; last line one JSON object
    python -m bench.orchestration --pairs 3 --steps 4

Both sides run the same code, `flows.nightly.nightly`'s body, on the same small config (the
embedded default model and wave shape, `--prompts` prompts per wave, a short warm start):

- prefect: `nightly(cfg)`, a flow run with every stage a task run (state tracking, result
  persistence, retries armed, logs and artifacts through the API of a Prefect server started
  once, before timing: the temporary test server, as `ratchet run`'s ephemeral one);
- bare: `nightly.fn(cfg)` with every task replaced by its own `.fn` (the plain function), under
  `disable_run_logger()`: the same core calls in the same order, no orchestration.

Pairs alternate (prefect, bare, bare, prefect, ...) so machine load hits both alike; each run
gets a fresh run id in one shared store (environment production is reused after the warm-up,
as a nightly reuses yesterday's snapshot) and min_gain 1.0 (nothing is promoted, so no run
evaluates an incumbent the other did not). Figures: medians. Last line:
{"prefect_s", "bare_s", "ratio", "runs", "steps", "per_run": [...]}. Goal: ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time


def small(store: str, run_id: str, steps: int, prompts: int):
    from ratchet.config import (EnvsConfig, EvalConfig, GateConfig, ModelConfig, MonitorConfig, NightlyConfig,
                                RolloutConfig, StoreConfig)

    return NightlyConfig(
        run_id=run_id, steps=steps, checkpoint_every=2, store=StoreConfig(uri=store),
        envs=EnvsConfig(n_train=200, n_heldout=48),
        model=ModelConfig(sft_steps=20),                  # the embedded default model, a short warm start
        rollout=RolloutConfig(prompts_per_wave=prompts),  # group 8, 48 new tokens: the defaults
        gate=GateConfig(max_zero_variance_frac=1.0),           # a short warm start: many all-equal groups
        monitor=MonitorConfig(max_zero_variance_frac=None),
        eval=EvalConfig(n_tasks=48, min_gain=1.0),
    )


@contextlib.contextmanager
def bare_tasks():
    """Every task the nightly flow calls, replaced by its plain function for the duration."""
    import flows.nightly as module
    from prefect import Task
    from prefect.logging import disable_run_logger

    tasks = {name: obj for name, obj in vars(module).items() if isinstance(obj, Task)}
    try:
        for name, t in tasks.items():
            setattr(module, name, t.fn)
        with disable_run_logger():
            yield
    finally:
        for name, t in tasks.items():
            setattr(module, name, t)


def run_once(mode: str, store: str, run_id: str, steps: int, prompts: int) -> float:
    from flows.nightly import nightly

    cfg = small(store, run_id, steps, prompts)
    t0 = time.perf_counter()
    if mode == "prefect":
        nightly(cfg)
    else:
        with bare_tasks():
            nightly.fn(cfg)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="(prefect, bare) pairs timed after the warm-up")
    ap.add_argument("--steps", type=int, default=4, help="waves per run")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per wave (x 8 samples)")
    args = ap.parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    import torch
    from prefect.testing.utilities import prefect_test_harness

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"prefect": [], "bare": []}
    per_run = []
    with tempfile.TemporaryDirectory(prefix="bench-orch-") as store, prefect_test_harness(server_startup_timeout=180):
        run_once("prefect", store, "warmup-prefect", 1, args.prompts)   # starts the server, produces the envs
        run_once("bare", store, "warmup-bare", 1, args.prompts)
        for i in range(args.pairs):
            order = ("prefect", "bare") if i % 2 == 0 else ("bare", "prefect")
            for mode in order:
                s = run_once(mode, store, f"{mode}-{i}", args.steps, args.prompts)
                times[mode].append(s)
                per_run.append({"mode": mode, "pair": i, "wall_s": round(s, 2)})
                print(json.dumps(per_run[-1]), file=sys.stderr, flush=True)
    prefect_s, bare_s = statistics.median(times["prefect"]), statistics.median(times["bare"])
    out = {"prefect_s": round(prefect_s, 2), "bare_s": round(bare_s, 2), "ratio": round(prefect_s / bare_s, 3),
           "runs": args.pairs, "steps": args.steps, "prompts": args.prompts, "per_run": per_run}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
