"""The behaviour policy: the engine that samples waves, with weights of its own, apart from the trainer's.

    behaviour = TorchCopy(session.engine, keep=2)            # async, in-process: a second copy of the weights
    behaviour = ServerWeights(HTTPEngine(url), sync_dir, keep=1)   # `ratchet serve` / vLLM: weights through a directory
    behaviour.publish(3, model, tokenizer)                   # trainer side, after an epoch: version 3 handed over
    with behaviour.at(3) as engine:                          # rollout side: the engine, its weights moved to version 3
        rollouts = engine.generate(prompts, n=8)

Why: in async mode (`rollout.mode: async`) wave k+1 is sampled while wave k trains, so the weights
it samples from must not be the ones being updated; and a server engine (`ratchet serve`, vLLM)
holds its own copy in another process anyway. The trainer publishes every new version; the rollout
asks for exactly the version its wave was given (`PolicyRef.version`, which the wave records as
`policy_version`), so which weights sampled a wave never depends on thread timing. A version is
kept until `keep` newer ones are published (`rollout.max_staleness` + 1: a wave submitted ahead still
finds its version after the trainer moved on).

Weight sync, per engine: the in-process copy takes a `load_state_dict` from a CPU snapshot; a server
is sent the directory of that version's weights (safetensors, Hugging Face layout, written by
`publish`): `ratchet serve` loads it on POST /v1/load, vLLM per `ratchet/rollout/vllm.py`. Each sync is
timed (`last_sync_s`, and logged by the rollout task).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Iterator

import torch

from ratchet.config import RolloutConfig
from ratchet.scratch import remove_gone


class Behaviour(ABC):
    """Published versions (kept until `keep` newer exist) and an engine moved between them."""

    def __init__(self, engine, keep: int):
        if keep < 1:
            raise ValueError(f"keep: at least 1 published version must be kept, got {keep}")
        self.engine, self.keep = engine, keep
        self.loaded: int | None = None      # the version the engine's weights are now
        self.syncs, self.last_sync_s = 0, 0.0
        self._versions: dict[int, object] = {}
        self._lock = threading.Lock()       # the version table
        self._use = threading.Lock()        # one wave at a time on the engine: its weights never move under it

    def publish(self, version: int, model: torch.nn.Module, tokenizer) -> None:
        """Hand over the weights of `version` (call when nothing is updating `model`)."""
        snapshot = self._snapshot(version, model, tokenizer)
        with self._lock:
            self._versions[version] = snapshot
            stale = sorted(self._versions)[:-self.keep]
            dropped = [(v, self._versions.pop(v)) for v in stale]
        for v, snap in dropped:
            self._drop(v, snap)

    def published(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    @contextlib.contextmanager
    def at(self, version: int) -> Iterator:
        """The engine with the weights of `version`, held for the caller's exclusive use. When the caller
        fails (or the load does), the engine's weights are taken as unknown and the next call syncs again:
        a server may have been restarted on other weights meanwhile (a retried wave then re-syncs it)."""
        with self._use:
            if self.loaded != version:
                with self._lock:
                    snapshot = self._versions.get(version)
                if snapshot is None:
                    raise LookupError(f"behaviour policy: version {version} was never published or was dropped "
                                      f"(published: {self.published()}; keep={self.keep})")
                self.loaded = None               # until the load completes: a failed one may leave it half-moved
                t0 = time.perf_counter()
                self._load(version, snapshot)
                self.syncs, self.last_sync_s = self.syncs + 1, time.perf_counter() - t0
                self.loaded = version
                self.engine.policy_version = version
            try:
                yield self.engine
            except BaseException:
                self.loaded = None
                raise

    def close(self) -> None:
        with self._lock:
            dropped = list(self._versions.items())
            self._versions.clear()
        for v, snap in dropped:
            self._drop(v, snap)

    @abstractmethod
    def _snapshot(self, version: int, model, tokenizer) -> object: ...

    @abstractmethod
    def _load(self, version: int, snapshot: object) -> None: ...

    def _drop(self, version: int, snapshot: object) -> None:
        """Free a snapshot no wave can ask for any more."""


class Shared(Behaviour):
    """Sync mode, in-process: the engine samples with the trainer's own weights (no copy, no sync).
    Only the version it was last told is checked: a wave must be sampled by the policy it records."""

    def __init__(self, engine):
        super().__init__(engine, keep=1)

    def _snapshot(self, version, model, tokenizer):
        self.loaded = None               # the shared weights are `version`'s now, no longer those loaded before
        return version

    def _load(self, version, snapshot):
        pass


class TorchCopy(Behaviour):
    """A second in-process copy of the model for the engine; each version a CPU snapshot of the state dict."""

    def __init__(self, engine, keep: int):
        twin = copy.copy(engine)             # the same engine settings (device, tokenizer, prompts), its own weights
        twin.model = copy.deepcopy(engine.model).eval().requires_grad_(False)
        super().__init__(twin, keep)

    def _snapshot(self, version, model, tokenizer):
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def _load(self, version, snapshot):
        self.engine.model.load_state_dict(snapshot)


class ServerWeights(Behaviour):
    """A server engine (HTTPEngine to `ratchet serve`, or vLLM): each version's weights saved under
    `<this behaviour's own directory>/v<version>` and loaded by the server from there
    (`engine.set_policy_version(v, path)`). With `start` instead of an engine, the server is started on
    the first version's directory.

    The own directory is a fresh subdirectory of `sync_dir` (`self.sync_dir`), so runs that share
    sync_dir (one shared volume for every run of a deployment) never overwrite or delete each other's
    versions; it writes each version under a unique temporary name and renames it whole. Only versions
    this behaviour published and then dropped are deleted, never by listing the directory: a dropped
    version the server may still be reading (the one it loads or serves) is deleted once it has moved
    to another."""

    def __init__(self, engine, sync_dir: str | Path, keep: int, start: Callable[[str], object] | None = None):
        if engine is None and start is None:
            raise ValueError("ServerWeights: give an engine, or how to start one")
        super().__init__(engine, keep)
        self.start = start
        self.sync_dir = _own_dir(Path(sync_dir))       # this run's own
        self._serving: int | None = None               # the version the server was last told to load
        self._retired: dict[int, Path] = {}            # dropped while _serving, deleted once it moves on

    def _snapshot(self, version, model, tokenizer):
        from ratchet.model import save_policy

        path = self.sync_dir / f"v{version:06d}"
        tmp = self.sync_dir / f".v{version:06d}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            tmp.mkdir()
            save_policy(model, tokenizer, tmp)
            with self._lock:                   # published again after a drop: that path is the new one's
                self._retired.pop(version, None)
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)                   # complete or absent: a server never reads a half-written version
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def _load(self, version, snapshot):
        with self._lock:                       # claimed under the table's lock: a drop now keeps its files
            if version not in self._versions:
                raise LookupError(f"behaviour policy: version {version} was dropped while being loaded "
                                  f"(published: {sorted(self._versions)}; keep={self.keep})")
            self._serving = version
            gone = [self._retired.pop(v) for v in list(self._retired) if v != version]
        for path in gone:                      # the server is done with them: it loads `version` now
            shutil.rmtree(path, ignore_errors=True)
        if self.engine is None:
            self.engine = self.start(str(snapshot))     # started on this version: nothing to sync
        else:
            self.engine.set_policy_version(version, path=str(snapshot))

    def _drop(self, version, snapshot):
        with self._lock:
            if version == self._serving:       # the server may still read the files of the version it serves
                self._retired[version] = snapshot
                return
        shutil.rmtree(snapshot, ignore_errors=True)


def _own_dir(sync_dir: Path) -> Path:
    """A new directory of this process's in `sync_dir`, `<host>-<pid>-<random>`, made as a plain mkdir
    (the umask's mode: a server on another node may read it as another user; mkdtemp's is 0700). The
    directories of processes of this host that are gone (a run killed before it closed) are removed."""
    host = socket.gethostname()
    sync_dir.mkdir(parents=True, exist_ok=True)
    remove_gone(sync_dir, rf"{re.escape(host)}-(\d+)-")
    own = sync_dir / f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    own.mkdir()
    return own


def open_behaviour(engine, rollout: RolloutConfig, seed: int = 0) -> Behaviour:
    """The behaviour engine `rollout` asks for, beside the session's in-process `engine` (a TorchEngine).
    Nothing is published yet: the caller publishes the session's version. A server engine is sent each
    prompt as the token ids `engine.encode_prompts` gives, the trainer's own (client.py, "Prompts")."""
    keep = rollout.max_staleness + 1 if rollout.mode == "async" else 1
    if rollout.engine == "torch":
        return TorchCopy(engine, keep) if rollout.mode == "async" else Shared(engine)
    sync_dir = rollout.sync_dir or tempfile.mkdtemp(prefix=f"ratchet-sync-{os.getpid()}-")   # scratch: removed when stale
    client = dict(encode=engine.encode_prompts, timeout_s=rollout.request_timeout_s)   # every server engine's
    if rollout.engine == "http":
        from ratchet.rollout.client import HTTPEngine

        return ServerWeights(HTTPEngine(rollout.engine_url, **client), sync_dir, keep)
    from ratchet.rollout.vllm import VLLMEngine, vllm_engine

    if rollout.engine_url:
        return ServerWeights(VLLMEngine(rollout.engine_url, sync=rollout.vllm_sync, **client), sync_dir, keep)
    start = lambda path: vllm_engine(rollout.vllm_python, path, rollout.vllm_args, rollout.vllm_sync, seed,  # noqa: E731
                                     **client)
    return ServerWeights(None, sync_dir, keep, start=start)


