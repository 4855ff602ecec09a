"""The policy model: the embedded tiny default, or any local Hugging Face causal LM directory.

No pretrained weights can be downloaded at run time, so the embedded default is built here:
a byte-level BPE tokenizer trained on the task corpus (digits split one per token) and a
Llama-style causal LM of ~2M parameters, saved in the Hugging Face layout (safetensors) so
`AutoModelForCausalLM.from_pretrained(path)` loads it like any other model.

Any other local Hugging Face causal LM loads through the Auto classes:

    model, tokenizer = load_policy(path, cfg.model)     # on cfg.model.device, in cfg.model.dtype
    eos_ids(model, tokenizer)                           # every id that ends a sequence (generation_config)
    context_length(model)                               # max_position_embeddings (or the like), None if unknown
    model_header(path)                                  # config + generation config, no weights: for the above
    encode_prompts(tokenizer, prompts, chat=True)       # token ids, through the chat template as a user turn
    text_ids(tokenizer, observation)                    # token ids of text: "<eos>" in it is not that token
    prompt_room(cfg.model, max_new_tokens)(prompts)     # per prompt: why it leaves no room to answer (None: fits)
    save_policy(model, tokenizer, path)                 # safetensors + config + generation config + tokenizer

Chat template (`ModelConfig.chat_template`, default "auto"): a task's prompt is plain text. A
tokenizer that ships a chat template belongs to an instruct/chat model, trained to see its turns
in that format, so by default the prompt becomes one user message followed by the assistant's
generation prompt; the completion is still judged exactly as generated. The embedded model has
no template and sees the plain prompt ("off" forces that for any model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerFast)

from ratchet.config import ModelConfig
from ratchet.rollout.engine import fits

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
    """Hugging Face layout: model.safetensors, config.json, generation_config.json, tokenizer files
    (with its chat template), so `AutoModelForCausalLM.from_pretrained(path)` and vLLM load it as is."""
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def resolve_device(name: str = "auto") -> torch.device:
    """"auto": CUDA when visible (cuda:LOCAL_RANK under a launcher), else CPU; "cuda" without a GPU is an error."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("model.device 'cuda': no CUDA device is visible to this process")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": "auto"}


def load_policy(path: str | Path, cfg: ModelConfig | None = None):
    """(model, tokenizer) from a Hugging Face directory, on `cfg.device` in `cfg.dtype` (no cfg: fp32
    on CPU). The tokenizer pads on the left, with EOS as its pad token when it has none. Weights
    that do not make the model (`weights_gap`) are a ValueError: transformers would leave those
    randomly initialised and only log a table."""
    cfg = cfg or ModelConfig(device="cpu")
    device = resolve_device(cfg.device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.dtype], output_loading_info=True,
                                                       ignore_mismatched_sizes=True)   # refused here, by name
    gap = weights_gap(info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"])
    if gap:
        raise ValueError(f"{path}: {gap}")
    pad_left(tokenizer, model)
    if device.type == "cpu":
        _own_memory(model)
    else:
        model.to(device)   # fresh device memory: no file views left
    return model, tokenizer


def weights_gap(missing, unexpected, mismatched) -> str | None:
    """Why a checkpoint's weights do not make the model its config.json builds (None: they do), from
    the names `from_pretrained` reports (or preflight finds in the file headers). A missing or
    misshapen weight would be post-trained from its random initialisation. Unexpected names alone
    pass (a value head saved alongside, say) but are named, since they usually say where the
    missing ones went (`_orig_mod.` prefixes: a torch.compile'd model's state dict)."""
    if not missing and not mismatched:
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's weights are not in the files "
                     f"(first: {', '.join(sorted(missing)[:3])})")
    if mismatched:
        name, file, model = sorted(mismatched)[0]
        parts.append(f"{len(mismatched)} have another shape in the files (first: {name}, {list(file)} in the files, "
                     f"{list(model)} in the model)")
    if unexpected:
        parts.append(f"the files hold {len(unexpected)} weights the model has no place for "
                     f"(first: {', '.join(sorted(unexpected)[:3])})")
    return "the weights do not fit the model config.json describes: " + "; ".join(parts)


