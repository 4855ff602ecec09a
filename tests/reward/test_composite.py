"""Hand-computed rewards for every rule of ratchet.reward.composite (run: .venv/bin/pytest tests/reward -q)."""

import math

import pytest

from envs.spec import RewardLogic, RewardRule
from ratchet.config import RewardConfig
from ratchet.reward import RewardLogicError, reward_bounds, score, validate_logic
from ratchet.reward.composite import overlong_penalty
from ratchet.reward.metrics import metric_score

SPEC_EXAMPLE = RewardLogic(rules=(
    RewardRule(metric="test_pass_rate", weight=0.7, aggregation="max"),
    RewardRule(metric="execution_time_ms", weight=0.3, aggregation="min", threshold=5000),
))
CFG = RewardConfig()  # partial credit on, timeout -0.5, security penalty 0.0, format weight 0


def m(**kw):
    base = {"test_pass_rate": 1.0, "tests_passed": 4, "tests_total": 4, "syntax_ok": True, "execution_time_ms": 100.0,
            "peak_memory_mb": 20.0, "timed_out": False, "format_ok": True, "output_bytes": 10, "security_flags": []}
    return {**base, **kw}


def rule(metric, weight=1.0, aggregation="mean", threshold=None):
    return RewardRule(metric=metric, weight=weight, aggregation=aggregation, threshold=threshold)


def test_spec_example_by_hand():
    # 0.7 * 0.5 + 0.3 * clip(1 - 1000/5000) = 0.35 + 0.3 * 0.8 = 0.59
    assert score(m(test_pass_rate=0.5, execution_time_ms=1000.0), SPEC_EXAMPLE, CFG) == pytest.approx(0.59)
    # 0.7 * 0.75 + 0.3 * (1 - 4000/5000) = 0.525 + 0.06 = 0.585
    assert score(m(test_pass_rate=0.75, execution_time_ms=4000.0), SPEC_EXAMPLE, CFG) == pytest.approx(0.585)
    # slower than the threshold: efficiency clips to 0 -> 0.7 * 1.0
    assert score(m(test_pass_rate=1.0, execution_time_ms=9000.0), SPEC_EXAMPLE, CFG) == pytest.approx(0.7)


def test_aggregations_reduce_repeated_measurements():
    # runs: pass rates [0.25, 1.0, 0.5], times [3000, 1000, 2000]
    metrics = m(test_pass_rate=[0.25, 1.0, 0.5], execution_time_ms=[3000.0, 1000.0, 2000.0])
    # spec example: max pass = 1.0, min time = 1000 -> 0.7 + 0.3 * 0.8 = 0.94
    assert score(metrics, SPEC_EXAMPLE, CFG) == pytest.approx(0.94)
    assert metric_score(rule("test_pass_rate", aggregation="min"), metrics) == 0.25
    assert metric_score(rule("test_pass_rate", aggregation="mean"), metrics) == pytest.approx(0.5833333333)  # 1.75/3
    assert metric_score(rule("test_pass_rate", aggregation="last"), metrics) == 0.5
    # time, mean 2000 -> 1 - 2000/5000 = 0.6; max 3000 -> 0.4; last 2000 -> 0.6
    assert metric_score(rule("execution_time_ms", aggregation="mean", threshold=5000), metrics) == pytest.approx(0.6)
    assert metric_score(rule("execution_time_ms", aggregation="max", threshold=5000), metrics) == pytest.approx(0.4)
    # booleans: format_ok over turns [True, False, True, True], mean = 0.75, min = 0
    turns = m(format_ok=[True, False, True, True])
    assert metric_score(rule("format_ok", aggregation="mean"), turns) == 0.75
    assert metric_score(rule("format_ok", aggregation="min"), turns) == 0.0


