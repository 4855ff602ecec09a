"""A server behaviour engine (ratchet/rollout/behaviour.py `ServerWeights`, the `http` and `vllm`
engines): what it sends the server, and how it hands each version's weights over through sync_dir.
`ratchet serve` runs in-process on loopback (tests/rollout/test_engine_contract.py's server); the
weight-sync bookkeeping is checked against a stand-in server that records what it is told to load.

    .venv/bin/python -m pytest tests/rollout/test_behaviour.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ratchet.config import RolloutConfig
from ratchet.model import load_policy
from ratchet.errors import is_transient
from ratchet.rollout.behaviour import ServerWeights, open_behaviour
from ratchet.rollout.client import HTTPEngine
from ratchet.rollout.torch_engine import TorchEngine
from tests.rollout.test_engine_contract import CHAT, PROMPTS, _call, _LoopbackServer


@pytest.fixture(scope="module")
def policies(checkpoints):
    return [load_policy(p) for p in checkpoints]


class Recorder:
    """A server stand-in: each load it is told of, as (version, the weights it found there or None)."""

    policy_version = 0

    def __init__(self):
        self.loads: list[tuple[int, dict | None]] = []

    def set_policy_version(self, version: int, path: str | None = None) -> None:
        f = Path(path) / "model.safetensors"
        self.loads.append((version, load_file(f) if f.exists() else None))


def logprobs(rollouts) -> list[float]:
    return [x for r in rollouts for x in r.logprobs]


def same_weights(found: dict | None, model) -> bool:
    return found is not None and all(torch.equal(found[k], v) for k, v in model.state_dict().items() if k in found)


@pytest.fixture
def served(checkpoints):
    s = _LoopbackServer(checkpoints[0])
    yield s
    s.stop()


def test_the_http_engine_samples_on_the_prompt_ids_the_trainer_trains_on(checkpoints, served, tmp_path):
    """Found by review: with a chat template the trainer encodes the templated prompt (session.engine's
    encode_prompts, stages.train_samples), while the http engine sent the raw text and `ratchet serve`
    encoded it without the template: the wave's behaviour log-probs were not pi_old's context. The
    behaviour engine open_behaviour builds now sends the trainer's ids and samples exactly as the
    in-process engine does on them."""
    model, tok = load_policy(checkpoints[0])
    tok.chat_template = CHAT
    trainer = TorchEngine(model.eval(), tok, chat_template=True)            # the session's engine
    behaviour = open_behaviour(trainer, RolloutConfig(engine="http", engine_url=served.url,
                                                      sync_dir=str(tmp_path / "sync")))
    behaviour.publish(0, model, tok)
    with behaviour.at(0) as engine:
        out = engine.generate(PROMPTS, n=2, max_new_tokens=8, seed=0)
    ref = trainer.generate(PROMPTS, n=2, max_new_tokens=8, seed=0)
    encoded = trainer.encode_prompts(PROMPTS)
    assert [r.prompt_ids for r in out] == [encoded[r.prompt_index] for r in out]
    assert [r.completion_ids for r in out] == [r.completion_ids for r in ref]
    for r, q in zip(out, ref):
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(q.logprobs), atol=1e-5, rtol=1e-5)


def test_a_server_engines_request_timeout_is_the_runs_setting(checkpoints, tmp_path):
    """Found by review: the client's 600 s timeout was fixed, and a wave is one request: a wave whose
    generation took longer failed every attempt, whatever the run needed."""
    model, tok = load_policy(checkpoints[0])
    trainer = TorchEngine(model.eval(), tok)
    for cfg in ({"engine": "http"}, {"engine": "vllm"}):
        behaviour = open_behaviour(trainer, RolloutConfig(**cfg, engine_url="http://127.0.0.1:9", request_timeout_s=1800,
                                                          sync_dir=str(tmp_path / "sync")))
        assert behaviour.engine.timeout_s == 1800


def test_runs_sharing_a_sync_dir_keep_their_own_versions(policies, tmp_path):
    """Found by review: versions were named v<version> in sync_dir itself, so run B's v0 replaced run A's
    (A's server loaded B's weights as A's v0), and B's first sync deleted every v* it had not published,
    A's v5 included. Each behaviour now writes in a subdirectory of its own and deletes only what it dropped."""
    (ma, ta), (mb, tb) = policies
    sync = tmp_path / "sync"
    a, b = ServerWeights(Recorder(), sync, keep=2), ServerWeights(Recorder(), sync, keep=2)
    a.publish(0, ma, ta)
    b.publish(0, mb, tb)                       # run B, the same sync_dir
    with a.at(0):
        pass
    a.publish(5, ma, ta)                       # A's next version, not loaded yet
    with b.at(0):                              # B's sync
        pass
    with a.at(5):
        pass
    assert [v for v, _ in a.engine.loads] == [0, 5] and all(same_weights(w, ma) for _, w in a.engine.loads)
    assert [v for v, _ in b.engine.loads] == [0] and same_weights(b.engine.loads[0][1], mb)
    assert sorted(p.name for p in a.sync_dir.iterdir()) == ["v000000", "v000005"]
    assert a.sync_dir.parent == b.sync_dir.parent == sync and a.sync_dir != b.sync_dir


def test_a_runs_versions_are_readable_by_another_user_and_a_gone_runs_are_removed(policies, tmp_path):
    """Found by review: the run's directory and each version were made by mkdtemp (mode 0700), so a
    server reading a shared sync_dir as another user (a vLLM container) could load none; and nothing
    removed the directory of a run that was killed. Plain mkdirs (the umask's mode); the next run on
    the host removes those of processes that are gone, never a live one's."""
    import socket
    import stat

    model, tok = policies[0]
    sync, host = tmp_path / "sync", socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (sync / f"{host}-{gone.stdout.strip()}-dead0000" / "v000003").mkdir(parents=True)   # a killed run's
    (sync / f"{host}-{os.getpid()}-live0000").mkdir()                                    # a live one's
    (sync / "otherhost-1-x").mkdir()                                                     # another host's
    old = os.umask(0o022)
    try:
        behaviour = ServerWeights(Recorder(), sync, keep=1)
        behaviour.publish(0, model, tok)
    finally:
        os.umask(old)
    assert stat.S_IMODE(behaviour.sync_dir.stat().st_mode) == 0o755
    assert stat.S_IMODE((behaviour.sync_dir / "v000000").stat().st_mode) == 0o755
    assert sorted(p.name for p in sync.iterdir()) == sorted(["otherhost-1-x", f"{host}-{os.getpid()}-live0000",
                                                             behaviour.sync_dir.name])


def test_only_versions_it_dropped_are_deleted_once_the_server_moved_on(policies, tmp_path):
    """keep=1: the version the server serves is kept when a newer one drops it (the server may still read
    it), and deleted at the next load; a directory it did not publish is never touched."""
    model, tok = policies[0]
    behaviour = ServerWeights(Recorder(), tmp_path / "sync", keep=1)
    (behaviour.sync_dir / "v000007").mkdir()   # not this behaviour's version: a listing would have taken it
    behaviour.publish(0, model, tok)
    with behaviour.at(0):
        pass
    behaviour.publish(1, model, tok)           # drops v0, which the server serves
    assert sorted(p.name for p in behaviour.sync_dir.iterdir()) == ["v000000", "v000001", "v000007"]
    with behaviour.at(1):
        pass
    assert sorted(p.name for p in behaviour.sync_dir.iterdir()) == ["v000001", "v000007"]
    behaviour.publish(2, model, tok)
    behaviour.publish(3, model, tok)           # v2 never loaded: deleted when dropped
    assert sorted(p.name for p in behaviour.sync_dir.iterdir()) == ["v000001", "v000003", "v000007"]


def test_a_version_published_while_another_loads_is_not_deleted(policies, tmp_path, monkeypatch):
    """Found by review: publish renamed .v(k+1).tmp to v(k+1) before recording k+1 as published, and a
    sync to version k in between (the rollout thread) deleted every v* not recorded: the new version was
    gone when its wave asked for it. The sync runs here exactly in that window, from the rename itself."""
    model, tok = policies[0]
    behaviour = ServerWeights(Recorder(), tmp_path / "sync", keep=2)
    behaviour.publish(0, model, tok)
    with behaviour.at(0):
        pass
    behaviour.publish(1, model, tok)
    rename, synced = Path.rename, []

    def rename_then_sync(self, target):
        out = rename(self, target)
        if Path(target).name == "v000002" and not synced:
            with behaviour.at(1):              # between the rename and publish recording v2
                synced.append(1)
        return out

    monkeypatch.setattr(Path, "rename", rename_then_sync)
    behaviour.publish(2, model, tok)
    assert synced and behaviour.published() == [1, 2]
    with behaviour.at(2):
        pass
    assert [v for v, _ in behaviour.engine.loads] == [0, 1, 2]
    assert all(same_weights(w, model) for _, w in behaviour.engine.loads)


def test_a_server_restarted_on_other_weights_is_synced_again_before_the_retry(checkpoints, policies, served, tmp_path):
    """Found by review: a `ratchet serve` restarted between two waves of one version (on its --model,
    version 0) served them with its original weights, recorded as version 1: the behaviour engine
    believed version 1 loaded and the client dropped the policy_version the server answered. Now the
    answer's version is checked (a TransientError: the task retries) and a failed wave leaves the
    weights unknown, so the retry syncs the server again."""
    (ma, ta), (mb, tb) = policies
    local_b = TorchEngine(mb.eval(), tb)
    behaviour = ServerWeights(HTTPEngine(served.url), tmp_path / "sync", keep=2)
    behaviour.publish(0, ma, ta)
    behaviour.publish(1, mb, tb)
    sample = dict(n=1, max_new_tokens=6, seed=0)
    with behaviour.at(1) as engine:
        first = engine.generate(PROMPTS, **sample)
    assert logprobs(first) == pytest.approx(logprobs(local_b.generate(PROMPTS, **sample)), abs=1e-5)
    status, _ = _call(served.url, "/v1/load", {"path": str(checkpoints[0]), "version": 0})   # the restart
    assert status == 200
    with pytest.raises(Exception, match="sampled with policy version 0, not 1") as e:
        with behaviour.at(1) as engine:                                  # the next wave of version 1
            engine.generate(PROMPTS, **sample)
    assert is_transient(e.value) and behaviour.syncs == 1
    with behaviour.at(1) as engine:                                      # its retry
        again = engine.generate(PROMPTS, **sample)
    assert behaviour.syncs == 2 and engine.models()[0]["policy_version"] == 1
    assert logprobs(again) == pytest.approx(logprobs(first), abs=1e-6)
