"""Prefect tasks of training: bootstrap the policy, train an epoch on a gated wave, checkpoint.
Thin: load refs, call `ratchet.stages` / `ratchet.train`, save, return refs."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from envs.snapshot import load_specs
from ratchet import stages
from ratchet.config import NightlyConfig
from ratchet.rollout.behaviour import check_staleness, cpu_share
from ratchet.store import Ref, open_store
from ratchet.train import session as sessions
from ratchet.train.checkpoint import load_latest, rewind_latest, save_checkpoint
from ratchet.scratch import scratch_dir
from tasks.evaluate import set_aside_evaluations
from tasks.retry import transient_only


@task(retries=1, retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def bootstrap_policy(run_id: str, cfg: NightlyConfig, train: list[Ref]) -> sessions.PolicyRef:
    """The policy a run starts from: its own LATEST checkpoint (resume), a local HF model
    directory, or the embedded tiny model built and warm-started here. Saved as version 0."""
    logger = get_run_logger()
    store = open_store(cfg.store)
    with scratch_dir("boot") as tmp:
        found = load_latest(store, run_id, Path(tmp))
        if found is not None:
            ref, _ = found
            logger.info("resuming run %s from %s", run_id, ref.uri)
            session = sessions.restore(sessions.PolicyRef(run_id=run_id, version=-1, checkpoint=ref), cfg)
            rejected = rewind_latest(store, run_id, ref)    # fell back past checkpoints that did not verify
            if rejected:
                logger.warning("checkpoint(s) %s of run %s did not verify: set aside (runs/%s/checkpoints/rejected/), "
                               "LATEST back at the one resumed from", rejected, run_id, run_id)
            moved = set_aside_evaluations(store, run_id, session.version)   # later versions are trained again
            if moved:
                logger.info("evaluations of versions past v%d set aside (runs/%s/eval/superseded/): %s",
                            session.version, run_id, ", ".join(k.rsplit("/", 1)[-1] for k in moved))
            return session.ref(ref, session.version)
        if cfg.model.path:
            from ratchet.model import load_policy, save_policy

            # re-saved in HF layout (safetensors, generation config, tokenizer with its chat template);
            # loaded on the CPU only to be written: the session places it on model.device
            model, tokenizer = load_policy(cfg.model.path, cfg.model.model_copy(update={"device": "cpu"}))
            write = lambda d: save_policy(model, tokenizer, d)  # noqa: E731
        else:
            from ratchet.agent import warm_start_revisions
            from ratchet.train.sft import warm_start

            specs = [s for r in train for s in load_specs(r)]
            revisions, own = warm_start_revisions(cfg, specs, log=logger.info)
            write = lambda d: warm_start(cfg.model, specs, d, log=logger.info, revisions=revisions,  # noqa: E731
                                         own_revisions=own, own_steps=cfg.agent.own_revision_steps)
        ref = save_checkpoint(store, run_id, 0, write)
    logger.info("policy v0 of run %s at %s", run_id, ref.uri)
    return sessions.PolicyRef(run_id=run_id, version=0, checkpoint=ref, checkpoint_version=0)


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def train_epoch(policy: sessions.PolicyRef, wave: Ref, cfg: NightlyConfig) -> tuple[sessions.PolicyRef, dict]:
    """One RL epoch on a gated wave; returns the next policy version and the train metrics.
    The advantages are computed here, once, stored beside the wave (`trained.parquet`), and
    exactly those are trained on; in async mode the wave's behaviour policy may be at most
    `rollout.max_staleness` versions old; its age is recorded as `staleness`. An epoch that fails part-way drops the session: its retry starts
    from the checkpoint of `policy.version` if there is one, else stops with `StaleSession` and the
    run resumes from LATEST, redoing those waves identically (never a wave's steps applied twice)."""
    session = sessions.open_session(policy, cfg)
    if cfg.rollout.mode == "async":
        # this version published before its weights change in place: a wave that starts sampling
        # during the epoch reads that copy. A retry's session (restored after a failed attempt)
        # has none until now, and a rollout would have copied the weights it was training.
        sessions.behaviour(session, cfg)
    store = open_store(cfg.store)
    frame = store.read_table(wave)
    staleness = check_staleness(int(frame["policy_version"].min()), policy.version, cfg.rollout, int(frame["step"][0]))
    samples = session.trainer.assign_advantages(stages.train_samples(frame, session.engine.encode_prompts, cfg))
    store.write_table(wave.sibling("trained.parquet"), stages.with_advantages(frame, samples))
    try:
        with cpu_share(cfg.rollout, session.trainer.device):   # async on CPU: leave the sampler its cores
            metrics = session.trainer.train_wave(samples) if samples else {"train_samples": 0}
    except BaseException:
        sessions.discard(policy.run_id)   # half-updated: a retry restores the last good state, never reuses these
        raise
    metrics["staleness"] = stages.staleness(frame, session.version)
    session.version += 1
    session.consumed_waves.append(int(frame["step"][0]))
    sessions.publish(session)             # the behaviour engine may sample from this version from now on
    return session.ref(policy.checkpoint, policy.checkpoint_version), {**metrics, "staleness": staleness}


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def checkpoint_policy(policy: sessions.PolicyRef, cfg: NightlyConfig, lease: str | None = None) -> sessions.PolicyRef:
    """Weights, optimizer, RNG and ledger to the store; LATEST written last, if the run's lease record
    still carries `lease` (the flow's lease token): LeaseLost if another writer took the run over."""
    return sessions.save_session(sessions.open_session(policy, cfg), open_store(cfg.store), lease)
