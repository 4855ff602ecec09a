"""The embedded rollout engine: batched sampling with a KV cache, in-process torch.

    engine = TorchEngine(model, tokenizer)
    rollouts = engine.generate(prompts, n=8, max_new_tokens=48)   # len(prompts) * n, grouped by prompt

Each rollout carries the sampled token ids and their log-probs under the sampling
distribution (logits / temperature): the behaviour log-probs the trainer's importance
ratios are taken against. A batch holds up to `batch_size` sequences; the distinct prompts
in it are left-padded and prefilled ONCE, and their KV cache serves the n samples of each
(ratchet/rollout/decoders.py: a hand-written Llama/Qwen2 decode that never copies the prompt's
cache, or the model's own forward for other architectures). A sequence that emits any of the
model's EOS ids (the tokenizer's and the generation config's), or completes a stop string,
leaves the batch.

The engine runs wherever the model's weights are (CPU or CUDA, in their dtype): it shares the
module with the trainer, so a trainer that moves it (DeepSpeed) moves the engine too. With
`chat_template=True` prompts are rendered as one user turn (ratchet.model.encode_prompts); with
`check_context=True` a prompt that leaves no room for max_new_tokens in the model's context
(max_position_embeddings) is a ValueError naming it (`PromptTooLong`; callers that know the prompt's
task name it too, `ratchet.rollout.engine.naming_tasks`).
The interface it implements (greedy and stop semantics): ratchet/rollout/engine.py.
Speed against `model.generate`: python -m bench.rollout.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ratchet.model import context_length, encode_prompts, eos_ids
from ratchet.rollout.decoders import decoder_for
from ratchet.rollout.engine import Rollout, check_room, first_stop

__all__ = ["Rollout", "TorchEngine", "sample"]


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [b, V], by inverting the CDF at a uniform draw: the same
    distribution as torch.multinomial, at a fraction of its cost on CPU (one draw per row, not V)."""
    cdf = probs.cumsum(-1)                                                        # [b, V]
    u = torch.rand(len(probs), 1, generator=gen, dtype=cdf.dtype) * cdf[:, -1:]   # [b, 1]
    return torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[1] - 1).squeeze(1)  # [b]


class _StopScanner:
    """Finds, step by step, the token that completes the first stop string of each row.

    Each step decodes only a window of each live row's newest tokens, long enough to hold any stop
    string (a token decodes to >= 1 byte, a character takes <= 4): a stop string first seen in a
    window was completed by its newest token, since the older ones were all in the previous window.
    """

    def __init__(self, tokenizer, stops: Sequence[str], rows: int):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.window = 4 * max(len(s) for s in self.stops) + 2
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.hit: dict[int, str] = {}                                             # batch row -> stop string seen

    def step(self, rows: list[int], toks: list[int], eos: set[int]) -> list[bool]:
        """Append each row's new token; True where it completed a stop string (an EOS ends it anyway)."""
        for b, t in zip(rows, toks):
            self.ids[b].append(t)
        texts = self.tokenizer.batch_decode([self.ids[b][-self.window:] for b in rows], skip_special_tokens=False)
        done = []
        for b, t, text in zip(rows, toks, texts):
            hit = first_stop(text, self.stops) if t not in eos else None
            if hit:
                self.hit[b] = hit[1]
            done.append(hit is not None)
        return done


