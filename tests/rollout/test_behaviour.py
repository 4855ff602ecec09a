"""A server behaviour engine (ratchet/rollout/behaviour.py `ServerWeights`, the `http` and `vllm`
engines): what it sends the server, and how it hands each version's weights over through sync_dir.
`ratchet serve` runs in-process on loopback (tests/rollout/test_engine_contract.py's server); the
weight-sync bookkeeping is checked against a stand-in server that records what it is told to load.

    .venv/bin/python -m pytest tests/rollout/test_behaviour.py -q
"""

from __future__ import annotations

import copy

import pytest
import torch

from ratchet.config import RolloutConfig
from ratchet.model import load_policy
from ratchet.rollout.behaviour import open_behaviour
from ratchet.rollout.torch_engine import TorchEngine
from tests.rollout.test_engine_contract import CHAT, PROMPTS, _LoopbackServer, _save


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return _save(root / "a", 0), _save(root / "b", 1)


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