def test_each_metric_kind_scores_by_hand():
    assert metric_score(rule("syntax_ok"), m(syntax_ok=False)) == 0.0
    assert metric_score(rule("format_ok"), m(format_ok=True)) == 1.0
    assert metric_score(rule("timed_out"), m(timed_out=True)) == 0.0
    assert metric_score(rule("timed_out"), m(timed_out=False)) == 1.0
    assert metric_score(rule("peak_memory_mb", threshold=80), m(peak_memory_mb=20.0)) == 0.75      # 1 - 20/80
    assert metric_score(rule("output_bytes", threshold=1000), m(output_bytes=250)) == 0.75         # 1 - 250/1000
    assert metric_score(rule("tests_passed", threshold=8), m(tests_passed=2)) == 0.25              # 2/8
    assert metric_score(rule("tests_passed", threshold=8), m(tests_passed=20)) == 1.0              # clipped
    assert metric_score(rule("security_flags"), m(security_flags=["network_attempt"])) == 0.0
    assert metric_score(rule("security_flags"), m(security_flags=[])) == 1.0
    # several runs of flags: [[], ["fork_limit"]] -> per run [1, 0]; mean 0.5
    assert metric_score(rule("security_flags"), m(security_flags=[[], ["fork_limit"]])) == 0.5
    assert metric_score(rule("test_pass_rate"), m(test_pass_rate=None)) == 0.0                     # unmeasured


def test_composite_is_weighted_mean():
    logic = RewardLogic(rules=(rule("test_pass_rate", 2.0), rule("format_ok", 1.0), rule("peak_memory_mb", 1.0, threshold=100)))
    # (2 * 0.5 + 1 * 1 + 1 * (1 - 60/100)) / 4 = (1 + 1 + 0.4) / 4 = 0.6
    assert score(m(test_pass_rate=0.5, peak_memory_mb=60.0), logic, CFG) == pytest.approx(0.6)


def test_partial_credit_off_is_all_or_nothing():
    strict = RewardConfig(partial_credit=False)
    # 0.75 of tests: completion 0 -> 0.7 * 0 + 0.3 * (1 - 1000/5000) = 0.24
    assert score(m(test_pass_rate=0.75, execution_time_ms=1000.0), SPEC_EXAMPLE, strict) == pytest.approx(0.24)
    # full pass: 0.7 * 1 + 0.24 = 0.94
    assert score(m(test_pass_rate=1.0, execution_time_ms=1000.0), SPEC_EXAMPLE, strict) == pytest.approx(0.94)
    assert score(m(test_pass_rate=0.75), RewardLogic(), strict) == 0.0
    assert score(m(test_pass_rate=0.75), RewardLogic(), CFG) == 0.75


def test_timeout_reward_replaces_the_composite():
    assert score(m(timed_out=True, test_pass_rate=0.5), SPEC_EXAMPLE, CFG) == -0.5
    assert score(m(timed_out=[False, True]), SPEC_EXAMPLE, RewardConfig(timeout_reward=-0.25)) == -0.25


def test_security_flag_zeroes_penalises_or_is_ignored():
    flagged = m(test_pass_rate=1.0, execution_time_ms=1000.0, security_flags=["network_attempt"])
    assert score(flagged, SPEC_EXAMPLE, CFG) == 0.0                                         # zeroes (default 0.0)
    assert score(flagged, SPEC_EXAMPLE, RewardConfig(security_penalty=-1.0)) == -1.0        # penalises
    assert score(flagged, SPEC_EXAMPLE, RewardConfig(security_penalty=None)) == pytest.approx(0.94)  # no effect
    # flagged and timed out: the lower of timeout_reward (-0.5) and the penalty (0.0)
    assert score({**flagged, "timed_out": True}, SPEC_EXAMPLE, CFG) == -0.5


def test_runtime_noise_flags_are_reported_not_penalised():
    # pytest itself spawns processes and writes caches outside the workdir: reported, reward unchanged
    noisy = m(test_pass_rate=1.0, execution_time_ms=1000.0, security_flags=["process_spawn", "write_refused"])
    assert score(noisy, SPEC_EXAMPLE, CFG) == pytest.approx(0.94)
    # an unregistered flag is penalised (safe default), like the registered misbehaviour
    assert score(m(security_flags=["process_spawn", "something_new"]), SPEC_EXAMPLE, CFG) == 0.0


def test_format_weight_mixes_format_compliance():
    cfg = RewardConfig(format_weight=0.2)
    # c = 0.59 (spec example); (1 - 0.2) * 0.59 + 0.2 * 1 = 0.472 + 0.2 = 0.672
    assert score(m(test_pass_rate=0.5, execution_time_ms=1000.0), SPEC_EXAMPLE, cfg) == pytest.approx(0.672)
    # badly formatted: 0.8 * 0.59 + 0 = 0.472
    assert score(m(test_pass_rate=0.5, execution_time_ms=1000.0, format_ok=False), SPEC_EXAMPLE, cfg) == pytest.approx(0.472)


