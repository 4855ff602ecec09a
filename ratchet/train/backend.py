"""What every trainer backend shares: advantages, the wave loop, the loss, resume state.

    trainer = TorchTrainer(model, pad_id, cfg.train, cfg.rl)       # or DeepSpeedTrainer, same signature
    samples = trainer.assign_advantages(samples)                   # computed once: what is stored is what trains
    metrics = trainer.train_wave(samples)                          # samples: list[TrainSample]
    state = trainer.state_dict(); ...; trainer.load_state_dict(state)

Advantages are computed in one place, `assign_advantages`, for every estimator: the group
estimators of `ratchet.rl.advantages` from the rewards (less the KL penalty with
`kl_in_reward`, which needs the reference model) and PPO's GAE over the value head. The
nightly stores what it returns next to the wave (`trained.parquet`) before training on it.

A wave is split into minibatches of `minibatch_prompts` groups; each minibatch is seen
`updates_per_batch` times (PPO epochs), one optimizer step each. A minibatch is cut into
micro-batches packed by token budget (dynamic batching); the loss is normalised over the
whole minibatch (`denom`), so accumulation gives the same gradient as one big batch.

Importance sampling (decoupled PPO, Hilton et al. 2021, arXiv:2110.00641): the PPO ratio is
taken against the proximal policy pi_old, the weights at the start of the minibatch (their
log-probs are the first pass's, detached, so they cost no extra forward); the gap between
pi_old and the behaviour policy that sampled the wave (the engine's log-probs) is corrected
per token by the truncated weight min(pi_old / pi_behav, `is_cap`).

Multi-turn trajectories (`TrainSample.loss_mask`, 0 on observation tokens): the observations are
in the forward (attended to) but outside every loss term: the policy loss, KL, entropy bonus
and value loss are masked to the model's own tokens, and the denominators (`denom`, `max_len`)
count action tokens only. GAE skips observation tokens: they are the environment's transition
between two answers, so the recursion steps from the last token of answer k straight to the
first token of answer k + 1 (whose value V(s) has read the observation), with no discount over
the observation's length; the outcome reward sits on the last action token, and advantages are
whitened over the wave's action tokens. With loss_mask None nothing changes, bit for bit.
Per-turn credit (`TrainSample.turn_rewards`, `AgentConfig.credit` "turn"): the group estimator
runs once per turn over the state values after that turn of the episodes that answered it (turn 1:
the whole group; turn k: its revisions), and each answer's tokens get their turn's advantage
(`token_advantages`; observation tokens 0).

Samples whose gradient is exactly zero (advantage 0 with no KL/entropy/value term) are not
forwarded at all; they still count in the normaliser, so the gradient does not change.

A backend (torch_trainer.py, deepspeed_trainer.py) only says how to build the optimizer, run
the forward, backward and optimizer step, and save/load optimizer state.
"""

from __future__ import annotations

import copy
import math
import random
from abc import ABC, abstractmethod
from dataclasses import replace

import torch
from torch import Tensor

from ratchet.config import RLConfig, TrainConfig
from ratchet.rl import (
    answer_count,
    compute_advantages,
    entropy_from_logits,
    gae,
    kl_in_reward,
    masked_whiten,
    outcome_to_token_rewards,
    policy_loss,
    spread_over_turns,
    turn_advantages,
    value_loss,
)
from ratchet.train.batching import (
    TrainSample,
    collate,
    collate_shared,
    loss_mask_of,
    pack_by_prompt,
    pack_by_tokens,
    place_tokens,
)
from ratchet.train.policy import PolicyWithValue, ValueHead, logprobs_from_logits, token_logprobs


def lr_factor(step: int, warmup: int, schedule: str = "constant", decay_steps: int = 0, min_ratio: float = 0.0) -> float:
    """LR multiplier at optimizer step `step` (0-based): linear warm-up, then constant or cosine
    down to `min_ratio` over `decay_steps` steps (Loshchilov & Hutter 2017, arXiv:1608.03983)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine" and decay_steps > 0:
        t = min(1.0, (step - warmup) / decay_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return 1.0


def _by_size(groups) -> dict[int, list[TrainSample]]:
    """The groups' samples, flattened per group size: a group estimator takes [B*G] with one G."""
    out: dict[int, list[TrainSample]] = {}
    for rows in groups:
        out.setdefault(len(rows), []).extend(rows)
    return out


