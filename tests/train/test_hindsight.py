"""Hindsight (`agent.hindsight`): a revision that fixed its episode is also trained as a first answer
to the bare prompt, one more member of its task's group.

The hand-built group of `test_turn_credit`: one episode passes at turn 1, one fails turn 1 and is
fixed at turn 2, one fails both. Checked: which rows give a hindsight sample and what it holds
(`train_samples`), its behaviour log-probs and advantage (`assign_advantages`), that a group whose
every first answer failed gets a turn-1 signal only with it, that a training wave makes the fix more
likely as a first answer, what `with_advantages` stores, and the config's errors.

    pytest tests/train/test_hindsight.py -q
"""

from __future__ import annotations

import pytest
import torch

from ratchet.config import AgentConfig, NightlyConfig, RLConfig, RolloutConfig, TrainConfig
from ratchet.data.schemas import trajectories_frame
from ratchet.rl import compute_advantages
from ratchet.stages import as_first_answer, train_samples, with_advantages
from ratchet.trace import render_row
from ratchet.train.torch_trainer import TorchTrainer
from tests.train import tiny
from tests.train.test_turn_credit import A2, PROMPT, group, turns

CFG = NightlyConfig(rollout=RolloutConfig(group_size=3), agent=AgentConfig(turns=2, credit="turn", hindsight=True))


def frame_of(samples):
    """The trajectory rows of `group`'s episodes (one task, group "g")."""
    rows = []
    for i, (s, ts) in enumerate(zip(samples, (turns(True), turns(False, True), turns(False, False)))):
        rows.append({"run_id": "r", "step": 0, "policy_version": 0, "task_id": "t", "family": "f", "difficulty": 1,
                     "group_id": "g", "sample_idx": i, "prompt": "p", "completion": "c", "prompt_tokens": len(PROMPT),
                     "completion_tokens": len(s.completion_ids), "completion_ids": s.completion_ids,
                     "behavior_logprobs": s.behavior_logprobs, "loss_mask": s.loss_mask, "reward": s.reward,
                     "env_error": False,
                     "turns": [{"turn": k, "action": "a", "observation": None, "action_tokens": 3,
                                "observation_tokens": 2 if k < len(ts) - 1 else 0, "metrics": None, "feedback": None,
                                "passed": t["passed"], "reward": t["reward"], "env_error": False}
                               for k, t in enumerate(ts)]})
    return trajectories_frame(rows)


def samples_of(cfg=CFG):
    episodes = group(True)
    return train_samples(frame_of(episodes), lambda ps: [list(PROMPT) for _ in ps], cfg), episodes


def test_only_a_fix_gives_a_first_answer():
    samples, episodes = samples_of()
    assert len(samples) == 4
    fix = samples[3]
    eos = tiny.tokenizer().eos_token_id
    assert fix.hindsight and fix.group == "g" and fix.row == 1 and fix.loss_mask is None
    assert fix.prompt_ids == PROMPT and fix.completion_ids == A2 + [eos]          # the fix, after the bare prompt
    assert fix.reward == 1.0 and fix.turn_rewards == [1.0, 1.0]
    assert not any(s.hindsight for s in samples[:3])
    off = CFG.model_copy(update={"agent": AgentConfig(turns=2, credit="turn")})
    assert len(samples_of(off)[0]) == 3
    bad = episodes[1]
    with pytest.raises(ValueError, match=r"group 'g'.*not its last 4 action tokens"):
        as_first_answer(bad, [{"passed": False}, {"passed": True, "action_tokens": 4, "reward": 1.0}], 2)


