"""Held-out evaluation and the promotion rule.

    result = evaluate(engine, heldout_specs, cfg.verify, samples=1)            # greedy pass@1
    result = evaluate(engine, heldout_specs, cfg.verify, samples=8, seed=0)    # 8 samples: pass@1, pass@8
    result = evaluate(engine, heldout_specs, cfg.verify, agent=cfg.agent)      # agent.turns K: pass after each turn
    result.table("family")                     # pass@1 with its confidence interval, per family
    decision = should_promote(result.results, incumbent_results, cfg.eval)      # paired, with a CI

A task's sample counts as solved when it `Verification.passed` (the verifier's one definition,
the audit's too: every hidden test, within the time limit). With k samples per task, pass@1 is
the mean over tasks of c/k and pass@k the unbiased estimator of Chen et al. 2021
(`stats.pass_at_k`). A task any of whose samples hit an infrastructure error is excluded from
every denominator (and counted in `env_errors`), never scored as a failure.

Multi-turn (`agent.turns` K of 2 or more): each sample is an episode of up to K answers, the
sandbox's feedback in between (`ratchet.agent.run_episodes`), judged by its last answer; the
summary's `turns` adds the pass rate after each turn (after turn 1 it is the single-turn figure:
one run gives both, so base, candidate and incumbent compare vertically in either mode) and the
fix rate.

Groupings: `family`, `difficulty` and `source` (the task's `metadata["source"]`, else its
family: an imported task set names itself there). `report.vertical_table` lines up base ->
candidate -> incumbent per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import polars as pl

from envs.spec import TaskSpec
from ratchet.config import AgentConfig, EvalConfig, VerifyConfig
from ratchet.eval.stats import PromotionDecision, bootstrap_mean, decide, pass_at_k
from ratchet.rollout.engine import naming_tasks
from ratchet.scale import executor_for
from ratchet.verify import verify_many

GROUPS = ("family", "difficulty", "source")


def source_of(spec: TaskSpec) -> str:
    """Where a task came from: an imported set's name (`metadata["source"]`), else its family."""
    return str(spec.metadata.get("source") or spec.family)


@dataclass
class EvalResult:
    rows: pl.DataFrame   # one row per (task, sample): task_id, family, source, difficulty, sample, completion, env_error,
                         # passed (the last answer), turns (per answer taken: passed, action, action_tokens, observation_tokens)
    samples: int         # k, samples per task
    turns: int = 1       # K, most answers per episode (1: single-turn)

    def per_task(self) -> pl.DataFrame:
        """One row per task with a verdict on every sample: n (= k) and c (samples that passed)."""
        return (self.rows.group_by("task_id", maintain_order=True)
                .agg(pl.col("family").first(), pl.col("source").first(), pl.col("difficulty").first(),
                     pl.col("env_error").any().alias("env_error"), pl.col("passed").sum().alias("c"),
                     pl.len().alias("n"))
                .filter(~pl.col("env_error")))

    @property
    def n_tasks(self) -> int:
        return self.per_task().height

    @property
    def env_errors(self) -> int:
        return self.rows["task_id"].n_unique() - self.n_tasks

    @property
    def pass_rate(self) -> float:
        """pass@1: the mean over tasks of the fraction of samples that passed."""
        return self.pass_at(1)

    def pass_at(self, k: int) -> float:
        """Unbiased pass@k over the tasks with a verdict (0.0 when there are none)."""
        t = self.per_task()
        return sum(pass_at_k(n, c, k) for n, c in zip(t["n"], t["c"])) / t.height if t.height else 0.0

    @property
    def results(self) -> dict[str, list[bool] | None]:
        """{task_id: [passed per sample]}, None where verification was an env_error: what promotion pairs."""
        out: dict[str, list[bool] | None] = {}
        for t, e, p in self.rows.select("task_id", "env_error", "passed").iter_rows():
            if t in out and out[t] is None:
                continue
            out[t] = None if e else [*out.get(t, []), p]
        return out

    def table(self, by: str, confidence: float = 0.95) -> list[dict]:
        """pass@1 per group (`family`, `difficulty` or `source`) with its bootstrap CI over tasks."""
        if by not in GROUPS:
            raise ValueError(f"EvalResult.table: by must be one of {GROUPS}, got {by!r}")
        t = self.per_task().with_columns((pl.col("c") / pl.col("n")).alias("rate"))
        out = []
        for (key,), g in sorted(t.group_by(by), key=lambda kv: kv[0]):
            est, lo, hi = bootstrap_mean(g["rate"].to_list(), confidence=confidence)
            out.append({by: key, "n_tasks": g.height, "pass_at_1": round(est, 4),
                        "ci": [round(lo, 4), round(hi, 4)]})
        return out

    def summary(self, confidence: float = 0.95) -> dict:
        """The JSON record of an evaluation: overall pass@1 with its CI, pass@k, the three tables,
        and per-task results (what promotion pairs)."""
        t = self.per_task()
        lo, hi = bootstrap_mean((t["c"] / t["n"]).to_list(), confidence=confidence)[1:] if t.height else (0.0, 0.0)
        ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= self.samples} | {self.samples})
        out = {"pass_rate": self.pass_rate, "ci": [round(lo, 4), round(hi, 4)], "samples": self.samples,
                "pass_at": {str(k): round(self.pass_at(k), 4) for k in ks},
                "n_tasks": self.n_tasks, "env_errors": self.env_errors,
                "by_difficulty": {int(r["difficulty"]): r["pass_at_1"] for r in self.table("difficulty", confidence)},
                "tables": {by: self.table(by, confidence) for by in GROUPS},
                "results": self.results}
        if self.turns > 1:
            from ratchet.agent import episode_metrics

            bad = set(self.rows.filter(pl.col("env_error"))["task_id"])   # per_task's: a task with any env_error is out
            out["turns"] = {**episode_metrics([turns for turns, task in self.rows.select("turns", "task_id").iter_rows()
                                               if task not in bad], self.turns),
                            "env_errors": int(self.rows["env_error"].sum())}   # the episodes that ended in one
        return out


