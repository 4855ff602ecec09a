"""The module a trainer optimises: the policy, and for PPO a value head on it.

    module = PolicyWithValue(model, ValueHead(width) if ppo else None)
    logits, values = module(ids, attn, with_values=True)       # [N, L, V], [N, L]
    logp, entropy = token_logprobs(model, ids, attn, with_entropy=True)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ratchet.rl import entropy_from_logits


def logprobs_from_logits(logits: Tensor, ids: Tensor, temperature: float = 1.0, with_entropy: bool = False):
    """logits [N, L, V] of ids [N, L] -> log-prob of each next token [N, L-1] (and entropy [N, L-1])."""
    z = logits[:, :-1].float() / temperature                                    # [N, L-1, V]
    logp = torch.log_softmax(z, dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)  # [N, L-1]
    return logp, (entropy_from_logits(z) if with_entropy else None)


def token_logprobs(model, ids, attn, temperature: float = 1.0, with_entropy: bool = False):
    """Log-prob of each next token [N, L-1] (and entropy [N, L-1]) under a plain causal LM."""
    return logprobs_from_logits(model(input_ids=ids, attention_mask=attn).logits, ids, temperature, with_entropy)


class ValueHead(nn.Module):
    """PPO's critic: a 2-layer MLP on the policy's last hidden state -> V(s_t) per position.

    It reads the hidden state detached: the value loss trains the head only and never moves
    the policy's features (a separate critic, as in Ziegler et al. 2019, arXiv:1909.08593,
    at the cost of a head-sized network). The last layer starts at zero, so V = 0 at first.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Tanh(), nn.Linear(hidden_size, 1))
        nn.init.zeros_(self.net[2].weight)
        nn.init.zeros_(self.net[2].bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.net(hidden.detach().to(self.net[0].weight.dtype)).float().squeeze(-1)  # [N, L, H] -> [N, L]


class PolicyWithValue(nn.Module):
    """The policy and (for "gae") its value head as one module: one optimizer, one ZeRO engine."""

    def __init__(self, policy: nn.Module, value_head: ValueHead | None):
        super().__init__()
        self.policy, self.value_head = policy, value_head

    def forward(self, ids: Tensor, attn: Tensor, with_values: bool = False, shared: tuple | None = None):
        if shared is not None:
            return self.forward_shared(ids, attn, *shared), None
        with_values = with_values and self.value_head is not None
        out = self.policy(input_ids=ids, attention_mask=attn, output_hidden_states=with_values)
        values = self.value_head(out.hidden_states[-1]) if with_values else None  # [N, L]
        return out.logits, values                                                  # [N, L, V]

    def forward_shared(self, prompt_ids: Tensor, prompt_attn: Tensor, index: Tensor, comp_ids: Tensor,
                       comp_attn: Tensor) -> Tensor:
        """Completion-aligned logits [N, C, V]: each distinct prompt is forwarded once and its KV
        cache (with gradients) is shared by every row of its group; the gradient is the one of
        the plain [N, P + C] forward, without recomputing the prompt G times. Rows that carry a
        gradient are selected with index_select, never advanced indexing (`x[index]`, as in
        `cache.batch_select_indices`): the backward of advanced indexing (index_put with
        accumulate) sums a shared prompt's
        gradients in an order that depends on torch's thread count on CPU, so the same run on 1
        and 2 threads trained different bits; index_select's (index_add) does not."""
        pos = (prompt_attn.cumsum(-1) - 1).clamp(min=0)                                    # [U, P]
        out = self.policy(input_ids=prompt_ids, attention_mask=prompt_attn, position_ids=pos,
                          use_cache=True, logits_to_keep=1)
        cache = out.cache
        for layer in cache.layers:                                                         # U -> N rows
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        attn = torch.cat([prompt_attn[index], comp_attn], dim=1)                           # [N, P + C]
        pos_c = pos[index, -1:] + 1 + torch.arange(comp_ids.shape[1], device=pos.device)   # [N, C]
        out_c = self.policy(input_ids=comp_ids, attention_mask=attn, position_ids=pos_c,
                            cache=cache, use_cache=True)
        # completion token j is predicted at the last prompt position (j = 0) or at completion j - 1
        return torch.cat([out.logits[:, -1:].index_select(0, index), out_c.logits[:, :-1]], dim=1)   # [N, C, V]