def test_the_fix_is_scored_as_sampled_at_turn_one():
    """Its behaviour log-probs are the policy's own under the bare prompt; at turn 1 it is one more pass
    among (pass, fail, fail, fix): the same advantage as the episode that passed at turn 1."""
    samples, _ = samples_of()
    model = tiny.model()
    t = TorchTrainer(model, tiny.tokenizer().pad_token_id, TrainConfig(), CFG.rl)
    first, fixed, failed, fix = t.assign_advantages(samples)
    with torch.no_grad():
        ids = torch.tensor([fix.prompt_ids + fix.completion_ids])
        own = torch.log_softmax(model(ids).logits[0, len(PROMPT) - 1:-1].float(), -1)
        own = own.gather(1, torch.tensor(fix.completion_ids)[:, None])[:, 0]
    assert fix.behavior_logprobs == pytest.approx(own.tolist(), abs=1e-5)
    assert fix.behavior_logprobs != samples[3].behavior_logprobs                 # not the ones sampled after feedback
    assert fix.token_advantages == pytest.approx([first.token_advantages[0]] * 3, rel=1e-6)
    up, down = compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)[:2].tolist()
    assert first.token_advantages[0] == pytest.approx(up, rel=1e-5)
    assert fixed.token_advantages[0] == failed.token_advantages[0] == pytest.approx(down, rel=1e-5)
    stored = with_advantages(frame_of(group(True)), [first, fixed, failed, fix])
    assert stored["hindsight_advantage"].to_list() == [None, pytest.approx(up, rel=1e-5), None]
    assert stored["token_advantages"].to_list()[1] == fixed.token_advantages          # the episode's, kept
    shown = render_row(stored.row(1, named=True), trained=True)                  # `ratchet trace show`
    assert f"its fix as a first answer (hindsight): advantage {up:+.3f}" in shown


def test_a_group_whose_first_answers_all_failed_learns_turn_one_only_with_hindsight():
    """fail, fix | fail, fail: without hindsight turn 1 has no variance (advantage 0); with it, the
    two wrong first answers are pushed down and the fix, as a first answer, up."""
    episodes = group(True)[1:]
    frame = frame_of(group(True)).slice(1, 2)
    cfg = CFG.model_copy(update={"rollout": RolloutConfig(group_size=2)})
    t = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), cfg.rl)
    without = t.assign_advantages(episodes)
    assert [s.token_advantages[0] for s in without] == [0.0, 0.0]
    fixed, failed, fix = t.assign_advantages(train_samples(frame, lambda ps: [list(PROMPT) for _ in ps], cfg))
    assert fixed.token_advantages[0] < 0 and failed.token_advantages[0] < 0 < fix.token_advantages[0]


def test_a_training_wave_makes_the_fix_likelier_as_a_first_answer():
    """One wave from the same weights, with and without the hindsight sample: the fix's log-prob after
    the bare prompt rises with it by more than twice what the episodes alone give it (they share its EOS)."""
    samples, _ = samples_of()
    fix = samples[3].completion_ids
    gains = []
    for wave in (samples, samples[:3]):
        model = tiny.model()
        t = TorchTrainer(model, tiny.tokenizer().pad_token_id, TrainConfig(lr=1e-3), CFG.rl)

        def logp_of_fix() -> float:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([PROMPT + fix])).logits[0, len(PROMPT) - 1:-1].float(), -1)
                return float(logp.gather(1, torch.tensor(fix)[:, None]).sum())

        before = logp_of_fix()
        metrics = t.train_wave(t.assign_advantages(wave))
        gains.append(logp_of_fix() - before)
        assert (metrics["train_samples"], metrics["hindsight_samples"]) == (3, len(wave) - 3)   # episodes, fixes
    assert gains[0] > 2 * gains[1] > 0


def test_hindsight_needs_revisions_and_a_group():
    with pytest.raises(ValueError, match="agent.hindsight .* agent.turns 1 has no revisions"):
        NightlyConfig(agent=AgentConfig(turns=1, hindsight=True))
    with pytest.raises(ValueError, match="agent.hindsight .* rl.estimator 'gae' has no group"):
        NightlyConfig(agent=AgentConfig(turns=2, hindsight=True), rl=RLConfig(estimator="gae"))
    samples, _ = samples_of()
    t = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(), RLConfig(estimator="gae"))
    with pytest.raises(ValueError, match="hindsight samples join their task's group; gae has none"):
        t.assign_advantages([s for s in samples if s.hindsight] + samples[:3])
