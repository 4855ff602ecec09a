"""The embedded model: a tokenizer and weights ratchet builds itself, loadable as any HF model."""

import torch
from transformers import AutoModelForCausalLM

from envs.registry import get_family
from ratchet.config import ModelConfig
from ratchet.model import build_model, build_tokenizer, load_policy, save_policy
from ratchet.train.sft import demonstrations, sft

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=256, sft_steps=0)


def _specs(n=60):
    fam = get_family("python_functions")
    return [fam.generate(fam.config(), 0, i, 1 + i % 3, "train") for i in range(n)]


def test_tokenizer_round_trips_code_and_splits_digits():
    specs = _specs()
    tok = build_tokenizer([s.prompt + s.reference_solution for s in specs], 256)
    text = specs[0].prompt + specs[0].reference_solution
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    pieces = tok.convert_ids_to_tokens(tok("x = x + 123", add_special_tokens=False)["input_ids"])
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["1", "2", "3"]


def test_saved_model_loads_with_auto_model(tmp_path):
    specs = _specs()
    tok = build_tokenizer([s.prompt + s.reference_solution for s in specs], TINY.vocab_size)
    model = build_model(TINY, tok)
    save_policy(model, tok, tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[tok.bos_token_id, 5, 6, 7]])
    torch.testing.assert_close(again(ids).logits, model(ids).logits)
    _, tok2 = load_policy(tmp_path)
    assert tok2.padding_side == "left" and tok2.eos_token_id == tok.eos_token_id


def test_sft_lowers_the_loss_on_demonstrations():
    specs = _specs(120)
    tok = build_tokenizer([s.prompt + s.reference_solution for s in specs], TINY.vocab_size)
    model = build_model(TINY.model_copy(update={"hidden_size": 64}), tok)
    losses = sft(model, tok, demonstrations(specs, 1.0), steps=40, batch_size=16, lr=3e-3)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_demonstrations_are_a_deterministic_share_of_every_difficulty():
    specs = list({s.prompt: s for s in _specs(900)}.values())     # distinct prompts only
    demos = demonstrations(specs, 0.5)
    assert demos == demonstrations(specs, 0.5)
    prompts = dict(demos)
    for d in (1, 2, 3):
        level = [s for s in specs if s.difficulty == d]
        share = sum(s.prompt in prompts for s in level) / len(level)
        assert 0.25 < share < 0.75, (d, len(level), share)