def evaluate(engine, specs: Sequence[TaskSpec], verify: VerifyConfig = VerifyConfig(), max_new_tokens: int = 48,
             batch_size: int = 128, samples: int = 1, temperature: float = 1.0, seed: int = 0,
             agent: AgentConfig | None = None) -> EvalResult:
    """pass@1 (and pass@k) of `engine` on `specs`, verified as training verifies (same limits,
    retries). samples=1: one greedy completion per task; samples=k: k sampled at `temperature`
    with `seed` (candidate and incumbent get the same seed, so their samples are paired).
    `agent.turns` K > 1: every sample is an episode of up to K answers, judged by its last."""
    if samples < 1:
        raise ValueError(f"evaluate: samples must be >= 1, got {samples}")
    greedy = samples == 1
    sampling = dict(max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature, batch_size=batch_size,
                    seed=None if greedy else seed)
    executor = executor_for(verify)
    if agent is not None and agent.turns > 1:
        from ratchet.agent import run_episodes, turn_records

        episodes = run_episodes(engine, specs, samples, agent, verify, executor=executor, **sampling)
        owner = [specs[e.episode.prompt_index] for e in episodes]
        completions = [e.episode.turns[-1].action_text for e in episodes]
        env_error = [e.env_error for e in episodes]
        turns = [[{k: t[k] for k in ("passed", "action", "action_tokens", "observation_tokens")} for t in turn_records(e)]
                 for e in episodes]
    else:
        with naming_tasks([s.task_id for s in specs]):
            rollouts = engine.generate([s.prompt for s in specs], n=samples, **sampling)
        owner = [specs[r.prompt_index] for r in rollouts]
        completions = [r.text for r in rollouts]
        results = verify_many(list(zip(owner, completions)), verify.sandbox_limits(), verify.concurrency,
                              verify.env_error_retries, executor=executor)
        env_error = [v.env_error for v in results]
        turns = [[{"passed": v.passed, "action": r.text, "action_tokens": len(r.completion_ids), "observation_tokens": 0}]
                 for r, v in zip(rollouts, results)]
    rows = pl.DataFrame({
        "task_id": [s.task_id for s in owner],
        "family": [s.family for s in owner],
        "source": [source_of(s) for s in owner],
        "difficulty": [s.difficulty for s in owner],
        "sample": [i % samples for i in range(len(owner))],
        "completion": completions,
        "env_error": env_error,
        "passed": [t[-1]["passed"] for t in turns],
        "turns": turns,
    }, schema_overrides={"difficulty": pl.Int64, "sample": pl.Int64,
                         "turns": pl.List(pl.Struct({"passed": pl.Boolean, "action": pl.String, "action_tokens": pl.Int64,
                                                     "observation_tokens": pl.Int64}))})
    return EvalResult(rows=rows, samples=samples, turns=agent.turns if agent is not None else 1)


def _samples(results: dict[str, list[bool] | bool | None]) -> dict[str, list[bool]]:
    """{task_id: [bool]} of the tasks with a verdict; a bare bool is one sample."""
    return {t: ([p] if isinstance(p, bool) else list(p)) for t, p in results.items() if p is not None}


def should_promote(candidate: dict[str, list[bool] | bool | None], incumbent: dict[str, list[bool] | bool | None] | None,
                   cfg: EvalConfig = EvalConfig(), against: str = "the incumbent") -> PromotionDecision:
    """The promotion rule: candidate and incumbent judged on the same held-out tasks, paired.

    candidate / incumbent: {task_id: [passed per sample]} (a bool: one sample; None: that task's
    verification was an env_error; a task is compared only where both have a verdict). Promote only
    when the lower bound of the `cfg.confidence` interval of the pass-rate gain exceeds
    `cfg.min_gain` and the exact sign test over tasks (McNemar's, one sample per task) agrees:
    `ratchet.eval.stats.decide`. No incumbent: promote. No task with a verdict on both sides: keep the
    incumbent (nothing says the candidate is better). `against` names the other side in the reason
    (the nightly compares with the base model when there is no incumbent yet).
    """
    cand = _samples(candidate)
    if incumbent is None:
        return decide(list(cand.values()), None, confidence=cfg.confidence, min_gain=cfg.min_gain)
    inc = _samples(incumbent)
    tasks = [t for t in cand if t in inc]
    if not tasks:
        return PromotionDecision(False, 0.0, 0.0, 0.0, "no shared task", None,
                                 f"Keep {against}: the two share no held-out task with a verdict ({len(cand)} tasks "
                                 f"with one for the candidate, {len(inc)} for {against}).")
    return decide([cand[t] for t in tasks], [inc[t] for t in tasks], confidence=cfg.confidence, min_gain=cfg.min_gain,
                  against=against)
