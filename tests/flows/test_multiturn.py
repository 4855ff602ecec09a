"""A multi-turn nightly end to end: episodes in the waves, every turn in the Parquet file, the loss
on the model's own tokens only, the evaluation by turn (issue 14's "done when")."""

import pytest

from envs.episode import repeats
from ratchet.config import AgentConfig
from ratchet.store import open_store
from tests.flows.test_nightly import tiny

TURN_PENALTY = 0.05


@pytest.fixture(scope="module")
def run(prefect_harness, tmp_path_factory):
    from flows.nightly import nightly

    store_uri = str(tmp_path_factory.mktemp("store"))
    cfg = tiny(store_uri, run_id="mt", agent=AgentConfig(turns=3, observation_tokens=24, stop_on_pass=True,
                                                        revision_demos=0.5, turn_penalty=TURN_PENALTY,
                                                        repeat_reward=0.0)).model_copy(update={"steps": 2})
    return store_uri, cfg, nightly(cfg)


def test_the_waves_hold_episodes_turn_by_turn(run):
    store_uri, cfg, summary = run
    store = open_store(store_uri)
    revised = 0
    for step in range(2):
        wave = store.read_table(f"runs/mt/waves/{step:06d}/trained.parquet")
        assert wave.height == 16
        for row in wave.iter_rows(named=True):
            turns = row["turns"]
            assert 1 <= len(turns) <= 3 and [t["turn"] for t in turns] == list(range(len(turns)))
            assert row["completion"] == turns[-1]["action"]
            if row["env_error"]:
                continue
            # an episode ends at its first passing answer, else at the turn (or context) limit
            assert [t["passed"] for t in turns[:-1]] == [False] * (len(turns) - 1)
            assert turns[-1]["passed"] == (row["metrics"]["test_pass_rate"] == 1.0 and not row["metrics"]["timed_out"])
            assert all(t["observation"] for t in turns[:-1]) and turns[-1]["observation"] is None
            assert row["reward"] == pytest.approx(turns[-1]["reward"] - TURN_PENALTY * (len(turns) - 1))  # the final state's
            for before, t in zip(turns, turns[1:]):       # repeat_reward 0: a repeated failure keeps no partial credit
                assert t["reward"] == 0.0 or not repeats(t["action"], before["action"])
            # the token stream: answers and observations in order, the mask 1 on answers, 0 on observations
            mask = [m for t in turns for m in [1] * t["action_tokens"] + [0] * t["observation_tokens"]]
            assert row["loss_mask"] == mask and len(row["completion_ids"]) == len(mask) == row["completion_tokens"]
            assert all(lp == 0.0 for lp, m in zip(row["behavior_logprobs"], mask) if m == 0)
            assert all(lp < 0.0 for lp, m in zip(row["behavior_logprobs"], mask) if m == 1)
            assert row["prompt_tokens"] + row["completion_tokens"] <= cfg.model.max_seq_len
            revised += len(turns) > 1
    assert revised > 0, "no episode went past its first answer"


def test_wave_and_eval_figures_by_turn(run):
    _, _, summary = run
    for h in summary["history"]:
        after = h["pass_after_turn"]
        assert len(after) == 3 and after == sorted(after) and 0.0 <= h["fix_rate"] <= 1.0
        assert 1.0 <= h["mean_turns"] <= 3.0 and h["sampled_tokens"] > 0
        assert h["sandbox_launched"] > 0        # every answer ran in the sandbox during the rollout
    for key in ("base", "final"):
        turns = summary[key]["turns"]
        assert len(turns["pass_after_turn"]) == 3
        assert turns["pass_after_turn"][-1] == pytest.approx(summary[key]["pass_rate"])   # judged by the last answer


def test_trace_shows_every_turn(run):
    from ratchet.trace import render_row

    store_uri, _, _ = run
    wave = open_store(store_uri).read_table("runs/mt/waves/000000/scored.parquet")
    row = next(r for r in wave.iter_rows(named=True) if len(r["turns"]) > 1)
    text = render_row(row)
    for t in row["turns"]:
        assert f"turn {t['turn'] + 1} (" in text
    assert text.count("observation:") == len(row["turns"]) - 1 and row["turns"][0]["observation"].splitlines()[0] in text


def test_replay_reproduces_the_shaped_rewards_of_episodes(run):
    """`ratchet trace replay` runs an episode's final answer again and applies the run's recorded shaping
    (turn_penalty, repeat_reward) over its stored turns, as score_wave did."""
    from ratchet.trace import replay

    store_uri, _, _ = run
    store = open_store(store_uri)
    wave = store.read_table("runs/mt/waves/000000/scored.parquet")
    revised = next(r for r in wave.iter_rows(named=True) if len(r["turns"]) > 1 and not r["env_error"])
    report = replay(store, "mt", 0, revised["task_id"])
    assert report.reproduced, [(s.stored_reward, s.replayed_reward) for s in report.samples]
    assert any(s.stored_reward != pytest.approx(r["turns"][-1]["reward"])       # the shaping was replayed, not skipped
               for s, r in zip(report.samples, wave.filter(wave["task_id"] == revised["task_id"]).iter_rows(named=True)))
