"""Per-turn credit (`agent.credit` "turn"): each answer of an episode is credited with the group-relative
value of the state it left, not with the episode's final reward; a revision is compared with the other
revisions of its task at the same turn.

A hand-built group of three episodes of one task: one passes at turn 1, one fails turn 1 and is fixed
at turn 2, one fails both. With the trajectory's reward every token of the fixed episode, its wrong
first answer included, is pushed up; with per-turn credit the wrong first answer is pushed down (it
did worse than the turn-1 pass) and the fix up. Checked on the advantages, on the gradient the loss
sends to the logits (both layouts), and end to end from a scored frame through `train_samples`.

    pytest tests/train/test_turn_credit.py -q
"""

from __future__ import annotations

import polars as pl
import pytest
import torch

from ratchet.config import AgentConfig, NightlyConfig, RLConfig, RolloutConfig, TrainConfig
from ratchet.data.schemas import trajectories_frame
from ratchet.reward.frame import turn_states
from ratchet.rl import answer_count, compute_advantages, spread_over_turns, turn_advantages
from ratchet.stages import train_samples, with_advantages
from ratchet.train.batching import TrainSample
from ratchet.train.torch_trainer import TorchTrainer
from tests.train import tiny
from tests.train.test_loss_mask import Capture, logit_grads

PROMPT = [10, 11, 12, 13]
A1, O1, A2 = [20, 21], [23, 24], [25, 26]


def turns(*passed: bool) -> list[dict]:
    return [{"reward": float(p), "passed": p} for p in passed]


def group(per_turn: bool) -> list[TrainSample]:
    """pass at turn 1 | fail, observation, fix | fail, observation, fail (rewards 1, 1, 0)."""
    eos = tiny.tokenizer().eos_token_id
    two = A1 + [eos] + O1 + A2 + [eos]
    mask = [1] * 3 + [0] * 2 + [1] * 3
    episodes = [(A1 + [eos], None, turns(True)), (two, mask, turns(False, True)), (two[:-1] + [27], mask, turns(False, False))]
    out = []
    for ids, m, ts in episodes:
        out.append(TrainSample(PROMPT, ids, [0.0] * len(ids), None, "g", reward=ts[-1]["reward"], loss_mask=m,
                               turn_rewards=turn_states(ts, 2) if per_turn else None))
    with torch.no_grad():   # behaviour log-probs: the policy's own, so the first pass is on-policy
        policy = tiny.model()
        for s in out:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logp = torch.log_softmax(policy(ids).logits[0, len(PROMPT) - 1:-1].float(), -1)
            s.behavior_logprobs = logp.gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0].tolist()
    return out


def test_turn_states_carry_the_last_state_and_the_penalty():
    assert turn_states(turns(True), 3) == [1.0, 1.0, 1.0]
    assert turn_states(turns(False, True), 3, turn_penalty=0.1) == pytest.approx([0.0, 0.9, 0.9])
    assert turn_states(turns(False, False, False), 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="1..2 turns, got 3"):
        turn_states(turns(False, False, True), 2)
    with pytest.raises(ValueError, match="every turn needs its reward"):
        turn_states([{"reward": None}], 2)


def test_turn_advantages_by_hand():
    """Turn 1: GRPO over the whole group; turn k: over the episodes that answered turn k (the revisions),
    not against the ones that passed earlier; a lone revision gets 0."""
    states = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    answers = torch.tensor([1, 2, 3, 3])
    adv = turn_advantages("grpo", states, 4, answers)
    torch.testing.assert_close(adv[:, 0], compute_advantages("grpo", states[:, 0], 4))   # turn 1: single-turn GRPO
    # turn 2, among the three revisions (states 1, 0, 0): mean 1/3, std sqrt(1/3)
    torch.testing.assert_close(adv[1:, 1], torch.tensor([2 / 3, -1 / 3, -1 / 3]) / (1 / 3) ** 0.5, rtol=1e-4, atol=1e-4)
    # turn 3, between the two third answers (1, 0): +-1/sqrt(2); with the whole group it would be pushed down
    torch.testing.assert_close(adv[2:, 2], torch.tensor([1.0, -1.0]) * 2 ** -0.5, rtol=1e-4, atol=1e-4)
    assert adv[0, 1:].tolist() == [0.0, 0.0] and adv[1, 2] == 0.0          # past an episode's last answer
    lone = turn_advantages("grpo", states[:2], 2, answers[:2])
    assert lone[1, 1] == 0.0                                                # one revision: nothing to compare with
    with pytest.raises(ValueError, match="2-D"):
        turn_advantages("grpo", states[:, 0], 4, answers)
    with pytest.raises(ValueError, match="answers must be"):
        turn_advantages("grpo", states, 4, answers[:2])


