"""Traces you can replay: the verifier's feedback, a real scored wave shown readably, its rewards
replayed through the real sandbox, and drift (a changed hidden test, a tampered snapshot) caught.

    .venv/bin/python -m pytest tests/test_trace.py -q

The wave is built as a nightly run builds it, without a model: real python_functions tasks
(envs production), completions written here (the reference, a wrong answer that prints, one
that raises, an empty one), scored by the real score_wave task (`.fn()`: sandbox, rewards,
scoring record), advantages from ratchet.rl.
"""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch
from typer.testing import CliRunner

from envs.episode import feedback_text
from envs.production import produce
from envs.snapshot import save_production
from envs.spec import NEVER_RAN, CallTest
from ratchet.cli import app
from ratchet.config import EnvsConfig, GateConfig, NightlyConfig, RolloutConfig, StoreConfig, VerifyConfig
from ratchet.data.gates import check_wave
from ratchet.data.schemas import TRAJECTORY_SCHEMA
from ratchet.rl.advantages import rloo
from ratchet.rollout.engine import Rollout
from ratchet.rollout.wave import wave_frame
from ratchet.store import open_store
from ratchet.trace import TraceError, load_wave, render, render_replay, replay
from ratchet.verify import verify_many

RUN, STEP, GROUP = "trace-run", 2, 4
WRONG = "    print('thinking about', repr(s))\n    return None\n"
RAISES = "    raise ValueError('no idea')\n"


@pytest.fixture(scope="module")
def production():
    return produce("python_functions", EnvsConfig(n_train=8, n_heldout=2))


