"""The stage functions the nightly tasks call: which groups train, and the advantages they train
on (computed once, by the trainer, for every estimator), by hand."""

import math

import polars as pl
import pytest

from ratchet.config import NightlyConfig, RLConfig, RolloutConfig, TrainConfig
from ratchet.data.schemas import trajectories_frame
from ratchet.stages import group_stats, train_samples, with_advantages
from ratchet.train.torch_trainer import TorchTrainer
from tests.train import tiny


def _wave(rewards: dict[str, list[float | None]]) -> pl.DataFrame:
    rows = []
    for group, rs in rewards.items():
        for i, r in enumerate(rs):
            rows.append({"run_id": "r", "step": 0, "policy_version": 0, "task_id": f"t{group}", "family": "f",
                         "difficulty": 1, "group_id": group, "sample_idx": i, "prompt": "p", "completion": "c",
                         "prompt_tokens": 1, "completion_tokens": 1, "completion_ids": [5],
                         "behavior_logprobs": [-1.0], "reward": r, "env_error": r is None})
    return trajectories_frame(rows)


WAVE = {"a": [1.0, 0.0], "b": [0.5, 0.5], "c": [1.0, None]}


def _cfg(estimator: str = "grpo") -> NightlyConfig:
    return NightlyConfig(rollout=RolloutConfig(group_size=2), rl=RLConfig(estimator=estimator))


def _advantages(frame: pl.DataFrame, cfg: NightlyConfig) -> pl.DataFrame:
    trainer = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), cfg.rl)
    samples = trainer.assign_advantages(train_samples(frame, lambda ps: [[1, 2] for _ in ps], cfg))
    return with_advantages(frame, samples)


def test_group_stats_count_excluded_and_equal_reward_groups():
    assert group_stats(_wave(WAVE), _cfg()) == {"groups": 3, "groups_env_error": 1, "groups_zero_variance": 1}


def test_only_whole_verified_groups_are_trainable():
    samples = train_samples(_wave(WAVE), lambda ps: [[1, 2] for _ in ps], _cfg())
    assert sorted(s.group for s in samples) == ["a", "a", "b", "b"]          # c has an env_error row
    assert [s.row for s in samples] == [0, 1, 2, 3] and all(s.advantage is None for s in samples)


def test_a_multi_turn_row_trains_with_its_loss_mask():
    """A row's loss_mask (0 on observation tokens) reaches its TrainSample; a null one stays None (all ones)."""
    frame = _wave({"a": [1.0, 0.0]}).with_columns(
        pl.Series("completion_ids", [[5, 6, 7, 8], [5]], dtype=pl.List(pl.Int32)),
        pl.Series("behavior_logprobs", [[-1.0, 0.0, 0.0, -1.0], [-1.0]], dtype=pl.List(pl.Float32)),
        pl.Series("completion_tokens", [4, 1], dtype=pl.Int32),
        pl.Series("loss_mask", [[1, 0, 0, 1], None], dtype=pl.List(pl.Int8)))
    samples = train_samples(frame, lambda ps: [[1, 2] for _ in ps], _cfg())
    assert [s.loss_mask for s in samples] == [[1, 0, 0, 1], None]
    assert [s.action_tokens for s in samples] == [2, 1]
    gae = _advantages(frame, _cfg("gae"))["token_advantages"].to_list()      # stored what trains: 0 on o1
    assert len(gae[0]) == 4 and gae[0][1:3] == [0.0, 0.0] and gae[0][0] != 0.0 and gae[0][3] != 0.0


