"""The embedded rollout engine: batched sampling with a KV cache, in-process torch.

    engine = TorchEngine(model, tokenizer)
    rollouts = engine.generate(prompts, n=8, max_new_tokens=48)   # len(prompts) * n, grouped by prompt

Each rollout carries the sampled token ids and their log-probs under the sampling
distribution (logits / temperature): the behaviour log-probs the trainer's importance
ratios are taken against. Prompts are left-padded so every sequence's next token sits in
the last column; finished sequences keep decoding pad tokens until the batch is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollout:
    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]   # includes the EOS token when finished
    logprobs: list[float]       # one per completion token
    text: str                   # completion decoded, without EOS
    finished: bool


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
            for start in range(0, len(jobs), batch_size):
                out += self._generate_batch(jobs[start:start + batch_size], max_new_tokens, temperature, greedy, gen)
        finally:
            self.model.train(was_training)
        return out

    def _generate_batch(self, jobs, max_new_tokens, temperature, greedy, gen) -> list[Rollout]:
        B, P = len(jobs), max(len(ids) for _, ids in jobs)
        input_ids = torch.full((B, P), self.pad, dtype=torch.long)
        attn = torch.zeros((B, P), dtype=torch.long)
        for b, (_, ids) in enumerate(jobs):
            input_ids[b, P - len(ids):] = torch.tensor(ids)
            attn[b, P - len(ids):] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)                                  # [B, P]
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos,
                         use_cache=True, logits_to_keep=1)
        past, logits = out.cache, out.logits[:, -1].float()                       # [B, V]
        next_pos = pos[:, -1:] + 1                                                # [B, 1]
        tokens, logps = [], []
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        for _ in range(max_new_tokens):
            logprobs = torch.log_softmax(logits / temperature, dim=-1)             # [B, V]
            if greedy:
                tok = logprobs.argmax(-1)                                         # [B]
            else:
                tok = torch.multinomial(logprobs.exp().cpu(), 1, generator=gen).squeeze(1).to(self.device)
            lp = logprobs.gather(1, tok[:, None]).squeeze(1)                      # [B]
            tok = torch.where(done, torch.full_like(tok, self.pad), tok)
            tokens.append(tok)
            logps.append(lp)
            done |= tok == self.eos
            if bool(done.all()):
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)            # [B, P+t]
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos,
                             cache=past, use_cache=True)
            past, logits = out.cache, out.logits[:, -1].float()
            next_pos = next_pos + 1
        toks = torch.stack(tokens, 1).cpu()                                        # [B, T]
        lps = torch.stack(logps, 1).cpu()                                          # [B, T]
        results = []
        for b, (i, ids) in enumerate(jobs):
            row = toks[b].tolist()
            length = row.index(self.eos) + 1 if self.eos in row else len(row)
            finished = self.eos in row
            comp = row[:length]
            text_ids = comp[:-1] if finished else comp
            results.append(Rollout(i, ids, comp, lps[b, :length].tolist(),
                                   self.tokenizer.decode(text_ids, skip_special_tokens=False), finished))
        return results
