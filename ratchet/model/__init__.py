"""The policy model: the embedded tiny default, or any local Hugging Face model directory.

No pretrained weights can be downloaded at run time, so the embedded default is built here:
a byte-level BPE tokenizer trained on the task corpus (digits split one per token) and a
Llama-style causal LM of ~2M parameters, saved in the Hugging Face layout (safetensors) so
`AutoModelForCausalLM.from_pretrained(path)` loads it like any other model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ratchet.config import ModelConfig

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def build_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `corpus`; every digit is its own token (arithmetic-friendly)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", padding_side="left"
    )


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.hidden_size * 8 // 3 // 16 * 16,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def set_context(model: LlamaForCausalLM, seq_len: int, rope_type: str = "default", factor: float = 1.0,
                original: int | None = None) -> LlamaForCausalLM:
    """Give a Llama model a context of `seq_len` positions with RoPE scaling, in place: the config
    (max_position_embeddings, rope_parameters: what `save_pretrained` writes and `from_pretrained`
    reads back) and the rotary tables built from it. `original`: the length the model was first
    trained at (YaRN scales relative to it). The weights are untouched: RoPE has no parameters."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = model.config
    theta = (config.rope_parameters or {}).get("rope_theta", 10_000.0)
    rope = {"rope_type": rope_type, "rope_theta": theta}
    if rope_type != "default":
        rope["factor"] = float(factor)
    if rope_type == "yarn":
        rope["original_max_position_embeddings"] = int(original or config.max_position_embeddings)
    config.max_position_embeddings = seq_len
    config.rope_parameters = rope
    config.validate_rope()
    device = model.model.embed_tokens.weight.device
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config).to(device)
    return model


def save_policy(model, tokenizer, path: str | Path) -> Path:
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a Hugging Face directory; the tokenizer pads on the left."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    _own_memory(model)
    return model, tokenizer


@torch.no_grad()
def _own_memory(model) -> None:
    """Copy every weight out of the loaded file into freshly allocated tensors.

    safetensors hands out views at the file's byte offsets (24 mod 64 here), while torch
    allocates 64-byte-aligned memory; vectorised CPU kernels split reductions by alignment,
    so the same maths on a loaded model and a built one can differ in the last bit. Owning
    aligned memory makes a resumed run bit-identical to an uninterrupted one on every CPU.
    """
    for t in [*model.parameters(), *model.buffers()]:
        t.data = t.data.clone()
