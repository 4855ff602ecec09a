"""Benchmark: does training on multi-turn episodes teach the embedded model to use the sandbox's feedback?

    python -m bench.multiturn                       # ~35 min on 2 CPU cores (two seeds ~45); the LAST line is one JSON object
    python -m bench.multiturn --seeds 0 1 2 --budget 200000 --prompts 32 --turns 3
    python -m bench.multiturn --credit trajectory   # the K-turn run credits every answer with the episode's reward
    python -m bench.multiturn --sft-steps 130       # make run's shorter warm start (model.sft_steps; default 400)
    python -m bench.multiturn --loss-agg seq_mean_token_mean      # the K-turn run's loss: each episode one sequence (before 2026-12-05)
    python -m bench.multiturn --repeat-reward 0     # a revision that repeats the failed answer before it scores 0
    python -m bench.multiturn --overlong-buffer 12  # an answer within 12 tokens of the 48-token cap loses up to 1 (DAPO)
    python -m bench.multiturn --warm-seed 1         # another warm start (model.seed): both runs of every seed start from it
    python -m bench.multiturn --own-revision-steps 0     # the warm start without its 100 SFT steps on its own mistakes (before 2026-12-06)
    python -m bench.multiturn --seeds 0 1 2 3       # ~65 min alone, ~85 beside a CI run (2026-12-07)
    python -m bench.multiturn --budget 1800000 --eval-at 900000   # twice the budget, both runs also evaluated halfway
    python -m bench.multiturn --branch 2            # the K-turn run's first answers each revised by 2 episodes apart

1. The start, shared by every run: python_functions tasks produced and audited into a temporary
   store, and the embedded model warm-started by SFT with revision demonstrations
   (`agent.revision_demos`: 1 to K - 1 wrong attempts, each with the sandbox's real feedback on it, then
   the fix, so that the warm start has seen a revision at every turn of an episode), then 100 more
   steps on revision demos whose wrong answers are the model's own (`--own-revision-steps`;
   `agent.own_revision_steps`: the mutants' are not the mistakes it makes), saved as a checkpoint.
   Both runs of a seed start from it, so they differ only in how they train. Its 400 SFT steps
   (make run's 130 leave a model that passes 3% of the held-out tasks: RL from there mostly learns
   what SFT would teach, and no run learns to revise) give 34-43% at turn 1 over the warm starts
   tried (`--warm-seed`); the own-mistake steps then move it (at `--warm-seed 4`: turn 1 37.3% -> 34.7%,
   fix rate 11.2% -> 16.8%).
2. Per seed (`train.seed`: which tasks each wave draws and how it samples), two trainings for the
   same budget of SAMPLED tokens (`--budget`; the model's own tokens, observation tokens are not
   sampled): single-turn (`agent.turns` 1) and K-turn (`agent.turns` K, `agent.credit` from --credit:
   by default "turn", each answer credited with the state it left, a revision among the task's other
   revisions at its turn; `rl.loss_agg` from --loss-agg: by default each answer a sequence in the loss),
   each for waves until it has sampled the budget (the K-turn run's episodes
   sample more per prompt, so it sees fewer prompts). The family curriculum moves from easy to hard
   over each run's budget (`planned_waves`; before 2026-12-06 it stayed at its start: uniform over
   difficulties, as `steps` was a bound of 10,000 waves).
   Every run is a process of its own on half the cores, two at a time, the K-turn runs first (they
   take 2-3.5x as long), so that the cores stay busy across seeds (training is bit-identical
   across thread counts, DESIGN.md "Determinism"). Each run reports `no_signal_groups`: the share of
   its groups (scored whole) that gave the trainer nothing to learn (`stages.learning_signal` all
   equal: every episode alike, mostly a task whose eight first answers all passed), whose sampled
   tokens count against the budget all the same.
3. The warm start and both final policies are evaluated on the same held-out tasks in K-turn mode,
   greedy: pass@1 after turn 1 (the single-turn figure), after the last turn, and the fix rate
   (episodes that failed turn 1 and passed later, over those that failed turn 1), the repeat rate
   (revisions that repeat the answer before them: they cannot pass); the last-turn gain
   of K-turn over single-turn is paired by task (bootstrap CI, exact McNemar p) for each seed, pooled
   over the task-seed pairs of all seeds (`gain_last_pooled`), and taken across seeds, each seed's gain
   one value, with its t-interval (`gain_last_across_seeds`: the one that says what the next seed will do).

The training loop is the nightly's own stages (`tasks/*.fn`: rollout_wave, score_wave, gate_wave,
train_epoch, evaluate), called in the flow's order without Prefect's run tracking, so that the
runs can stop on the token budget. Last line:
{"warm_start": {...}, "single_turn": {"pass_turn1", "pass_last", "fix_rate", ...}, "multi_turn": {...}, "gain_last", ...},
each figure the mean over seeds, with the per-seed values beside it. Goal: multi_turn.pass_last beats
single_turn.pass_last by >= 5 points, and multi_turn.fix_rate > 0.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


BUDGET = 900_000   # sampled tokens per run: about make run's 90 waves of 64 prompts x 8, single-turn


def note(what: str, since: float) -> None:
    print(f"bench.multiturn: {what} in {time.perf_counter() - since:.1f} s (load {os.getloadavg()[0]:.1f})",
          file=sys.stderr, flush=True)


def config(store: str, run_id: str, args, seed: int, turns: int, model_path: str | None = None):
    from ratchet.config import (AgentConfig, EnvsConfig, EvalConfig, GateConfig, ModelConfig, MonitorConfig,
                                NightlyConfig, RewardConfig, RLConfig, RolloutConfig, StoreConfig, TrainConfig)

    return NightlyConfig(
        run_id=run_id, steps=10_000, checkpoint_every=10_000, store=StoreConfig(uri=store),
        envs=EnvsConfig(families=("python_functions",), n_train=args.train_tasks, n_heldout=args.eval_tasks),
        model=ModelConfig(path=model_path, max_seq_len=args.context, sft_steps=args.sft_steps, seed=args.warm_seed),
        rollout=RolloutConfig(prompts_per_wave=args.prompts, group_size=args.group),
        agent=AgentConfig(turns=turns, observation_tokens=args.observation_tokens, revision_demos=args.revision_demos,
                          own_revision_steps=args.own_revision_steps, credit=args.credit, repeat_reward=args.repeat_reward,
                          branch=args.branch if turns > 1 else 1),
        train=TrainConfig(seed=seed),
        rl=RLConfig(loss_agg=args.loss_agg),      # the same loss for single-turn rows either way
        reward=RewardConfig(overlong_buffer=args.overlong_buffer),   # both runs alike
        gate=GateConfig(max_zero_variance_frac=1.0),
        monitor=MonitorConfig(max_zero_variance_frac=None),
        eval=EvalConfig(n_tasks=args.eval_tasks, min_gain=1.0),
    )


def start(store: Path, args) -> tuple[list, list, str, dict]:
    """Produce and audit the tasks, warm-start the embedded model and evaluate it like the trained ones;
    (train refs, held-out refs, start dir, its figures)."""
    from tasks.audit import audit_envs
    from tasks.produce import produce_envs
    from tasks.train import bootstrap_policy

    cfg = config(str(store), "bench-start", args, seed=0, turns=args.turns)
    t0 = time.perf_counter()
    audits = [audit_envs.fn(produce_envs.fn(f, cfg.envs, cfg.store), cfg.audit, cfg.verify, cfg.store)
              for f in cfg.envs.families]
    note("tasks produced and audited", t0)
    t0 = time.perf_counter()
    train_refs, heldout = [a.passed for a in audits], [a.heldout_passed for a in audits]
    policy = bootstrap_policy.fn("bench-start", cfg, train_refs)
    note("warm start (revision demos, SFT)", t0)
    return train_refs, heldout, str(store / "runs/bench-start/checkpoints/000000"), held_out(policy, heldout, cfg)


def held_out(policy, heldout, cfg) -> dict:
    """The policy's held-out figures in K-turn mode, and whether each task passed at the last turn (for the pairing)."""
    from ratchet.store import open_store
    from tasks.evaluate import evaluate

    t0 = time.perf_counter()
    final = evaluate.fn(policy, heldout, cfg)
    by_turn = final["turns"]
    note(f"{policy.run_id}: held-out evaluation, {cfg.agent.turns} turns", t0)
    rows = open_store(cfg.store).read_table(f"runs/{policy.run_id}/eval/{policy.version:06d}.parquet")
    return {"pass_turn1": by_turn["pass_after_turn"][0], "pass_last": by_turn["pass_after_turn"][-1],
            "fix_rate": by_turn["fix_rate"], "repeat_rate": by_turn["repeat_rate"], "mean_turns": by_turn["mean_turns"],
            "passed": dict(zip(rows["task_id"], rows["passed"]))}


