"""Multi-turn episodes for a wave or an evaluation: answer, read the sandbox's verdict, revise.

    results = run_episodes(engine, specs, n=4, agent=cfg.agent, verify=cfg.verify,
                           max_new_tokens=64, temperature=1.0, greedy=False, seed=0, batch_size=128)
    results[0].episode.turns, results[0].verifications, results[0].final.passed
    episode_metrics([turn_records(r) for r in results], cfg.agent.turns)   # pass rate after turn k, fix rate, ...
    frame = episode_frame(run_id, step, version, specs, results, group_size=4)   # the wave's trajectory rows
    demos = revision_demos(specs, 0.3, cfg.verify, seed=0, attempts=2)   # (prompt, [(wrong, False), (obs, False), ..., (fix, True)])

`run_episodes` samples with `generate_episodes` (ratchet/rollout/episodes.py: every live episode
of a batch decodes together, the KV cache is reused across turns) and answers each turn with
`respond`: every live answer of the turn is verified in ONE `verify_many` batch (the one judge,
env_error retries as in a single-turn wave), the Verification recorded, and the episode either
ends (it passed, with `agent.stop_on_pass`; or an env_error: nothing the model did) or gets the
observation of its verdict (`envs/episode.py`), cut to `agent.observation_tokens` tokens of the
engine's tokenizer: the feedback is cut, the family's re-prompt kept whole. The budget counts the
observation's own text; with a chat template the template's turn markers come on top of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from envs.episode import observation_parts, repeats
from envs.spec import TaskSpec
from ratchet.audit import task_mutants
from ratchet.config import AgentConfig, NightlyConfig, VerifyConfig
from ratchet.data.schemas import trajectories_frame
from ratchet.model import text_ids
from ratchet.rollout.engine import naming_tasks
from ratchet.rollout.episodes import Episode, Turn, generate_episodes
from ratchet.rollout.torch_engine import TorchEngine
from ratchet.rollout.wave import group_id
from ratchet.scale import executor_for
from ratchet.train.sft import demo_sequence
from ratchet.verify import Verification, verify_many

if TYPE_CHECKING:
    import polars as pl

CUT = "...\n"
"""Marks where an observation's feedback was cut to the token budget."""


@dataclass
class EpisodeResult:
    episode: Episode
    verifications: list[Verification]   # one per turn: the verdict on that turn's answer

    @property
    def final(self) -> Verification:
        """The verdict on the last answer: the episode's final state (what the reward is taken from)."""
        return self.verifications[-1]

    @property
    def env_error(self) -> bool:
        """An infrastructure failure ended the episode (its last verdict): excluded, as a wave's env_error rows."""
        return self.final.env_error

    @property
    def passed_at(self) -> int | None:
        """The first turn (1-based) whose answer passed; None if none did."""
        return next((k for k, v in enumerate(self.verifications, 1) if v.passed), None)


def turn_records(result: EpisodeResult) -> list[dict]:
    """The episode's turns as the trajectory row's `turns` (TURN in ratchet/data/schemas.py): action,
    observation (None on the last turn), token counts, the turn's metrics and feedback, passed,
    env_error, shared (the first answer of an episode that shares it: `agent.branch`); `reward` None
    (the scoring stage fills it from the metrics)."""
    ep = result.episode
    return [{"turn": k, "action": t.text_before_stop, "observation": t.observation,
             "action_tokens": len(t.action_ids), "observation_tokens": len(t.observation_ids),
             "metrics": v.metrics or None, "feedback": v.feedback, "passed": v.passed, "reward": None,
             "env_error": v.env_error, "shared": k == 0 and ep.shared_first}
            for k, (t, v) in enumerate(zip(ep.turns, result.verifications))]


