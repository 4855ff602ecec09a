"""The embedded rollout engine: batched sampling with a KV cache, in-process torch.

    engine = TorchEngine(model, tokenizer)
    rollouts = engine.generate(prompts, n=8, max_new_tokens=48)   # len(prompts) * n, grouped by prompt

Each rollout carries the sampled token ids and their log-probs under the sampling
distribution (logits / temperature): the behaviour log-probs the trainer's importance
ratios are taken against. A batch holds up to `batch_size` sequences; the distinct prompts
in it are left-padded and prefilled ONCE, and their KV cache serves the n samples of each
(ratchet/rollout/decoders.py: a hand-written Llama decode that never copies the prompt's cache,
or the model's own forward for other architectures). A sequence that emits EOS leaves the batch.
Speed against `model.generate`: python -m bench.rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ratchet.rollout.decoders import decoder_for


@dataclass
class Rollout:
    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]   # includes the EOS token when finished
    logprobs: list[float]       # one per completion token
    text: str                   # completion decoded, without EOS
    finished: bool


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [b, V], by inverting the CDF at a uniform draw: the same
    distribution as torch.multinomial, at a fraction of its cost on CPU (one draw per row, not V)."""
    cdf = probs.cumsum(-1)                                                        # [b, V]
    u = torch.rand(len(probs), 1, generator=gen, dtype=cdf.dtype) * cdf[:, -1:]   # [b, 1]
    return torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[1] - 1).squeeze(1)  # [b]


class TorchEngine:
    def __init__(self, model, tokenizer, device: str | torch.device = "cpu"):
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id

    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        return [bos + ids for ids in self.tokenizer(prompts, add_special_tokens=False)["input_ids"]]

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int = 1, max_new_tokens: int = 48, temperature: float = 1.0,
                 greedy: bool = False, batch_size: int = 128, seed: int | None = None) -> list[Rollout]:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        encoded = self.encode_prompts(prompts)
        jobs = [(i, encoded[i]) for i in range(len(prompts)) for _ in range(n)]
        out: list[Rollout] = []
        was_training = self.model.training
        self.model.eval()
        try:
            new_decoder = decoder_for(self.model)
            for start in range(0, len(jobs), batch_size):
                out += self._generate_batch(jobs[start:start + batch_size], new_decoder, max_new_tokens, temperature,
                                            greedy, gen)
        finally:
            self.model.train(was_training)
        return out

    def _generate_batch(self, jobs, new_decoder, max_new_tokens, temperature, greedy, gen) -> list[Rollout]:
        # Jobs come grouped by prompt: prefill each distinct prompt once; its samples share its cache.
        owner = torch.tensor([i for i, _ in jobs])
        owner = torch.unique_consecutive(owner, return_inverse=True)[1].to(self.device)  # [B] row -> distinct prompt
        distinct = [ids for b, (i, ids) in enumerate(jobs) if b == 0 or jobs[b - 1][0] != i]
        B, U, P = len(jobs), len(distinct), max(len(ids) for ids in distinct)
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
        for t in range(max_new_tokens):
            logprobs = torch.log_softmax(logits / temperature, dim=-1)             # [b, V]
            if greedy:
                tok = logprobs.argmax(-1)                                         # [b]
            else:
                tok = sample(logprobs.exp().cpu(), gen).to(self.device)                 # [b]
            steps.append((rows, tok, logprobs.gather(1, tok[:, None]).squeeze(1)))
            live = tok != self.eos                                                # [b]
            if t == max_new_tokens - 1 or not bool(live.any()):
                break
            if not bool(live.all()):  # drop finished rows from the batch and the KV cache
                idx = live.nonzero().squeeze(1)
                decoder.keep(idx)
                rows, tok, next_pos = rows[idx], tok[idx], next_pos[idx]
            logits = decoder.step(tok, next_pos)                                  # [b, V]
            next_pos = next_pos + 1
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        for r, tok, lp in steps:
            for b, x, l in zip(r.tolist(), tok.tolist(), lp.tolist()):
                tokens[b].append(x)
                logps[b].append(l)
        results = []
        for b, (i, ids) in enumerate(jobs):
            comp = tokens[b]
            finished = bool(comp) and comp[-1] == self.eos
            text = self.tokenizer.decode(comp[:-1] if finished else comp, skip_special_tokens=False)
            results.append(Rollout(i, ids, comp, logps[b], text, finished))
        return results
