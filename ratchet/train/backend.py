"""What every trainer backend shares: the sample type, packing, the loss, the wave loop, resume state.

    trainer = TorchTrainer(model, pad_id, cfg.train, cfg.rl)       # or DeepSpeedTrainer, same signature
    metrics = trainer.train_wave(samples)                          # samples: list[TrainSample]
    state = trainer.state_dict(); ...; trainer.load_state_dict(state)

A wave is split into minibatches of `minibatch_prompts` groups; each minibatch is seen
`updates_per_batch` times (PPO epochs), one optimizer step each. A minibatch is cut into
micro-batches packed by token budget (dynamic batching); the loss is normalised over the
whole minibatch (`denom`), so accumulation gives the same gradient as one big batch.
Importance ratios are taken against the behaviour log-probs recorded by the rollout engine.

Samples whose gradient is exactly zero (advantage 0 with no KL/entropy/value term) are not
forwarded at all; they still count in the normaliser, so the gradient does not change.

A backend (torch_trainer.py, deepspeed_trainer.py) only says how to build the optimizer, run
the forward, backward and optimizer step, and save/load optimizer state: the loss, the
advantages for PPO (GAE over a value head) and the KL-in-reward path live here, once.
"""

from __future__ import annotations

import copy
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ratchet.config import RLConfig, TrainConfig
from ratchet.rl import (
    compute_advantages,
    entropy_from_logits,
    gae,
    kl_in_reward,
    masked_whiten,
    outcome_to_token_rewards,
    policy_loss,
    value_loss,
)


@dataclass
class TrainSample:
    prompt_ids: list[int]
    completion_ids: list[int]
    behavior_logprobs: list[float]   # one per completion token, from the rollout engine
    advantage: float                 # outcome-level estimators; ignored by "gae"
    group: str                       # prompt group id (whole groups stay in one minibatch)
    reward: float | None = None      # needed by "gae" and by kl_in_reward (advantages recomputed here)


def pack_by_tokens(samples: list[TrainSample], budget: int) -> list[list[TrainSample]]:
    """Greedy packing by padded size: rows * longest row <= budget (at least one row each)."""
    ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))
    batches: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    for s in ordered:
        length = len(s.prompt_ids) + len(s.completion_ids)
        if current and (len(current) + 1) * length > budget:
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    return batches


