"""Decode steps for TorchEngine: one new token per live row, on top of a prefilled prompt cache.

    new_decoder = decoder_for(model)                                    # once per generate(): fuses weights
    decoder = new_decoder(cache, attn, owner, max_new_tokens)           # cache/attn: one row per distinct prompt
    logits = decoder.step(tok, pos)                                     # [b] tokens at positions [b] -> [b, V]
    decoder.keep(idx)                                                   # finished rows leave the batch
    decoder.release()                                                   # the batch is done: buffers back to the pool

`owner[r]` is the distinct prompt of batch row r; rows come grouped by prompt (a GRPO group).

`HFDecoder` copies each prompt's KV cache rows to its samples and calls the model's own forward
with its DynamicCache: it works for any causal LM.

`LlamaDecoder` runs the same maths with the same weights for Llama-style models (Llama, and
Qwen2, which is Llama with q/k/v biases, when no layer uses sliding-window attention), written
out in torch for one-token steps. On CPU, a tiny model's decode step spends about as much time outside
its matrix products as in them (masks, cache concatenation, one copy of the prompt's cache per
sample, per-op overhead); this decoder removes what it can:
- the prompt's keys/values are stored ONCE per distinct prompt and never copied to the samples;
  attention to them is one matrix product per (kv head, prompt) over the stacked queries of the
  group's live rows (cascade attention); attention to the generated tokens is per row;
- the generated tokens' cache is preallocated (no concatenation per step), and a finished row
  leaving the batch moves only the generated columns;
- q/k/v and gate/up are each one matrix product; rotary tables are computed once;
- on CPU the generated tokens' cache is reused by the next batch of the same shape (`_Workspace`):
  a fresh buffer of tens of MB costs one page fault per 4 KiB on first touch (4-8 us each in this
  VM, ~4,600 per batch at 64 rows x 48 tokens: ~10% of a generate() call), a reused one none.
Measured (python -m bench.rollout, 2 shared CPU cores): ~1.3-1.4x the tokens/s of HFDecoder
in the same engine. Other architectures use HFDecoder.
tests/rollout/test_torch_engine.py checks both against a full forward and against each other;
tests/model/test_hf_models.py checks Qwen2 against HF's forward and `generate`.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F


class _Workspace:
    """Free generated-token caches on CPU, handed to the next decoder that asks for the same shape.
    Thread-safe (a buffer set is taken out while in use: two engines never share one); it keeps at
    most one set, of at most MAX_BYTES, so an idle process holds little."""

    MAX_BYTES = 256 * 2**20

    def __init__(self):
        self._free: tuple[tuple, list[torch.Tensor]] | None = None
        self._lock = threading.Lock()

    def take(self, n: int, shape: tuple, like: torch.Tensor) -> list[torch.Tensor]:
        key = (n, tuple(shape), like.dtype, like.device)
        with self._lock:
            if self._free is not None and self._free[0] == key:
                bufs, self._free = self._free[1], None
                return bufs
        return [like.new_empty(shape) for _ in range(n)]

    def give(self, bufs: list[torch.Tensor]) -> None:
        b = bufs[0]
        if b.device.type != "cpu" or len(bufs) * b.numel() * b.element_size() > self.MAX_BYTES:
            return                                   # CUDA's caching allocator reuses memory by itself
        with self._lock:
            self._free = ((len(bufs), tuple(b.shape), b.dtype, b.device), bufs)


_WORKSPACE = _Workspace()


class HFDecoder:
    """The model's own forward with its DynamicCache; any Hugging Face causal LM."""

    def __init__(self, model, cache, attn: torch.Tensor, owner: torch.Tensor, max_new_tokens: int):
        cache.batch_select_indices(owner)                                          # [U, ...] -> [b, ...]
        self.model, self.cache, self.attn = model, cache, attn[owner]             # attn: [b, P] 1 = real token

    def release(self) -> None:
        """Nothing pooled: the model's own cache."""

    def keep(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        self.attn = self.attn[idx]

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, torch.ones_like(self.attn[:, :1])], dim=1)  # [b, L+1]
        out = self.model(input_ids=tok[:, None], attention_mask=self.attn, position_ids=pos[:, None],
                         cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.logits[:, -1].float()                                          # [b, V]


class LlamaDecoder:
    """One-token decode steps of a LlamaForCausalLM: same weights and maths, shared prompt cache."""

    ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")

    @staticmethod
    def supports(model) -> bool:
        cfg = model.config
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        full_attention = all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or []))
        return (type(model).__name__ in LlamaDecoder.ARCHITECTURES and cfg.hidden_act == "silu"
                and getattr(cfg, "pretraining_tp", 1) == 1 and not getattr(cfg, "mlp_bias", False)
                and full_attention                                    # Qwen2's sliding-window layers: not here
                and rope in ("default", "linear", "llama3"))   # position-only rotary tables (not "dynamic")

    def __init__(self, model, layers: list[_Layer], cache, attn: torch.Tensor, owner: torch.Tensor,
                 max_new_tokens: int):
        cfg, base = model.config, model.model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.embed, self.lm_head, self.final_norm = base.embed_tokens.weight, model.lm_head, base.norm
        self.layers = layers
        # kv head leading: the prompt cache is [KVH, U, P, D], rows' tensors are [KVH, b, ...], so
        # stacking a prompt's rows for the shared-prompt matmul is a gather along one dim, no transposes
        self.prompt_k = [layer.keys.transpose(0, 1).contiguous() for layer in cache.layers]  # per layer [KVH, U, P, D]
        self.prompt_v = [layer.values.transpose(0, 1).contiguous() for layer in cache.layers]
        U, P = attn.shape
        dtype, device = self.prompt_k[0].dtype, attn.device
        # additive mask over prompt columns, -inf on left padding; broadcasts over [KVH, U, nmax*G, P]
        self.prompt_bias = torch.zeros(U, 1, P, dtype=dtype, device=device).masked_fill(attn[:, None] == 0, float("-inf"))
        shape = (self.kv_heads, len(owner), max_new_tokens, self.head_dim)
        self._buffers = _WORKSPACE.take(2 * len(self.prompt_k), shape, self.prompt_k[0])
        self.gen_k = self._buffers[:len(self.prompt_k)]                           # per layer [KVH, b, T, D]
        self.gen_v = self._buffers[len(self.prompt_k):]
        self.length = 0                                                           # generated columns filled
        # rotary tables for every position a row can reach; rotate_half(x) * sin == swap_halves(x) * signed_sin
        positions = torch.arange(P + max_new_tokens, device=device)[None]         # [1, P+T]
        cos, sin = base.rotary_emb(self.prompt_k[0], positions)                   # [1, P+T, D]
        half = self.head_dim // 2
        self.cos, self.signed_sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # [P+T, D]
        self.scaling = base.layers[0].self_attn.scaling
        self._set_rows(owner)

    def _set_rows(self, owner: torch.Tensor) -> None:
        """Row r is sample slot[r] of prompt owner[r]; nmax: the largest live group; flat: r's place in [U*nmax]."""
        counts = torch.bincount(owner, minlength=len(self.prompt_bias))           # [U]
        self.nmax = int(counts.max())
        slot = torch.arange(len(owner), device=owner.device) - (counts.cumsum(0) - counts)[owner]
        self.owner, self.flat = owner, owner * self.nmax + slot                   # [b], [b]
        self.full = len(owner) == len(counts) * self.nmax                         # every group whole: flat == arange

    def release(self) -> None:
        """The batch is done: its generated-token buffers go back to the pool (uninitialised for the next)."""
        _WORKSPACE.give(self._buffers)
        self.gen_k = self.gen_v = self._buffers = []

    def keep(self, idx: torch.Tensor) -> None:
        """Rows idx (ascending) stay: compact the generated columns in place (no new buffers)."""
        n, g = len(idx), self.length
        for cache in (self.gen_k, self.gen_v):
            for i, c in enumerate(cache):
                c[:, :n, :g] = c[:, :, :g].index_select(1, idx)   # ~3x faster than c[:, idx] here
                cache[i] = c[:, :n]
        self._set_rows(self.owner[idx])

    def _by_prompt(self, x: torch.Tensor) -> torch.Tensor:
        """[KVH, b, G, X] rows -> [KVH, U, nmax*G, X], each prompt's live rows stacked (zeros in free slots)."""
        (KVH, b, G, X), U = x.shape, len(self.prompt_bias)
        if self.full:                                                             # rows already stacked by prompt
            return x.reshape(KVH, U, self.nmax * G, X)
        grouped = x.new_zeros(KVH, U * self.nmax, G, X).index_copy_(1, self.flat, x)
        return grouped.view(KVH, U, self.nmax * G, X)

    def _by_row(self, x: torch.Tensor, G: int) -> torch.Tensor:
        """Inverse of _by_prompt: [KVH, U, nmax*G, X] -> [KVH, b, G, X]."""
        KVH, U, _, X = x.shape
        if self.full:
            return x.view(KVH, U * self.nmax, G, X)
        return x.view(KVH, U * self.nmax, G, X).index_select(1, self.flat)

    def _attend(self, q, k_prompt, v_prompt, k_gen, v_gen) -> torch.Tensor:
        """Attention of q [KVH, b, G, D] (scaled) over the row's prompt (shared) and its own generated tokens."""
        G, P = q.shape[2], k_prompt.shape[2]
        s_prompt = torch.matmul(self._by_prompt(q), k_prompt.transpose(-1, -2)) + self.prompt_bias  # [KVH, U, nmax*G, P]
        s_gen = torch.matmul(q, k_gen.transpose(-1, -2))                          # [KVH, b, G, g]
        probs = torch.softmax(torch.cat([self._by_row(s_prompt, G), s_gen], dim=-1), dim=-1)  # [KVH, b, G, P+g]
        o_prompt = torch.matmul(self._by_prompt(probs[..., :P]), v_prompt)       # [KVH, U, nmax*G, D]
        return self._by_row(o_prompt, G) + torch.matmul(probs[..., P:], v_gen)    # [KVH, b, G, D]

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, H, KVH, D, g = len(tok), self.heads, self.kv_heads, self.head_dim, self.length
        x = self.embed.index_select(0, tok)                                       # [b, E]
        cos, sin = self.cos.index_select(0, pos)[:, None], self.signed_sin.index_select(0, pos)[:, None]  # [b, 1, D]
        for i, w in enumerate(self.layers):
            qkv = F.linear(F.rms_norm(x, w.norm1.shape, w.norm1, w.eps), w.qkv, w.qkv_bias)  # [b, (H+2*KVH)*D]
            qk = qkv[:, :(H + KVH) * D].view(b, H + KVH, D)
            qk = torch.addcmul(qk * cos, qk.view(b, H + KVH, 2, D // 2).flip(2).view(b, H + KVH, D), sin)  # rotary, q and k at once
            self.gen_k[i][:, :, g] = qk[:, H:].transpose(0, 1)                    # [KVH, b, D]
            self.gen_v[i][:, :, g] = qkv[:, (H + KVH) * D:].view(b, KVH, D).transpose(0, 1)
            q = (qk[:, :H] * self.scaling).view(b, KVH, H // KVH, D).transpose(0, 1)  # [KVH, b, G, D]: head h -> kv head h // G
            o = self._attend(q, self.prompt_k[i], self.prompt_v[i], self.gen_k[i][:, :, :g + 1], self.gen_v[i][:, :, :g + 1])
            x = x + F.linear(o.transpose(0, 1).reshape(b, H * D), w.o, w.o_bias)
            gu = F.linear(F.rms_norm(x, w.norm2.shape, w.norm2, w.eps), w.gate_up)  # [b, 2*I]
            x = x + F.linear(F.silu(gu[:, :w.inter]) * gu[:, w.inter:], w.down)
        self.length = g + 1
        norm = self.final_norm
        x = F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
        return F.linear(x, self.lm_head.weight, self.lm_head.bias).float()        # [b, V]


class _Layer:
    """One decoder layer's weights, q|k|v and gate|up each fused into one matrix."""

    def __init__(self, layer):
        a, m = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.variance_epsilon
        self.qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        self.qkv_bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
        self.o, self.o_bias = a.o_proj.weight, a.o_proj.bias
        self.gate_up, self.inter = torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.gate_proj.out_features
        self.down = m.down_proj.weight


def decoder_for(model):
    """-> new_decoder(cache, attn, owner, max_new_tokens): LlamaDecoder where it applies, else HFDecoder."""
    if LlamaDecoder.supports(model):
        layers = [_Layer(layer) for layer in model.model.layers]
        return lambda cache, attn, owner, max_new_tokens: LlamaDecoder(model, layers, cache, attn, owner, max_new_tokens)
    return lambda cache, attn, owner, max_new_tokens: HFDecoder(model, cache, attn, owner, max_new_tokens)
