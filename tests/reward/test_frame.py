"""score_frame on TRAJECTORY_SCHEMA frames, and reward noise: a sandbox that fails on purpose
yields env_error rows that are excluded (reward null), never scored 0."""

import pytest

import ratchet.verify.verifier as verify
from envs.spec import COMPLETION, CallTest, CheckCalls, EnvironmentConfig, OverwriteFile, RewardLogic, RewardRule, TaskSpec
from ratchet.config import RewardConfig
from ratchet.data.schemas import TRAJECTORY_SCHEMA, trajectories_frame
from ratchet.reward import score_frame
from ratchet.verify import verify_many
from ratchet.sandbox import RunResult

CFG = RewardConfig()
SPEC_EXAMPLE = RewardLogic(rules=(
    RewardRule(metric="test_pass_rate", weight=0.7, aggregation="max"),
    RewardRule(metric="execution_time_ms", weight=0.3, aggregation="min", threshold=5000),
))


def metrics(rate, ms=1000.0, **kw):
    return {"test_pass_rate": rate, "tests_passed": int(rate * 4), "tests_total": 4, "syntax_ok": True,
            "execution_time_ms": ms, "peak_memory_mb": 10.0, "timed_out": False, "format_ok": True,
            "output_bytes": 0, "security_flags": [], **kw}


def row(i, task_id="t1", family="fam_a", completion="def f(x): return x", m=None, env_error=False, kind=None):
    return {"run_id": "r", "step": 0, "policy_version": 0, "task_id": task_id, "family": family, "difficulty": 1,
            "group_id": f"{task_id}-g", "sample_idx": i, "prompt": "p", "completion": completion,
            "prompt_tokens": 1, "completion_tokens": 1, "completion_ids": [1], "metrics": m,
            "env_error": env_error, "env_error_kind": kind}


def test_score_frame_by_hand():
    frame = trajectories_frame([
        row(0, m=metrics(0.5)),                                          # 0.35 + 0.3 * 0.8 = 0.59
        row(1, m=metrics(1.0, ms=2500.0)),                               # 0.7 + 0.3 * 0.5 = 0.85
        row(2, task_id="t2", m=metrics(0.75)),                           # default logic: 0.75
        row(3, m=metrics(1.0, timed_out=True)),                          # timeout: -0.5
        row(4, m=None, env_error=True, kind="sandbox: worker died"),     # excluded: null
        row(5, m=None),                                                  # not verified: null
    ])
    out = score_frame(frame, {"t1": SPEC_EXAMPLE, "t2": RewardLogic()}, CFG)
    assert out.schema == TRAJECTORY_SCHEMA
    assert out["reward"].to_list() == pytest.approx([0.59, 0.85, 0.75, -0.5, None, None], nan_ok=False)
    assert out.drop("reward").equals(frame.drop("reward"))


def episode(i, answers, rates):
    """A multi-turn row: one answer per turn, each with its pass rate; the row is the last answer's."""
    turns = [{"turn": k, "action": a, "observation": None, "action_tokens": 1, "observation_tokens": 0,
              "metrics": metrics(r), "feedback": None, "passed": r == 1.0, "reward": None, "env_error": False}
             for k, (a, r) in enumerate(zip(answers, rates))]
    return {**row(i, completion=answers[-1], m=metrics(rates[-1])), "turns": turns}