def test_sampled_tokens_leave_out_observations_and_the_copies_of_a_shared_first_answer():
    """Row 0 sampled a1 (3 tokens) and a2 (2) around a 4-token observation; row 1 shares row 0's a1
    (agent.branch: copied, not sampled) and sampled its own a2 (1); row 2 is single-turn (5 tokens).
    The entropy estimate takes the sampled tokens' log-probs alone; a wave written before `shared`
    existed (its turns without the field) counts every action token."""
    from ratchet.config import AgentConfig
    from ratchet.stages import sampled_tokens, wave_stats

    def turn(k, tokens, shared):
        return {"turn": k, "action": "a", "observation": None, "action_tokens": tokens, "observation_tokens": None,
                "metrics": None, "feedback": None, "passed": False, "reward": None, "env_error": False, "shared": shared}

    frame = _wave({"a": [0.0, 0.0], "b": [1.0]}).with_columns(
        pl.Series("completion_tokens", [9, 8, 5], dtype=pl.Int32),
        pl.Series("loss_mask", [[1] * 3 + [0] * 4 + [1] * 2, [1] * 3 + [0] * 4 + [1], None], dtype=pl.List(pl.Int8)),
        pl.Series("turns", [[turn(0, 3, False), turn(1, 2, False)], [turn(0, 3, True), turn(1, 1, False)], None],
                  dtype=trajectories_frame([]).schema["turns"]),
        pl.Series("behavior_logprobs", [[-1.0] * 3 + [0.0] * 4 + [-2.0] * 2, [-1.0] * 3 + [0.0] * 4 + [-4.0], [-0.5] * 5],
                  dtype=pl.List(pl.Float32)))
    assert sampled_tokens(frame) == 5 + 1 + 5
    cfg = NightlyConfig(rollout=RolloutConfig(group_size=2), agent=AgentConfig(turns=2))
    assert wave_stats(frame, cfg)["sampled_entropy"] == pytest.approx((3 + 4 + 4 + 2.5) / 11)
    turn_ = pl.element().struct
    before = frame.with_columns(pl.col("turns").list.eval(pl.struct(turn_.field("turn"), turn_.field("action_tokens"))))
    assert sampled_tokens(before) == 5 + 4 + 5


def test_grpo_advantages_by_hand_and_excluded_groups():
    frame = _advantages(_wave(WAVE), _cfg())
    adv = dict(zip(zip(frame["group_id"], frame["sample_idx"]), frame["advantage"]))
    # group a: mean 0.5, sample std sqrt(0.5) = 0.7071 -> (1 - 0.5) / 0.7071 = +0.7071
    assert math.isclose(adv[("a", 0)], 0.5 / math.sqrt(0.5), rel_tol=1e-5)
    assert math.isclose(adv[("a", 1)], -0.5 / math.sqrt(0.5), rel_tol=1e-5)
    assert adv[("b", 0)] is None and adv[("b", 1)] is None      # zero variance: dropped
    assert adv[("c", 0)] is None and adv[("c", 1)] is None      # an env_error row: the whole group out


def test_rloo_by_hand():
    frame = _advantages(_wave({"a": [1.0, 0.0]}), _cfg("rloo"))
    assert frame.sort("sample_idx")["advantage"].to_list() == [1.0, -1.0]   # r_i - mean of the others


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_gae_fills_token_advantages_not_the_scalar(estimator):
    frame = _advantages(_wave({"a": [1.0, 0.0]}), _cfg(estimator))
    if estimator == "gae":
        assert frame["advantage"].to_list() == [None, None]
        assert [len(t) for t in frame["token_advantages"].to_list()] == [1, 1]   # one per completion token
    else:
        assert frame["token_advantages"].to_list() == [None, None]


def test_a_wave_is_a_function_of_weights_seed_and_step():
    """What lets a resumed run redo a wave identically: no global RNG in the sampling."""
    import torch

    from envs.registry import get_family
    from ratchet.rollout.torch_engine import TorchEngine
    from ratchet.stages import rollout

    fam = get_family("python_functions")
    tasks = [fam.generate(fam.config(), 0, i, 1, "train") for i in range(8)]
    cfg = NightlyConfig(rollout=RolloutConfig(prompts_per_wave=4, group_size=2, max_new_tokens=8))
    engine = TorchEngine(tiny.model(), tiny.tokenizer())
    a = rollout(engine, tasks, "r", 3, 0, cfg)
    torch.manual_seed(12345)                     # whatever else happened in between
    b = rollout(engine, tasks, "r", 3, 0, cfg)
    c = rollout(engine, tasks, "r", 4, 0, cfg)
    assert a.equals(b) and not a["completion_ids"].equals(c["completion_ids"])


