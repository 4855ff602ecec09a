"""A tiny random Hugging Face causal LM directory, built here in a second (nothing downloaded), for
tests that need one that really loads: preflight's checks, `ratchet run --model`.

    tiny_llama(path)                  # BOS/EOS, no pad, no chat template; config.json, safetensors, tokenizer
    tiny_llama(path, eos=False)       # no EOS anywhere: not the tokenizer, config or generation config
    tiny_llama(path, extra_tokens=n)  # n more tokens in the tokenizer than the model has embedding rows
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = ["def f(x):\n    return x + 1\n", "print('hello world 123')\n"] * 20


def _tokenizer(eos: bool, extra: int = 0) -> PreTrainedTokenizerFast:
    specials = ["<unk>", "<s>", "</s>"] if eos else ["<unk>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials + [
        f"<x{i}>" for i in range(extra)], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    named = {"bos_token": "<s>", "eos_token": "</s>"} if eos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **named)


def tiny_llama(path: Path, eos: bool = True, extra_tokens: int = 0) -> Path:
    tok = _tokenizer(eos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(path)
    (_tokenizer(eos, extra_tokens) if extra_tokens else tok).save_pretrained(path)
    return Path(path)


def preflight_reads_weights() -> bool:
    """Whether preflight can match a directory's weight names against its config here: it leans on
    transformers' loading internals (ratchet.preflight._fit), which a transformers release may move;
    then preflight skips that check (load_policy's refusal stays) and tests of it skip too."""
    from ratchet.preflight import _fit

    try:
        _fit(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2), {})
    except (ImportError, AttributeError, TypeError):
        return False
    return True
