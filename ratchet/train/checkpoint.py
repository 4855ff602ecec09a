"""Checkpoints: complete, atomic, verified.

Layout in the store (DESIGN.md):

    runs/<run_id>/checkpoints/<version>/model.safetensors, config.json, tokenizer*.json  (HF layout)
    runs/<run_id>/checkpoints/<version>/trainer.pt     optimizer, scheduler, RNG states, step
    runs/<run_id>/checkpoints/<version>/ledger.json    which waves were consumed, policy version
    runs/<run_id>/checkpoints/<version>/MANIFEST.json  sha256 of every file, written last
    runs/<run_id>/checkpoints/LATEST                   pointer to the manifest, written after it

A checkpoint without a manifest was interrupted and does not exist. Loading verifies every
file's sha256; a corrupt checkpoint is reported and the previous good one is used.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from ratchet.store import ArtifactStore, IntegrityError, Ref

log = logging.getLogger(__name__)


def checkpoint_prefix(run_id: str, version: int) -> str:
    return f"runs/{run_id}/checkpoints/{version:06d}"


def latest_key(run_id: str) -> str:
    return f"runs/{run_id}/checkpoints/LATEST"


def save_checkpoint(store: ArtifactStore, run_id: str, version: int, write_files) -> Ref:
    """`write_files(dir)` writes the checkpoint's files; they are uploaded with a manifest,
    then LATEST is pointed at it. Returns the manifest's Ref."""
    with tempfile.TemporaryDirectory(prefix="ratchet-ckpt-") as tmp:
        write_files(Path(tmp))
        ref = store.put_dir(checkpoint_prefix(run_id, version), tmp)
    store.set_pointer(latest_key(run_id), ref)
    return ref


def checkpoint_versions(store: ArtifactStore, run_id: str) -> list[int]:
    """Versions that have a manifest (complete checkpoints), newest first."""
    versions = set()
    for key in store.list(f"runs/{run_id}/checkpoints/"):
        parts = key.split("/")
        if len(parts) == 5 and parts[4] == "MANIFEST.json" and parts[3].isdigit():
            versions.add(int(parts[3]))
    return sorted(versions, reverse=True)


def load_checkpoint(store: ArtifactStore, ref: Ref, dest: Path) -> Path:
    """Download and verify one checkpoint (IntegrityError if any file is corrupt)."""
    return store.get_dir(ref, dest)


def load_latest(store: ArtifactStore, run_id: str, dest: Path) -> tuple[Ref, Path] | None:
    """The newest good checkpoint of a run: LATEST first, then older ones if it is corrupt."""
    candidates: list[Ref] = []
    pointer = store.get_pointer(latest_key(run_id))
    if pointer is not None:
        candidates.append(pointer)
    for v in checkpoint_versions(store, run_id):
        key = f"{checkpoint_prefix(run_id, v)}/MANIFEST.json"
        if pointer is None or key != pointer.key:
            candidates.append(store.ref(key))
    for ref in candidates:
        target = dest / ref.key.split("/")[-2]
        try:
            return ref, load_checkpoint(store, ref, target)
        except (IntegrityError, FileNotFoundError, KeyError, json.JSONDecodeError) as e:
            log.warning("checkpoint %s is unusable (%s); falling back to the previous one", ref.uri, e)
    return None