def test_with_branches_a_second_answer_is_judged_against_the_revisions_of_its_own_first_answer():
    """branch 2: rows (0, 1) share a near miss, rows (2, 3) a hopeless answer, rows (4, 5) a pass. Per
    task, the near miss's repeat (0.75) would beat the other answer's rewrite (0.5) and be pushed up; per
    tuple it is pushed down against the fix (1.0) of the same answer. Turn 3 stays per task."""
    states = torch.tensor([[0.75, 0.75, 0.75], [0.75, 1.0, 1.0], [0.0, 0.5, 0.5], [0.0, 0.25, 1.0],
                           [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    answers = torch.tensor([3, 2, 3, 3, 1, 1])
    per_task = turn_advantages("grpo", states, 6, answers)
    assert per_task[0, 1] > 0                                          # the repeat, against the other answer's revisions
    tuples = turn_advantages("grpo", states, 6, answers, branch=2)
    torch.testing.assert_close(tuples[:4, 1], torch.tensor([-1.0, 1.0, 1.0, -1.0]) * 2 ** -0.5)
    torch.testing.assert_close(tuples[:, 0], per_task[:, 0])                # turn 1: the group, as without branches
    torch.testing.assert_close(tuples[:, 2], per_task[:, 2])                # turn 3: the task's third answers
    assert tuples[4:, 1:].abs().sum() == 0
    with pytest.raises(ValueError, match=r"group_size \(6\) must be a multiple of branch \(4\)"):
        turn_advantages("grpo", states, 6, answers, branch=4)


def test_the_trainer_finds_a_groups_tuples_by_row_whatever_order_the_samples_come_in():
    """branch 2, rows 0-3: revisions scoring (0.5, 0) of one first answer, (1, 0.75) of another; the
    samples handed over as rows 0, 2, 1, 3 still pair by row: each revision +-1/sqrt(2) against its own
    tuple's other (paired as they came, row 0 would be pushed down against row 2, row 3 up)."""
    eos = tiny.tokenizer().eos_token_id
    ids, mask = A1 + [eos] + O1 + A2 + [eos], [1] * 3 + [0] * 2 + [1] * 3
    states = [[0.0, 0.5], [0.0, 0.0], [0.0, 1.0], [0.0, 0.75]]
    samples = [TrainSample(PROMPT, ids, [-1.0] * len(ids), None, "g", reward=st[-1], row=r, loss_mask=mask,
                           turn_rewards=st, branch=2) for r, st in enumerate(states)]
    t = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), RLConfig())
    got = {s.row: s.token_advantages[5] for s in t.assign_advantages([samples[i] for i in (0, 2, 1, 3)])}
    assert [got[r] for r in range(4)] == pytest.approx([2 ** -0.5, -(2 ** -0.5), 2 ** -0.5, -(2 ** -0.5)], rel=1e-5)
    samples[0].branch = 1
    with pytest.raises(ValueError, match=r"one agent.branch, got \[1, 2\]"):
        t.assign_advantages(samples)


def test_branch_needs_turns_and_a_group_of_whole_tuples():
    NightlyConfig(rollout=RolloutConfig(group_size=8), agent=AgentConfig(turns=3, branch=2))
    for agent, group_size in ((AgentConfig(turns=1, branch=2), 8), (AgentConfig(turns=3, branch=3), 8)):
        with pytest.raises(ValueError, match=r"agent.branch \d: .* needs agent.turns of 2 or more .* multiple of it"):
            NightlyConfig(rollout=RolloutConfig(group_size=group_size), agent=agent)


def test_answer_count_counts_the_runs_of_the_loss_mask():
    assert answer_count(torch.tensor([1, 1, 0, 0, 1, 0, 1])) == 3
    assert answer_count(torch.ones(4)) == 1


def test_spread_over_turns_puts_each_turns_advantage_on_its_answer():
    got = spread_over_turns(torch.tensor([0.5, -2.0]), torch.tensor([1, 1, 0, 0, 1]))
    assert got.tolist() == [0.5, 0.5, 0.0, 0.0, -2.0]
    with pytest.raises(ValueError, match="2 answers but there are advantages for 1 turns"):
        spread_over_turns(torch.tensor([0.5]), torch.tensor([1, 0, 1]))


def test_the_fixed_episodes_wrong_first_answer_is_pushed_down_only_with_turn_credit():
    eos = tiny.tokenizer().eos_token_id
    for shared in (True, False):
        signs = {}
        for per_turn in (False, True):
            samples = group(per_turn)
            t = Capture(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(updates_per_batch=1), RLConfig())
            t.share_prompts = shared
            t.train_wave(t.assign_advantages(samples))
            fixed = samples[1]
            g = logit_grads(t)[tuple(fixed.completion_ids)]                    # [c, V]
            chosen = g.gather(1, torch.tensor(fixed.completion_ids)[:, None])[:, 0]
            # d loss / d chosen logit: < 0 pushes the token up, > 0 down; observation tokens: exactly 0
            signs[per_turn] = [1 if x > 0 else -1 if x < 0 else 0 for x in chosen.tolist()]
        assert signs[False] == [-1, -1, -1, 0, 0, -1, -1, -1]                 # trajectory: all of it up
        assert signs[True] == [1, 1, 1, 0, 0, -1, -1, -1]                     # turn: a1 down, the fix up
        assert fixed.completion_ids[2] == eos


def test_the_trainer_judges_a_revision_among_the_revisions():
    """pass | fail, fix | fail, fail: the two second answers are compared with each other (+-1/sqrt(2)),
    not with the whole group (where the fix would get +0.577 and the failure -1.155)."""
    t = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), RLConfig())
    _, fixed, failed = t.assign_advantages(group(True))
    assert fixed.token_advantages[5:] == pytest.approx([2 ** -0.5] * 3, rel=1e-5)
    assert failed.token_advantages[5:] == pytest.approx([-(2 ** -0.5)] * 3, rel=1e-5)
    for estimator, fix in (("dr_grpo", 0.5), ("rloo", 1.0)):
        t = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), RLConfig(estimator=estimator))
        _, fixed, failed = t.assign_advantages(group(True))
        assert (fixed.token_advantages[5], failed.token_advantages[5]) == pytest.approx((fix, -fix), rel=1e-5)