def episode_frame(run_id: str, step: int, version: int, specs: Sequence[TaskSpec], results: Sequence,
                  group_size: int) -> pl.DataFrame:
    """Trajectory rows of multi-turn episodes (`ratchet.agent.run_episodes` results, grouped by prompt),
    verified already: one row per episode. `completion` is the final answer (what the row's metrics
    judge); `completion_ids` the whole conversation after the prompt, answers and observations, with
    `loss_mask` 0 and behaviour log-prob 0.0 on observation tokens; `turns` every answer with its
    observation, metrics, feedback and verdict (`ratchet.agent.turn_records`; rewards: the scoring stage's)."""
    rows = []
    for i, res in enumerate(results):
        ep, spec, final = res.episode, specs[res.episode.prompt_index], res.final
        turns = turn_records(res)
        rows.append({
            "run_id": run_id, "step": step, "policy_version": version,
            "task_id": spec.task_id, "family": spec.family, "difficulty": spec.difficulty,
            "group_id": group_id(step, spec), "sample_idx": i % group_size,
            "prompt": spec.prompt, "completion": turns[-1]["action"], "turns": turns,
            "prompt_tokens": len(ep.prompt_ids), "completion_tokens": len(ep.completion_ids),
            "completion_ids": ep.completion_ids, "behavior_logprobs": ep.logprobs, "loss_mask": ep.loss_mask,
            "metrics": None if final.env_error else final.metrics or None,
            "feedback": final.feedback, "env_error": final.env_error, "env_error_kind": final.env_error_kind,
        })
    return trajectories_frame(rows)


def fit_observation(body: str, again: str, tokenizer, budget: int) -> str:
    """body + again in at most `budget` tokens (`text_ids`, as the engine encodes an observation): the
    feedback `body` is cut at the end (marked with CUT), the re-prompt `again` kept whole, even when it
    alone is over the budget."""
    def fits(text: str) -> bool:
        return len(text_ids(tokenizer, text)) <= budget

    if fits(body + again):
        return body + again
    lo, hi = 0, len(body) - 1                  # longest prefix of body that fits with the marker
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(body[:mid] + CUT + again) else (lo, mid - 1)
    if lo == 0 or not fits(body[:lo] + CUT + again):
        return again
    word = max(body.rfind(" ", 0, lo), body.rfind("\n", 0, lo)) + 1     # end at a word, when one ends close by
    keep = body[:word] if lo - word <= 12 and word > 0 and fits(body[:word] + CUT + again) else body[:lo]
    return keep + CUT + again


def render_observation(spec: TaskSpec, v: Verification, tokenizer=None, budget: int | None = None) -> str:
    """The observation after an answer with verdict `v`, cut to `budget` tokens when both are given."""
    body, again = observation_parts(spec, v.feedback, v.metrics or None)
    return body + again if tokenizer is None or budget is None else fit_observation(body, again, tokenizer, budget)


