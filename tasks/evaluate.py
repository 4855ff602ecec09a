"""Prefect tasks at the end of a cycle: evaluate on held-out tasks, promote only a winner."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from envs.snapshot import load_specs
from envs.sources import interleave
from ratchet.config import NightlyConfig
from ratchet.eval import evaluate as evaluate_policy
from ratchet.eval import should_promote
from ratchet.scratch import scratch_dir
from ratchet.store import Ref, open_store
from ratchet.store.lease import one_at_a_time
from ratchet.train import session as sessions
from tasks.retry import transient_only

INCUMBENT = "models/promoted/INCUMBENT"


def _tasks(heldout: list[Ref], cfg: NightlyConfig) -> list:
    """The held-out tasks an evaluation runs: every family / source gets its share of eval.n_tasks."""
    return interleave([load_specs(r) for r in heldout])[: cfg.eval.n_tasks]


def _eval(engine, specs: list, cfg: NightlyConfig):
    return evaluate_policy(engine, specs, cfg.verify, cfg.rollout.max_new_tokens, cfg.rollout.batch_size,
                           samples=cfg.eval.samples, temperature=cfg.eval.temperature, seed=cfg.train.seed,
                           agent=cfg.agent)


def task_digests(specs: list) -> dict[str, str]:
    """Each held-out task's content, by id: a record is compared with another only where the tasks
    they share read the same (a family's code fixed between a crash and its resume makes new tasks
    under the same ids; an audit verdict that flipped only adds or drops one, which pairing handles)."""
    return {s.task_id: hashlib.sha256(s.model_dump_json().encode()).hexdigest()[:12] for s in specs}


def _changed(kept: dict, now: dict[str, str]) -> list[str]:
    """The task ids a kept record and this attempt share whose content differs."""
    return [t for t, d in (kept.get("task_digests") or {}).items() if t in now and now[t] != d]


def set_aside_evaluations(store, run_id: str, resumed_at: int) -> list[str]:
    """A run resumed from its checkpoint of version `resumed_at` trains every later version again,
    and those weights need not be the crashed attempt's (async sampling, GPU kernels): its kept
    evaluations of versions past `resumed_at` would describe weights that no longer exist. Each is
    moved (json and parquet) to runs/<id>/eval/superseded/<version>-<n>.<ext> (kept, not lost), so
    `evaluate` runs again. Returns the keys moved."""
    moved = []
    for key in store.list(f"runs/{run_id}/eval/"):
        name = key.rsplit("/", 1)[-1]
        stem, _, ext = name.partition(".")
        if "/superseded/" in key or not stem.isdigit() or int(stem) <= resumed_at:
            continue
        n = sum(1 for k in store.list(f"runs/{run_id}/eval/superseded/{stem}-") if k.endswith(f".{ext}"))
        store.put_bytes(f"runs/{run_id}/eval/superseded/{stem}-{n}.{ext}", store.get_bytes(key))
        store.delete(key)
        moved.append(key)
    return moved


def protocol(cfg: NightlyConfig) -> dict:
    """What an evaluation's figures depend on besides the weights and the tasks (`task_digests`): two
    records are compared (promotion, the vertical table) only under one protocol. `confidence`: the
    level its intervals were computed at."""
    return _as_judged({"confidence": cfg.eval.confidence, "n_tasks": cfg.eval.n_tasks, "samples": cfg.eval.samples, "temperature": cfg.eval.temperature,
                       "seed": cfg.train.seed, "max_new_tokens": cfg.rollout.max_new_tokens, "turns": cfg.agent.turns,
                       "observation_tokens": cfg.agent.observation_tokens, "stop_on_pass": cfg.agent.stop_on_pass,
                       # the sandbox's limits decide pass and fail, and its feedback an episode's next turn
                       "verify_timeout_s": cfg.verify.timeout_s, "verify_memory_mb": cfg.verify.memory_mb,
                       "feedback_bytes": cfg.verify.feedback_bytes})


def _as_judged(p: dict) -> dict:
    """One sample per task is greedy: its figures depend on neither the temperature nor the seed,
    so both read None (a resumed run that changed them reuses its records; one kept with them
    before this rule reads the same)."""
    return {**p, "temperature": None, "seed": None} if p.get("samples") == 1 else p


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def evaluate(policy: sessions.PolicyRef, heldout: list[Ref], cfg: NightlyConfig) -> dict:
    """Held-out pass@1 (and pass@k) of the policy with its CI, per family / difficulty / source;
    per-sample results to runs/<id>/eval/<version>.parquet. Kept per policy version, so a retry or
    a resumed run does not evaluate twice; a run resumed under another evaluation protocol stops
    here, at its base evaluation, naming what changed (it would otherwise compare records of two
    protocols, or fail at promotion after all its training)."""
    store = open_store(cfg.store)
    key = f"runs/{policy.run_id}/eval/{policy.version:06d}"
    now, specs = protocol(cfg), _tasks(heldout, cfg)
    digests = task_digests(specs)
    if store.exists(f"{key}.json"):
        kept = store.get_json(f"{key}.json")
        was = {**now, **_as_judged(kept.get("protocol", now))}   # what a record from before a key was kept lacks: as now
        changed = {k: (was.get(k), v) for k, v in now.items() if was.get(k) != v}
        if changed:
            raise ValueError(f"run {policy.run_id}: policy v{policy.version} was evaluated with "
                             + ", ".join(f"{k} {a!r}" for k, (a, _) in changed.items()) + "; this attempt has "
                             + ", ".join(f"{k} {b!r}" for k, (_, b) in changed.items())
                             + ": resume with the run's own settings, or start a new run id")
        if other := _changed(kept, digests):
            raise ValueError(f"run {policy.run_id}: {len(other)} held-out task(s) (e.g. {other[0]!r}) read differently "
                             f"from when policy v{policy.version} was evaluated (a family's code or a task source "
                             f"changed since): its results would be paired with another task's; start a new run id")
        return kept
    session = sessions.open_session(policy, cfg)
    result = _eval(session.engine, specs, cfg)
    ref = store.write_table(f"{key}.parquet", result.rows)
    out = {"version": policy.version, "eval": ref.uri, "protocol": now, "task_digests": digests,
           **result.summary(cfg.eval.confidence)}
    get_run_logger().info("policy v%d held-out pass@1 %.3f (CI %s) pass@k %s%s", policy.version, out["pass_rate"],
                          out["ci"], out["pass_at"], f", by turn {out['turns']}" if "turns" in out else "")
    store.put_json(f"{key}.json", out)
    return out


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def evaluate_incumbent(policy: sessions.PolicyRef, heldout: list[Ref], cfg: NightlyConfig) -> dict | None:
    """The promoted model on this run's held-out tasks, under the same protocol as `evaluate`
    (None when nothing is promoted yet). Kept for the run (runs/<id>/eval/incumbent.json) while the
    pointer still names what was judged, or names this run's own checkpoint: a run resumed after it
    promoted is judged again against what it beat, not against itself."""
    store = open_store(cfg.store)
    pointer = store.get_pointer(INCUMBENT)
    key = f"runs/{policy.run_id}/eval/incumbent.json"
    now, judged_under, specs = pointer.uri if pointer else None, protocol(cfg), _tasks(heldout, cfg)
    digests = task_digests(specs)
    if store.exists(key):
        kept = store.get_json(key)
        if (now in (kept["checkpoint"], policy.checkpoint.uri if policy.checkpoint else None)
                and kept.get("protocol") is not None and _as_judged(kept["protocol"]) == judged_under
                and not _changed(kept, digests)):
            return kept["result"]
    result = None
    if pointer is not None:
        with scratch_dir("incumbent") as tmp:
            got = _eval(sessions.load_engine(store.get_dir(pointer, Path(tmp)), cfg), specs, cfg)
        result = {"checkpoint": now, **got.summary(cfg.eval.confidence)}
    store.put_json(key, {"checkpoint": now, "protocol": judged_under, "task_digests": digests, "result": result})
    return result


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def promote(policy: sessions.PolicyRef, candidate: dict, incumbent: dict | None, cfg: NightlyConfig,
            against: str = "the incumbent") -> dict:
    """Point models/promoted/INCUMBENT at the policy's checkpoint if it beats the incumbent beyond
    noise (`ratchet.eval.should_promote`). candidate / incumbent: `evaluate` results of each
    (`against`: what the incumbent side is, for the reason: the base model before any promotion).
    The pointer moves only if it still names what was judged (`incumbent["checkpoint"]`; nothing,
    against the base model) or this checkpoint already: a run that promoted while this one ran is
    not overwritten by a candidate never compared with it."""
    store = open_store(cfg.store)
    d = should_promote(candidate["results"], incumbent["results"] if incumbent else None, cfg.eval, against)
    reason = d.reason
    theirs = incumbent["results"] if incumbent else {}
    unpaired = sum(v is None or (incumbent is not None and theirs.get(t) is None) for t, v in candidate["results"].items())
    if d.promote and unpaired > cfg.gate.max_env_error_rate * len(candidate["results"]):
        d = replace(d, promote=False)     # an env_error where the other side passed drops a loss from the pairing
        reason = (f"{d.reason}; but not promoted: {unpaired} of {len(candidate['results'])} held-out tasks could not be "
                  f"paired (an env_error on either side, or missing from {against}), above gate.max_env_error_rate "
                  f"{cfg.gate.max_env_error_rate:.0%}: infrastructure failures must not decide a promotion")
    if d.promote and policy.checkpoint is not None:
        judged = (incumbent or {}).get("checkpoint")
        with one_at_a_time(store, "promotion", owner=policy.run_id):   # another run's check and move, not between ours
            now = store.get_pointer(INCUMBENT)
            if now is not None and now.uri not in (judged, policy.checkpoint.uri):
                d = replace(d, promote=False)
                reason = (f"{d.reason}; but not promoted: {INCUMBENT} moved to {now.uri} while this run was judged "
                          f"against {judged or 'the base model'} (evaluate against it before promoting)")
            else:
                store.set_pointer(INCUMBENT, policy.checkpoint)
    get_run_logger().info("promotion: %s", reason)
    return {"promoted": d.promote, "reason": reason, "estimate": d.estimate, "ci": [d.ci_low, d.ci_high],
            "p_value": d.p_value, "method": d.method,
            "checkpoint": policy.checkpoint.uri if d.promote and policy.checkpoint else None}