def test_repeat_reward_replaces_the_partial_credit_of_a_repeated_failure():
    a, b = "    return x\n", "    return -x\n"
    frame = trajectories_frame([
        episode(0, [a, " return x  ", b], [0.5, 0.5, 1.0]),   # turn 2 repeats turn 1 (whitespace aside)
        episode(1, [a, b, a], [0.5, 0.25, 0.5]),              # turn 3 is turn 1 again, not the answer before it
        episode(2, [a, a + "\n"], [0.5, 0.5]),                 # ends on a repeat: the episode's reward is its
    ])
    logic = {"t1": RewardLogic()}                               # reward = test_pass_rate
    plain = score_frame(frame, logic, CFG)
    shaped = score_frame(frame, logic, CFG, turn_penalty=0.1, repeat_reward=-0.2)

    def turn_rewards(out):
        return [[t["reward"] for t in ts] for ts in out["turns"].to_list()]

    assert turn_rewards(plain) == [[0.5, 0.5, 1.0], [0.5, 0.25, 0.5], [0.5, 0.5]]
    assert turn_rewards(shaped) == [[0.5, -0.2, 1.0], [0.5, 0.25, 0.5], [0.5, -0.2]]
    assert plain["reward"].to_list() == [1.0, 0.5, 0.5]
    assert shaped["reward"].to_list() == pytest.approx([1.0 - 0.2, 0.5 - 0.2, -0.2 - 0.1])
    # a repeat of an answer that passed (episodes that go on after a pass) is not a spent turn
    again = trajectories_frame([episode(0, [a, a], [1.0, 1.0])])
    assert score_frame(again, logic, CFG, repeat_reward=0.0)["reward"].to_list() == [1.0]
    # an empty answer never scores above 0, a repeated one included (the wave gate checks it)
    empty = score_frame(trajectories_frame([episode(0, ["", " \n"], [0.0, 0.0])]), logic, CFG, repeat_reward=0.2)
    assert turn_rewards(empty) == [[0.0, 0.0]] and empty["reward"].to_list() == [0.0]


def test_overlong_penalty_takes_from_each_answer_by_its_own_length():
    logic = {"t1": RewardLogic()}                               # reward = test_pass_rate
    cfg = RewardConfig(overlong_buffer=12)                      # cap 48: the penalty runs from 36 to 48 tokens
    single = trajectories_frame([{**row(0, m=metrics(1.0)), "completion_tokens": 48},   # at the cap: all of it
                                 {**row(1, m=metrics(1.0)), "completion_tokens": 42},   # half way: half
                                 {**row(2, m=metrics(0.5)), "completion_tokens": 20},   # short: none
                                 {**row(3, m=None, env_error=True), "completion_tokens": 48}])  # excluded stays null
    assert score_frame(single, logic, cfg, cap=48)["reward"].to_list() == pytest.approx([0.0, 0.5, 0.5, None])
    assert score_frame(single, logic, CFG)["reward"].to_list() == [1.0, 1.0, 0.5, None]   # off: as before
    # an episode: each turn by its own answer's tokens, the episode by its last answer (not its whole row)
    ep = episode(0, ["    return x\n", "    return -x\n"], [0.5, 1.0])
    ep["turns"][0]["action_tokens"], ep["turns"][1]["action_tokens"], ep["completion_tokens"] = 48, 39, 48 + 30 + 39
    out = score_frame(trajectories_frame([ep]), logic, cfg, cap=48)
    assert [t["reward"] for t in out["turns"].to_list()[0]] == pytest.approx([0.5 - 1.0, 1.0 - 0.25])
    assert out["reward"].to_list() == pytest.approx([0.75])
    # a revision that repeats the failed answer before it gets repeat_reward, and still pays for its length
    rep = episode(0, ["    return x\n", "    return x \n"], [0.5, 0.5])
    rep["turns"][0]["action_tokens"], rep["turns"][1]["action_tokens"] = 20, 48
    out = score_frame(trajectories_frame([rep]), logic, cfg, repeat_reward=0.0, cap=48)
    assert [t["reward"] for t in out["turns"].to_list()[0]] == [0.5, -1.0] and out["reward"].to_list() == [-1.0]
    for cap in (None, 8):                                       # no cap, or one shorter than the buffer
        with pytest.raises(ValueError, match=f"overlong_buffer 12 needs the length cap.*cap={cap}"):
            score_frame(single, logic, cfg, cap=cap)


def test_score_frame_empty_completion_never_scores_above_zero():
    # metrics that would score 1.0 (e.g. the tests pass on the starting snapshot), but the completion is empty
    frame = trajectories_frame([row(0, completion="  \n", m=metrics(1.0)), row(1, completion="", m=metrics(1.0))])
    assert score_frame(frame, {"t1": SPEC_EXAMPLE}, CFG)["reward"].to_list() == [0.0, 0.0]