class TorchEngine:
    def __init__(self, model, tokenizer, policy_version: int = 0, chat_template: bool = False,
                 check_context: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids(model, tokenizer)          # every one ends a sequence
        self.eos = self.eos_ids[0]                        # the tokenizer's own
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.policy_version = policy_version
        self.chat_template = chat_template
        # check_context: a prompt + max_new_tokens past the model's context is a ValueError (the run's
        # engines); off, it decodes past it (a probe beyond the limit, RoPE extrapolation)
        self.context = context_length(model) if check_context else None

    @property
    def device(self) -> torch.device:
        """Where the (shared) weights are now."""
        return next(self.model.parameters()).device

    def set_policy_version(self, version: int, path: str | None = None) -> None:
        """The weights are the trainer's own, shared in memory: moving to `version` only records it."""
        self.policy_version = version

    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts, self.chat_template)

    @torch.inference_mode()   # no autograd bookkeeping per op (cheaper than no_grad); results leave as lists
    def generate(self, prompts: list[str] | list[list[int]], n: int = 1, max_new_tokens: int = 48,
                 temperature: float = 1.0, greedy: bool = False, batch_size: int = 128, seed: int | None = None,
                 stop: Sequence[str] | None = None) -> list[Rollout]:
        """len(prompts) * n rollouts grouped by prompt; greedy and stop as in ratchet/rollout/engine.py.
        Prompts given as token ids (`ratchet serve`'s, encoded by its client) are sampled on as they are."""
        if stop is not None and any(not s for s in stop):
            raise ValueError("stop: every stop string must be non-empty")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        given = bool(prompts) and not isinstance(prompts[0], str)
        encoded = [list(p) for p in prompts] if given else self.encode_prompts(prompts)
        check_room(encoded, max_new_tokens, self.context)   # PromptTooLong (a ValueError) naming the prompt
        jobs = [(i, encoded[i]) for i in range(len(prompts)) for _ in range(n)]
        out: list[Rollout] = []
        was_training = self.model.training
        self.model.eval()
        try:
            new_decoder = decoder_for(self.model)
            for start in range(0, len(jobs), batch_size):
                out += self._generate_batch(jobs[start:start + batch_size], new_decoder, max_new_tokens, temperature,
                                            greedy, gen, list(stop or []))
        finally:
            self.model.train(was_training)
        return out

    def _generate_batch(self, jobs, new_decoder, max_new_tokens, temperature, greedy, gen, stop) -> list[Rollout]:
        # Jobs come grouped by prompt: prefill each distinct prompt once; its samples share its cache.
        owner = torch.tensor([i for i, _ in jobs])
        owner = torch.unique_consecutive(owner, return_inverse=True)[1].to(self.device)  # [B] row -> distinct prompt
        distinct = [ids for b, (i, ids) in enumerate(jobs) if b == 0 or jobs[b - 1][0] != i]
        B, U, P = len(jobs), len(distinct), max(len(ids) for ids in distinct)
        eos = set(self.eos_ids)
        eos_t = torch.tensor(self.eos_ids, device=self.device)
        input_ids = torch.full((U, P), self.pad, dtype=torch.long)
        attn = torch.zeros((U, P), dtype=torch.long)
        for u, ids in enumerate(distinct):
            input_ids[u, P - len(ids):] = torch.tensor(ids)
            attn[u, P - len(ids):] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)                                  # [U, P]
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos,
                         use_cache=True, logits_to_keep=1)
        cache, logits = out.cache, out.logits[:, -1].float()                      # [U, V]
        decoder = new_decoder(cache, attn, owner, max_new_tokens)
        logits, pos = logits[owner], pos[owner]                                   # [B, V], [B, P]
        next_pos = pos[:, -1] + 1                                                 # [b]
        rows = torch.arange(B, device=self.device)                                # [b] batch row of each live row
        steps = []                                                                # (rows, tokens, logprobs) per step
        scanner = _StopScanner(self.tokenizer, stop, B) if stop else None
        scale = 1.0 if greedy else temperature
        for t in range(max_new_tokens):
            logprobs = torch.log_softmax(logits if scale == 1.0 else logits / scale, dim=-1)  # [b, V]
            if greedy:
                tok = logprobs.argmax(-1)                                         # [b]
            else:
                tok = sample(logprobs.exp().cpu(), gen).to(self.device)                 # [b]
            steps.append((rows, tok, logprobs.gather(1, tok[:, None]).squeeze(1)))
            live = ~torch.isin(tok, eos_t)                                        # [b]
            if scanner is not None:
                stopped = scanner.step(rows.tolist(), tok.tolist(), eos)
                live &= ~torch.tensor(stopped, dtype=torch.bool, device=self.device)
            n_live = int(live.sum())                                              # the step's one host read
            if t == max_new_tokens - 1 or n_live == 0:
                break
            if n_live < len(live):    # drop finished rows from the batch and the KV cache
                idx = live.nonzero().squeeze(1)
                decoder.keep(idx)
                rows, tok, next_pos = rows[idx], tok[idx], next_pos[idx]
            logits = decoder.step(tok, next_pos)                                  # [b, V]
            next_pos = next_pos + 1
        decoder.release()         # its buffers serve the next batch (after an error: simply freed)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        for r, tok, lp in steps:
            for b, x, l in zip(r.tolist(), tok.tolist(), lp.tolist()):
                tokens[b].append(x)
                logps[b].append(l)
        results = []
        for b, (i, ids) in enumerate(jobs):
            comp = tokens[b]
            ended = bool(comp) and comp[-1] in eos
            text = self.tokenizer.decode(comp[:-1] if ended else comp, skip_special_tokens=False)
            hit = scanner.hit.get(b) if scanner is not None else None
            if hit is not None:   # the full text's earliest stop (the window's, should decoding differ)
                hit = (first_stop(text, stop) or (0, hit))[1]
            results.append(Rollout(i, ids, comp, logps[b], text, ended or hit is not None, hit))
        return results