def pad_left(tokenizer, model):
    """The tokenizer pads on the left, with EOS as its pad token when it has none (ValueError
    when nothing names an EOS: see eos_ids)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:   # padding is always masked out: any real token will do; EOS by convention
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos_ids(model, tokenizer)[0]
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)
    return tokenizer


def model_header(path: str | Path) -> SimpleNamespace:
    """What `load_policy` reads of a directory besides its weights, as a stand-in model for
    `eos_ids`, `pad_left` and `context_length`: its config (AutoConfig's errors raised) and the
    generation config `from_pretrained` gives it: generation_config.json, or, when there is none
    or it does not load (from_pretrained's OSError), one from config.json (None here: eos_ids
    then reads the config itself, the same ids)."""
    config = AutoConfig.from_pretrained(path)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:
        generation = None
    return SimpleNamespace(config=config, generation_config=generation)


def eos_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a sequence: the tokenizer's EOS first, then the generation config's
    (an int or a list: an instruct model's end-of-turn token), else the model config's. Never empty."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for source in (getattr(model, "generation_config", None), model.config):
        found = getattr(source, "eos_token_id", None) if source is not None else None
        for i in ([found] if isinstance(found, int) else list(found or [])):
            if i not in ids:
                ids.append(int(i))
        if found is not None:
            break
    if not ids:
        raise ValueError(f"{getattr(model.config, '_name_or_path', 'the model')}: neither the tokenizer nor the "
                         "generation config names an end-of-sequence token")
    return ids


def context_length(model) -> int | None:
    """The model's own context window from its config (a model or its config; None when it names none)."""
    cfg = getattr(model, "config", model)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def use_chat_template(setting: str, tokenizer) -> bool:
    """Whether prompts go through the tokenizer's chat template (ModelConfig.chat_template)."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting == "on" and not has:
        raise ValueError("model.chat_template 'on': this tokenizer has no chat template (set it to 'auto' or 'off')")
    return has and setting != "off"


def encode_prompts(tokenizer, prompts: list[str], chat: bool = False) -> list[list[int]]:
    """Prompt token ids: BOS (when the tokenizer has one) + the plain text, or with `chat`, the chat
    template's rendering of one user turn and the assistant's generation prompt (its own BOS kept once)."""
    if chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    bos = tokenizer.bos_token_id
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    if bos is None:
        return [list(x) for x in ids]
    return [list(x) if x[:1] == [bos] else [bos, *x] for x in ids]


def text_ids(tokenizer, text: str) -> list[int]:
    """The tokens of `text` as text: a special token's string in it ("<eos>", "<|im_end|>" that an answer
    printed into an observation) is its characters, never that token. Text with no such string (every
    ordinary observation): `tokenizer(text, add_special_tokens=False)`, id for id."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


@dataclass(frozen=True)
class PromptRoom:
    """Whether task prompts leave room for the completion in the run's context (`run_context`), counted
    as the run's rollout engine counts them (`encode_prompts`: the same tokenizer, the chat template when
    the run uses one), so a prompt it passes is one the engine's own check (PromptTooLong) passes."""

    tokenizer: object
    chat: bool
    context: int
    max_new_tokens: int
    limit: str = "the model's context"     # what sets `context`, as the reason names it

    def tokens(self, prompts: list[str]) -> list[int]:
        """Per prompt: its length in tokens, as the engine encodes it."""
        return [len(ids) for ids in encode_prompts(self.tokenizer, prompts, self.chat)]

    def why(self, tokens: int) -> str | None:
        """Why a prompt of `tokens` tokens does not fit (None: it fits)."""
        if fits(tokens, self.max_new_tokens, self.context):
            return None
        return (f"prompt is {tokens} tokens + max_new_tokens {self.max_new_tokens}, "
                f"over {self.limit} of {self.context} tokens")

    def __call__(self, prompts: list[str]) -> list[str | None]:
        """Per prompt: why it does not fit (None: it fits)."""
        return [self.why(n) for n in self.tokens(prompts)]


def run_context(model, cfg: ModelConfig) -> tuple[int, str]:
    """The context a run's sequences stay within, and what sets it: model.max_seq_len (the wave gate
    holds every prompt + completion to it), or the model's own context (a model or its config) where
    that is shorter (preflight refuses a max_seq_len past it, but a probe or a test may set one)."""
    own = context_length(model)
    if own is not None and own <= cfg.max_seq_len:
        return own, "the model's context"
    return cfg.max_seq_len, "model.max_seq_len"


def prompt_room(cfg: ModelConfig, max_new_tokens: int) -> PromptRoom | None:
    """The PromptRoom of the model directory `cfg.path` (its tokenizer and config, no weights loaded),
    in the run's context (`run_context`). None for the embedded model (its tokenizer is trained in the
    warm start, from the run's tasks)."""
    if not cfg.path:
        return None
    context, limit = run_context(AutoConfig.from_pretrained(cfg.path), cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.path)
    return PromptRoom(tokenizer, use_chat_template(cfg.chat_template, tokenizer), context, max_new_tokens, limit)


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
