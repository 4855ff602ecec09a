"""The torch rollout engine: KV-cached batched sampling whose log-probs match a full forward."""

import torch

from ratchet.config import ModelConfig
from ratchet.model import build_model, build_tokenizer
from ratchet.rollout.torch_engine import TorchEngine

CORPUS = ["# add 3\ndef f(x):\n    x = x + 3\n    return x\n", "# reverse it\ndef f(s):\n    s = s[::-1]\n    return s\n"] * 20


def _engine():
    tok = build_tokenizer(CORPUS, 128)
    model = build_model(ModelConfig(hidden_size=32, num_layers=2, num_heads=2), tok).eval()
    return TorchEngine(model, tok), model


def test_groups_and_logprobs_match_a_full_forward():
    engine, model = _engine()
    prompts = ["# add 3\ndef f(x):\n", "# reverse it, then add 1 and more\ndef f(s):\n"]   # different lengths: left padding
    out = engine.generate(prompts, n=3, max_new_tokens=10, seed=0)
    assert [r.prompt_index for r in out] == [0, 0, 0, 1, 1, 1]
    for r in out:
        assert len(r.completion_ids) == len(r.logprobs) <= 10
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
        ref = logp[len(r.prompt_ids) - 1:].gather(1, ids[0, len(r.prompt_ids):, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-4, rtol=1e-4)


def test_greedy_is_deterministic_and_batch_independent():
    engine, _ = _engine()
    prompts = ["# add 3\ndef f(x):\n", "# reverse it\ndef f(s):\n"]
    alone = [engine.generate([p], greedy=True, max_new_tokens=12)[0].completion_ids for p in prompts]
    together = [r.completion_ids for r in engine.generate(prompts, greedy=True, max_new_tokens=12)]
    assert alone == together


def test_finished_rollouts_end_with_eos_and_text_excludes_it():
    engine, _ = _engine()
    for r in engine.generate(["# add 3\ndef f(x):\n"], n=8, max_new_tokens=30, seed=1):
        if r.finished:
            assert r.completion_ids[-1] == engine.eos and "<eos>" not in r.text
        else:
            assert len(r.completion_ids) == 30