SUMMED_METRICS = ("pg_loss", "value_loss")  # micro-batch values add up to the minibatch's
# pi against pi_old: on a minibatch's first pass the two are the same weights (ratio 1, KL 0), so these
# are averaged over its later passes only, the drift of the steps before them; one pass: not measured
DRIFT_METRICS = ("approx_kl", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean")


class Trainer(ABC):
    """One RL epoch over a scored wave; backends implement the six abstract methods below."""

    backend = "base"
    share_prompts = True  # forward each distinct prompt once per micro-batch (not with a value head)
    pack_shared = staticmethod(pack_by_prompt)   # how that layout's micro-batches are cut

    def __init__(self, model, pad_id: int, cfg: TrainConfig, rl: RLConfig, temperature: float = 1.0):
        self.model, self.pad_id, self.cfg, self.rl, self.temperature = model, pad_id, cfg, rl, temperature
        self.ppo = rl.estimator == "gae"
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if rl.kl_coef > 0 else None
        # as wide as the last hidden state the head reads: the LM head's input (OPT-350m projects 1024 to 512)
        width = getattr(model.get_output_embeddings(), "in_features", None) or model.config.hidden_size
        value_head = ValueHead(width) if self.ppo else None
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

    def _micro_batch_count(self, n: int) -> int:
        """How many forward/backward passes this process runs for a minibatch it packed into `n`
        micro-batches: n; a multi-process backend returns the most any of its processes has."""
        return n

    def _across_ranks(self, tokens: int, answers: int, rows: int, max_len: int) -> tuple:
        """A minibatch's loss denominators (action tokens, answers, rows; the longest answer) as this
        process's loss divides by them: its own; a multi-process backend, whose step averages the
        processes' gradients, returns the sums over processes divided by their number and the max."""
        return tokens, answers, rows, max_len

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

    def _value_head_module(self) -> torch.nn.Module | None:
        return self.module.value_head

    # -- advantages: computed once, here, for every estimator --
    @torch.no_grad()
    def assign_advantages(self, samples: list[TrainSample]) -> list[TrainSample]:
        """The samples this wave trains on, each with the advantage the loss will use.

        Group estimators: per prompt group, from the rewards (minus kl_coef * sum_t KL_t with
        kl_in_reward); with drop_zero_variance a group whose rewards are all equal is dropped
        (its advantages are 0: no policy gradient), and with per-turn credit a group whose every
        advantage is 0 (`ratchet.stages.learning_signal` counts the same groups). GAE: per token, over the value head's V(s_t)
        before this epoch, whitened over the wave, with the returns and old values of the value loss.
        """
        if any(s.reward is None for s in samples):
            raise ValueError("assign_advantages: every sample needs its reward")
        if not samples:
            return []
        kl_reward = self.rl.kl_in_reward and self.ref_model is not None
        self.module.eval()
        per_turn = any(s.turn_rewards is not None for s in samples)
        if per_turn and (self.ppo or kl_reward or any(s.turn_rewards is None for s in samples)):
            raise ValueError("assign_advantages: per-turn credit (turn_rewards) needs every sample's turn rewards, "
                             "a group estimator (not gae) and kl_in_reward off")
        if self.ppo:
            return self._gae_advantages(samples, kl_reward)
        groups: dict[str, list[TrainSample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        if per_turn:
            return self._turn_advantages(list(groups.values()))
        if self.rl.drop_zero_variance:
            groups = {g: rows for g, rows in groups.items() if len({s.reward for s in rows}) > 1}
        kept = [s for rows in groups.values() for s in rows]
        rewards = self._token_pass(kept, kl_reward) if kl_reward else {id(s): s.reward for s in kept}
        out: dict[int, float] = {}
        for size, flat in _by_size(groups.values()).items():   # one vectorised call per group size
            adv = compute_advantages(self.rl.estimator, torch.tensor([float(rewards[id(s)]) for s in flat]), size)
            out.update({id(s): float(a) for s, a in zip(flat, adv)})                      # [B*G]
        return [replace(s, advantage=out[id(s)]) for s in kept]

    def _turn_advantages(self, groups: list[list[TrainSample]]) -> list[TrainSample]:
        """Per-turn credit: the estimator per turn over the groups' state values, a revision against the
        group's other revisions at its turn (`turn_advantages`), each answer's tokens given its turn's
        advantage (`spread_over_turns`). With drop_zero_variance, a group whose advantages are all 0 is
        dropped: its turn states may still differ where nothing is compared (after an episode's last
        answer, a revision with no other at its turn, across `agent.branch` tuples), and kept, its answers
        would count in the loss's denominator and dilute the groups that train."""
        out: dict[int, list[float]] = {}
        branches = {s.branch for rows in groups for s in rows}
        if len(branches) > 1:
            raise ValueError(f"assign_advantages: the samples of one wave come from one agent.branch, got {sorted(branches)}")
        branch = branches.pop() if branches else 1
        groups = [sorted(rows, key=lambda s: s.row) for rows in groups]   # a group's tuples: consecutive rows
        for size, flat in _by_size(groups).items():   # one call per group size
            masks = [loss_mask_of(s) for s in flat]
            adv = turn_advantages(self.rl.estimator, torch.tensor([s.turn_rewards for s in flat]), size,
                                  torch.tensor([answer_count(m) for m in masks]), branch)  # [B*G, K]
            signal = adv.view(-1, size, adv.shape[1]).ne(0).flatten(1).any(1)  # [B] False: a group that teaches nothing
            out.update({id(s): spread_over_turns(a, m).tolist() for j, (s, a, m) in enumerate(zip(flat, adv, masks))
                        if signal[j // size] or not self.rl.drop_zero_variance})
        return [replace(s, advantage=None, token_advantages=out[id(s)]) for rows in groups for s in rows if id(s) in out]

    def _gae_advantages(self, samples: list[TrainSample], kl_reward: bool) -> list[TrainSample]:
        per_sample = self._token_pass(samples, kl_reward, values=True)   # id -> (adv [c], returns [c], values [c])
        flat = torch.cat([per_sample[id(s)][0] for s in samples])                             # [sum c]
        flat_mask = torch.cat([loss_mask_of(s) for s in samples]).to(flat.dtype)              # [sum c]
        white = masked_whiten(flat[None], flat_mask[None])[0]        # PPO: over the wave's action tokens
        out, pos = [], 0
        for s in samples:
            adv, ret, val = per_sample[id(s)]
            out.append(replace(s, advantage=None, token_advantages=white[pos:pos + adv.numel()].tolist(),
                               returns=ret.tolist(), old_values=val.tolist()))
            pos += adv.numel()
        return out

    def _token_pass(self, samples: list[TrainSample], kl_reward: bool, values: bool = False) -> dict:
        """One no-grad pass over the samples: KL-adjusted rewards {id: float}, or with values=True
        GAE's {id: (advantages [c], returns [c], values [c])} on the completion tokens."""
        rl, out = self.rl, {}
        for micro in pack_by_tokens(samples, self.cfg.token_budget):
            ids, attn, mask, behavior, _ = (t.to(self.device) for t in collate(micro, self.pad_id))
            rewards = torch.tensor([s.reward for s in micro], device=self.device)               # [N]
            ref = token_logprobs(self.ref_model, ids, attn, self.temperature)[0] if kl_reward else None
            if not values:
                adjusted = kl_in_reward(rewards, behavior, ref, mask, rl.kl_coef, rl.kl)  # [N]
                out.update({id(s): float(r) for s, r in zip(micro, adjusted)})
                continue
            _, v = self._forward(ids, attn, True)
            v = v[:, :-1].float()                                                              # [N, L-1]
            token_rewards = outcome_to_token_rewards(rewards, mask)                            # [N, L-1]
            if kl_reward:
                token_rewards = kl_in_reward(token_rewards, behavior, ref, mask, rl.kl_coef, rl.kl)
            adv, ret = gae(token_rewards, v, mask, rl.gamma, rl.lam)                           # [N, L-1] each
            for b, s in enumerate(micro):
                p, c = len(s.prompt_ids), len(s.completion_ids)
                out[id(s)] = tuple(x[b, p - 1:p - 1 + c].cpu() for x in (adv, ret, v))
        return out

    # -- the wave loop --
    def train_wave(self, samples: list[TrainSample]) -> dict[str, float]:
        """Minibatches of whole groups, `updates_per_batch` optimizer steps each, on the advantages
        `assign_advantages` set (it is not called here: what was stored is what trains). The module
        stays in eval mode: dropout would make pi_old a noisy forward, unlike the engine's behaviour
        log-probs and the reference's (importance weights, KL and ratios away from 1 with no step
        taken). approx_kl and the clip fractions: over each minibatch's passes after its first
        (DRIFT_METRICS)."""
        missing = [s for s in samples if s.token_advantages is None and (self.ppo or s.advantage is None)]
        if missing:
            raise ValueError(f"train_wave: {len(missing)} sample(s) have no advantage; call assign_advantages first")
        groups: dict[str, list[TrainSample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        order = list(groups)
        self.rng.shuffle(order)
        k = self.cfg.minibatch_prompts
        totals: dict[str, float] = {}
        n_updates = 0
        self.module.eval()
        for start in range(0, len(order), k):
            minibatch = [s for g in order[start:start + k] for s in groups[g]]
            old: dict[int, Tensor] = {}   # pi_old's log-probs [c] per sample: the first pass's, detached
            for n in range(self.cfg.updates_per_batch):
                for key, v in self._update(minibatch, old).items():
                    if n > 0 or key not in DRIFT_METRICS:
                        totals[key] = totals.get(key, 0.0) + v
                n_updates += 1
        later = n_updates - n_updates // self.cfg.updates_per_batch      # passes after a minibatch's first
        out = {k: v / max(later if k in DRIFT_METRICS else n_updates, 1) for k, v in totals.items()}
        # not measured is not 0: `kl` only with a reference in the loss, `entropy` only with its bonus on
        if self.ref_model is None or self.rl.kl_in_reward:
            out.pop("kl", None)
        if self.rl.entropy_coef == 0:
            out.pop("entropy", None)
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
        zero = s.advantage == 0.0 if s.token_advantages is None else not any(s.token_advantages)
        return (zero and not self.ppo and rl.entropy_coef == 0
                and (self.ref_model is None or rl.kl_in_reward or rl.kl_coef == 0))

    def _update(self, minibatch: list[TrainSample], old: dict[int, Tensor]):
        rl = self.rl
        answers = [answer_count(loss_mask_of(s)) for s in minibatch] if rl.loss_agg == "answer_mean_token_mean" else []
        # one answer per row: the same loss as seq_mean_token_mean, by the same code (bit for bit)
        loss_agg = "seq_mean_token_mean" if answers and all(n == 1 for n in answers) else rl.loss_agg
        # the whole minibatch's denominators, skipped rows included, and every rank's rows (`_across_ranks`)
        n_tokens, n_answers, n_rows, max_len = self._across_ranks(
            sum(s.action_tokens for s in minibatch), sum(answers), len(minibatch),   # the model's own tokens
            max(s.action_tokens for s in minibatch))
        denom = (n_tokens if rl.loss_agg == "token_mean" else n_answers if rl.loss_agg == "answer_mean_token_mean"
                 else n_rows)
        shortest = min(minibatch, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))
        # keep one row so the optimizer sees a (zero) gradient, exactly as without skipping
        live = [s for s in minibatch if not self._zero_grad_sample(s)] or [shortest]
        metrics: dict[str, float] = {}
        shared = self.share_prompts and not self.ppo  # the value head reads hidden states of the plain layout
        pack = self.pack_shared if shared else pack_by_tokens
        micros = pack(live, self.cfg.token_budget)
        # a rank with fewer micro-batches than another runs its shortest row again at zero loss: the same
        # forwards and backwards on every rank, so the collectives inside them pair up
        padding = [[shortest]] * (self._micro_batch_count(len(micros)) - len(micros))
        for i, micro in enumerate(micros + padding):
            if shared:
                loss, m = self._micro_loss_shared(micro, old, loss_agg, denom, max_len)
            else:
                loss, m = self._micro_loss(micro, old, loss_agg, denom, n_tokens, max_len)
            if i >= len(micros):
                self._backward(loss * 0.0)   # every parameter's gradient hook fires, adding 0
                continue
            self._backward(loss)
            for key, v in m.items():  # losses are already minibatch-normalised: sum; rates: average
                metrics[key] = metrics.get(key, 0.0) + (v if key in SUMMED_METRICS else v * len(micro) / len(live))
        lr = self.current_lr()
        metrics["grad_norm"] = self._optimizer_step(lr)
        metrics["lr"] = lr
        metrics["skipped_frac"] = 1 - len(live) / len(minibatch)
        self.step += 1
        return metrics

    @staticmethod
    def _proximal(micro, old: dict[int, Tensor], logp: Tensor, starts: list[int]) -> Tensor:
        """pi_old's log-probs laid out like `logp` [N, T]: recorded on the minibatch's first pass
        (the weights before its first step), then reused by its later passes."""
        for b, s in enumerate(micro):
            if id(s) not in old:
                old[id(s)] = logp[b, starts[b]:starts[b] + len(s.completion_ids)].detach().clone()
        out = torch.zeros_like(logp)
        for b, s in enumerate(micro):
            out[b, starts[b]:starts[b] + len(s.completion_ids)] = old[id(s)]
        return out                                                                           # [N, T]

    def _loss(self, logp, old_logp, behavior, adv, mask, ref, entropy, loss_agg, denom, max_len):
        rl = self.rl
        return policy_loss(
            logp, old_logp, adv, mask, clip_low=rl.clip_low, clip_high=rl.clip_high, loss_agg=loss_agg,
            ref_logprobs=ref, kl_coef=rl.kl_coef if ref is not None else 0.0, kl_estimator=rl.kl,
            entropy=entropy, entropy_coef=rl.entropy_coef, behavior_logprobs=behavior, is_cap=rl.is_cap,
            max_len=max_len, denom=denom,
        )

    def _micro_loss(self, micro, old, loss_agg, denom, n_tokens, max_len) -> tuple[Tensor, dict[str, float]]:
        rl, dev = self.rl, self.device
        ids, attn, mask, behavior, adv = (t.to(dev) for t in collate(micro, self.pad_id))
        logits, values = self._forward(ids, attn, self.ppo)
        logp, entropy = logprobs_from_logits(logits, ids, self.temperature, rl.entropy_coef > 0)   # [N, L-1]
        old_logp = self._proximal(micro, old, logp, [len(s.prompt_ids) - 1 for s in micro])
        ref = None
        if self.ref_model is not None and not rl.kl_in_reward:
            with torch.no_grad():
                ref, _ = token_logprobs(self.ref_model, ids, attn, self.temperature)
        if self.ppo:
            returns, old_values = (place_tokens(micro, [torch.tensor(getattr(s, f)) for s in micro], ids.shape[1] - 1).to(dev)
                                   for f in ("returns", "old_values"))                            # [N, L-1] each
        loss, m = self._loss(logp, old_logp, behavior, adv, mask, ref, entropy, loss_agg, denom, max_len)
        if self.ppo:
            v_loss = value_loss(values[:, :-1], returns, old_values, mask, denom=n_tokens)  # token mean
            loss = loss + rl.value_coef * v_loss
            m["value_loss"] = float(v_loss.detach())
        return loss, m

    def _micro_loss_shared(self, micro, old, loss_agg, denom, max_len) -> tuple[Tensor, dict[str, float]]:
        """The policy loss on the prompt-shared layout (completion positions only)."""
        rl, dev = self.rl, self.device
        prompt_ids, prompt_attn, index, comp_ids, comp_attn, mask, behavior, adv = (
            t.to(dev) for t in collate_shared(micro, self.pad_id))       # attention on observations, loss not
        logits, _ = self._forward(prompt_ids, prompt_attn, False, (index, comp_ids, comp_attn))  # [N, C, V]
        z = logits.float() / self.temperature
        logp = torch.log_softmax(z, dim=-1).gather(2, comp_ids[:, :, None]).squeeze(2)        # [N, C]
        entropy = entropy_from_logits(z) if rl.entropy_coef > 0 else None                       # [N, C]
        old_logp = self._proximal(micro, old, logp, [0] * len(micro))
        ref = None
        if self.ref_model is not None and not rl.kl_in_reward:
            with torch.no_grad():
                ref = self._ref_shared(prompt_ids, prompt_attn, index, comp_ids, comp_attn)            # [N, C]
        return self._loss(logp, old_logp, behavior, adv, mask, ref, entropy, loss_agg, denom, max_len)

    def _ref_shared(self, prompt_ids, prompt_attn, index, comp_ids, comp_attn) -> Tensor:
        ref = PolicyWithValue(self.ref_model, None)
        logits = ref.forward_shared(prompt_ids, prompt_attn, index, comp_ids, comp_attn)        # [N, C, V]
        z = logits.float() / self.temperature
        return torch.log_softmax(z, dim=-1).gather(2, comp_ids[:, :, None]).squeeze(2)          # [N, C]

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

    def load_state_dict(self, state: dict, optimizer: bool = True) -> None:
        """Resume from `state`. The KL reference (the policy the run started from) and the PPO value
        head belong to the run and are always restored; with optimizer=False (a state this trainer's
        optimizer cannot take: another backend's, another world size's) the optimizer, step and RNG
        start afresh."""
        if optimizer and state.get("backend", self.backend) != self.backend:
            raise ValueError(f"trainer state was written by the {state['backend']!r} backend; this is {self.backend!r}")
        if state.get("value_head") is not None and self._value_head_module() is not None:
            self._load_value_head_state(state["value_head"])
        if state.get("ref_model") is not None and self.ref_model is not None:
            self.ref_model.load_state_dict(state["ref_model"])
        if not optimizer:
            return
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
