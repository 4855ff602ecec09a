"""The torch rollout engine: KV-cached batched sampling whose log-probs match a full forward."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ratchet.config import ModelConfig
from ratchet.model import build_model, build_tokenizer
from ratchet.rollout import decoders
from ratchet.rollout.torch_engine import TorchEngine, sample

CORPUS = ["# add 3\ndef f(x):\n    x = x + 3\n    return x\n", "# reverse it\ndef f(s):\n    s = s[::-1]\n    return s\n"] * 20
PROMPTS = ["# add 3\ndef f(x):\n", "# reverse it, then add 1 and more\ndef f(s):\n", "# add 3\n"]   # lengths differ


def _engine():
    tok = build_tokenizer(CORPUS, 128)
    model = build_model(ModelConfig(hidden_size=32, num_layers=2, num_heads=2), tok).eval()
    return TorchEngine(model, tok), model


def _full_forward_logprobs(model, r, temperature=1.0) -> torch.Tensor:
    """log p(completion token | prefix) under logits / temperature, from one forward without a cache."""
    ids = torch.tensor([r.prompt_ids + r.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / temperature, -1)
    return logp[len(r.prompt_ids) - 1:].gather(1, ids[0, len(r.prompt_ids):, None]).squeeze(1)


def _greedy_reference(model, prompt_ids, max_new_tokens, eos) -> list[int]:
    """Greedy decoding the slow way: a full forward of the whole sequence per token, no cache, no padding."""
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_new_tokens and (not out or out[-1] != eos):
            out.append(int(model(input_ids=torch.tensor([prompt_ids + out])).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("n, batch_size, temperature", [(3, 128, 1.0), (1, 128, 1.0), (3, 2, 0.7), (4, 5, 1.3)])
def test_groups_and_logprobs_match_a_full_forward(n, batch_size, temperature):
    """Shared prompt prefill, groups split across batches (batch_size < n) and n=1 all give
    grouped rollouts whose behaviour log-probs equal a full forward's."""
    engine, model = _engine()
    out = engine.generate(PROMPTS, n=n, max_new_tokens=10, temperature=temperature, batch_size=batch_size, seed=0)
    assert [r.prompt_index for r in out] == [i for i in range(len(PROMPTS)) for _ in range(n)]
    for r in out:
        assert r.prompt_ids == engine.encode_prompts([PROMPTS[r.prompt_index]])[0]
        assert len(r.completion_ids) == len(r.logprobs) <= 10
        torch.testing.assert_close(torch.tensor(r.logprobs), _full_forward_logprobs(model, r, temperature),
                                   atol=1e-4, rtol=1e-4)


def test_greedy_matches_a_from_scratch_reference():
    engine, model = _engine()
    out = engine.generate(PROMPTS, n=2, greedy=True, max_new_tokens=12)
    ref = [_greedy_reference(model, ids, 12, engine.eos) for ids in engine.encode_prompts(PROMPTS)]
    assert [r.completion_ids for r in out] == [c for c in ref for _ in range(2)]


def test_seeded_sampling_is_deterministic():
    engine, _ = _engine()
    runs = [[r.completion_ids for r in engine.generate(PROMPTS, n=4, max_new_tokens=12, seed=s)] for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert len({tuple(c) for c in runs[0]}) > 1          # samples within a group differ


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


def _gqa_engine():
    """A Llama with grouped-query attention (3 query heads per kv head) and q/k/v biases."""
    tok = build_tokenizer(CORPUS, 128)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, attention_bias=True,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return TorchEngine(LlamaForCausalLM(config).eval(), tok)


@pytest.mark.parametrize("make", [_engine, _gqa_engine])
def test_llama_decoder_matches_the_models_own_forward(make, monkeypatch):
    """The hand-written Llama decode (shared prompt cache) against HF's forward with a DynamicCache."""
    engine = make()[0] if make is _engine else make()
    assert decoders.LlamaDecoder.supports(engine.model)
    kwargs = dict(n=4, max_new_tokens=16, temperature=0.9, batch_size=6, seed=3)
    fast = engine.generate(PROMPTS, **kwargs)
    monkeypatch.setattr(decoders.LlamaDecoder, "supports", staticmethod(lambda model: False))
    slow = engine.generate(PROMPTS, **kwargs)
    assert [r.completion_ids for r in fast] == [r.completion_ids for r in slow]
    assert any(r.finished for r in fast) and any(not r.finished for r in fast)     # rows left the batch early
    for f, s in zip(fast, slow):
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=1e-4)


def test_sample_draws_each_token_with_its_probability():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 0.0, 1.0]]).repeat(20000, 1)   # [40000, 4]
    tok = sample(probs, torch.Generator().manual_seed(0)).view(20000, 2)
    freq = torch.stack([torch.bincount(tok[:, j], minlength=4) / 20000 for j in range(2)])  # [2, 4]
    torch.testing.assert_close(freq, probs[:2], atol=0.015, rtol=0)      # ~4 standard errors at p = 0.5
    assert int(freq[0, 1]) == 0 and tok[:, 1].eq(3).all()                  # zero-probability tokens never drawn
