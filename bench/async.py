"""Benchmark: the nightly flow with generation decoupled from training (rollout.mode async) against
the same flow in sync mode: same waves, same start, same config otherwise.

    python -m bench.async                       # ~10-15 min on 2 CPU cores; the LAST line is one JSON object
    python -m bench.async --steps 8 --seeds 0,1 --threads 2 --prompts 32 --group 8 --staleness 1 --eval-tasks 200

(`async` is a Python keyword: run it with -m; `import bench.async` is a syntax error.)

1. A warm-up run (sync, 1 wave) produces and audits the python_functions tasks into a temporary
   store and builds the start: the embedded model warm-started by SFT, its version-0 checkpoint.
2. Per seed of `--seeds` (`train.seed`: which tasks each wave draws and the sampling), two runs of
   `--steps` waves, each from that checkpoint (`model.path`), the store's audited tasks reused: sync
   (each wave sampled, scored, trained in turn) and async (`rollout.mode: async`,
   `rollout.max_staleness: --staleness`: the engine samples the next waves from a copy of older
   weights while a wave is scored and trained; the loss corrects with truncated IS, `rl.is_cap`).
   The order alternates by seed (the first seed sync first; `--async-first`: the other way round),
   so a drift of the machine's load hits both modes; the load averages are printed after each run.

Fair threads: both modes run with the same total of torch intra-op threads, `--threads` T (default:
the machine's cores), set in the main thread before each run (threads that set none inherit it).
Sync runs each stage on T threads; async splits T between its two concurrent sides
(ratchet.rollout.behaviour.cpu_share: T // 2 for the sampling thread and T // 2 for the training
thread). What async gains is the overlap of stages
(and what T // 2-thread ops save over T-thread ops on a small model), never more threads. Sandboxed
scoring runs in processes of its own, the same in both modes.

Reported per mode, means over the seeds (and `per_seed`): `wall_s`, the wave loop's wall time (from
the base evaluation's record to the last wave's stats.json: every rollout, scoring, gate and
training epoch); `flow_s`, the whole flow (+ start-up, base and final evaluation); `pass_rate`,
held-out pass@1 of the final policy (greedy, `--eval-tasks` tasks; per seed with its 95% CI over
tasks); and the mean staleness of the waves trained. `ratio` = async wall_s / sync wall_s (goal <=
0.7). `pass_gap`: async - sync pass@1 with a 95% paired bootstrap CI over the held-out tasks (each
task's pass rate averaged over the seeds, both modes on the same tasks): pass@1 is within noise of
sync when that interval holds 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def config(store: str, run_id: str, args, seed: int = 0, **rollout):
    from ratchet.config import EnvsConfig, EvalConfig, ModelConfig, NightlyConfig, RolloutConfig, StoreConfig, TrainConfig

    return NightlyConfig(
        run_id=run_id, steps=args.steps, checkpoint_every=10_000, store=StoreConfig(uri=store),
        envs=EnvsConfig(families=("python_functions",), n_train=args.train_tasks, n_heldout=args.eval_tasks),
        model=ModelConfig(path=rollout.pop("model_path", None)),
        rollout=RolloutConfig(prompts_per_wave=args.prompts, group_size=args.group, **rollout),
        eval=EvalConfig(n_tasks=args.eval_tasks, min_gain=1.0), train=TrainConfig(seed=seed),
    )


def loop_wall(store: Path, run_id: str, steps: int) -> float:
    """From the base evaluation's record (written just before the first wave) to the last wave's stats."""
    start = (store / f"runs/{run_id}/eval/{0:06d}.json").stat().st_mtime
    end = (store / f"runs/{run_id}/waves/{steps - 1:06d}/stats.json").stat().st_mtime
    return end - start


def run(store: Path, run_id: str, args, seed: int, **rollout) -> dict:
    from flows.nightly import nightly

    t0 = time.perf_counter()
    summary = nightly(config(str(store), run_id, args, seed, **rollout))
    flow_s = time.perf_counter() - t0
    history = summary["history"]
    return {"seed": seed, "wall_s": round(loop_wall(store, run_id, args.steps), 1), "flow_s": round(flow_s, 1),
            "pass_rate": summary["final_pass_rate"], "ci": summary["final"]["ci"],
            "results": summary["final"]["results"], "threads_after": torch.get_num_threads(),
            "base_pass_rate": summary["base_pass_rate"],
            "staleness_mean": round(sum(h.get("staleness", 0) for h in history) / len(history), 2),
            "reward_mean": round(sum(h["reward_mean"] for h in history) / len(history), 4),
            "load_avg_after": [round(x, 1) for x in os.getloadavg()]}


def mode_summary(runs: list[dict]) -> dict:
    """Means over the seeds, and each seed's figures."""
    mean = lambda key: round(statistics.mean(r[key] for r in runs), 4)  # noqa: E731
    per_seed = [{k: v for k, v in r.items() if k != "results"} for r in runs]
    return {"wall_s": round(mean("wall_s"), 1), "pass_rate": mean("pass_rate"), "flow_s": round(mean("flow_s"), 1),
            "staleness_mean": mean("staleness_mean"), "per_seed": per_seed}


