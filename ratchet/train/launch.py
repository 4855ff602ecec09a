"""Multi-process training: one RL epoch on a stored wave with the DeepSpeed trainer, across N processes.

    deepspeed --num_gpus 8 --module ratchet.train.launch --config run.json --run-id RUN --step 12   # GPUs (nccl)
    deepspeed --hostfile /job/hostfile --module ratchet.train.launch --config run.json --run-id RUN --step 12
    torchrun --nproc_per_node 2 -m ratchet.train.launch --config run.json --run-id RUN --step 12   # CPU (gloo)
    python -m ratchet.train.launch --config run.json --run-id RUN --step 12                         # one process

Every rank runs this same module (the launcher sets RANK, WORLD_SIZE, MASTER_ADDR/PORT; the
DeepSpeed launcher also passes --local_rank). Each rank:

1. loads the run's LATEST checkpoint from the store (`--config`'s `store`: a shared directory
   or S3/MinIO) and builds `DeepSpeedTrainer` on it (ZeRO stage etc. from `train`);
2. reads the gated wave `runs/<run>/waves/<step>/scored.parquet`, takes its whole, verified
   groups (`ratchet.stages.train_samples`) and their advantages (`Trainer.assign_advantages`,
   computed identically on every rank, from the same weights);
3. takes its share of the groups, round-robin; the groups are first cut to a multiple of the
   world size, so every rank makes the same number of optimizer steps (DeepSpeed reduces the
   gradients at each step: a rank with one step more would wait for ever; within a step the
   trainer evens out the micro-batches). The cut groups are reported, never silently lost;
4. trains (`train_wave`), and rank 0 writes checkpoint version + 1 to the run: weights
   (gathered at ZeRO-3), `ledger.json` (+ this wave), `trained.parquet` beside the wave, and
   every rank's trainer state as `trainer-rank<r>.pt` (ZeRO partitions belong to their rank).
   LATEST moves last, as for every checkpoint.

Rank 0 prints one JSON line: version, world size, groups per rank, cut groups, optimizer steps,
the per-rank policy losses, the checkpoint URI, and whether the optimizer state was restored.

Resume: the trainer state is restored when the checkpoint has `trainer-rank<r>.pt` written by
the same world size (a multi-process checkpoint), or `trainer.pt` of a one-process DeepSpeed
run launched with one process; otherwise (e.g. the nightly's torch-backend checkpoint) the
weights carry over and the optimizer starts afresh, said in the output as
`optimizer_state: "fresh: <why>"`. The KL reference (the run's starting policy) and the PPO
value head are restored either way, from whichever trainer state the checkpoint has. A wave
already in the checkpoint's ledger is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ratchet.config import NightlyConfig
from ratchet.store import open_store
from ratchet.train.checkpoint import trainer_state_file


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ratchet.train.launch", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, help="NightlyConfig JSON (the same file as `ratchet run --config`)")
    p.add_argument("--run-id", required=True, help="the run whose LATEST checkpoint is trained")
    p.add_argument("--step", type=int, required=True, help="the wave: runs/<run>/waves/<step>/scored.parquet")
    p.add_argument("--store", help="store URI (overrides the config's store.uri)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the DeepSpeed launcher")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> NightlyConfig:
    fields = json.loads(args.config.read_text()) if args.config else {}
    if args.store:
        fields["store"] = {**fields.get("store", {}), "uri": args.store}
    fields.setdefault("train", {})
    fields["train"] = {**fields["train"], "backend": "deepspeed"}
    return NightlyConfig.model_validate(fields)


def shard_groups(samples: list, rank: int, world: int) -> tuple[list, int]:
    """This rank's samples (whole groups, round-robin over the groups in wave order) and how many
    groups were cut so that every rank has the same number. Pure: same input, same split on every rank."""
    order: list[str] = []
    for s in samples:
        if s.group not in order:
            order.append(s.group)
    keep = len(order) - len(order) % world
    mine = set(order[rank:keep:world])
    return [s for s in samples if s.group in mine], len(order) - keep


def _trainer_state(path: Path, rank: int, world: int) -> tuple[dict | None, str]:
    """The checkpoint's trainer state for this rank (`trainer-rank<r>.pt`, else `trainer.pt`, else
    rank 0's) and "restored" when its optimizer state is this rank's, else "fresh: <why>": the
    KL reference and value head in it are then restored all the same. (None, "fresh: ...") if none."""
    found = trainer_state_file(path, rank)
    if found is None:
        return None, "fresh: the checkpoint has no trainer state"
    state = torch.load(found, weights_only=False)
    if state.get("backend") != "deepspeed":
        return state, f"fresh: the checkpoint's trainer state is the {state.get('backend')!r} backend's"
    saved = state["optimizer"].get("rank"), state["optimizer"].get("world_size")
    if saved != (rank, world):
        return state, f"fresh: the checkpoint's trainer state is rank {saved[0]} of {saved[1]}'s, this is rank {rank} of {world}"
    return state, "restored"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args)
    from ratchet import stages
    from ratchet.model import save_policy
    from ratchet.scratch import scratch_dir
    from ratchet.train.checkpoint import load_latest, save_checkpoint
    from ratchet.train.deepspeed_trainer import DeepSpeedTrainer, init_distributed
    from ratchet.train.session import load_engine

    store = open_store(cfg.store)
    wave_key = f"runs/{args.run_id}/waves/{args.step:06d}/scored.parquet"
    with scratch_dir("launch") as tmp:
        found = load_latest(store, args.run_id, Path(tmp))
        if found is None:
            raise SystemExit(f"error: run {args.run_id!r} has no checkpoint to train from ({store.root_uri})")
        _, path = found
        ledger = (json.loads((path / "ledger.json").read_text()) if (path / "ledger.json").exists()
                  else {"version": 0, "consumed_waves": []})
        if args.step in ledger["consumed_waves"]:
            raise SystemExit(f"error: wave {args.step} is already in the ledger of checkpoint "
                             f"{ledger['version']} of run {args.run_id!r}; a wave is never trained twice")
        init_distributed()                                   # after the checks: every rank refuses alike
        dist = torch.distributed
        rank, world = dist.get_rank(), dist.get_world_size()
        engine = load_engine(path, cfg)                     # the run's: its dtype, and prompts as its rollouts encode them
        model, tokenizer = engine.model, engine.tokenizer
        state, restored = _trainer_state(path, rank, world)
        trainer = DeepSpeedTrainer(model, tokenizer.pad_token_id, cfg.train, cfg.rl, temperature=cfg.rollout.temperature)
        if state is not None:
            trainer.load_state_dict(state, optimizer=restored == "restored")

    frame = store.read_table(wave_key)
    samples = trainer.assign_advantages(stages.train_samples(frame, engine.encode_prompts, cfg))
    mine, cut = shard_groups(samples, rank, world)
    metrics = trainer.train_wave(mine) if mine else {"train_samples": 0, "optimizer_steps": 0}

    states = [None] * world if rank == 0 else None
    dist.gather_object(trainer.state_dict(), states, dst=0)
    every = [None] * world
    dist.all_gather_object(every, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    version = ledger["version"] + 1
    with trainer.gathered():                               # ZeRO-3: collective, every rank enters
        if rank == 0:
            def write(d: Path) -> None:
                save_policy(model, tokenizer, d)
                for r, st in enumerate(states):
                    torch.save(st, d / f"trainer-rank{r}.pt")
                (d / "ledger.json").write_text(json.dumps({"run_id": args.run_id, "version": version,
                                                           "consumed_waves": [*ledger["consumed_waves"], args.step]}))
            trained = [s for r in range(world) for s in shard_groups(samples, r, world)[0]]   # what every rank trained on
            store.write_table(f"runs/{args.run_id}/waves/{args.step:06d}/trained.parquet", stages.with_advantages(frame, trained))
            ref = save_checkpoint(store, args.run_id, version, write)
    dist.barrier()
    out = {"run_id": args.run_id, "step": args.step, "version": version, "world_size": world,
           "groups_per_rank": len({s.group for s in mine}), "groups_cut": cut,
           "optimizer_steps": [m.get("optimizer_steps", 0) for m in every],
           "pg_loss": [m.get("pg_loss") for m in every], "optimizer_state": restored}
    if rank == 0:
        out["checkpoint"] = ref.uri
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except SystemExit:
        raise
    except Exception as e:   # one line per rank, the launcher reports the failed rank
        if os.environ.get("RATCHET_DEBUG"):
            raise
        print(f"error: rank {os.environ.get('RANK', 0)}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()   # exiting with gloo's threads up can abort (SIGABRT, not 1)
        sys.exit(1)