def planned_waves(step: int, sampled: int, budget: int) -> int:
    """How many waves a run bounded by `budget` sampled tokens will take, projected from the `step`
    waves so far (`sampled` tokens): the `steps` the family curriculum reads its progress from
    (`pick_tasks`: wave `step` of `steps`), so that it moves from easy to hard over the budget as
    it does over a nightly's waves. Wave 0 is the curriculum's start whatever the total."""
    if step == 0 or sampled == 0:
        return 1
    return step + max(1, math.ceil((budget - sampled) * step / sampled))


def eval_marks(args) -> list[int]:
    """The sampled-token marks at which a run is evaluated on the way (--eval-at), in order; the budget's end is not one."""
    return sorted(m for m in args.eval_at if m < args.budget)


def train(store: Path, run_id: str, args, seed: int, turns: int, model_path: str, train_refs, heldout) -> dict:
    """Waves of the nightly's stages until `args.budget` sampled tokens; then the held-out evaluation in
    K-turn mode (`--turns`), whatever the run trained with."""
    from tasks.gate import gate_wave
    from tasks.rollout import rollout_wave
    from tasks.score import score_wave
    from tasks.train import bootstrap_policy, checkpoint_policy, train_epoch

    cfg = config(str(store), run_id, args, seed, turns, model_path)   # steps: planned_waves, per wave
    judged = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"turns": args.turns})})  # evaluated K-turn
    policy = bootstrap_policy.fn(run_id, cfg, train_refs)
    sampled, step, t0, rewards, at = 0, 0, time.perf_counter(), [], []
    silent = whole = 0    # groups scored whole, and of them those with no learning signal (they train nothing)
    marks = eval_marks(args)
    while sampled < args.budget:
        clock = cfg.model_copy(update={"steps": planned_waves(step, sampled, args.budget)})
        wave, rollout_stats = rollout_wave.fn(policy, step, train_refs, clock)
        scored, wave_stats = score_wave.fn(wave, train_refs, cfg)
        policy, _ = train_epoch.fn(policy, gate_wave.fn(scored, train_refs, cfg), cfg)
        sampled += rollout_stats["sampled_tokens"]
        rewards.append(wave_stats["reward_mean"])
        silent += wave_stats["groups_zero_variance"]
        whole += wave_stats["groups"] - wave_stats["groups_env_error"]
        step += 1
        while marks and sampled >= marks[0]:            # a held-out evaluation on the way (--eval-at), as a nightly's
            policy = checkpoint_policy.fn(policy, cfg)  # checkpoint_every does
            marks.pop(0)
            e0 = time.perf_counter()
            at.append({"waves": step, "sampled_tokens": sampled, **held_out(policy, heldout, judged)})
            t0 += time.perf_counter() - e0                  # train_s is training alone
    wall = time.perf_counter() - t0
    note(f"{run_id}: {step} waves, {sampled} sampled tokens", t0)
    policy = checkpoint_policy.fn(policy, cfg)
    return {**held_out(policy, heldout, judged), "waves": step, "sampled_tokens": sampled, "train_s": round(wall, 1),
            "reward_first": round(rewards[0], 4), "reward_last": round(rewards[-1], 4),
            "no_signal_groups": round(silent / whole, 4) if whole else None, "at": at}