def make_wave(store_uri: str, production, **cfg) -> tuple[NightlyConfig, list]:
    """Wave STEP of run RUN in the store at `store_uri`: two tasks x GROUP samples (two sampled tokens
    each), scored by the score_wave task, with trained.parquet (RLOO advantages) beside it; `cfg`:
    NightlyConfig fields over the test's. Returns the config and the tasks."""
    from tasks.score import score_wave

    cfg = NightlyConfig(**{"store": StoreConfig(uri=store_uri), "rollout": RolloutConfig(prompts_per_wave=2, group_size=GROUP),
                           "verify": VerifyConfig(timeout_s=60, feedback_bytes=1024), **cfg})   # no timeouts on a busy machine
    store = open_store(store_uri)
    train = save_production(store, production)["train"]
    a, b = production.train[:2]
    texts = [a.reference_solution, WRONG, "", a.reference_solution, b.reference_solution, RAISES, WRONG, RAISES]
    rollouts = [Rollout(i // GROUP, [1, 2, 3], [4, 5], [-0.5, -0.25], t, True) for i, t in enumerate(texts)]
    wave = store.write_table(f"runs/{RUN}/waves/{STEP:06d}/trajectories.parquet",
                             wave_frame(RUN, STEP, 7, [a, b], rollouts, GROUP))
    scored_ref, _ = score_wave.fn(wave, [train], cfg)
    scored = store.read_table(scored_ref)
    adv = rloo(torch.tensor(scored["reward"].to_list()), GROUP)
    store.write_table(scored_ref.sibling("trained.parquet"), scored.with_columns(
        pl.Series("advantage", adv.tolist(), dtype=pl.Float64)))
    return cfg, [a, b]


@pytest.fixture(scope="module")
def wave(tmp_path_factory, production):
    store_uri = str(tmp_path_factory.mktemp("store"))
    cfg, tasks = make_wave(store_uri, production)
    return open_store(store_uri), cfg, tasks


# --- the verifier's feedback ---------------------------------------------------------------

def test_feedback_of_pytest_script_and_call_tasks():
    from tests.verify.test_verifier import HALF, PYTEST, SCRIPT
    from tests.data.waves import spec

    calls = spec(1, tests=(CallTest(args="[1]", expected="2"), CallTest(args="[2]", expected="3"),
                           CallTest(args="[0]", expected="1")))
    noisy = "def f1(x):\n    print('x' * 500)\n    return 1 // x + 1\n"
    long = spec(1, tests=(CallTest(args=f"[{list(range(200))}]", expected=str(list(range(100)))),))
    pyt, script, call, short, empty, unloaded = verify_many(
        [(PYTEST, HALF), (SCRIPT, HALF), (calls, noisy), (calls, "def f1(x):\n    return x + 1\n"), (calls, ""),
         (long, "def f1(x):\n    return x\n\nraise RuntimeError('at import')\n")],
        VerifyConfig(timeout_s=60).sandbox_limits(), feedback_bytes=64)      # generous: pytest on a busy machine
    fb = pyt.feedback                               # pytest: the FAILED line with its assertion
    assert fb["exit_code"] == 1 and not fb["timed_out"] and fb["killed_by"] is None, fb
    assert fb["failed_tests"] == [{"name": "tests/test_a.py::test_two", "detail": "FAILED: assert 0 == 6"}]
    assert fb["stdout_tail"].startswith("[... ") and "1 failed, 2 passed in " in fb["stdout_tail"]   # the end is kept
    assert len(fb["stdout_tail"].split("\n", 1)[1].encode()) <= 64        # the tail is bounded
    fb = script.feedback                            # a script: its exit and the last line of stderr
    assert fb["failed_tests"] == [{"name": "python check.py", "detail": "exit 1: AssertionError: wrong"}]   # the command line
    assert fb["stderr_tail"].rstrip().endswith("AssertionError: wrong")
    fb = call.feedback                              # calls: args, expected and got, outside the sandbox
    assert call.metrics["tests_passed"] == 1 and [t["name"] for t in fb["failed_tests"]] == ["call 1", "call 2"]
    assert fb["failed_tests"][0]["detail"] == "args [2]: expected 3, got 1"
    assert fb["failed_tests"][1]["detail"] == "args [0]: expected 1, got raised ZeroDivisionError: integer division or modulo by zero"
    assert "@@ratchet-harness@@" not in fb["stdout_tail"] and fb["stdout_tail"].endswith("x" * 40)
    assert short.passed and short.feedback["failed_tests"] == [] and short.feedback["exit_code"] == 0
    assert empty.feedback is None                   # an empty completion is not run
    (fb,) = unloaded.feedback["failed_tests"]       # long args are cut, not what the call got
    assert len(fb["detail"]) <= 300 and fb["detail"].startswith("args [[0, 1, 2, ")
    assert fb["detail"].endswith(f"..., got {NEVER_RAN}") and "...]: expected [0, 1, " in fb["detail"]
    assert feedback_text(long, unloaded.feedback, unloaded.metrics).splitlines()[-1].startswith("- f1([0, 1, 2, ")  # a call


# --- a scored wave ---------------------------------------------------------------------------

def test_scored_wave_keeps_feedback_and_passes_the_gate(wave):
    store, cfg, (a, b) = wave
    scored = store.read_table(f"runs/{RUN}/waves/{STEP:06d}/scored.parquet")
    assert scored.schema == TRAJECTORY_SCHEMA
    assert scored["reward"].to_list() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert scored["feedback"].is_null().to_list() == [False, False, True, False, False, False, False, False]
    fb = scored["feedback"][5]
    assert len(fb["failed_tests"]) == len(b.tests) and fb["failed_tests"][0]["detail"].endswith("got raised ValueError: no idea")
    report = check_wave(scored, GateConfig(max_zero_variance_frac=1.0))
    assert report.success, report.to_markdown()
    record = store.get_json(f"runs/{RUN}/waves/{STEP:06d}/scoring.json")
    assert record["verify"] == cfg.verify.model_dump(mode="json") and len(record["train"]) == 1


def test_show_prints_prompt_completion_reward_feedback_and_advantage(wave):
    store, _, (a, b) = wave
    view = load_wave(store, RUN, STEP, a.task_id)
    assert view.table == "trained.parquet" and view.rows.height == GROUP
    text = render(view)
    assert text.startswith(f"run {RUN}, wave {STEP} (trained.parquet): task {a.task_id}, 4 samples")
    shown = lambda block: "\n".join("  " + ln for ln in block.rstrip("\n").split("\n"))  # noqa: E731
    assert text.count(shown(a.prompt)) == 1                               # the prompt once per task
    assert shown(a.reference_solution) in text and shown(WRONG) in text
    first = a.tests[0]
    assert f"call 0: args {first.args}: expected {first.expected}, got null" in text
    assert "thinking about" in text.split("stdout (tail):", 1)[1]       # what the wrong answer printed
    assert "reward 1.000 | advantage +0.667" in text and "reward 0.000 | advantage -0.667" in text
    assert f"tests {len(a.tests)}/{len(a.tests)} (pass rate 1.00)" in text
    assert "feedback: none (not run" in text                            # the empty completion
    whole = render(load_wave(store, RUN, STEP))
    assert whole.startswith(f"run {RUN}, wave {STEP} (trained.parquet): 2 tasks, 8 samples")
    assert "raised ValueError" in whole


def test_replay_reproduces_the_stored_rewards(wave):
    store, _, (a, b) = wave
    for task in (a, b):
        report = replay(store, RUN, STEP, task.task_id)
        assert report.reproduced and report.notes == [] and len(report.samples) == GROUP
        assert [s.replayed_reward for s in report.samples] == [s.stored_reward for s in report.samples]
    assert render_replay(report).endswith("reproduced: 4/4 samples give the stored reward")


def test_replay_applies_the_overlong_penalty_it_was_scored_with(tmp_path, production):
    """A wave scored with reward.overlong_buffer: every answer ran to its cap (2 of max_new_tokens 2), so
    each lost all of overlong_penalty; the replay reads the cap from the scoring record and agrees."""
    store_uri = str(tmp_path / "store")
    make_wave(store_uri, production, rollout=RolloutConfig(prompts_per_wave=2, group_size=GROUP, max_new_tokens=2),
              reward={"overlong_buffer": 1, "overlong_penalty": 0.25})
    store = open_store(store_uri)
    scored = store.read_table(f"runs/{RUN}/waves/{STEP:06d}/scored.parquet")
    assert scored["reward"].to_list() == [0.75, -0.25, -0.25, 0.75, 0.75, -0.25, -0.25, -0.25]
    report = replay(store, RUN, STEP, production.train[0].task_id)
    assert report.reproduced, render_replay(report)


def test_replay_catches_a_changed_hidden_test(wave):
    """The spec drifted: its first hidden test now expects something else. The samples that passed
    lose a test; those that failed everything still fail: only the former are not reproduced."""
    store, _, (a, b) = wave
    t0 = a.tests[0]
    changed = a.model_copy(update={"tests": (CallTest(args=t0.args, expected=json.dumps("drifted")), *a.tests[1:])})
    report = replay(store, RUN, STEP, a.task_id, spec=changed)
    assert not report.reproduced
    assert [s.reproduced for s in report.samples] == [False, True, True, False]
    assert report.samples[0].stored_reward == 1.0 and report.samples[0].replayed_reward == pytest.approx(0.9)
    text = render_replay(report)
    assert f"sample 0 (group 2:{a.task_id}): stored reward 1.000, replayed reward 0.900, pass rate 1.00 -> 0.90: NOT reproduced" in text
    assert f'call 0: args {t0.args}: expected "drifted"' in text and text.endswith("not reproduced: 2/4 samples give the stored reward")


def test_replay_of_a_tampered_snapshot_says_so(tmp_path, production):
    """Someone rewrote the task snapshot in the store after the run: the replay still runs, notes
    that the snapshot no longer matches its recorded sha256, and the changed test shows. It scores
    with the run's recorded RewardConfig (here changed to no partial credit), not the defaults."""
    store_uri = str(tmp_path / "store")
    _, (a, _) = make_wave(store_uri, production)
    store = open_store(store_uri)
    key = f"envs/python_functions/{production.version}/tasks.parquet"
    table = store.read_table(key)
    t0 = a.tests[0]
    spec = a.model_copy(update={"tests": (CallTest(args=t0.args, expected=json.dumps("tampered")), *a.tests[1:])})
    store.write_table(key, table.with_columns(
        pl.when(pl.col("task_id") == a.task_id).then(pl.lit(spec.model_dump_json())).otherwise(pl.col("spec_json"))
        .alias("spec_json")))
    record_key = f"runs/{RUN}/waves/{STEP:06d}/scoring.json"          # the run's own settings are used:
    record = store.get_json(record_key)                               # without partial credit, 9 of 10 scores 0
    store.put_json(record_key, {**record, "reward": {**record["reward"], "partial_credit": False}})
    report = replay(store, RUN, STEP, a.task_id)
    assert [s.reproduced for s in report.samples] == [False, True, True, False]
    assert report.samples[0].replayed_pass_rate == pytest.approx(0.9) and report.samples[0].replayed_reward == 0.0
    assert len(report.notes) == 1 and report.notes[0].startswith("the task snapshot changed since the wave was scored")
    res = CliRunner().invoke(app, ["trace", "replay", RUN, "--step", str(STEP), "--task", a.task_id,
                                   "--store", store_uri, "--json"])
    assert res.exit_code == 1, res.output                               # a check that ran and failed
    assert json.loads(res.stdout)["reproduced"] is False


def test_unknown_run_wave_task_and_missing_record(wave, tmp_path):
    store, _, (a, _) = wave
    with pytest.raises(TraceError, match="no run 'nope' in the store"):
        load_wave(store, "nope", 0)
    with pytest.raises(TraceError, match=f"run '{RUN}' has no wave 3; its waves: {STEP}$"):
        load_wave(store, RUN, 3)
    with pytest.raises(TraceError, match=f"task 'zz' is not in wave {STEP} of run '{RUN}'; its tasks: {a.task_id}, "):
        load_wave(store, RUN, STEP, "zz")
    other = open_store(str(tmp_path / "old"))          # a wave scored before scoring records existed
    scored = store.read_table(f"runs/{RUN}/waves/{STEP:06d}/scored.parquet")
    other.write_table("runs/old/waves/000000/scored.parquet", scored)
    assert "thinking about" in render(load_wave(other, "old", 0))            # shown...
    with pytest.raises(TraceError, match="has no scoring record .* it can be shown, not replayed"):
        replay(other, "old", 0, a.task_id)                                 # ...not replayed
    other.write_table("runs/old/waves/000001/trained.parquet", scored.drop("feedback"))   # older still: no feedback
    text = render(load_wave(other, "old", 1, a.task_id))
    assert text.count("feedback: not recorded (the wave was scored before feedback was kept)") == GROUP
    assert text.count("| not trained on (its group was excluded or had equal rewards)") == GROUP


def test_cli_show_and_replay(wave):
    store, cfg, (a, _) = wave
    base = ["--step", str(STEP), "--store", cfg.store.uri]
    res = CliRunner().invoke(app, ["trace", "show", RUN, "--task", a.task_id, *base])
    assert res.exit_code == 0, res.output
    assert f"task {a.task_id}, 4 samples" in res.stdout and "failed tests (" in res.stdout
    res = CliRunner().invoke(app, ["trace", "replay", RUN, "--task", a.task_id, *base])
    assert res.exit_code == 0, res.output
    assert res.stdout.rstrip().endswith("reproduced: 4/4 samples give the stored reward")


def test_a_wave_scored_again_is_traced_from_its_new_table_not_an_earlier_attempts(tmp_path, production):
    """Found by review: a wave redone after a resume rewrote trajectories and scored tables but left
    the earlier attempt's trained.parquet, which `trace show` reads first: a redo that stopped at the
    gate showed the old attempt's clean rows. Writing a wave table drops the tables made from it."""
    from ratchet.trace import write_wave_table
    from tasks.score import score_wave

    cfg, _ = make_wave(str(tmp_path), production)
    store = open_store(str(tmp_path))
    prefix = f"runs/{RUN}/waves/{STEP:06d}"
    assert load_wave(store, RUN, STEP).table == "trained.parquet"
    score_wave.fn(store.ref(f"{prefix}/trajectories.parquet"), [save_production(store, production)["train"]], cfg)
    assert not store.exists(f"{prefix}/trained.parquet") and load_wave(store, RUN, STEP).table == "scored.parquet"
    key = f"{prefix}/trajectories.parquet"
    write_wave_table(store, key, store.read_table(key))               # what rollout_wave writes a wave with
    assert load_wave(store, RUN, STEP).table == "trajectories.parquet"