def check_staleness(behaviour_version: int, version: int, rollout: RolloutConfig, step: int) -> int:
    """How many versions the behaviour policy of wave `step` is behind the trainer's `version`; an
    error when negative, or in async mode above rollout.max_staleness. (Sync mode samples every wave
    from the version that trains on it, by construction; a wave trained again later, as a test or a
    manual re-run does, is only recorded as stale: the importance weight corrects it.)"""
    staleness = version - behaviour_version
    bound = rollout.max_staleness if rollout.mode == "async" else None
    if staleness < 0 or (bound is not None and staleness > bound):
        raise ValueError(f"wave {step}: sampled by policy version {behaviour_version}, trained at version {version}: "
                         f"staleness {staleness} is outside 0..{bound if bound is not None else 'any'} "
                         f"(rollout.mode {rollout.mode}, rollout.max_staleness {rollout.max_staleness})")
    return staleness


_share = threading.local()     # cpu_share's depth in this thread


@contextlib.contextmanager
def cpu_share(rollout: RolloutConfig, device: torch.device | str = "cpu") -> Iterator[None]:
    """In async mode on CPU, the calling thread's torch ops run on half its threads while inside:
    max(1, T // 2), T its count before (threads that never set one inherit the main thread's). The
    sampling thread and the training thread each take half, so async uses T threads in all, as
    sync uses T for one stage at a time: python -m bench.async compares the two at the same total.
    The count is per thread (OpenMP: a thread that sets it keeps its own), so each thread restores
    its own on leaving, whatever the other does; nested in one thread, the outer share holds.
    Elsewhere (sync, or not on CPU): nothing changes."""
    if rollout.mode != "async" or torch.device(device).type != "cpu":
        yield
        return
    depth = getattr(_share, "depth", 0)
    before = torch.get_num_threads()
    if depth == 0:
        torch.set_num_threads(max(1, before // 2))
    _share.depth = depth + 1
    try:
        yield
    finally:
        _share.depth = depth
        if depth == 0:
            torch.set_num_threads(before)