def pass_gap(sync: list[dict], asyn: list[dict]) -> dict:
    """async - sync pass@1, paired over the held-out tasks, each task's pass rate the mean over seeds."""
    from ratchet.eval.stats import paired_bootstrap

    def per_task(runs):   # task -> mean over seeds of its greedy pass (env errors left out)
        tasks = [t for t in runs[0]["results"] if all(r["results"].get(t) is not None for r in runs)]
        return {t: statistics.mean(float(r["results"][t][0]) for r in runs) for t in tasks}

    a, s = per_task(asyn), per_task(sync)
    common = [t for t in a if t in s]
    est, lo, hi = paired_bootstrap([a[t] for t in common], [s[t] for t in common])
    return {"estimate": round(est, 4), "ci": [round(lo, 4), round(hi, 4)], "tasks": len(common),
            "within_noise": lo <= 0.0 <= hi}


def main() -> None:
    # before Prefect is imported (here and in the spawned runs, which inherit it); set here, not at
    # import, so that importing this module (tests do) leaves the importer's environment alone
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="waves per run")
    p.add_argument("--prompts", type=int, default=32, help="prompts per wave")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness of the async run")
    p.add_argument("--eval-tasks", type=int, default=300, help="held-out tasks evaluated (greedy pass@1)")
    p.add_argument("--seeds", default="0,1", help="train.seed of each sync/async pair, comma-separated")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch intra-op threads in all, the same for both modes (async splits them in two)")
    p.add_argument("--async-first", action="store_true", help="the first seed's pair runs async first (then alternates)")
    p.add_argument("--train-tasks", type=int, default=1000, help="training tasks produced (and audited)")
    args = p.parse_args()

    seeds = [int(x) for x in args.seeds.split(",")]
    torch.set_num_threads(args.threads)                  # one total for both modes (see the docstring)
    from prefect.testing.utilities import prefect_test_harness

    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    orders = []
    with tempfile.TemporaryDirectory(prefix="ratchet-bench-async-") as tmp, prefect_test_harness(server_startup_timeout=180):
        store = Path(tmp)
        from flows.nightly import nightly

        warm = config(str(store), "bench-warm", args).model_copy(update={"steps": 1})
        nightly(warm)
        start = str(store / "runs/bench-warm/checkpoints/000000")      # the SFT warm start, version 0
        for i, seed in enumerate(seeds):
            todo = {"sync": lambda: run(store, f"bench-sync-{seed}", args, seed, model_path=start),
                    "async": lambda: run(store, f"bench-async-{seed}", args, seed, model_path=start, mode="async",
                                         max_staleness=args.staleness)}
            order = ["async", "sync"] if args.async_first != (i % 2 == 1) else ["sync", "async"]
            orders.append(order)
            for mode in order:
                torch.set_num_threads(args.threads)
                runs[mode].append(todo[mode]())
                print(json.dumps({"mode": mode, **{k: v for k, v in runs[mode][-1].items() if k != "results"}}), flush=True)
    sync, asyn = mode_summary(runs["sync"]), mode_summary(runs["async"])
    out = {"sync": sync, "async": asyn, "ratio": round(asyn["wall_s"] / sync["wall_s"], 3),
           "ratio_per_seed": [round(a["wall_s"] / s["wall_s"], 3) for s, a in zip(runs["sync"], runs["async"])],
           "pass_gap": pass_gap(runs["sync"], runs["async"]),
           "steps": args.steps, "prompts": args.prompts, "group": args.group, "max_staleness": args.staleness,
           "seeds": seeds, "orders": orders, "torch_threads": args.threads, "cpus": os.cpu_count(),
           "load_avg": [round(x, 1) for x in os.getloadavg()]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