def run_episodes(engine, specs: Sequence[TaskSpec], n: int, agent: AgentConfig, verify: VerifyConfig, *,
                 max_new_tokens: int, temperature: float = 1.0, greedy: bool = False, seed: int | None = None,
                 batch_size: int = 128, branch: int = 1, executor=None) -> list[EpisodeResult]:
    """len(specs) * n episodes grouped by task (as `engine.generate`), each with its per-turn verdicts;
    `branch` b: every b episodes of a task share their first answer (`generate_episodes`)."""
    if not isinstance(getattr(engine, "model", None), torch.nn.Module):
        raise TypeError(f"run_episodes: multi-turn episodes need the in-process torch engine (rollout.engine: torch), "
                        f"not {type(engine).__name__}")
    specs = list(specs)
    executor = executor if executor is not None else executor_for(verify)
    verdicts: dict[int, list[Verification]] = {}

    def respond(turn: int, live: list[tuple[int, Turn]]) -> list[str | None]:
        items = [(specs[i // n], t.text_before_stop) for i, t in live]
        results = verify_many(items, verify.sandbox_limits(), verify.concurrency, verify.env_error_retries,
                              feedback_bytes=verify.feedback_bytes, executor=executor)
        out: list[str | None] = []
        for (i, _), (spec, _), v in zip(live, items, results):
            verdicts.setdefault(i, []).append(v)
            if v.env_error or (v.passed and agent.stop_on_pass):
                out.append(None)
            else:
                out.append(render_observation(spec, v, engine.tokenizer, agent.observation_tokens))
        return out

    with naming_tasks([s.task_id for s in specs]):
        episodes = generate_episodes(engine, [s.prompt for s in specs], n, respond, max_turns=agent.turns,
                                     max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy,
                                     seed=seed, batch_size=batch_size, branch=branch)
    results = []
    for i, ep in enumerate(episodes):
        got = verdicts.get(i, [])
        if len(got) != len(ep.turns):
            raise RuntimeError(f"episode {i}: {len(ep.turns)} turns but {len(got)} verdicts: generate_episodes "
                               f"must call respond after every turn")
        results.append(EpisodeResult(ep, got))
    return results


def episode_metrics(episodes: Sequence[Sequence[dict]], max_turns: int) -> dict:
    """Figures of a set of episodes, each given as its turn records (`turn_records`, or a trajectory
    row's `turns`: `passed`, `env_error`, `action`, `action_tokens`, `observation_tokens` per turn; the
    evaluation's carry no `env_error`). Episodes that ended in an env_error are left out (counted in
    `env_errors`). `pass_after_turn[k-1]`: the share whose answer as of turn k passes, k =
    1..max_turns (the episode's state after turn k, as per-turn credit values it: an episode that
    ended sooner keeps its last answer; with `agent.stop_on_pass` off, an answer that passed and was
    then revised into a failure counts as failed, so `pass_last` is what the last answer, the one
    promotion judges, scores); `pass_turn1`, `pass_last`; `fix_rate`: of the episodes that failed
    turn 1 (`failed_turn1`), the share whose last answer passes (None when none failed);
    `mean_turns`, `mean_action_tokens` (sampled: a copy of a shared first answer, `agent.branch`, is
    not), `mean_observation_tokens`; `repeat_rate`: of the revisions (answers after the first) whose records
    carry their `action`, the share that repeat the answer before them, leading and trailing whitespace
    aside (a repeat cannot pass a deterministic task: a revision spent); `ends`: episodes that ended
    passing, at the turn limit, or earlier (out of context). Rates are None when no episode counts."""
    if max_turns < 1:
        raise ValueError(f"episode_metrics: max_turns must be at least 1, got {max_turns}")
    ok = [e for e in episodes if e and not e[-1].get("env_error")]
    if any(len(e) > max_turns for e in ok):
        raise ValueError(f"episode_metrics: an episode has more than max_turns={max_turns} turns")

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    def passes_after(e: Sequence[dict], k: int) -> float:
        return float(bool(e[min(k, len(e)) - 1]["passed"]))

    after = [mean([passes_after(e, k) for e in ok]) for k in range(1, max_turns + 1)]
    failed1 = [e for e in ok if not e[0]["passed"]]
    repeated = [float(repeats(e[k]["action"], e[k - 1]["action"]))
               for e in ok for k in range(1, len(e)) if "action" in e[k]]
    ends = {"passed": 0, "turns": 0, "context": 0}
    for e in ok:
        ends["passed" if e[-1]["passed"] else "turns" if len(e) == max_turns else "context"] += 1
    return {
        "episodes": len(ok), "env_errors": len(episodes) - len(ok),
        "pass_after_turn": after, "pass_turn1": after[0], "pass_last": after[-1],
        "fix_rate": mean([passes_after(e, len(e)) for e in failed1]), "failed_turn1": len(failed1),
        "mean_turns": mean([len(e) for e in ok]),
        "mean_action_tokens": mean([sum(t.get("action_tokens") or 0 for t in e if not t.get("shared")) for e in ok]),
        "mean_observation_tokens": mean([sum(t.get("observation_tokens") or 0 for t in e) for e in ok]),
        "repeat_rate": mean(repeated),
        "ends": ends,
    }


def revision_demos(specs: Sequence[TaskSpec], fraction: float, verify: VerifyConfig, seed: int, *,
                   tokenizer=None, observation_tokens: int | None = None, attempts: int = 1, max_mutants: int = 4,
                   executor=None) -> list[tuple[str, list[tuple[str, bool]]]]:
    """Revision demonstrations for the warm start: for `fraction` of the specs that have a reference
    (drawn with `seed`), (prompt, [(wrong, False), (observation, False), ..., (reference, True)]): one
    to `attempts` wrong answers in a row, each followed by the observation of its own sandbox run,
    then the reference as the fix. A wrong answer is a mutant of the reference (`envs/mutation.py`, as
    the audit makes them) that the sandbox really fails; its observation is rendered from that run's
    real feedback (cut to `observation_tokens` of `tokenizer` when both are given, as an episode's).
    With `attempts` K - 1 the warm start has seen a revision at every turn a K-turn episode reaches,
    not only the second. Wrong answers are context, never targets. A task none of whose first
    `max_mutants` mutants fails (or whose runs are env_errors) gives no demo, so there may be fewer
    than asked."""
    found = wrong_attempts(specs, fraction, verify, seed, attempts=attempts, max_mutants=max_mutants,
                           executor=executor)
    return demos_from(found, tokenizer, observation_tokens)


def wrong_attempts(specs: Sequence[TaskSpec], fraction: float, verify: VerifyConfig, seed: int, *,
                   attempts: int = 1, max_mutants: int = 4,
                   executor=None) -> list[tuple[TaskSpec, list[tuple[str, Verification]]]]:
    """The sandbox runs behind `revision_demos`: per chosen task, (spec, [(wrong answer, its verdict), ...]),
    1 to `attempts` distinct failing mutants (how many is drawn per task with `seed`; fewer when fewer fail)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"revision_demos: fraction must be in [0, 1], got {fraction}")
    if attempts < 1:
        raise ValueError(f"revision_demos: attempts must be at least 1, got {attempts}")
    with_ref = [s for s in specs if s.reference_solution is not None]
    k = round(fraction * len(with_ref))
    chosen = [with_ref[i] for i in sorted(random.Random(f"revision_demos:{seed}").sample(range(len(with_ref)), k))]
    wanted = {s.task_id: _wanted(seed, s.task_id, attempts) for s in chosen}
    candidates = [(s, m) for s in chosen for m in task_mutants(s, max(max_mutants, attempts)) if m.strip()]   # distinct
    results = verify_many(candidates, verify.sandbox_limits(), verify.concurrency, verify.env_error_retries,
                          feedback_bytes=verify.feedback_bytes,
                          executor=executor if executor is not None else executor_for(verify))
    wrongs: dict[str, list[tuple[str, Verification]]] = {}
    for (spec, wrong), v in zip(candidates, results):
        got = wrongs.setdefault(spec.task_id, [])
        if not (v.env_error or v.passed) and len(got) < wanted[spec.task_id]:
            got.append((wrong, v))
    return [(s, wrongs[s.task_id]) for s in chosen if wrongs.get(s.task_id)]


def _wanted(seed: int, task_id: str, attempts: int) -> int:
    """How many wrong answers (1 to `attempts`) a task's revision demo asks for, drawn per task with `seed`."""
    return random.Random(f"revision_demos:{seed}:{task_id}").randint(1, attempts)


def own_attempts(engine, specs: Sequence[TaskSpec], agent: AgentConfig, verify: VerifyConfig, seed: int, *,
                 max_new_tokens: int, temperature: float, batch_size: int = 128,
                 executor=None) -> list[tuple[TaskSpec, list[tuple[str, Verification]]]]:
    """`wrong_attempts` from the policy itself: per spec (each with a reference), one episode sampled from
    `engine` at `temperature` for up to `agent.turns` - 1 turns (at least 1); its failed answers before
    the first pass, as many as `_wanted` draws (1 to turns - 1), with their verdicts. A task whose first
    answer passes, is empty or hits an env_error gives none. With `demos_from` (the reference as the
    fix): revision demos that start from the mistakes this model makes, which it otherwise tends to
    repeat; a mutant of the reference is a mistake it does not make (docs/multiturn-experiments.md)."""
    specs = [s for s in specs if s.reference_solution is not None]
    attempts = max(1, agent.turns - 1)
    results = run_episodes(engine, specs, 1, agent.model_copy(update={"turns": attempts, "stop_on_pass": True}), verify,
                           max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, batch_size=batch_size,
                           executor=executor)
    found = []
    for spec, r in zip(specs, results):
        wrongs, wanted = [], _wanted(seed, spec.task_id, attempts)
        for turn, v in zip(r.episode.turns, r.verifications):
            if len(wrongs) == wanted or v.passed or v.env_error or not turn.text_before_stop.strip():
                break
            wrongs.append((turn.text_before_stop, v))
        if wrongs:
            found.append((spec, wrongs))
    return found


def warm_start_revisions(cfg: NightlyConfig, specs: Sequence[TaskSpec], log=None):
    """The embedded warm start's revision demos as `ratchet.train.sft.warm_start` takes them:
    (revisions(tokenizer), own(model, tokenizer)), or None for what the config leaves off.
    `agent.revision_demos`: mutants of the reference that the sandbox fails, 1 to turns - 1 per demo
    (a revision at every turn an episode reaches); `agent.own_revision_steps`: the same tasks again,
    from the answers the SFT'd model samples (`own_attempts`, at `rollout.temperature`)."""
    if not cfg.agent.revision_demos:
        return None, None
    a = cfg.agent
    attempts = wrong_attempts(specs, a.revision_demos, cfg.verify, cfg.model.seed, attempts=max(1, a.turns - 1))
    if log:
        log(f"warm start: {len(attempts)} revision demos")

    def revisions(tokenizer):
        return demos_from(attempts, tokenizer, a.observation_tokens, cfg.model.max_seq_len)

    def own(model, tokenizer):
        # no context check: a prompt past the context samples on (its demo is dropped if it does not fit)
        found = own_attempts(TorchEngine(model, tokenizer), [s for s, _ in attempts], a, cfg.verify, cfg.model.seed,
                             max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                             batch_size=cfg.rollout.batch_size)
        return demos_from(found, tokenizer, a.observation_tokens, cfg.model.max_seq_len)

    return revisions, (own if a.own_revision_steps else None)


def demos_from(attempts: Sequence[tuple[TaskSpec, list[tuple[str, Verification]]]], tokenizer=None,
               observation_tokens: int | None = None, context: int | None = None) -> list[tuple[str, list[tuple[str, bool]]]]:
    """Revision demos from `wrong_attempts`, their observations cut to the budget when a tokenizer is
    given (the warm start renders them uncut for its tokenizer's corpus, then cut with that tokenizer).
    With a tokenizer and `context`, a demo keeps only as many wrong answers as fit in that many tokens
    (as an episode ends when its next turn would not fit); one that does not fit with one is dropped."""
    demos = []
    for spec, wrongs in attempts:
        tried = [seg for wrong, v in wrongs
                 for seg in ((wrong, False), (render_observation(spec, v, tokenizer, observation_tokens), False))]
        for n in range(len(wrongs), 0, -1):
            demo = (spec.prompt, tried[:2 * n] + [(spec.reference_solution, True)])
            if tokenizer is None or context is None or len(demo_sequence(tokenizer, demo)[0]) <= context:
                demos.append(demo)
                break
    return demos