def test_two_sources_in_one_wave_keep_their_groups_apart():
    """tasks/rollout.py samples each source apart and concatenates: each numbers its prompts from 0,
    so groups named by that number merged two tasks into one group of 2 x group_size, and
    whole-group selection then trained on none of them."""
    from envs.registry import get_family
    from ratchet.rollout.torch_engine import TorchEngine
    from ratchet.stages import rollout

    sources = [[fam.generate(fam.config(), 0, i, 1, "train") for i in range(4)]
               for fam in (get_family("python_functions"), get_family("bugfix"))]
    cfg = NightlyConfig(rollout=RolloutConfig(prompts_per_wave=3, group_size=2, max_new_tokens=4))
    engine = TorchEngine(tiny.model(), tiny.tokenizer())
    frame = pl.concat([rollout(engine, tasks, "r", 0, 0, cfg) for tasks in sources])
    assert frame.group_by("group_id").agg(pl.col("task_id").n_unique())["task_id"].to_list() == [1] * 6
    frame = frame.with_columns(reward=pl.Series([float(i % 2) for i in range(frame.height)]))
    assert group_stats(frame, cfg) == {"groups": 6, "groups_env_error": 0, "groups_zero_variance": 0}
    assert len(train_samples(frame, lambda ps: [[1, 2] for _ in ps], cfg)) == frame.height == 12


def test_a_group_that_reaches_one_reward_at_different_turns_has_signal_under_per_turn_credit():
    """Both episodes of group a pass, one at turn 1 and one at turn 2: one final reward, but per-turn
    credit trains on it (its turn-1 answers differ). Counted by the final reward alone, the monitors
    and the gate called such groups "no learning signal": 67% of the 3-turn bench's groups against the
    53% the trainer drops (bench.multiturn, --repeat-reward 0 --seeds 0 1)."""
    from ratchet.config import AgentConfig, GateConfig
    from ratchet.data.gates import check_wave
    from ratchet.stages import learning_signal

    def turn(k, r):
        return {"turn": k, "action": f"a{k}", "observation": None, "action_tokens": 1, "observation_tokens": 0,
                "metrics": None, "feedback": None, "passed": r == 1.0, "reward": r, "env_error": False}

    episodes = {"a": [[1.0], [0.0, 1.0]], "b": [[0.0, 0.0], [0.0, 0.0]]}
    frame = _wave({g: [eps[0][-1], eps[1][-1]] for g, eps in episodes.items()}).with_columns(pl.Series(
        "turns", [[turn(k, r) for k, r in enumerate(ep)] for eps in episodes.values() for ep in eps],
        dtype=trajectories_frame([]).schema["turns"]))
    for credit, zero_variance in (("trajectory", 2), ("turn", 1)):
        cfg = NightlyConfig(rollout=RolloutConfig(group_size=2), agent=AgentConfig(turns=2, credit=credit))
        assert group_stats(frame, cfg)["groups_zero_variance"] == zero_variance
        report = check_wave(frame, GateConfig(max_zero_variance_frac=0.5), signal=learning_signal(frame, cfg))
        assert report.success == (zero_variance == 1), report.failures
    signal = learning_signal(frame, cfg).to_list()     # the advantages of each turn: + / - at turn 1, none at turn 2
    assert signal[0] == pytest.approx([2 ** -0.5, 0.0], rel=1e-4) and signal[1] == pytest.approx([-(2 ** -0.5), 0.0], rel=1e-4)
    assert signal[2:] == [[0.0, 0.0], [0.0, 0.0]]


def test_the_gate_bounds_widen_by_every_shaping_a_reward_can_take():
    """reward_range: the reward logic's bounds (timeout -0.5 by default), then a repeat's reward, the
    overlong penalty a long repeat pays too, and turn_penalty per extra turn."""
    from envs.spec import RewardLogic
    from ratchet.stages import reward_range

    logic = RewardLogic()
    assert reward_range(logic, NightlyConfig()) == (-0.5, 1.0)
    agent = {"turns": 3, "turn_penalty": 0.1, "repeat_reward": -1.0}
    assert reward_range(logic, NightlyConfig(agent=agent)) == pytest.approx((-1.2, 1.0))
    assert reward_range(logic, NightlyConfig(agent=agent, reward={"overlong_buffer": 8, "overlong_penalty": 0.5})) \
        == pytest.approx((-1.7, 1.0))                                    # -1.0 - 0.5 (a repeat at the cap) - 0.2
    assert reward_range(logic, NightlyConfig(reward={"overlong_buffer": 8})) == (-1.5, 1.0)   # a timeout at the cap