def paired(multi: dict, single: dict) -> dict:
    """multi - single at the last turn over the same held-out tasks: the estimate, its 95% paired-bootstrap
    CI and the exact McNemar p (tasks only one of them solved)."""
    from ratchet.eval.stats import mcnemar, paired_bootstrap

    tasks = list(single)
    a, b = [bool(multi[t]) for t in tasks], [bool(single[t]) for t in tasks]
    ci, test = paired_bootstrap(a, b), mcnemar(a, b)
    return {"estimate": round(ci.estimate, 4), "ci95": [round(ci.ci_low, 4), round(ci.ci_high, 4)],
            "mcnemar_p": float(f"{test.p_value:.3g}"), "only_multi": test.b, "only_single": test.c}


def across_seeds(gains: list[float]) -> dict:
    """The seeds' gains as a sample of seeds: their mean and its 95% t-interval (None for one seed).
    The interval a claim about "a run of this recipe" has to live with: a pooled CI over task-seed
    pairs shows that the pairs differ, not that the next seed will."""
    from scipy.stats import t

    mean, n = statistics.fmean(gains), len(gains)
    if n < 2:
        return {"mean": round(mean, 4), "ci95": None}
    half = float(t.ppf(0.975, n - 1)) * statistics.stdev(gains) / n ** 0.5
    return {"mean": round(mean, 4), "ci95": [round(mean - half, 4), round(mean + half, 4)]}


