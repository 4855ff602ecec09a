"""The torch trainer backend (CPU and one GPU): AdamW, gradient clipping, bf16 autocast on CUDA.

It trains the module where the session put it (`model.device`, `model.dtype`); with
`train.bf16` and the module on CUDA every forward runs under bf16 autocast (fp32 weights and
optimizer state stay fp32). On CPU nothing changes: bf16 is a GPU setting.

    trainer = TorchTrainer(model, pad_id, train_cfg, rl_cfg, temperature=1.0)
    samples = trainer.assign_advantages(samples)   # samples: list[TrainSample]
    metrics = trainer.train_wave(samples)

The advantages, wave loop, packing, loss and resume state are shared with the DeepSpeed
backend (`ratchet/train/backend.py`); this file only owns the optimizer. Tests: `pytest tests/train -q`.
"""

from __future__ import annotations

import contextlib

import torch

from ratchet.train.backend import Trainer


class TorchTrainer(Trainer):
    backend = "torch"

    def _setup(self) -> None:
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self._autocast = self.cfg.bf16 and self.device.type == "cuda"

    def _forward(self, ids, attn, with_values, shared=None):
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self._autocast else contextlib.nullcontext()
        with ctx:
            return self.module(ids, attn, with_values, shared)

    def _backward(self, loss) -> None:
        loss.backward()

    def _optimizer_step(self, lr: float) -> float:
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:  # a parameter no row reached still takes its (zero-gradient) Adam step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def _optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def _load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
