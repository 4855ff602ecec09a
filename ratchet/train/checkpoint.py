"""Checkpoints: complete, atomic, verified, never lost and never moved backwards.

Layout in the store (DESIGN.md):

    runs/<run_id>/checkpoints/<version>/model.safetensors, config.json, tokenizer*.json  (HF layout)
    runs/<run_id>/checkpoints/<version>/trainer.pt     optimizer, scheduler, RNG states, step
                                                       (trainer-rank<r>.pt per rank from ratchet.train.launch)
    runs/<run_id>/checkpoints/<version>/ledger.json    which waves were consumed, policy version
    runs/<run_id>/checkpoints/<version>/MANIFEST.json  sha256 of every file, written last
    runs/<run_id>/checkpoints/LATEST                   pointer to the manifest, written after it

A checkpoint without a manifest was interrupted and does not exist (`clean_partial` removes
its files). Loading verifies every file's sha256; a corrupt checkpoint, or a LATEST that is
garbage, is reported and the newest checkpoint that verifies is used instead. If checkpoints
exist but none verifies, `load_latest` raises `NoUsableCheckpoint` rather than let the run
start afresh over them. LATEST never moves to an older version.

At the start of a run, holding its lease (ratchet/store/lease.py):

    removed = clean_partial(store, run_id)          # leftovers of an interrupted save
    found = load_latest(store, run_id, dest)        # None: fresh run; NoUsableCheckpoint: stop
    rewind_latest(store, run_id, found[0])          # it fell back past a corrupt LATEST: set those aside
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from ratchet import faults
from ratchet.errors import picklable
from ratchet.store import MANIFEST, ArtifactStore, IntegrityError, Ref
from ratchet.scratch import scratch_dir

log = logging.getLogger(__name__)

_UNUSABLE = (IntegrityError, FileNotFoundError, ValueError, KeyError, TypeError, AttributeError)
"""What bad stored data raises (ValueError covers JSON, UTF-8 and pydantic errors). Transport
errors (S3Error, OSError other than FileNotFoundError) are not among them: an unreachable store
must stop the run, not make it skip to an older checkpoint."""


@picklable
class NoUsableCheckpoint(RuntimeError):
    """The run has checkpoints (or a LATEST) but none of them verifies."""

    def __init__(self, run_id: str, root_uri: str, rejected: list[tuple[str, str]]):
        self.run_id, self.rejected = run_id, rejected
        why = "; ".join(f"{what}: {reason}" for what, reason in rejected)
        super().__init__(
            f"run {run_id!r} in {root_uri} has checkpoints but none is usable, so it can neither resume "
            f"nor safely start afresh. Rejected: {why}. Restore a good copy of runs/{run_id}/checkpoints/ "
            f"or start a new run id."
        )


class CheckpointBehindLatest(ValueError):
    """A save would move LATEST to an older version."""


def trainer_state_file(path: Path, rank: int = 0) -> Path | None:
    """A loaded checkpoint directory's trainer state for `rank`: `trainer-rank<rank>.pt` (written
    per rank by ratchet.train.launch), else `trainer.pt` (one process: the nightly), else rank 0's
    (another world size's: its optimizer partition is not this rank's, but its KL reference and
    value head are the run's); None when it has none."""
    found = [p for p in (path / f"trainer-rank{rank}.pt", path / "trainer.pt", path / "trainer-rank0.pt") if p.exists()]
    return found[0] if found else None


def checkpoint_prefix(run_id: str, version: int) -> str:
    return f"runs/{run_id}/checkpoints/{version:06d}"


def latest_key(run_id: str) -> str:
    return f"runs/{run_id}/checkpoints/LATEST"


def _manifest_key(run_id: str, version: int) -> str:
    return f"{checkpoint_prefix(run_id, version)}/{MANIFEST}"


def _version_of(run_id: str, manifest_key: str) -> int | None:
    """The version a manifest key belongs to, or None if it is not a manifest of this run."""
    base = f"runs/{run_id}/checkpoints/"
    folder, _, name = manifest_key[len(base):].partition("/")
    if manifest_key.startswith(base) and name == MANIFEST and folder.isdigit():
        return int(folder)
    return None


def _read_latest(store: ArtifactStore, run_id: str) -> tuple[Ref | None, str | None]:
    """(target, None) for a usable LATEST, (None, None) when there is none, (None, why) for garbage."""
    key = latest_key(run_id)
    try:
        ref = store.get_pointer(key)
    except FileNotFoundError:  # deleted between exists() and the read
        return None, None
    except _UNUSABLE as e:
        return None, f"{key} is not a readable pointer ({type(e).__name__}: {e})"
    if ref is None:
        return None, None
    if _version_of(run_id, ref.key) is None:
        return None, f"{key} points at {ref.key!r}, which is not a checkpoint manifest of run {run_id!r}"
    if not store.exists(ref.key):
        return None, f"{key} points at {ref.key!r}, which is not in the store"
    return ref, None


def _latest_version(store: ArtifactStore, run_id: str) -> tuple[int | None, str]:
    """The version LATEST points to (or, if LATEST is garbage, the newest complete one), and why."""
    ref, problem = _read_latest(store, run_id)
    if ref is not None:
        return _version_of(run_id, ref.key), f"LATEST points at {ref.key}"
    versions = checkpoint_versions(store, run_id) if problem else []
    if not versions:
        return None, ""
    return versions[0], f"LATEST is unusable and the newest complete checkpoint is {versions[0]:06d}"


def _refuse_if_behind(store: ArtifactStore, run_id: str, version: int) -> None:
    latest, why = _latest_version(store, run_id)
    if latest is not None and version < latest:
        raise CheckpointBehindLatest(
            f"run {run_id!r}: refusing to save checkpoint version {version} because {why} (version {latest}) "
            f"and LATEST never moves backwards. This writer is behind the run: another writer is active, "
            f"or it did not resume from LATEST. Resume with load_latest() instead."
        )


def save_checkpoint(store: ArtifactStore, run_id: str, version: int, write_files, lease=None) -> Ref:
    """`write_files(dir)` writes the checkpoint's files; they are uploaded with a manifest,
    then LATEST is pointed at it. Returns the manifest's Ref.

    Raises CheckpointBehindLatest if `version` is older than the one LATEST points to (checked
    before the upload and again before LATEST is moved). Saving LATEST's own version again (a
    retried task) is allowed. `lease` (a held `RunLease`, renewed; or its token, from a task that
    does not hold the object: the record must still carry it) is checked before the upload and
    before LATEST moves, so a writer whose lease was taken over stops with LeaseLost.
    The local temp directory is removed whatever happens; an interrupted upload leaves a
    folder without a manifest, which `clean_partial` removes."""
    if version < 0:
        raise ValueError(f"run {run_id!r}: checkpoint version must be >= 0, got {version}")
    _refuse_if_behind(store, run_id, version)
    _still_held(store, run_id, lease)
    with scratch_dir("ckpt") as tmp:  # removed on any exception too
        write_files(Path(tmp))
        ref = store.put_dir(checkpoint_prefix(run_id, version), tmp)
    _refuse_if_behind(store, run_id, version)  # LATEST may have moved during a long upload
    _still_held(store, run_id, lease)
    faults.point("checkpoint.latest")
    store.set_pointer(latest_key(run_id), ref)
    return ref


def rewind_latest(store: ArtifactStore, run_id: str, resumed: Ref) -> list[int]:
    """After `load_latest` resumed from `resumed` past newer checkpoints that did not verify: LATEST
    (or, where it is unusable, the newest complete checkpoint) is ahead of the run, and every save of
    a version in between would be refused as behind it (CheckpointBehindLatest), so the run could
    never checkpoint again. Those checkpoints (every complete version newer than `resumed`'s: newest
    first, `load_latest` tried each and rejected it) are moved, as stored, to
    runs/<id>/checkpoints/rejected/<version>-<n>/ (kept, not lost; the manifest last, so that a crash
    part-way leaves a folder that is still complete and is moved again), then LATEST is pointed at
    `resumed`: the one move backwards, made under the run's lease. Returns the versions set aside;
    [] when LATEST is not ahead (nothing was rejected, or LATEST named `resumed`)."""
    version = _version_of(run_id, resumed.key)
    latest, _ = _latest_version(store, run_id)
    if version is None or latest is None or latest <= version:
        return []
    rejected = [v for v in checkpoint_versions(store, run_id) if v > version]
    for v in rejected:
        prefix, aside = f"{checkpoint_prefix(run_id, v)}/", f"runs/{run_id}/checkpoints/rejected/{v:06d}-"
        n = len({k[len(aside):].split("/")[0] for k in store.list(aside)})
        for key in sorted(store.list(prefix), key=lambda k: k.endswith(f"/{MANIFEST}")):   # the manifest last
            store.move_aside(key, f"{aside}{n}/{key[len(prefix):]}")
    store.set_pointer(latest_key(run_id), resumed)
    log.warning("run %r: checkpoint(s) %s did not verify: moved to runs/%s/checkpoints/rejected/; LATEST is "
                "back at %06d, which the run resumed from", run_id, ", ".join(f"{v:06d}" for v in rejected),
                run_id, version)
    return rejected


def _still_held(store: ArtifactStore, run_id: str, lease) -> None:
    """LeaseLost if the writer's lease was taken over: a RunLease renews, a token is checked."""
    from ratchet.store.lease import require_holder

    if isinstance(lease, str):
        require_holder(store, run_id, lease)
    elif lease is not None:
        lease.heartbeat()


def checkpoint_versions(store: ArtifactStore, run_id: str) -> list[int]:
    """Versions that have a manifest (complete checkpoints), newest first."""
    versions = set()
    for key in store.list(f"runs/{run_id}/checkpoints/"):
        v = _version_of(run_id, key)
        if v is not None:
            versions.add(v)
    return sorted(versions, reverse=True)


def clean_partial(store: ArtifactStore, run_id: str) -> list[str]:
    """Delete the files of checkpoint folders that have no MANIFEST.json (interrupted saves);
    return the deleted keys, sorted. Call it at the start of a run while holding the run's
    lease: a save in progress has no manifest yet either, and would be deleted under its writer."""
    base = f"runs/{run_id}/checkpoints/"
    folders: dict[str, list[str]] = {}
    for key in store.list(base):
        folder, sep, _ = key[len(base):].partition("/")
        if sep and folder.isdigit():
            folders.setdefault(folder, []).append(key)
    removed = []
    for folder, keys in sorted(folders.items()):
        if f"{base}{folder}/{MANIFEST}" not in keys:
            for key in keys:
                store.delete(key)
            removed.extend(keys)
    if removed:
        log.warning("run %r: removed %d file(s) of interrupted checkpoint(s) %s", run_id, len(removed),
                    sorted({k[len(base):].split("/")[0] for k in removed}))
    return sorted(removed)


def load_checkpoint(store: ArtifactStore, ref: Ref, dest: Path) -> Path:
    """Download and verify one checkpoint (IntegrityError if any file is corrupt)."""
    return store.get_dir(ref, dest)


def load_latest(store: ArtifactStore, run_id: str, dest: Path) -> tuple[Ref, Path] | None:
    """The newest good checkpoint of a run, downloaded to `dest/<version>`: LATEST's target
    first, then the others newest first. None only if the run has no checkpoint at all (and
    no LATEST); NoUsableCheckpoint if it has some but none verifies. Writes nothing to the store."""
    pointer, problem = _read_latest(store, run_id)
    rejected: list[tuple[str, str]] = []
    if problem:
        log.warning("run %r: %s; falling back to the newest checkpoint whose manifest verifies", run_id, problem)
        rejected.append(("LATEST", problem))
    candidates: list[str] = [pointer.key] if pointer is not None else []
    candidates += [_manifest_key(run_id, v) for v in checkpoint_versions(store, run_id)]
    for i, key in enumerate(candidates):
        name = key.split("/")[-2]
        target = Path(dest) / name
        try:
            ref = pointer if i == 0 and pointer is not None else store.ref(key)
            if i > 0 and pointer is not None and ref == pointer:
                continue  # the same manifest LATEST named: already tried
            return ref, load_checkpoint(store, ref, target)
        except _UNUSABLE as e:
            shutil.rmtree(target, ignore_errors=True)  # no half-verified files left in dest
            log.warning("checkpoint %s of run %r is unusable (%s: %s); falling back to the previous one",
                        name, run_id, type(e).__name__, e)
            rejected.append((f"{name}{' (via LATEST)' if i == 0 and pointer is not None else ''}",
                             f"{type(e).__name__}: {e}"))
    if rejected:
        raise NoUsableCheckpoint(run_id, store.root_uri, rejected)
    return None