def test_a_group_with_equal_final_rewards_still_trains_on_its_first_turn():
    """Both episodes pass in the end, one only after a revision: the trajectory's rewards are equal (the
    group is dropped as zero-variance); per turn, turn 1 differs, so the group trains."""
    t = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), RLConfig())
    both_pass = group(True)[:2]
    assert t.assign_advantages(group(False)[:2]) == []
    first, fixed = t.assign_advantages(both_pass)
    assert first.advantage is None and first.token_advantages == pytest.approx([2 ** -0.5] * 3, rel=1e-5)
    assert fixed.token_advantages == pytest.approx([-(2 ** -0.5)] * 3 + [0.0] * 5, rel=1e-5)   # turn 2: no variance, 0


def test_turn_credit_needs_every_samples_turn_rewards_and_a_group_estimator():
    mixed = group(True)
    mixed[0].turn_rewards = None
    t = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), RLConfig())
    with pytest.raises(ValueError, match="per-turn credit"):
        t.assign_advantages(mixed)
    with pytest.raises(ValueError, match=r"does not combine with rl.estimator 'gae' or rl.kl_in_reward"):
        NightlyConfig(agent=AgentConfig(turns=2, credit="turn"), rl=RLConfig(estimator="gae", kl_in_reward=True))
    with pytest.raises(ValueError, match=r"per-task group estimator.*rl.estimator 'reinforce_pp'"):
        NightlyConfig(agent=AgentConfig(turns=2, credit="turn"), rl=RLConfig(estimator="reinforce_pp"))


def test_from_a_scored_frame_to_stored_token_advantages():
    """`train_samples` gives each episode its states after every turn (agent.credit turn only); what
    the trainer assigns is what `with_advantages` stores."""
    rows = []
    for i, ts in enumerate([turns(True), turns(False, True)]):
        n = 3 if len(ts) == 1 else 8
        rows.append({"run_id": "r", "step": 0, "policy_version": 0, "task_id": "t", "family": "f", "difficulty": 1,
                     "group_id": "a", "sample_idx": i, "prompt": "p", "completion": "c", "prompt_tokens": 1,
                     "completion_tokens": n, "completion_ids": list(range(20, 20 + n)), "behavior_logprobs": [-1.0] * n,
                     "loss_mask": None if n == 3 else [1, 1, 1, 0, 0, 1, 1, 1], "reward": 1.0, "env_error": False,
                     "turns": [{"turn": k, "action": "a", "observation": None, "action_tokens": 3,
                                "observation_tokens": 0, "metrics": None, "feedback": None, "passed": t["passed"],
                                "reward": t["reward"], "env_error": False} for k, t in enumerate(ts)]})
    frame = trajectories_frame(rows)
    cfg = NightlyConfig(rollout=RolloutConfig(group_size=2), agent=AgentConfig(turns=2, credit="turn"))
    samples = train_samples(frame, lambda ps: [[1, 2] for _ in ps], cfg)
    assert [s.turn_rewards for s in samples] == [[1.0, 1.0], [0.0, 1.0]]
    assert all(s.turn_rewards is None for s in train_samples(frame, lambda ps: [[1, 2] for _ in ps],
                                                               cfg.model_copy(update={"agent": AgentConfig(turns=2)})))
    trainer = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), cfg.rl)
    stored = with_advantages(frame, trainer.assign_advantages(samples))
    assert stored["advantage"].to_list() == [None, None]
    assert stored["token_advantages"].to_list()[1][3:5] == [0.0, 0.0]
    assert stored["token_advantages"].to_list()[1][0] < 0 < stored["token_advantages"].to_list()[0][0]
    merged = frame.with_columns(pl.Series("loss_mask", [None, [1] * 8], dtype=pl.List(pl.Int8)))   # no observation
    with pytest.raises(ValueError, match=r"wave row 1 \(group 'a'\): 2 turn\(s\) but its loss_mask holds 1 run\(s\) "
                                         r".*an observation of no tokens"):
        train_samples(merged, lambda ps: [[1, 2] for _ in ps], cfg)
    for mask, error in (([1, 0, 1, 0, 1, 0, 1, 1], r"holds 4 run\(s\) of action tokens, so per-turn credit cannot tell "
                                                   r"its answers apart$"),
                        (None, r"2 turn\(s\) but no loss_mask"), ([2] * 8, r"values \[2\] \(only 0 and 1")):
        bad = frame.with_columns(pl.Series("loss_mask", [None, mask], dtype=pl.List(pl.Int8)))
        with pytest.raises(ValueError, match=error):
            train_samples(bad, lambda ps: [[1, 2] for _ in ps], cfg)


