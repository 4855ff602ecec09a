"""Benchmark: the nightly flow with generation decoupled from training (rollout.mode async) against
the same flow in sync mode: same waves, same start, same config otherwise.

    python -m bench.async                       # ~5-10 min on 2 CPU cores; the LAST line is one JSON object
    python -m bench.async --steps 12 --prompts 32 --group 8 --staleness 1 --eval-tasks 300 --train-tasks 1000

(`async` is a Python keyword: run it with -m; `import bench.async` is a syntax error.)

1. A warm-up run (sync, 1 wave) produces and audits the python_functions tasks into a temporary
   store and builds the start: the embedded model warm-started by SFT, its version-0 checkpoint.
2. Two runs of `--steps` waves, each from that checkpoint (`model.path`), the store's audited
   tasks reused: sync (each wave sampled, scored, trained in turn) and async (`rollout.mode: async`,
   `rollout.max_staleness: --staleness`: the engine samples the next waves from a copy of older
   weights while a wave is scored and trained; the loss corrects with truncated IS, `rl.is_cap`).
   One pair per invocation, sync first (`--async-first`: the other order); on a shared machine run
   both orders and compare the load averages printed: a load change between the two runs moves
   the ratio more than anything measured.

Reported per mode: `wall_s`, the wave loop's wall time (from the base evaluation's record to the
last wave's stats.json: every rollout, scoring, gate and training epoch); `flow_s`, the whole
flow (+ start-up, base and final evaluation); `pass_rate`, held-out pass@1 of the final policy
(greedy, `--eval-tasks` tasks) with its 95% CI; and the mean staleness of the waves trained.
`ratio` = async wall_s / sync wall_s (goal <= 0.7), with pass@1 within noise of sync.

On CPU the two sides of async share the machine: sampling runs in a Prefect worker thread, scoring
in sandbox processes, training in the flow's thread; each torch thread uses half the cores while
async (ratchet.rollout.behaviour.cpu_share). What overlaps is what the other side does not use.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def config(store: str, run_id: str, args, **rollout):
    from ratchet.config import EnvsConfig, EvalConfig, ModelConfig, NightlyConfig, RolloutConfig, StoreConfig

    return NightlyConfig(
        run_id=run_id, steps=args.steps, checkpoint_every=10_000, store=StoreConfig(uri=store),
        envs=EnvsConfig(families=("python_functions",), n_train=args.train_tasks, n_heldout=args.eval_tasks),
        model=ModelConfig(path=rollout.pop("model_path", None)),
        rollout=RolloutConfig(prompts_per_wave=args.prompts, group_size=args.group, **rollout),
        eval=EvalConfig(n_tasks=args.eval_tasks, min_gain=1.0),
    )


def loop_wall(store: Path, run_id: str, steps: int) -> float:
    """From the base evaluation's record (written just before the first wave) to the last wave's stats."""
    start = (store / f"runs/{run_id}/eval/{0:06d}.json").stat().st_mtime
    end = (store / f"runs/{run_id}/waves/{steps - 1:06d}/stats.json").stat().st_mtime
    return end - start


def run(store: Path, run_id: str, args, **rollout) -> dict:
    from flows.nightly import nightly

    t0 = time.perf_counter()
    summary = nightly(config(str(store), run_id, args, **rollout))
    flow_s = time.perf_counter() - t0
    history = summary["history"]
    return {"wall_s": round(loop_wall(store, run_id, args.steps), 1), "flow_s": round(flow_s, 1),
            "pass_rate": summary["final_pass_rate"], "ci": summary["final"]["ci"],
            "base_pass_rate": summary["base_pass_rate"],
            "staleness_mean": round(sum(h.get("staleness", 0) for h in history) / len(history), 2),
            "reward_mean": round(sum(h["reward_mean"] for h in history) / len(history), 4),
            "load_avg_after": [round(x, 1) for x in os.getloadavg()]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="waves per run")
    p.add_argument("--prompts", type=int, default=32, help="prompts per wave")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness of the async run")
    p.add_argument("--eval-tasks", type=int, default=300, help="held-out tasks evaluated (greedy pass@1)")
    p.add_argument("--async-first", action="store_true", help="run the async flow first (machine drift hits the other side)")
    p.add_argument("--train-tasks", type=int, default=1000, help="training tasks produced (and audited)")
    args = p.parse_args()

    from prefect.testing.utilities import prefect_test_harness

    with tempfile.TemporaryDirectory(prefix="ratchet-bench-async-") as tmp, prefect_test_harness(server_startup_timeout=180):
        store = Path(tmp)
        from flows.nightly import nightly

        warm = config(str(store), "bench-warm", args).model_copy(update={"steps": 1})
        nightly(warm)
        start = store / "runs/bench-warm/checkpoints/000000"          # the SFT warm start, version 0
        runs = {"sync": lambda: run(store, "bench-sync", args, model_path=str(start)),
                "async": lambda: run(store, "bench-async", args, model_path=str(start), mode="async",
                                     max_staleness=args.staleness)}
        order = ["async", "sync"] if args.async_first else ["sync", "async"]
        done = {mode: runs[mode]() for mode in order}
        sync, asyn = done["sync"], done["async"]
    out = {"sync": sync, "async": asyn, "ratio": round(asyn["wall_s"] / sync["wall_s"], 3),
           "steps": args.steps, "prompts": args.prompts, "group": args.group, "max_staleness": args.staleness, "order": order,
           "cpus": os.cpu_count(), "load_avg": [round(x, 1) for x in os.getloadavg()]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