def test_score_frame_names_missing_and_invalid_logic():
    frame = trajectories_frame([row(0, m=metrics(1.0)), row(1, task_id="t9", m=metrics(1.0))])
    with pytest.raises(KeyError, match="t9"):
        score_frame(frame, {"t1": SPEC_EXAMPLE}, CFG)
    bad = RewardLogic(rules=(RewardRule(metric="speed", weight=1.0),))
    with pytest.raises(ValueError, match="task 't1'.*unknown metric 'speed'"):
        score_frame(frame, {"t1": bad, "t9": SPEC_EXAMPLE}, CFG)


# --- reward noise: the sandbox fails on purpose ---------------------------------------------------

def spec(task_id, family):
    return TaskSpec(task_id=task_id, family=family, prompt="# add one\ndef f(x):\n",
                    execution_steps=(OverwriteFile(path="/app/solution.py", content=COMPLETION), CheckCalls(entry_point="f")),
                    tests=(CallTest(args="[1]", expected="2"), CallTest(args="[5]", expected="6")),
                    reference_solution="def f(x):\n    return x + 1\n")


def wave(specs, completions, results):
    rows = []
    for i, (s, c, v) in enumerate(zip(specs, completions, results)):
        rows.append(row(i, task_id=s.task_id, family=s.family, completion=c, m=v.metrics or None,
                        env_error=v.env_error, kind=v.env_error_kind))
    return trajectories_frame(rows)


def test_broken_sandbox_rows_are_excluded_not_scored_zero(monkeypatch):
    """Family `broken` runs on a sandbox whose worker dies on every attempt; `ok` runs for real."""
    real_run_many = verify.run_many
    attempts = []

    def flaky_run_many(payloads, limits=None, concurrency=None):
        attempts.append(len(payloads))
        real = real_run_many(payloads, limits=limits, concurrency=concurrency)
        return [RunResult.infra("sandbox worker died") if "BROKEN" in p.code else r for p, r in zip(payloads, real)]

    monkeypatch.setattr(verify, "run_many", flaky_run_many)
    ok, broken = spec("ok1", "ok"), spec("broken1", "broken")
    good, bad = "def f(x):\n    return x + 1\n", "def f(x):\n    return x  # BROKEN\n"
    items = [(ok, good), (ok, "def f(x):\n    return 0\n"), (broken, bad), (broken, good + "# BROKEN\n")]
    results = verify_many(items, retries=2)
    assert attempts == [4, 2, 2]                          # the failing runs were retried twice, then given up
    assert [v.env_error for v in results] == [False, False, True, True]
    assert results[2].env_error_kind == "sandbox: sandbox worker died" and results[2].metrics == {}

    frame = score_frame(wave(*zip(*items), results), {"ok1": RewardLogic(), "broken1": RewardLogic()}, CFG)
    assert frame["reward"].to_list() == [1.0, 0.0, None, None]   # null, not 0: excluded from advantages


def test_infra_failure_that_recovers_on_retry_is_scored(monkeypatch):
    real_run_many, calls = verify.run_many, []

    def once_broken(payloads, limits=None, concurrency=None):
        calls.append(1)
        if len(calls) == 1:
            return [RunResult.infra("sandbox could not start") for _ in payloads]
        return real_run_many(payloads, limits=limits, concurrency=concurrency)

    monkeypatch.setattr(verify, "run_many", once_broken)
    [v] = verify_many([(spec("ok1", "ok"), "def f(x):\n    return x + 1\n")])
    assert not v.env_error and v.metrics["test_pass_rate"] == 1.0 and len(calls) == 2


def test_runtime_that_cannot_be_built_is_an_env_error():
    def resolver(env):
        raise RuntimeError("pip could not resolve numpy==99")

    s = spec("ok1", "ok").model_copy(update={"environment_config": EnvironmentConfig(dependencies=("numpy==99",))})
    [v] = verify_many([(s, "def f(x):\n    return x + 1\n")], runtime_python=resolver)
    assert v.env_error and v.env_error_kind == "runtime: RuntimeError: pip could not resolve numpy==99"