def collate(samples: list[TrainSample], pad_id: int):
    """Right-padded ids [N, L], attention [N, L]; completion-aligned mask/behaviour [N, L-1], adv [N]."""
    L = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    N = len(samples)
    ids = torch.full((N, L), pad_id, dtype=torch.long)
    attn = torch.zeros((N, L), dtype=torch.long)
    mask = torch.zeros((N, L - 1))
    behavior = torch.zeros((N, L - 1))
    for b, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[b, :p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attn[b, :p + c] = 1
        mask[b, p - 1:p + c - 1] = 1                       # position t predicts token t+1
        behavior[b, p - 1:p + c - 1] = torch.tensor(s.behavior_logprobs)
    adv = torch.tensor([s.advantage for s in samples])     # [N]
    return ids, attn, mask, behavior, adv


def pack_by_prompt(samples: list[TrainSample], budget: int) -> list[list[TrainSample]]:
    """Whole prompt groups per micro-batch, padded cost (prompts * P + rows * C) <= budget
    (a group larger than the budget is split; its prompt is then forwarded once per piece)."""
    groups: dict[tuple[int, ...], list[TrainSample]] = {}
    for s in samples:
        groups.setdefault(tuple(s.prompt_ids), []).append(s)
    ordered = sorted(groups.values(), key=lambda g: len(g[0].prompt_ids) + max(len(s.completion_ids) for s in g))
    batches: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    n_prompts, P, C = 0, 0, 0
    for g in ordered:
        for s in sorted(g, key=lambda s: len(s.completion_ids)):
            new_prompt = not current or current[-1].prompt_ids != s.prompt_ids
            p, c = max(P, len(s.prompt_ids)), max(C, len(s.completion_ids))
            if current and (n_prompts + new_prompt) * p + (len(current) + 1) * c > budget:
                batches.append(current)
                current, n_prompts, new_prompt, p, c = [], 0, True, len(s.prompt_ids), len(s.completion_ids)
            current.append(s)
            n_prompts, P, C = n_prompts + new_prompt, p, c
    if current:
        batches.append(current)
    return batches


def collate_shared(samples: list[TrainSample], pad_id: int):
    """Prompt-shared layout: unique prompts left-padded [U, P] (+ attention), the row -> prompt
    index [N], completions right-padded [N, C] (+ attention = loss mask), behaviour [N, C], adv [N]."""
    prompts: dict[tuple[int, ...], int] = {}
    index = [prompts.setdefault(tuple(s.prompt_ids), len(prompts)) for s in samples]
    U, P = len(prompts), max(len(p) for p in prompts)
    N, C = len(samples), max(len(s.completion_ids) for s in samples)
    prompt_ids = torch.full((U, P), pad_id, dtype=torch.long)
    prompt_attn = torch.zeros((U, P), dtype=torch.long)
    for p, u in prompts.items():
        prompt_ids[u, P - len(p):] = torch.tensor(p)
        prompt_attn[u, P - len(p):] = 1
    comp_ids = torch.full((N, C), pad_id, dtype=torch.long)
    comp_attn = torch.zeros((N, C), dtype=torch.long)
    behavior = torch.zeros((N, C))
    for b, s in enumerate(samples):
        c = len(s.completion_ids)
        comp_ids[b, :c] = torch.tensor(s.completion_ids)
        comp_attn[b, :c] = 1
        behavior[b, :c] = torch.tensor(s.behavior_logprobs)
    adv = torch.tensor([s.advantage for s in samples])                     # [N]
    return prompt_ids, prompt_attn, torch.tensor(index), comp_ids, comp_attn, behavior, adv


def place_tokens(samples: list[TrainSample], values: list[Tensor], width: int) -> Tensor:
    """Per-sample completion vectors ([c] each) -> [N, width] aligned like `collate`'s mask."""
    out = torch.zeros((len(samples), width))
    for b, (s, v) in enumerate(zip(samples, values)):
        p = len(s.prompt_ids)
        out[b, p - 1:p - 1 + v.numel()] = v
    return out


def logprobs_from_logits(logits: Tensor, ids: Tensor, temperature: float = 1.0, with_entropy: bool = False):
    """logits [N, L, V] of ids [N, L] -> log-prob of each next token [N, L-1] (and entropy [N, L-1])."""
    z = logits[:, :-1].float() / temperature                                    # [N, L-1, V]
    logp = torch.log_softmax(z, dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)  # [N, L-1]
    return logp, (entropy_from_logits(z) if with_entropy else None)


def token_logprobs(model, ids, attn, temperature: float = 1.0, with_entropy: bool = False):
    """Log-prob of each next token [N, L-1] (and entropy [N, L-1]) under a plain causal LM."""
    return logprobs_from_logits(model(input_ids=ids, attention_mask=attn).logits, ids, temperature, with_entropy)


def lr_factor(step: int, warmup: int, schedule: str = "constant", decay_steps: int = 0, min_ratio: float = 0.0) -> float:
    """LR multiplier at optimizer step `step` (0-based): linear warm-up, then constant or cosine
    down to `min_ratio` over `decay_steps` steps (Loshchilov & Hutter 2017, arXiv:1608.03983)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine" and decay_steps > 0:
        t = min(1.0, (step - warmup) / decay_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return 1.0


SUMMED_METRICS = ("pg_loss", "value_loss")  # micro-batch values add up to the minibatch's


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
        the plain [N, P + C] forward, without recomputing the prompt G times."""
        pos = (prompt_attn.cumsum(-1) - 1).clamp(min=0)                                    # [U, P]
        out = self.policy(input_ids=prompt_ids, attention_mask=prompt_attn, position_ids=pos,
                          use_cache=True, logits_to_keep=1)
        cache = out.cache
        cache.batch_select_indices(index)                                                  # U -> N rows
        attn = torch.cat([prompt_attn[index], comp_attn], dim=1)                           # [N, P + C]
        pos_c = pos[index, -1:] + 1 + torch.arange(comp_ids.shape[1], device=pos.device)   # [N, C]
        out_c = self.policy(input_ids=comp_ids, attention_mask=attn, position_ids=pos_c,
                            cache=cache, use_cache=True)
        # completion token j is predicted at the last prompt position (j = 0) or at completion j - 1
        return torch.cat([out.logits[index, -1:], out_c.logits[:, :-1]], dim=1)           # [N, C, V]


class Trainer(ABC):
    """One RL epoch over a scored wave; backends implement the six abstract methods below."""

    backend = "base"
    share_prompts = True  # forward each distinct prompt once per micro-batch (not with a value head)

    def __init__(self, model, pad_id: int, cfg: TrainConfig, rl: RLConfig, temperature: float = 1.0):
        self.model, self.pad_id, self.cfg, self.rl, self.temperature = model, pad_id, cfg, rl, temperature
        self.ppo = rl.estimator == "gae"
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if rl.kl_coef > 0 else None
        value_head = ValueHead(model.config.hidden_size) if self.ppo else None
        if value_head is not None:
            value_head.to(next(model.parameters()).device)
        self.module = PolicyWithValue(model, value_head)
        self.rng = random.Random(cfg.seed)
        self.step = 0
        self._setup()

    # -- what a backend provides --
    @abstractmethod
    def _setup(self) -> None:
        """Build the optimizer (and engine) over `self.module`'s parameters."""

    @abstractmethod
    def _forward(self, ids: Tensor, attn: Tensor, with_values: bool, shared: tuple | None = None):
        """`self.module(ids, attn, with_values, shared)`: (logits [N, L, V], values [N, L] or None) with
        gradients; with `shared` = (index, comp_ids, comp_attn), ids/attn are the unique prompts."""

    @abstractmethod
    def _backward(self, loss: Tensor) -> None: ...

    @abstractmethod
    def _optimizer_step(self, lr: float) -> float:
        """Clip, step at `lr`, zero the gradients; return the gradient norm before clipping."""

    @abstractmethod
    def _optimizer_state(self) -> dict: ...

    @abstractmethod
    def _load_optimizer_state(self, state: dict) -> None: ...

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _value_head_module(self) -> nn.Module | None:
        return self.module.value_head

    # -- the wave loop --
    def train_wave(self, samples: list[TrainSample]) -> dict[str, float]:
        """Minibatches of whole groups, `updates_per_batch` optimizer steps each."""
        samples, token_targets = self._prepare(samples)
        groups: dict[str, list[TrainSample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        order = list(groups)
        self.rng.shuffle(order)
        k = self.cfg.minibatch_prompts
        totals: dict[str, float] = {}
        n_updates = 0
        self.module.train()
        for start in range(0, len(order), k):
            minibatch = [s for g in order[start:start + k] for s in groups[g]]
            for _ in range(self.cfg.updates_per_batch):
                for key, v in self._update(minibatch, token_targets).items():
                    totals[key] = totals.get(key, 0.0) + v
                n_updates += 1
        self.module.eval()
        out = {k: v / max(n_updates, 1) for k, v in totals.items()}
        out.update(optimizer_steps=n_updates, train_samples=len(samples))
        return out

    def current_lr(self) -> float:
        cfg = self.cfg
        factor = lr_factor(self.step, cfg.warmup_steps, cfg.lr_schedule,
                           cfg.lr_decay_steps, cfg.min_lr_ratio)
        return cfg.lr * factor

    def _zero_grad_sample(self, s: TrainSample) -> bool:
        """True when this sample's loss gradient is exactly 0 (so its forward can be skipped)."""
        rl = self.rl
        return (s.advantage == 0.0 and not self.ppo and rl.entropy_coef == 0
                and (self.ref_model is None or rl.kl_in_reward or rl.kl_coef == 0))

    def _update(self, minibatch: list[TrainSample], token_targets: dict[int, tuple[Tensor, Tensor, Tensor]]):
        rl = self.rl
        seq_level = rl.loss_agg != "token_mean"
        n_tokens = sum(len(s.completion_ids) for s in minibatch)
        denom = len(minibatch) if seq_level else n_tokens      # the whole minibatch's, skipped rows included
        max_len = max(len(s.completion_ids) for s in minibatch)
        live = [s for s in minibatch if not self._zero_grad_sample(s)]
        if not live:  # keep one row so the optimizer sees a (zero) gradient, exactly as without skipping
            live = [min(minibatch, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))]
        metrics: dict[str, float] = {}
        shared = self.share_prompts and not self.ppo  # the value head reads hidden states of the plain layout
        pack = pack_by_prompt if shared else pack_by_tokens
        for micro in pack(live, self.cfg.token_budget):
            if shared:
                loss, m = self._micro_loss_shared(micro, denom, max_len)
            else:
                loss, m = self._micro_loss(micro, token_targets, denom, n_tokens, max_len)
            self._backward(loss)
            for key, v in m.items():  # losses are already minibatch-normalised: sum; rates: average
                metrics[key] = metrics.get(key, 0.0) + (v if key in SUMMED_METRICS else v * len(micro) / len(live))
        lr = self.current_lr()
        metrics["grad_norm"] = self._optimizer_step(lr)
        metrics["lr"] = lr
        metrics["skipped_frac"] = 1 - len(live) / len(minibatch)
        self.step += 1
        return metrics

    def _micro_loss(self, micro, token_targets, denom, n_tokens, max_len) -> tuple[Tensor, dict[str, float]]:
        rl, dev = self.rl, self.device
        ids, attn, mask, behavior, adv = (t.to(dev) for t in collate(micro, self.pad_id))
        logits, values = self._forward(ids, attn, self.ppo)
        logp, entropy = logprobs_from_logits(logits, ids, self.temperature, rl.entropy_coef > 0)
        ref = None
        if self.ref_model is not None and not rl.kl_in_reward:
            with torch.no_grad():
                ref, _ = token_logprobs(self.ref_model, ids, attn, self.temperature)
        if self.ppo:
            width = ids.shape[1] - 1
            adv, returns, old_values = (
                place_tokens(micro, [token_targets[id(s)][i] for s in micro], width).to(dev) for i in range(3)
            )                                                                   # [N, L-1] each
        loss, m = policy_loss(
            logp, behavior, adv, mask, clip_low=rl.clip_low, clip_high=rl.clip_high, loss_agg=rl.loss_agg,
            ref_logprobs=ref, kl_coef=rl.kl_coef if ref is not None else 0.0, kl_estimator=rl.kl_estimator,
            entropy=entropy, entropy_coef=rl.entropy_coef, max_len=max_len, denom=denom,
        )
        if self.ppo:
            v_loss = value_loss(values[:, :-1], returns, old_values, mask, denom=n_tokens)  # token mean
            loss = loss + rl.value_coef * v_loss
            m["value_loss"] = float(v_loss.detach())
        return loss, m

    def _micro_loss_shared(self, micro, denom, max_len) -> tuple[Tensor, dict[str, float]]:
        """The policy loss on the prompt-shared layout (completion positions only)."""
        rl, dev = self.rl, self.device
        prompt_ids, prompt_attn, index, comp_ids, mask, behavior, adv = (
            t.to(dev) for t in collate_shared(micro, self.pad_id))
        logits, _ = self._forward(prompt_ids, prompt_attn, False, (index, comp_ids, mask))  # [N, C, V]
        z = logits.float() / self.temperature
        logp = torch.log_softmax(z, dim=-1).gather(2, comp_ids[:, :, None]).squeeze(2)        # [N, C]
        entropy = entropy_from_logits(z) if rl.entropy_coef > 0 else None                       # [N, C]
        ref = None
        if self.ref_model is not None and not rl.kl_in_reward:
            with torch.no_grad():
                ref = self._ref_shared(prompt_ids, prompt_attn, index, comp_ids, mask)                 # [N, C]
        return policy_loss(
            logp, behavior, adv, mask, clip_low=rl.clip_low, clip_high=rl.clip_high, loss_agg=rl.loss_agg,
            ref_logprobs=ref, kl_coef=rl.kl_coef if ref is not None else 0.0, kl_estimator=rl.kl_estimator,
            entropy=entropy, entropy_coef=rl.entropy_coef, max_len=max_len, denom=denom,
        )

    def _ref_shared(self, prompt_ids, prompt_attn, index, comp_ids, comp_attn) -> Tensor:
        ref = PolicyWithValue(self.ref_model, None)
        logits = ref.forward_shared(prompt_ids, prompt_attn, index, comp_ids, comp_attn)        # [N, C, V]
        z = logits.float() / self.temperature
        return torch.log_softmax(z, dim=-1).gather(2, comp_ids[:, :, None]).squeeze(2)          # [N, C]

    # -- advantages that need the model: PPO's GAE, and KL folded into the reward --
    @torch.no_grad()
    def _prepare(self, samples: list[TrainSample]):
        """-> (samples, {id(sample): (token adv [c], returns [c], old values [c])} for "gae")."""
        rl = self.rl
        kl_reward = rl.kl_in_reward and self.ref_model is not None
        if not self.ppo and not kl_reward:
            return samples, {}
        if any(s.reward is None for s in samples):
            raise ValueError(f"estimator={rl.estimator!r} / kl_in_reward need TrainSample.reward on every sample")
        self.module.eval()
        per_sample: dict[int, tuple] = {}
        for micro in pack_by_tokens(samples, self.cfg.token_budget):
            ids, attn, mask, behavior, _ = (t.to(self.device) for t in collate(micro, self.pad_id))
            rewards = torch.tensor([s.reward for s in micro], device=self.device)               # [N]
            ref = token_logprobs(self.ref_model, ids, attn, self.temperature)[0] if kl_reward else None
            if self.ppo:
                _, values = self._forward(ids, attn, True)
                values = values[:, :-1].float()                                                # [N, L-1]
                token_rewards = outcome_to_token_rewards(rewards, mask)                        # [N, L-1]
                if kl_reward:
                    token_rewards = kl_in_reward(token_rewards, behavior, ref, mask, rl.kl_coef, rl.kl_estimator)
                adv, ret = gae(token_rewards, values, mask, rl.gamma, rl.lam)                  # [N, L-1] each
                rows = (adv, ret, values)
            else:
                rows = (kl_in_reward(rewards, behavior, ref, mask, rl.kl_coef, rl.kl_estimator),)  # [N]
            for b, s in enumerate(micro):
                p, c = len(s.prompt_ids), len(s.completion_ids)
                per_sample[id(s)] = tuple(r[b, p - 1:p - 1 + c].cpu() if r.dim() == 2 else r[b].cpu() for r in rows)
        if not self.ppo:
            return self._regroup_advantages(samples, {k: float(v[0]) for k, v in per_sample.items()}), {}
        # PPO whitens the advantages over the batch's valid tokens
        flat = torch.cat([per_sample[id(s)][0] for s in samples])                              # [sum c]
        white = masked_whiten(flat[None], torch.ones_like(flat)[None])[0]
        out, pos = {}, 0
        for s in samples:
            adv, ret, val = per_sample[id(s)]
            out[id(s)] = (white[pos:pos + adv.numel()], ret, val)
            pos += adv.numel()
        return samples, out

    def _regroup_advantages(self, samples: list[TrainSample], rewards: dict[int, float]) -> list[TrainSample]:
        """Recompute outcome advantages from KL-adjusted rewards, group by group (same estimator)."""
        groups: dict[str, list[TrainSample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        sizes = {len(g) for g in groups.values()}
        batches = [list(groups.values())] if len(sizes) == 1 else [[g] for g in groups.values()]
        out: dict[int, float] = {}
        for batch in batches:
            flat = [s for g in batch for s in g]
            r = torch.tensor([rewards[id(s)] for s in flat])
            adv = compute_advantages(self.rl.estimator, r, len(batch[0]))
            out.update({id(s): float(a) for s, a in zip(flat, adv)})
        return [replace(s, advantage=out[id(s)]) for s in samples]

    # -- checkpoint state (everything but the policy weights, which are saved in HF layout) --
    def state_dict(self) -> dict:
        head = self._value_head_module()
        state = {
            "backend": self.backend,
            "optimizer": self._optimizer_state(),
            "scheduler": {"step": self.step, "lr": self.current_lr()},  # the schedule is a function of step
            "step": self.step,
            "rng": self.rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "value_head": self._value_head_state() if head is not None else None,
            # the KL reference is the policy the run started from, not the weights resumed from
            "ref_model": ({k: v.detach().cpu().clone() for k, v in self.ref_model.state_dict().items()}
                          if self.ref_model is not None else None),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("backend", self.backend) != self.backend:
            raise ValueError(f"trainer state was written by the {state['backend']!r} backend; this is {self.backend!r}")
        if state.get("value_head") is not None and self._value_head_module() is not None:
            self._load_value_head_state(state["value_head"])
        if state.get("ref_model") is not None and self.ref_model is not None:
            self.ref_model.load_state_dict(state["ref_model"])
        self._load_optimizer_state(state["optimizer"])
        self.step = state["step"]
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])

    def _value_head_state(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self._value_head_module().state_dict().items()}

    def _load_value_head_state(self, state: dict) -> None:
        self._value_head_module().load_state_dict(state)
