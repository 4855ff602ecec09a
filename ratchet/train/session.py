"""A policy session: the long-lived trainer + rollout engine of one run, in this process.

Prefect orchestrates waves and epochs; the weights and optimizer state stay in memory
between them (DESIGN.md, "Scale-out path"). Stages hand each other a `PolicyRef` (run id,
policy version, last checkpoint). A task that finds no session for the version it was
given (a fresh worker, a crash) restores it from the checkpoint, which must be of that
version; otherwise it raises `StaleSession` and the run is resumed from its LATEST
checkpoint (`nightly(NightlyConfig(run_id=...))`).

The model, the rollout engine and the trainer share one module on `model.device` (CUDA when
present by default), in `model.dtype`; the engine follows the module wherever the trainer puts
it (DeepSpeed places it on its accelerator).
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from ratchet.config import NightlyConfig
from ratchet.model import load_policy, run_context, save_policy, use_chat_template
from ratchet.rollout.behaviour import Behaviour, open_behaviour
from ratchet.rollout.torch_engine import TorchEngine
from ratchet.store import ArtifactStore, Ref, store_for
from ratchet.train.checkpoint import load_checkpoint, save_checkpoint, trainer_state_file
from ratchet.train.torch_trainer import TorchTrainer
from ratchet.scratch import scratch_dir


class PolicyRef(BaseModel):
    """What stages hand each other instead of weights."""

    model_config = ConfigDict(frozen=True)
    run_id: str
    version: int
    checkpoint: Ref | None = None
    """The newest checkpoint; its ledger's version may be older than `version`."""
    checkpoint_version: int | None = None


class StaleSession(RuntimeError):
    """This process has no session at the requested version and no checkpoint of it."""


@dataclass
class PolicySession:
    run_id: str
    version: int
    model: torch.nn.Module
    tokenizer: object
    engine: TorchEngine
    trainer: TorchTrainer
    consumed_waves: list[int]
    behaviour: Behaviour | None = None
    """What samples the waves (ratchet/rollout/behaviour.py): opened by the first rollout."""

    def ref(self, checkpoint: Ref | None, checkpoint_version: int | None) -> PolicyRef:
        return PolicyRef(run_id=self.run_id, version=self.version, checkpoint=checkpoint,
                         checkpoint_version=checkpoint_version)


_SESSIONS: dict[str, PolicySession] = {}
_LOCK = threading.Lock()


def load_engine(model_dir: str | Path, cfg: NightlyConfig, policy_version: int = 0) -> TorchEngine:
    """A rollout engine over the checkpoint in `model_dir`, placed and prompted as the run's policy is."""
    model, tokenizer = load_policy(model_dir, cfg.model)
    engine = TorchEngine(model.eval(), tokenizer, policy_version=policy_version,
                         chat_template=use_chat_template(cfg.model.chat_template, tokenizer), check_context=True)
    engine.context = run_context(model, cfg.model)[0]   # what the gate holds a wave to; episodes stop there
    return engine


def _build(run_id: str, model_dir: Path, cfg: NightlyConfig, trainer_state: dict | None,
           ledger: dict | None, optimizer: bool) -> PolicySession:
    engine = load_engine(model_dir, cfg)
    model, tokenizer = engine.model, engine.tokenizer
    if cfg.train.backend == "deepspeed":
        from ratchet.train.deepspeed_trainer import DeepSpeedTrainer as Trainer
    else:
        Trainer = TorchTrainer
    trainer = Trainer(model, tokenizer.pad_token_id, cfg.train, cfg.rl, temperature=cfg.rollout.temperature)
    if trainer_state is not None:
        trainer.load_state_dict(trainer_state, optimizer=optimizer)
    ledger = ledger or {"version": 0, "consumed_waves": []}
    return PolicySession(run_id, ledger["version"], model, tokenizer, engine, trainer, list(ledger["consumed_waves"]))


def restore(policy: PolicyRef, cfg: NightlyConfig) -> PolicySession:
    """Rebuild a session from `policy.checkpoint` (verified) and register it."""
    if policy.checkpoint is None:
        raise StaleSession(f"run {policy.run_id}: no session in this process and no checkpoint to restore from")
    store = store_for(policy.checkpoint)
    with scratch_dir("restore") as tmp:
        path = load_checkpoint(store, policy.checkpoint, Path(tmp))
        found = trainer_state_file(path)   # a launch's trainer-rank0.pt: its optimizer partition is not ours
        state = torch.load(found, weights_only=False) if found else None
        ledger = json.loads((path / "ledger.json").read_text()) if (path / "ledger.json").exists() else None
        session = _build(policy.run_id, path, cfg, state, ledger,
                         optimizer=found is not None and found.name == "trainer.pt")
    with _LOCK:
        _SESSIONS[policy.run_id] = session
    return session


def discard(run_id: str) -> None:
    """Forget this process's session of `run_id` (its weights may be half-updated)."""
    with _LOCK:
        _SESSIONS.pop(run_id, None)


def open_session(policy: PolicyRef, cfg: NightlyConfig) -> PolicySession:
    """The live session at `policy.version`, restoring from the checkpoint if needed."""
    with _LOCK:
        session = _SESSIONS.get(policy.run_id)
    if session is not None and session.version == policy.version:
        return session
    session = restore(policy, cfg)
    if session.version != policy.version:
        raise StaleSession(
            f"run {policy.run_id}: policy version {policy.version} is not in this process and the last "
            f"checkpoint is version {session.version}; resume the run from its LATEST checkpoint"
        )
    return session


def sampling_session(policy: PolicyRef, cfg: NightlyConfig) -> PolicySession:
    """The session a wave of `policy` samples from: the live one, even when the trainer has moved
    past `policy.version` (async: its behaviour engine keeps that version published), else open_session."""
    with _LOCK:
        session = _SESSIONS.get(policy.run_id)
    if session is not None and session.behaviour is not None and policy.version in session.behaviour.published():
        return session
    return open_session(policy, cfg)


def behaviour(session: PolicySession, cfg: NightlyConfig) -> Behaviour:
    """The session's behaviour engine, opened on first use with the session's version published."""
    with _LOCK:
        if session.behaviour is None:
            session.behaviour = open_behaviour(session.engine, cfg.rollout, cfg.train.seed)
            publish(session)
    return session.behaviour


def publish(session: PolicySession) -> None:
    """Hand the session's weights, as its current version, to its behaviour engine (after each epoch)."""
    if session.behaviour is not None:
        with getattr(session.trainer, "gathered", contextlib.nullcontext)():   # ZeRO-3: whole weights
            session.behaviour.publish(session.version, session.model, session.tokenizer)


def save_session(session: PolicySession, store: ArtifactStore, lease: str | None = None) -> PolicyRef:
    """Write a complete checkpoint of the session (weights, trainer state, ledger) + LATEST; `lease`:
    the run's lease token, which the lease record must still carry when LATEST moves."""

    def write(d: Path) -> None:
        with getattr(session.trainer, "gathered", contextlib.nullcontext)():   # ZeRO-3: whole weights
            save_policy(session.model, session.tokenizer, d)
        torch.save(session.trainer.state_dict(), d / "trainer.pt")
        (d / "ledger.json").write_text(json.dumps(
            {"run_id": session.run_id, "version": session.version, "consumed_waves": session.consumed_waves}
        ))

    ref = save_checkpoint(store, session.run_id, session.version, write, lease=lease)
    return session.ref(ref, session.version)