def test_a_group_whose_turn_states_differ_only_where_nothing_is_compared_teaches_nothing():
    """Per-turn credit compares first answers within the group and a revision with the other revisions
    at its turn (within its tuple at turn 2 with agent.branch). Group "tuples" (branch 2): every first
    answer fails alike, and the two revisions of each first answer score alike (1, 1 and 0.5, 0.5), so
    every advantage is 0 although the turn states differ; group "lone" (branch 1): one episode ended
    on the context after turn 1, the other revised alone. The trainer drops both, as it drops a group of
    equal rewards (kept, their answers would count in the loss's denominator), and the wave's figures
    and gate count them as groups without a learning signal; group "fixed" trains."""
    from ratchet.config import GateConfig
    from ratchet.data.gates import check_wave
    from ratchet.stages import group_stats, learning_signal

    def row(group: str, i: int, rewards: list[float]) -> dict:
        n = 4 * len(rewards) - 1   # answers of 3 tokens, observations of 1
        mask = ([1, 1, 1, 0] * len(rewards))[:n]
        return {"run_id": "r", "step": 0, "policy_version": 0, "task_id": f"t{group}", "family": "f", "difficulty": 1,
                "group_id": group, "sample_idx": i, "prompt": "p", "completion": "c", "prompt_tokens": 1,
                "completion_tokens": n, "completion_ids": list(range(20, 20 + n)), "behavior_logprobs": [-1.0] * n,
                "loss_mask": mask, "reward": rewards[-1], "env_error": False,
                "turns": [{"turn": k, "action": f"a{i}{k}", "observation": None, "action_tokens": 3,
                           "observation_tokens": 1, "metrics": None, "feedback": None, "passed": r == 1.0,
                           "reward": r, "env_error": False} for k, r in enumerate(rewards)]}

    waves = {2: {"tuples": [[0.0, 1.0], [0.0, 1.0], [0.0, 0.5], [0.0, 0.5]],
                 "fixed": [[0.0, 1.0], [0.0, 0.0], [1.0], [1.0]]},
             1: {"lone": [[0.0], [0.0, 1.0]], "fixed": [[0.0, 1.0], [0.0, 0.0]]}}
    for branch, groups in waves.items():
        size = 4 if branch == 2 else 2
        frame = trajectories_frame([row(g, i, rs) for g, eps in groups.items() for i, rs in enumerate(eps)])
        cfg = NightlyConfig(rollout=RolloutConfig(group_size=size),
                            agent=AgentConfig(turns=2, credit="turn", branch=branch))
        samples = train_samples(frame, lambda ps: [[1, 2] for _ in ps], cfg)
        assert {s.group for s in samples if s.turn_rewards != samples[0].turn_rewards}   # the states differ
        trainer = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), cfg.rl)
        assert {s.group for s in trainer.assign_advantages(samples)} == {"fixed"}
        kept = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(),
                            cfg.rl.model_copy(update={"drop_zero_variance": False})).assign_advantages(samples)
        assert {s.group for s in kept} == set(groups)
        assert all(a == 0.0 for s in kept if s.group != "fixed" for a in s.token_advantages)
        assert group_stats(frame, cfg)["groups_zero_variance"] == 1
        signal = learning_signal(frame, cfg)
        report = check_wave(frame, GateConfig(max_zero_variance_frac=0.4), signal=signal)
        assert [f.check for f in report.failures] == ["zero_variance_groups"]