def test_no_efficiency_or_security_credit_without_passing_a_test():
    # a do-nothing program is fast: 0.7 * 0 + 0.3 * 0.98 would be 0.294 > 0; gated to 0
    assert score(m(test_pass_rate=0.0, tests_passed=0, execution_time_ms=100.0), SPEC_EXAMPLE, CFG) == 0.0
    logic = RewardLogic(rules=(rule("security_flags"), rule("timed_out")))
    assert score(m(test_pass_rate=0.0), logic, CFG) == 0.0
    # one of four passed: (0.7 * 0.25 + 0.3 * 0.98) = 0.175 + 0.294 = 0.469
    assert score(m(test_pass_rate=0.25, execution_time_ms=100.0), SPEC_EXAMPLE, CFG) == pytest.approx(0.469)


def test_env_error_metrics_score_none():
    assert score(None, SPEC_EXAMPLE, CFG) is None


@pytest.mark.parametrize("cfg, bounds", [
    (RewardConfig(), (-0.5, 1.0)),
    (RewardConfig(security_penalty=-2.0), (-2.0, 1.0)),
    (RewardConfig(security_penalty=None, timeout_reward=0.0), (0.0, 1.0)),
    (RewardConfig(timeout_reward=1.5), (0.0, 1.5)),
    (RewardConfig(overlong_buffer=12, overlong_penalty=0.5), (-1.0, 1.0)),   # a timeout at the cap: -0.5 - 0.5
    (RewardConfig(overlong_buffer=0, overlong_penalty=0.5), (-0.5, 1.0)),    # off: no penalty
])
def test_reward_bounds(cfg, bounds):
    assert reward_bounds(SPEC_EXAMPLE, cfg) == bounds


def test_scores_stay_within_bounds():
    lo, hi = reward_bounds(SPEC_EXAMPLE, CFG)
    cases = [m(), m(test_pass_rate=0.0), m(timed_out=True), m(security_flags=["x"]), m(execution_time_ms=1e9),
             m(test_pass_rate=[0.0, 1.0], execution_time_ms=[0.0, 1.0]), {}]
    for metrics in cases:
        r = score(metrics, SPEC_EXAMPLE, CFG)
        assert lo <= r <= hi and math.isfinite(r)


@pytest.mark.parametrize("bad, named", [
    (rule("tests_pased"), "tests_pased"),
    (rule("tests_total"), "tests_total"),
    (rule("execution_time_ms"), "needs a threshold"),
    (rule("test_pass_rate", threshold=3.0), "takes no threshold"),
])
def test_unknown_or_misused_metric_is_a_clear_error(bad, named):
    logic = RewardLogic(rules=(rule("test_pass_rate"), bad))
    with pytest.raises(RewardLogicError, match=named) as e:
        validate_logic(logic)
    assert "reward_logic.rules.1." in str(e.value)
    with pytest.raises(RewardLogicError):
        score(m(), logic, CFG)


def test_unknown_aggregation_is_a_clear_error():
    # pydantic rejects it at construction; a logic built without validation is caught by the registry
    bad = RewardRule.model_construct(metric="test_pass_rate", weight=1.0, aggregation="median", threshold=None)
    with pytest.raises(RewardLogicError, match="unknown aggregation 'median'"):
        validate_logic(RewardLogic.model_construct(type="composite", rules=(bad,)))
    with pytest.raises(ValueError):
        RewardRule(metric="test_pass_rate", weight=1.0, aggregation="median")


@pytest.mark.parametrize("tokens, penalty", [(1, 0.0), (36, 0.0), (37, 1 / 12), (42, 0.5), (48, 1.0), (60, 1.0)])
def test_overlong_penalty_rises_linearly_through_the_buffer_to_the_cap(tokens, penalty):
    cfg = RewardConfig(overlong_buffer=12)
    assert overlong_penalty(tokens, 48, cfg) == pytest.approx(penalty)
    assert overlong_penalty(tokens, 48, RewardConfig(overlong_buffer=12, overlong_penalty=0.3)) == pytest.approx(0.3 * penalty)
    assert overlong_penalty(tokens, 48, RewardConfig()) == 0.0          # the default: off