def train_in_child(store: str, run_id: str, args, seed: int, turns: int, model_path: str, train_refs, heldout) -> dict:
    """`train` in a process of its own (spawned), on its share of the cores, with its own Prefect test server."""
    import torch
    from prefect.logging import disable_run_logger
    from prefect.testing.utilities import prefect_test_harness

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    import tasks.evaluate, tasks.gate, tasks.rollout, tasks.score, tasks.train  # noqa: E401,F401
    with prefect_test_harness(server_startup_timeout=180), disable_run_logger():
        return train(Path(store), run_id, args, seed, turns, model_path, train_refs, heldout)


def main() -> None:
    # before Prefect is imported (here and in the spawned runs, which inherit it); set here, not at
    # import, so that importing this module (tests do) leaves the importer's environment alone
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="train.seed of each pair of runs")
    p.add_argument("--budget", type=int, default=BUDGET, help="sampled tokens each run trains on (whole waves: it stops at the first wave that reaches it)")
    p.add_argument("--eval-at", type=int, nargs="*", default=[],
                   help="sampled-token marks below --budget at which both runs are also evaluated (at the first wave that "
                        "reaches each), so that one invocation gives the gain along the budget: `at` of each seed's line")
    p.add_argument("--prompts", type=int, default=64, help="prompts per wave")
    p.add_argument("--group", type=int, default=8, help="samples (episodes) per prompt")
    p.add_argument("--turns", type=int, default=3, help="K: answers per episode of the multi-turn run and the evaluation")
    p.add_argument("--credit", choices=("trajectory", "turn"), default="turn",
                   help="agent.credit of the K-turn run: each answer credited with the episode's final reward, or with its turn's state")
    p.add_argument("--loss-agg", choices=("seq_mean_token_mean", "answer_mean_token_mean"), default="answer_mean_token_mean",
                   help="rl.loss_agg of the K-turn run: each answer a sequence (the default), or each episode (the single-turn "
                        "run's answers are its sequences: the two are the same loss for it, bit for bit)")
    p.add_argument("--repeat-reward", type=float, default=None,
                   help="agent.repeat_reward: the reward of a revision that repeats the failed answer before it (default: its own)")
    p.add_argument("--overlong-buffer", type=int, default=0,
                   help="reward.overlong_buffer of both runs: DAPO's soft overlong punishment, in tokens (0: off)")
    p.add_argument("--observation-tokens", type=int, default=48, help="agent.observation_tokens")
    p.add_argument("--branch", type=int, default=1,
                   help="agent.branch of the K-turn run: each first answer shared by this many episodes of its group, "
                        "which revise it apart (its second answers judged within the tuple); 1: every episode its own")
    p.add_argument("--revision-demos", type=float, default=0.5,
                   help="agent.revision_demos of the shared warm start (0: none, and no own-mistake steps either)")
    p.add_argument("--own-revision-steps", type=int, default=100,
                   help="agent.own_revision_steps of the shared warm start: SFT steps on revision demos from its own mistakes "
                        "(0: the mutant demos alone, the bench's default before 2026-12-06)")
    p.add_argument("--warm-seed", type=int, default=0,
                   help="model.seed of the shared warm start (weights, SFT order, which tasks get revision demos): "
                        "another warm start, equally valid; the RL seeds' intervals do not cover it")
    p.add_argument("--sft-steps", type=int, default=400, help="model.sft_steps of the shared warm start (make run's: 130)")
    p.add_argument("--context", type=int, default=384, help="model.max_seq_len of the embedded model")
    p.add_argument("--eval-tasks", type=int, default=300, help="held-out tasks evaluated")
    p.add_argument("--train-tasks", type=int, default=3000, help="training tasks produced (and audited)")
    args = p.parse_args()
    if not args.revision_demos:
        args.own_revision_steps = 0      # own-mistake demos are revision demos: none without them (AgentConfig)

    from prefect.logging import disable_run_logger
    from prefect.testing.utilities import prefect_test_harness

    import tasks.audit, tasks.evaluate, tasks.gate, tasks.produce, tasks.rollout, tasks.score, tasks.train  # noqa: E401,F401
    # (imported before the run loggers are disabled: importing them sets Prefect's logging up again)
    per_seed = []
    with tempfile.TemporaryDirectory(prefix="ratchet-bench-multiturn-") as tmp, \
            prefect_test_harness(server_startup_timeout=180), disable_run_logger():
        store = Path(tmp)
        train_refs, heldout, model_path, warm = start(store, args)
        warm.pop("passed")                              # per task: the pairing is of the trained runs
        spawn = multiprocessing.get_context("spawn")
        arms = (("multi", args.turns), ("single", 1))   # the K-turn runs first: they are the long ones
        pooled_multi, pooled_single = {}, {}           # (seed, task) -> passed at the last turn
        with ProcessPoolExecutor(max_workers=2, mp_context=spawn) as pool:
            runs = {(name, seed): pool.submit(train_in_child, tmp, f"{name}-{seed}", args, seed, turns, model_path,
                                              train_refs, heldout)
                    for name, turns in arms for seed in args.seeds}
            try:
                for seed in args.seeds:
                    single, multi = runs["single", seed].result(), runs["multi", seed].result()
                    multi_passed, single_passed = multi.pop("passed"), single.pop("passed")
                    pooled_multi |= {(seed, t): v for t, v in multi_passed.items()}
                    pooled_single |= {(seed, t): v for t, v in single_passed.items()}
                    on_the_way = [{"mark": mark, "gain_last": paired(m.pop("passed"), s.pop("passed")),
                                   "single_turn": s, "multi_turn": m}
                                  for mark, m, s in zip(eval_marks(args), multi.pop("at"), single.pop("at"))]
                    per_seed.append({"seed": seed, "single_turn": single, "multi_turn": multi,
                                     "gain_last": paired(multi_passed, single_passed), "at": on_the_way})
                    print(json.dumps(per_seed[-1]), flush=True)
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)  # a failed run: the queued ones do not start
                raise

    def summary(side: str) -> dict:
        out = {}
        for k in ("pass_turn1", "pass_last", "fix_rate", "repeat_rate", "no_signal_groups", "waves", "sampled_tokens", "train_s"):
            values = [r[side][k] for r in per_seed]
            known = [v for v in values if v is not None]      # repeat_rate: None where no episode revised
            out[k] = round(statistics.fmean(known), 4) if known else None
            out[f"{k}_per_seed"] = values
        return out

    gains = [r["gain_last"]["estimate"] for r in per_seed]
    gains_at = {str(mark): round(statistics.fmean(r["at"][i]["gain_last"]["estimate"] for r in per_seed), 4)
                for i, mark in enumerate(eval_marks(args))}
    print(json.dumps({"warm_start": {k: None if v is None else round(v, 4) for k, v in warm.items()}, "single_turn": summary("single_turn"), "multi_turn": summary("multi_turn"),
                      "gain_last": round(statistics.fmean(gains), 4), "gain_last_per_seed": [round(g, 4) for g in gains],
                      "gain_last_spread": [round(min(gains), 4), round(max(gains), 4)],
                      "gain_last_across_seeds": across_seeds(gains), "gain_last_pooled": paired(pooled_multi, pooled_single),
                      "gain_last_at": gains_at,
                      "seeds": args.seeds,
                      "turns": args.turns, "credit": args.credit, "repeat_reward": args.repeat_reward, "overlong_buffer": args.overlong_buffer, "loss_agg": args.loss_agg, "sft_steps": args.sft_steps, "own_revision_steps": args.own_revision_steps, "warm_seed": args.warm_seed, "branch": args.branch, "budget": args.budget, "prompts": args.prompts, "group": args.group,
                      "cpus": os.cpu_count(), "load_avg": [round(x, 1) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
