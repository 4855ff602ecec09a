"""Health monitors (`ratchet.monitor`) on hand-built histories, on two recorded healthy runs, and
the wave figures they read (`ratchet.stages.wave_stats`, the trainer's metrics). The flow-level
test (a tiny nightly stopped before promotion) is tests/flows/test_health.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ratchet.config import MonitorConfig, NightlyConfig, RLConfig, RolloutConfig, TrainConfig
from ratchet.data.schemas import trajectories_frame
from ratchet.monitor import HealthCheckFailed, check_health, replay
from ratchet.stages import wave_stats

HEALTHY = json.loads((Path(__file__).parent / "fixtures" / "healthy_runs.json").read_text())
RUNS = [k for k in HEALTHY if not k.startswith("_")]

# Every monitor off but the one under test, so that each test sees only its own rule.
OFF = dict(reward_collapse_frac=None, entropy_floor=None, entropy_min_ratio=None, max_kl=None, max_approx_kl=None,
           length_drift_factor=None, max_env_error_rate=None, max_zero_variance_frac=None)


def only(**kw) -> MonitorConfig:
    return MonitorConfig(**{**OFF, **kw})


def waves(**series: list) -> list[dict]:
    """A history: wave i holds series[k][i] for each signal k (None: the wave lacks it)."""
    n = len(next(iter(series.values())))
    return [{"step": i, **{k: v[i] for k, v in series.items() if v[i] is not None}} for i in range(n)]


def messages(history: list[dict], cfg: MonitorConfig) -> list[str]:
    return [a.message() for a in check_health(history, cfg)]


# --- reward collapse ------------------------------------------------------------------------

def test_reward_collapse_trips_on_the_moving_mean_after_patience():
    cfg = only(reward_collapse_frac=0.5, reward_window=2, patience=2)
    h = waves(reward_mean=[0.4, 0.4, 0.4, 0.4, 0.1, 0.1, 0.1])
    # 2-wave means: -, .4, .4, .4, .25, .1, .1; running best .4 -> threshold .2: waves 5 and 6 breach
    assert check_health(h[:6], cfg) == []                      # wave 5 alone: patience 2 not reached
    [alarm] = check_health(h, cfg)
    assert (alarm.monitor, alarm.signal, alarm.wave, alarm.waves) == ("reward_collapse", "reward_mean", 6, (5, 6))
    assert alarm.values == pytest.approx((0.1, 0.1)) and alarm.threshold == pytest.approx(0.2)
    assert alarm.message() == ("reward collapse at wave 6: reward_mean 0.1 < 0.5 x its running best 0.4 = 0.2 "
                               "(2-wave means) for 2 waves in a row (waves 5-6: 0.1, 0.1)")


def test_reward_collapse_ignores_one_bad_wave_and_a_best_too_small_to_fall_from():
    cfg = only(reward_collapse_frac=0.5, reward_window=3, patience=1)
    assert replay(waves(reward_mean=[0.4, 0.4, 0.4, 0.0, 0.4, 0.4]), cfg) == []   # 3-wave mean .267 > .2
    assert replay(waves(reward_mean=[0.04, 0.04, 0.04, 0.0, 0.0, 0.0]), cfg) == []  # best .04 < reward_min_best
    assert messages(waves(reward_mean=[0.04, 0.04, 0.04, 0.0, 0.0, 0.0]), cfg.model_copy(update={"reward_min_best": 0.01}))
    assert replay(waves(reward_mean=[-0.5, -0.4, -0.5, -0.5, -0.5]), cfg) == []     # negative best: nothing to fall from


# --- entropy collapse -----------------------------------------------------------------------

def test_entropy_below_the_floor_trips():
    cfg = only(entropy_floor=0.02, patience=2)
    h = waves(sampled_entropy=[0.3, 0.3, 0.3, 0.01, 0.015])
    assert check_health(h[:4], cfg) == []
    assert messages(h, cfg) == ["entropy collapse at wave 4: sampled_entropy 0.015 < floor 0.02 "
                                "for 2 waves in a row (waves 3-4: 0.01, 0.015)"]


def test_entropy_falling_by_a_factor_of_its_baseline_trips():
    cfg = only(entropy_min_ratio=0.1, baseline_waves=2, patience=2)
    h = waves(sampled_entropy=[0.4, 0.2, 0.1, 0.025, 0.029])   # baseline .3 -> threshold .03
    [alarm] = check_health(h, cfg)
    assert alarm.threshold == pytest.approx(0.03) and alarm.waves == (3, 4)
    assert alarm.message().startswith("entropy collapse at wave 4: sampled_entropy 0.029 < 0.1 x baseline 0.3 = 0.03")
    assert check_health(waves(sampled_entropy=[0.4, 0.2, 0.1, 0.025, 0.031]), cfg) == []


def test_the_baseline_waves_themselves_are_not_judged_against_the_baseline():
    cfg = only(entropy_min_ratio=0.5, baseline_waves=3, patience=1)
    assert replay(waves(sampled_entropy=[1.0, 0.01, 0.01]), cfg) == []
    assert messages(waves(sampled_entropy=[1.0, 0.01, 0.01, 0.01]), cfg) == [
        "entropy collapse at wave 3: sampled_entropy 0.01 < 0.5 x baseline 0.34 = 0.17"]


# --- KL blow-up -----------------------------------------------------------------------------

def test_kl_blowup_on_approx_kl_and_on_the_reference_kl():
    cfg = only(max_approx_kl=0.1, max_kl=1.0, patience=2)
    assert messages(waves(approx_kl=[0.01, 0.2, 0.3]), cfg) == [
        "KL blow-up at wave 2: approx_kl 0.3 > ceiling 0.1 for 2 waves in a row (waves 1-2: 0.2, 0.3)"]
    assert messages(waves(approx_kl=[0.2, 0.01, 0.3]), cfg) == []              # not consecutive
    [alarm] = check_health(waves(kl=[0.5, 1.5, 2.5], approx_kl=[0.01, 0.01, 0.01]), cfg)
    assert (alarm.signal, alarm.values) == ("kl", (1.5, 2.5))


def test_a_wave_without_the_signal_does_not_breach_and_nan_always_does():
    cfg = only(max_approx_kl=0.1, patience=2)
    assert check_health(waves(approx_kl=[0.5, None, 0.5]), cfg) == []          # a wave that trained nothing
    assert messages(waves(approx_kl=[0.01, math.nan, math.inf]), cfg) == [
        "KL blow-up at wave 2: approx_kl inf is not finite for 2 waves in a row (waves 1-2: nan, inf)"]


# --- completion-length drift ----------------------------------------------------------------

def test_length_drift_up_and_down_from_the_baseline():
    cfg = only(length_drift_factor=2.0, baseline_waves=2, patience=2)
    assert messages(waves(completion_tokens_mean=[20, 20, 45, 50]), cfg) == [
        "completion-length drift at wave 3: completion_tokens_mean 50 > 2 x baseline 20 = 40 for 2 waves in a row "
        "(waves 2-3: 45, 50)"]
    assert messages(waves(completion_tokens_mean=[18, 22, 8, 9]), cfg) == [
        "completion-length drift at wave 3: completion_tokens_mean 9 < baseline 20 / 2 = 10 for 2 waves in a row (waves 2-3: 8, 9)"]
    assert check_health(waves(completion_tokens_mean=[20, 20, 39, 11]), cfg) == []


# --- env_error spike, zero-variance share ---------------------------------------------------

def test_env_error_spike_needs_patience_consecutive_waves():
    cfg = only(max_env_error_rate=0.02, patience=2)
    assert messages(waves(env_error_rate=[0.0, 0.03, 0.04]), cfg) == [
        "env_error spike at wave 2: env_error_rate 0.04 > ceiling 0.02 for 2 waves in a row (waves 1-2: 0.03, 0.04)"]
    assert check_health(waves(env_error_rate=[0.03, 0.0, 0.03]), cfg) == []
    assert check_health(waves(env_error_rate=[0.0, 0.02, 0.02]), cfg) == []    # at the ceiling is not above it


def test_zero_variance_share_above_its_ceiling_trips():
    cfg = only(max_zero_variance_frac=0.9, patience=3)
    assert check_health(waves(zero_variance_frac=[0.95, 0.95]), cfg) == []     # fewer waves than patience
    [alarm] = check_health(waves(zero_variance_frac=[0.95, 1.0, 0.92]), cfg)
    assert (alarm.monitor, alarm.wave, alarm.values, alarm.threshold) == ("zero_variance", 2, (0.95, 1.0, 0.92), 0.9)


# --- switches, several alarms, bad input ----------------------------------------------------

def test_a_monitor_can_be_turned_off_alone_or_all_at_once():
    h = waves(env_error_rate=[0.5, 0.5], zero_variance_frac=[1.0, 1.0])
    assert {a.monitor for a in check_health(h, MonitorConfig())} == {"env_error_spike", "zero_variance"}
    assert [a.monitor for a in check_health(h, MonitorConfig(max_zero_variance_frac=None))] == ["env_error_spike"]
    assert check_health(h, MonitorConfig(enabled=False)) == []


def test_the_error_names_every_tripped_monitor_and_the_alarm_is_plain_json():
    alarms = check_health(waves(env_error_rate=[0.5, 0.5], zero_variance_frac=[1.0, 1.0]), MonitorConfig())
    err = HealthCheckFailed(alarms)
    assert str(err) == ("env_error spike at wave 1: env_error_rate 0.5 > ceiling 0.02 for 2 waves in a row "
                        "(waves 0-1: 0.5, 0.5); zero-variance share at wave 1: zero_variance_frac 1 > ceiling 0.9 "
                        "for 2 waves in a row (waves 0-1: 1, 1)")
    d = json.loads(json.dumps(alarms[0].to_dict()))
    assert d == {"monitor": "env_error_spike", "signal": "env_error_rate", "wave": 1, "waves": [0, 1],
                 "values": [0.5, 0.5], "threshold": 0.02, "rule": "> ceiling 0.02", "message": alarms[0].message()}


def test_bad_histories_fail_with_one_clear_error():
    with pytest.raises(ValueError, match="waves out of order: step 1 after step 2"):
        check_health([{"step": 2}, {"step": 1}], MonitorConfig())
    with pytest.raises(ValueError, match="wave 1 has approx_kl='high'; expected a number"):
        check_health([{"step": 0}, {"step": 1, "approx_kl": "high"}], MonitorConfig())
    with pytest.raises(ValueError, match="less than or equal to 1"):
        MonitorConfig(max_zero_variance_frac=1.5)


# --- the defaults on real runs ----------------------------------------------------------------

@pytest.mark.parametrize("run", RUNS)
def test_the_defaults_do_not_trip_on_recorded_healthy_runs(run):
    history = HEALTHY[run]
    assert len(history) >= 70 and replay(history, NightlyConfig().monitor) == []


def test_the_defaults_catch_a_collapse_injected_into_a_healthy_run():
    """The 90-wave healthy run with its entropy cut to 5% from wave 60 on (what a policy that
    stopped exploring looks like) and, separately, its reward cut to 30% from wave 50 on."""
    run = HEALTHY[RUNS[0]]
    cold = [{**w, "sampled_entropy": w["sampled_entropy"] * (0.05 if w["step"] >= 60 else 1)} for w in run]
    first = replay(cold, MonitorConfig())[0]
    assert (first.monitor, first.wave, first.waves) == ("entropy_collapse", 61, (60, 61))
    assert "< floor 0.02" in first.message()       # 0.05 x ~0.14 = ~0.007 nats per token
    poor = [{**w, "reward_mean": w["reward_mean"] * (0.3 if w["step"] >= 50 else 1)} for w in run]
    first = replay(poor, MonitorConfig())[0]
    assert first.monitor == "reward_collapse" and 51 <= first.wave <= 53


# --- the figures the monitors read ----------------------------------------------------------

def _row(group: str, i: int, reward: float | None, passed: bool, tokens: int, logprobs: list[float] | None) -> dict:
    metrics = None if reward is None else {"test_pass_rate": 1.0 if passed else 0.5, "timed_out": False}
    return {"run_id": "r", "step": 0, "policy_version": 0, "task_id": f"t{group}", "family": "f", "difficulty": 1,
            "group_id": group, "sample_idx": i, "prompt": "p", "completion": "c", "prompt_tokens": 1,
            "completion_tokens": tokens, "completion_ids": [5] * tokens, "behavior_logprobs": logprobs,
            "metrics": metrics, "reward": reward, "env_error": reward is None}


def test_wave_stats_by_hand():
    frame = trajectories_frame([
        _row("a", 0, 1.0, True, 2, [-0.5, -1.5]), _row("a", 1, 0.0, False, 4, [-1.0, -1.0, -1.0, -1.0]),
        _row("b", 0, 0.5, False, 1, [-2.0]), _row("b", 1, 0.5, False, 1, [-2.0]),
        _row("c", 0, 1.0, True, 2, None), _row("c", 1, None, False, 2, None),           # c: an env_error row
    ])
    s = wave_stats(frame, NightlyConfig(rollout=RolloutConfig(group_size=2)))
    assert (s["groups"], s["groups_env_error"], s["groups_zero_variance"]) == (3, 1, 1)
    assert s["zero_variance_frac"] == 0.5                         # b of the whole groups a, b
    assert s["env_error_rate"] == pytest.approx(1 / 6)
    assert s["reward_mean"] == pytest.approx(3.0 / 5) and s["pass_rate"] == pytest.approx(2 / 5)
    assert s["reward_std"] == pytest.approx(math.sqrt(((0.4**2) * 2 + 0.6**2 + 0.1**2 * 2) / 4))   # sample std
    assert s["completion_tokens_mean"] == pytest.approx(12 / 6)
    assert s["sampled_entropy"] == pytest.approx(10.0 / 8)       # -mean over the 8 tokens with log-probs


def test_the_trainer_reports_kl_and_entropy_only_when_it_measures_them():
    from ratchet.train.torch_trainer import TorchTrainer
    from tests.train import tiny

    def metrics(rl: RLConfig) -> dict:
        t = TorchTrainer(tiny.model(), tiny.tokenizer().pad_token_id, TrainConfig(minibatch_prompts=2), rl)
        return t.train_wave(t.assign_advantages(tiny.wave(tiny.model(), seed=1, n_groups=2, group_size=2)))

    plain = metrics(RLConfig())
    assert "kl" not in plain and "entropy" not in plain and plain["approx_kl"] >= 0
    assert {"clip_frac", "grad_norm"} <= set(plain)
    measured = metrics(RLConfig(kl_coef=0.1, entropy_coef=0.01))
    assert measured["kl"] >= 0 and measured["entropy"] > 0
    assert "kl" not in metrics(RLConfig(kl_coef=0.1, kl_in_reward=True))      # the KL went into the reward
