"""The DeepSpeed trainer backend: ZeRO stage 0-3, bf16, optimizer/parameter offload.

    trainer = DeepSpeedTrainer(model, pad_id, train_cfg, rl_cfg, temperature=1.0)
    metrics = trainer.train_wave(samples)          # same interface and loss as TorchTrainer

The DeepSpeed config is built from `TrainConfig` by `ds_config` (no hand-written JSON). The
optimizer is always a torch AdamW handed to DeepSpeed, so nothing JIT-compiles (DeepSpeed's
own FusedAdam / CPUAdam would compile for ~80 s on first use). Gradient accumulation is
"unmanaged": every micro-batch's `backward` accumulates, `step()` is the boundary, so the
token-budget packing of `backend.py` works unchanged. Across ranks a minibatch packs into as
many micro-batches as its rows' lengths and skipped rows make; ZeRO-2 reduces in every backward
and ZeRO-3 gathers in every forward, so a rank with fewer pads with zero-loss passes
(`_micro_batch_count`) and every rank runs the same collectives.

Launched by the DeepSpeed launcher (`deepspeed --hostfile ... --module ...`, see deploy/deepspeed.md)
the process group comes from its RANK/WORLD_SIZE/MASTER_* variables; otherwise (a Prefect
worker, a test) a one-process gloo/nccl group on 127.0.0.1 and a free port is started here.

Devices: the session loads the policy on `model.device`; on a machine with a GPU DeepSpeed works
on CUDA, so a policy left on the CPU is moved there (with the KL reference), and the rollout
engine, which shares the module, follows it. With `bf16` DeepSpeed holds the module in bf16
(fp32 master weights in the optimizer): the engine then samples from those bf16 weights.

Resume state (`state_dict`) is this rank's: ZeRO partitions (optimizer moments and fp32 master
weights) belong to the rank that wrote them, so a multi-process run saves one per rank.
"""

from __future__ import annotations

import logging
import os

import torch

from ratchet.config import TrainConfig
from ratchet.train.backend import Trainer


def ds_config(cfg: TrainConfig) -> dict:
    """The DeepSpeed JSON config for `cfg` (micro-batching and the LR schedule stay ratchet's)."""
    zero: dict = {"stage": cfg.zero_stage, "overlap_comm": False, "contiguous_gradients": cfg.zero_stage >= 2}
    if cfg.offload and cfg.zero_stage >= 1:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.offload and cfg.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": 1,   # nominal: ratchet packs micro-batches by tokens
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # backward() accumulates, step() is the boundary
        "gradient_clipping": cfg.max_grad_norm,
        "bf16": {"enabled": cfg.bf16},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,   # a torch AdamW: nothing to compile
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def init_distributed() -> None:
    """Join the launcher's process group, or start a one-process group over an in-memory store."""
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        # One process has no one to rendezvous with: no TCP store, so no port to bind (a port found free
        # and bound a moment later can be taken in between: EADDRINUSE, seen in CI under load).
        # DeepSpeed takes a group torch already has (deepspeed.comm.init_distributed).
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    if not torch.cuda.is_available():
        # The CPU accelerator JIT-compiles a shared-memory all-reduce op (~50-90 s) at start-up;
        # one process has nothing to reduce with, and several reduce over plain gloo just as well
        # (`python -m ratchet.train.launch` under torchrun/deepspeed on CPU): mark the op unavailable.
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        if builder is not None and isinstance(compatible, dict):
            compatible[builder.NAME] = False
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


class DeepSpeedTrainer(Trainer):
    backend = "deepspeed"

    def _setup(self) -> None:
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        init_distributed()
        if torch.cuda.is_available() and self.device.type != "cuda":
            # DeepSpeed's accelerator is CUDA whenever a GPU is visible: the policy (and with it the
            # rollout engine, which shares it) and the KL reference go there together
            self.module.to(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        params = [p for p in self.module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.module, optimizer=optimizer, model_parameters=params, config=ds_config(self.cfg)
        )
        self._zero = self.engine.zero_optimization_stage()

    def _forward(self, ids, attn, with_values, shared=None):
        return self.engine(ids, attn, with_values, shared)

    def _backward(self, loss) -> None:
        self.engine.backward(loss)

    def _micro_batch_count(self, n: int) -> int:
        """The most micro-batches any rank has in this minibatch: ZeRO-2 reduces gradients in every
        backward and ZeRO-3 gathers parameters in every forward, so a rank that ran fewer would leave
        the others waiting in a collective (or pair it with the wrong one)."""
        count = torch.tensor([n], device=self.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        return int(count)

    def _across_ranks(self, tokens: int, answers: int, rows: int, max_len: int) -> tuple:
        """DeepSpeed averages the ranks' gradients: a rank divides its loss by the minibatch's
        denominators over every rank over the world size, so the average is the one-process loss of
        the whole minibatch (each rank's own denominators weighed a token on a rank of short answers
        more than one on a rank of long ones)."""
        world = torch.distributed.get_world_size()
        if world == 1:
            return tokens, answers, rows, max_len
        sums = torch.tensor([tokens, answers, rows], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(sums)
        longest = torch.tensor([max_len], device=self.device)
        torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX)
        return (*(sums / world).tolist(), int(longest))

    def _optimizer_step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # ZeRO stage 0 in fp32 clips without recording the norm (get_global_grad_norm: None): the norm of the
        # gradients as they stand before the step (not partitioned at stage 0)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None] if self._zero == 0 else []
        mine = torch.nn.utils.get_total_norm(grads) if grads else None
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = norm if norm is not None else mine
        return float(norm) if norm is not None else float("nan")

    def _optimizer_state(self) -> dict:
        state = self.optimizer.state_dict()
        return {"zero_stage": self._zero, "world_size": torch.distributed.get_world_size(),
                "rank": torch.distributed.get_rank(), "state": state}

    def _load_optimizer_state(self, state: dict) -> None:
        if (state["zero_stage"], state["world_size"]) != (self._zero, torch.distributed.get_world_size()):
            raise ValueError(
                f"optimizer state was saved with ZeRO stage {state['zero_stage']} on {state['world_size']} ranks; "
                f"this trainer runs stage {self._zero} on {torch.distributed.get_world_size()}"
            )
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        if not isinstance(self.optimizer, ZeROOptimizer):
            # the plain torch optimizer, or (bf16 at stage 0) FP16_UnfusedOptimizer: one dict, fp32 master weights in it
            self.optimizer.load_state_dict(state["state"])
            return
        # ZeRO stages 1-3 and BF16_Optimizer: a list of per-rank states; fp32 master weights restored exactly
        states = [None] * state["world_size"]
        states[torch.distributed.get_rank()] = state["state"]
        self.optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)

    def gathered(self):
        """Context in which every parameter is whole (ZeRO-3 partitions them): use it to save weights."""
        import deepspeed

        if self._zero == 3:
            return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=0)
        import contextlib

        return contextlib.nullcontext()

    def _value_head_state(self) -> dict:
        with self.gathered():
            return super()._value_head_state()

    def _load_value_head_state(self, state: dict) -> None:
        with self.gathered():
            super()._load_value_head_state(state)
