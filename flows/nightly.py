"""The nightly training cycle, top to bottom.

    produce_envs (+ import_envs per task source) -> audit_envs -> fit_to_context -> bootstrap_policy -> evaluate (base)
    -> [rollout_wave -> score_wave -> gate_wave -> train_epoch -> record_wave -> watch_wave -> check_health
        (-> checkpoint_policy, evaluate)] x steps
       (rollout.mode async: the rollouts of the next max_staleness waves run while a wave trains)
    -> publish_curves -> checkpoint_policy -> evaluate (final) -> promote -> write_summary

Run it from Python:   from flows.nightly import nightly; nightly(NightlyConfig(steps=10))
from the shell:       ratchet run            (or: make run)
from the Prefect UI:  deployment "nightly" in deploy/prefect.yaml

Each stage is a task in tasks/ that hands the next one references into the store. One
process at a time runs a run id (a lease in the store); a run with the id of an interrupted
one resumes from its LATEST checkpoint, and its summary covers every attempt.
"""

from __future__ import annotations

from datetime import datetime, timezone

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.settings import deployment_settings, require_store
from ratchet.config import NightlyConfig
from ratchet.eval.report import pass_rates_by_source, vertical_table
from ratchet.run import run_attempt
from ratchet.store import open_store
from tasks.audit import audit_envs
from tasks.evaluate import evaluate, evaluate_incumbent, promote
from tasks.gate import check_health, gate_wave
from tasks.produce import import_envs, produce_envs
from tasks.room import fit_to_context
from tasks.rollout import rollout_wave
from tasks.score import score_wave
from tasks.summary import record_wave, write_summary
from tasks.train import bootstrap_policy, checkpoint_policy, train_epoch
from tasks.watch import publish_curves, watch_wave


def sample_wave(policy, step: int, train: list, cfg: NightlyConfig, ahead: dict):
    """Wave `step`. sync: sampled now by `policy`. async (rollout.mode): the wave started earlier on
    the engine, by a policy up to rollout.max_staleness versions older; before returning it, queue the
    waves up to step + max_staleness from `policy`, so they sample while this one is scored and trained."""
    if cfg.rollout.mode == "sync":
        return rollout_wave(policy, step, train, cfg)
    wave = (ahead.pop(step, None) or rollout_wave.submit(policy, step, train, cfg)).result()
    for later in range(step + 1, min(step + cfg.rollout.max_staleness, cfg.steps - 1) + 1):
        if later not in ahead:   # one engine: each wave after the one before it
            before = [ahead[later - 1]] if later - 1 in ahead else None
            ahead[later] = rollout_wave.submit(policy, later, train, cfg, wait_for=before)
    return wave


@flow(name="nightly", log_prints=True, persist_result=True, validate_parameters=False)   # flows.settings validates
def nightly(cfg: NightlyConfig = NightlyConfig()) -> dict:
    """Train on audited environments; promote the result only if it beats the incumbent."""
    cfg, = deployment_settings(cfg=cfg)   # a partial override keeps the deployment's other settings
    require_store(cfg.store)              # a worker without the S3 settings: one error naming them
    logger = get_run_logger()
    run_id = cfg.run_id or datetime.now(timezone.utc).strftime("nightly-%Y%m%d-%H%M%S")

    with run_attempt(open_store(cfg.store), run_id, owner=flow_run.id or run_id) as lease:
        snapshots = [produce_envs(family, cfg.envs, cfg.store) for family in cfg.envs.families]
        snapshots += [import_envs(source, cfg.envs, cfg.store) for source in cfg.envs.sources]   # users' task sets
        audits = [audit_envs(snapshot, cfg.audit, cfg.verify, cfg.store) for snapshot in snapshots]
        tasks = fit_to_context(run_id, audits, cfg)   # the run's model: a prompt with no room to answer is dropped
        train, heldout = tasks.train, tasks.heldout

        policy = bootstrap_policy(run_id, cfg, train)
        base = evaluate(policy.model_copy(update={"version": 0}), heldout, cfg)  # cached per version: resume-safe
        logger.info("run %s starts at policy v%d, held-out pass@1 %.3f", run_id, policy.version, base["pass_rate"])

        ahead: dict = {}                               # async: waves sampling while earlier ones train
        for step in range(policy.version, cfg.steps):  # one wave per policy version
            lease.check()       # no I/O: a takeover the heartbeat found stops the run here, not at a checkpoint
            wave, rollout_stats = sample_wave(policy, step, train, cfg, ahead)
            scored, wave_stats = score_wave(wave, train, cfg)
            gated = gate_wave(scored, train, cfg)
            policy, train_stats = train_epoch(policy, gated, cfg)
            stats = {**wave_stats, **train_stats, **rollout_stats}
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.steps:
                stats["heldout_pass_rate"] = evaluate(policy, heldout, cfg)["pass_rate"]
            record_wave(run_id, step, stats, cfg)
            watch_wave(run_id, step, stats, cfg)     # TensorBoard; curves and table every watch.every waves
            check_health(run_id, step, cfg)                # a tripped health monitor stops the run here
            logger.info("wave %d/%d: reward %.3f, %d samples trained", step + 1, cfg.steps,
                        wave_stats["reward_mean"], train_stats.get("train_samples", 0))
            if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                lease.check()
                policy = checkpoint_policy(policy, cfg, lease.token)
        publish_curves(run_id, cfg)
        if policy.checkpoint_version != policy.version:
            lease.check()
            policy = checkpoint_policy(policy, cfg, lease.token)

        final = evaluate(policy, heldout, cfg)
        incumbent = evaluate_incumbent(policy, heldout, cfg)
        decision = promote(policy, final, base if incumbent is None else incumbent, cfg,   # paired, beyond noise
                           "the base model" if incumbent is None else "the incumbent")

    return write_summary(run_id, {
        "run_id": run_id,
        "base_pass_rate": base["pass_rate"],
        "final_pass_rate": final["pass_rate"],
        "incumbent_pass_rate": incumbent["pass_rate"] if incumbent else None,
        "promoted": decision["promoted"],
        "promotion": decision["reason"],
        "decision": decision,
        "steps": cfg.steps,
        "policy_version": policy.version,
        "checkpoint": policy.checkpoint.uri if policy.checkpoint else None,
        "base": base,
        "final": final,
        "incumbent": incumbent,
        "eval_table": vertical_table({"base": base, "candidate": final, "incumbent": incumbent}, cfg.eval.confidence),
        "audits": [a.counts for a in audits],
        "too_long": {"tasks": tasks.too_long, "quarantine": tasks.quarantine.uri if tasks.quarantine else None},
        "sources": [s.imported for s in snapshots if s.imported],
        "by_source": pass_rates_by_source({"base": base, "final": final, "incumbent": incumbent}),
        "config": cfg.model_dump(mode="json"),
    }, cfg)
