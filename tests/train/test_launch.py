"""The multi-process training entry (`python -m ratchet.train.launch`) with the DeepSpeed trainer
across 2 CPU processes (gloo), started by DeepSpeed's own launcher (`deepspeed --num_gpus 2
--module ratchet.train.launch ...`; on CPU it starts one process per "slot" all the same)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from ratchet.config import NightlyConfig, RLConfig, RolloutConfig, StoreConfig, TrainConfig
from ratchet.model import save_policy
from ratchet.net import free_port
from ratchet.rollout.torch_engine import TorchEngine
from ratchet.rollout.wave import wave_frame
from ratchet.store import open_store
from ratchet.train.batching import TrainSample
from ratchet.train.checkpoint import save_checkpoint
from ratchet.train.launch import _trainer_state, shard_groups
from ratchet.train.session import PolicyRef, restore
from ratchet.train.torch_trainer import TorchTrainer
from tests.train import tiny
from tests.train.test_trainers import GradCapture

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """A child's environment: this one's, less the rendezvous an in-process DeepSpeed trainer of an earlier
    test set (RANK, WORLD_SIZE, ...: a child would join that group of one, or want MPI to find the rest)."""
    mine = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {**{k: v for k, v in os.environ.items() if k not in mine},
            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


class _Spec:
    def __init__(self, i: int):
        self.task_id, self.family, self.difficulty, self.prompt = f"t{i}", "f", 1, tiny.CORPUS[i][:30]


def _store_with_wave(tmp_path, n_groups: int):
    store = open_store(str(tmp_path / "store"))
    model, tok = tiny.model(), tiny.tokenizer()
    save_checkpoint(store, "r", 0, lambda d: save_policy(model, tok, d))
    specs = [_Spec(i) for i in range(n_groups)]
    rollouts = TorchEngine(model, tok).generate([s.prompt for s in specs], n=4, max_new_tokens=6, seed=0)
    rng = random.Random(0)
    rewards = [float(x) for g in range(n_groups) for x in ([1, 0, 0, 1] if g % 2 else [0, 1, rng.random() < .5, 1])]
    frame = wave_frame("r", 0, 0, specs, rollouts, 4).with_columns(pl.Series("reward", rewards, dtype=pl.Float64))
    store.write_table("runs/r/waves/000000/scored.parquet", frame)
    return store


def test_shard_groups_gives_every_rank_the_same_number_of_whole_groups():
    class S:
        def __init__(self, g):
            self.group = g
    samples = [S(g) for g in "aabbccddeee"]                          # 5 groups
    r0, cut0 = shard_groups(samples, 0, 2)
    r1, cut1 = shard_groups(samples, 1, 2)
    assert [s.group for s in r0] == list("aacc") and [s.group for s in r1] == list("bbdd")
    assert cut0 == cut1 == 1                                        # group "e": cut, reported
    assert shard_groups(samples, 0, 1) == (samples, 0)


def _uneven_wave(rank: int) -> list:
    """One group of 4 rows; rank 0's completions are long (packed into 2 micro-batches at the token
    budget's floor of 64), rank 1's short (1 micro-batch)."""
    rng = random.Random(rank)
    vocab = range(len(tiny.tokenizer().all_special_ids), len(tiny.tokenizer()))
    prompt, n = [rng.choice(vocab) for _ in range(6)], (20 if rank == 0 else 3)
    return [TrainSample(prompt, [rng.choice(vocab) for _ in range(n)], [-5.0] * n, 1.0 if i % 2 else -1.0,
                        f"r{rank}", reward=float(i % 2)) for i in range(4)]


_UNEVEN = TrainConfig(backend="deepspeed", minibatch_prompts=1, updates_per_batch=1, token_budget=64)


def _uneven_rank() -> None:
    """One rank of the test below (RANK etc. in its environment): one step at ZeRO-2, then ZeRO-3."""
    from ratchet.train.deepspeed_trainer import DeepSpeedTrainer

    rank = int(os.environ["RANK"])
    for stage, agg in ((2, "answer_mean_token_mean"), (3, "answer_mean_token_mean"), (2, "token_mean")):
        t = DeepSpeedTrainer(tiny.model(), tiny.tokenizer().pad_token_id, _UNEVEN.model_copy(update={"zero_stage": stage}),
                             RLConfig(loss_agg=agg))
        print(json.dumps({"rank": rank, "stage": stage, "agg": agg,
                          "grad_norm": t.train_wave(_uneven_wave(rank))["grad_norm"]}), flush=True)
    # as `ratchet.train.launch` ends: a rank that exits with the group up can abort in gloo's threads
    # ("terminate called without an active exception", SIGABRT) while the other is still in a collective
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_ranks_with_different_micro_batch_counts_take_the_same_step(tmp_path):
    """Rank 0 packs its minibatch into 2 micro-batches, rank 1 into 1: ZeRO-2 reduces in every backward
    (a rank short of one crashed gloo with a collective mismatch) and ZeRO-3 gathers in every forward
    (it hung). Rank 1 pads with a zero-loss pass; the step's gradient is the mean of the two ranks'
    minibatch gradients, as the one-process torch trainer computes them, with nothing added."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", "from tests.train.test_launch import _uneven_rank; _uneven_rank()"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**_env(),
                                   "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = [json.loads(ln) for out, _ in outs for ln in out.splitlines() if ln.startswith("{")]
    grads = []
    for rank in (0, 1):
        t = GradCapture(tiny.model(), tiny.tokenizer().pad_token_id, _UNEVEN, RLConfig())
        t.train_wave(_uneven_wave(rank))
        grads.append(t.grads[0])
    want = float(((grads[0] + grads[1]) / 2).norm())
    assert sorted((g["stage"], g["rank"]) for g in got if g["agg"] != "token_mean") == [(2, 0), (2, 1), (3, 0), (3, 1)]
    for g in got:
        if g["agg"] != "token_mean":
            assert g["grad_norm"] == pytest.approx(want, rel=1e-5)
    # found by review: each rank divided its loss by its own tokens, so a token on rank 1 (3-token answers)
    # weighed 1/12 and one on rank 0 (20-token answers) 1/80; the step is the one-process step of both groups
    whole = GradCapture(tiny.model(), tiny.tokenizer().pad_token_id,
                        _UNEVEN.model_copy(update={"minibatch_prompts": 2}), RLConfig(loss_agg="token_mean"))
    whole.train_wave(_uneven_wave(0) + _uneven_wave(1))
    [one_step] = whole.grads
    assert [g["grad_norm"] for g in got if g["agg"] == "token_mean"] == pytest.approx([float(one_step.norm())] * 2, rel=1e-5)


_KL_PPO = RLConfig(kl_coef=0.1, estimator="gae")


def _trained_state():
    """A torch trainer's state after one wave (KL reference and value head in it) and the weights it
    trained: they have moved away from the run's start (`tiny.model()`), the KL reference has not."""
    model = tiny.model()
    t = TorchTrainer(model, tiny.tokenizer().pad_token_id, TrainConfig(lr=1e-2), _KL_PPO)
    t.train_wave(t.assign_advantages(tiny.wave(model, seed=1, n_groups=2, group_size=4)))
    assert any(not torch.equal(v, tiny.model().state_dict()[k]) for k, v in model.state_dict().items())
    return t.state_dict(), model


def _keeps_the_run(trainer, saved: dict) -> None:
    start = tiny.model().state_dict()
    assert all(torch.equal(v.cpu(), start[k]) for k, v in trainer.ref_model.state_dict().items())
    head = trainer.module.value_head.state_dict()
    assert all(torch.equal(head[k].cpu(), v) for k, v in saved["value_head"].items())
    assert trainer.step == 0                                             # the optimizer and its step: afresh


def test_a_fresh_optimizer_keeps_the_runs_kl_reference_and_value_head(tmp_path):
    """launch on a trainer state its optimizer cannot take (the nightly's torch backend's trainer.pt, or
    another world size's trainer-rank<r>.pt) still restores the KL reference, the run's starting policy
    (it became a copy of the checkpoint's weights), and the PPO value head (it restarted at 0)."""
    from ratchet.train.deepspeed_trainer import DeepSpeedTrainer

    saved, model = _trained_state()
    torch.save(saved, tmp_path / "trainer.pt")
    state, why = _trainer_state(tmp_path, 0, 1)
    assert why == "fresh: the checkpoint's trainer state is the 'torch' backend's"
    trainer = DeepSpeedTrainer(model, tiny.tokenizer().pad_token_id, TrainConfig(backend="deepspeed"), _KL_PPO)
    trainer.load_state_dict(state, optimizer=why == "restored")                    # as launch.main does
    _keeps_the_run(trainer, saved)

    (tmp_path / "trainer.pt").unlink()
    torch.save({**saved, "backend": "deepspeed", "optimizer": {"rank": 0, "world_size": 2}}, tmp_path / "trainer-rank0.pt")
    state, why = _trainer_state(tmp_path, 2, 3)                            # no trainer-rank2.pt: rank 0's
    assert why == "fresh: the checkpoint's trainer state is rank 0 of 2's, this is rank 2 of 3"
    assert state["ref_model"] is not None and state["value_head"] is not None
    assert _trainer_state(tmp_path, 0, 2)[1] == "restored"


def test_the_nightly_restores_a_launch_checkpoint_with_the_runs_kl_reference_and_value_head(tmp_path):
    """A checkpoint written by launch has only trainer-rank<r>.pt: the in-process session starts its
    optimizer afresh but takes the KL reference and value head from rank 0's state."""
    saved, model = _trained_state()
    store = open_store(str(tmp_path / "store"))

    def write(d: Path) -> None:
        save_policy(model, tiny.tokenizer(), d)
        torch.save({**saved, "backend": "deepspeed", "optimizer": {"rank": 0, "world_size": 2}}, d / "trainer-rank0.pt")
        (d / "ledger.json").write_text(json.dumps({"run_id": "r", "version": 1, "consumed_waves": [0]}))

    ref = save_checkpoint(store, "r", 1, write)
    cfg = NightlyConfig(store=StoreConfig(uri=str(tmp_path / "store")), model=tiny.TINY, rl=_KL_PPO)
    session = restore(PolicyRef(run_id="r", version=1, checkpoint=ref), cfg)
    assert session.version == 1
    _keeps_the_run(session.trainer, saved)


def test_a_rank_that_fails_after_joining_the_group_exits_1_with_one_line(tmp_path):
    """A wave that is not in the store is found missing after the process group is up: the rank says so
    in one line and exits 1, its group left first (not SIGABRT from gloo's threads at exit)."""
    store = open_store(str(tmp_path / "store"))
    save_checkpoint(store, "r", 0, lambda d: save_policy(tiny.model(), tiny.tokenizer(), d))
    (tmp_path / "run.json").write_text(json.dumps({"store": {"uri": str(tmp_path / "store")}, "model": tiny.TINY.model_dump(),
                                                   "train": TrainConfig(backend="deepspeed").model_dump()}))
    env = _env()
    out = subprocess.run([sys.executable, "-m", "ratchet.train.launch", "--config", str(tmp_path / "run.json"),
                          "--run-id", "r", "--step", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0: ") and "000003" in errors[0], out.stderr[-3000:]
    assert "terminate called" not in out.stderr


@pytest.mark.slow
def test_two_cpu_processes_train_one_wave_and_write_the_next_checkpoint(tmp_path):
    store = _store_with_wave(tmp_path, n_groups=5)
    cfg = {"store": {"uri": str(tmp_path / "store")}, "model": tiny.TINY.model_dump(),
           "rollout": RolloutConfig(group_size=4, max_new_tokens=6).model_dump(),
           "train": TrainConfig(backend="deepspeed", zero_stage=2, minibatch_prompts=1, updates_per_batch=1,
                                lr=1e-2).model_dump()}
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    env = _env()
    args = ["--config", str(tmp_path / "run.json"), "--run-id", "r", "--step", "0"]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "--module", "ratchet.train.launch", *args]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    assert report["world_size"] == 2 and report["version"] == 1
    assert report["groups_per_rank"] == 2 and report["groups_cut"] == 1        # 5 groups: 2 + 2, one cut
    assert report["optimizer_steps"] == [2, 2]                                 # same steps on both ranks
    assert report["optimizer_state"].startswith("fresh")                       # v0 has no trainer state

    new = Path(tmp_path / "v1")
    from ratchet.train.checkpoint import load_latest
    ref, path = load_latest(store, "r", new)
    assert ref.key.startswith("runs/r/checkpoints/000001/")
    assert json.loads((path / "ledger.json").read_text())["consumed_waves"] == [0]
    states = [torch.load(path / f"trainer-rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [s["optimizer"]["rank"] for s in states] == [0, 1] and {s["optimizer"]["world_size"] for s in states} == {2}
    before = tiny.model().state_dict()
    after = load_file(path / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in after if k in before)   # the weights moved
    trained = store.read_table("runs/r/waves/000000/trained.parquet")
    assert trained["advantage"].is_not_null().sum() == 16                      # the 4 groups trained on

    again = subprocess.run([sys.executable, "-m", "ratchet.train.launch", *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "never trained twice" in again.stderr      # a wave is not trained twice
