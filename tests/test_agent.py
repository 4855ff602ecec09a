"""Multi-turn episodes (ratchet/agent.py) with a real TorchEngine on a tiny model and real sandbox
runs: every turn is verified, its verdict comes back as the observation within the token budget,
episodes end as the settings say; the metrics by hand; revision demos really fail, then pass."""

from __future__ import annotations

import pytest

from envs.episode import observation_parts
from envs.registry import get_family
from envs.spec import COMPLETION, OverwriteFile, RunCommand, TaskSpec
from ratchet.agent import (CUT, EpisodeResult, _wanted, demos_from, episode_metrics, fit_observation, own_attempts,
                           render_observation, revision_demos, run_episodes, turn_records, warm_start_revisions,
                           wrong_attempts)
from ratchet.config import AgentConfig, ModelConfig, NightlyConfig, VerifyConfig
from ratchet.eval import evaluate
from ratchet.model import build_model, build_tokenizer, text_ids
from ratchet.rollout.episodes import Episode, Turn
from ratchet.rollout.torch_engine import TorchEngine
from ratchet.train.sft import demo_sequence
from ratchet.verify import Verification, verify_many

VERIFY = VerifyConfig(timeout_s=5.0, concurrency=2)
BUDGET = 40
CORPUS = ["# add 3\ndef f(x):\n    x = x + 3\n    return x\n", "Tests: 0 of 10 passed.\n- f(3): expected 6, got 5\n",
          "Revise your answer.\ndef f(x):\n", "apple banana cherry\n"] * 20


def _command_task(task_id: str, command: str, prompt: str) -> TaskSpec:
    """The answer is written to answer.txt; `command` judges it (exit 0: passed)."""
    return TaskSpec(task_id=task_id, family="imported", prompt=prompt,
                    execution_steps=(OverwriteFile(path="/app/answer.txt", content=COMPLETION), RunCommand(command=command)))


PF = get_family("python_functions")
SPECS = [
    _command_task("has-e", "grep -q e answer.txt", "Write a word with the letter e.\n"),   # some answers pass
    PF.generate(PF.config(), 0, 0, 1, "train"),                                            # none does
    _command_task("env-err", "no_such_program_here answer.txt", "Anything.\n"),             # an env_error
]


@pytest.fixture(scope="module")
def engine():
    tok = build_tokenizer(CORPUS, 256)
    model = build_model(ModelConfig(hidden_size=32, num_layers=2, num_heads=2, max_seq_len=256), tok).eval()
    return TorchEngine(model, tok, check_context=True)


def _episodes(engine, **agent):
    return run_episodes(engine, SPECS, 4, AgentConfig(turns=3, observation_tokens=BUDGET, **agent), VERIFY,
                        max_new_tokens=6, temperature=1.0, seed=3, batch_size=16)


@pytest.fixture(scope="module")
def stopping(engine):
    return _episodes(engine)


def test_every_turn_is_verified_and_its_verdict_comes_back(engine, stopping):
    tok = engine.tokenizer
    assert [r.episode.prompt_index for r in stopping] == [i for i in range(3) for _ in range(4)]
    items = [(SPECS[r.episode.prompt_index], t.text_before_stop) for r in stopping for t in r.episode.turns]
    again = iter(verify_many(items, VERIFY.sandbox_limits(), 2))           # every verdict reproduces
    cut = 0
    for r in stopping:
        spec, turns = SPECS[r.episode.prompt_index], r.episode.turns
        assert len(r.verifications) == len(turns) and r.final is r.verifications[-1]
        for k, (t, v) in enumerate(zip(turns, r.verifications)):
            assert (v.passed, v.env_error) == (lambda w: (w.passed, w.env_error))(next(again))
            if k < len(turns) - 1:       # the observation is the rendered verdict, within the budget
                assert t.observation == render_observation(spec, v, tok, BUDGET)
                assert t.observation_ids == tok(t.observation, add_special_tokens=False)["input_ids"]
                assert len(t.observation_ids) <= BUDGET
                cut += t.observation.endswith(CUT + observation_parts(spec, v.feedback, v.metrics)[1])
            else:
                assert t.observation is None
        assert r.episode.loss_mask == [m for t in turns for m in [1] * len(t.action_ids) + [0] * len(t.observation_ids)]
        records = turn_records(r)
        assert [(x["turn"], x["action"], x["observation"], x["passed"], x["env_error"]) for x in records] == \
            [(k, t.text_before_stop, t.observation, v.passed, v.env_error) for k, (t, v) in enumerate(zip(turns, r.verifications))]
        assert sum(x["action_tokens"] + x["observation_tokens"] for x in records) == len(r.episode.completion_ids)
    assert cut > 0, "some feedback was cut to the budget"


def test_episodes_end_on_pass_env_error_or_the_turn_limit(stopping):
    for r in stopping:
        ep = r.episode
        if r.env_error:               # the env_error task: one turn, nothing the model did
            assert ep.prompt_index == 2 and len(ep.turns) == 1 and ep.end == "done"
        elif r.final.passed:          # stop on pass: the first passing answer is the last
            assert ep.end == "done" and r.passed_at == len(ep.turns)
        else:
            assert ep.end in ("turns", "context") and not any(v.passed for v in r.verifications)
            assert len(ep.turns) == 3 or ep.end == "context"
    assert {r.env_error for r in stopping if r.episode.prompt_index == 2} == {True}
    assert not any(r.passed_at for r in stopping if r.episode.prompt_index == 1)
    has_e = [r.passed_at for r in stopping if r.episode.prompt_index == 0]
    assert any(has_e) and None in has_e, f"the tiny model should pass some has-e episodes, not all: {has_e}"
    m = episode_metrics([turn_records(r) for r in stopping], 3)
    assert m["env_errors"] == 4 and m["episodes"] == 8 and m["pass_last"] == sum(map(bool, has_e)) / 8


def test_without_stop_on_pass_a_passing_episode_goes_on(engine, stopping):
    going = _episodes(engine, stop_on_pass=False)
    first = {i: r for i, r in enumerate(stopping)}
    for i, r in enumerate(going):
        if r.env_error:
            continue
        assert r.episode.end in ("turns", "context")
        # same seed, same layout: turn 1 is sampled identically in both runs
        assert r.episode.turns[0].action_ids == first[i].episode.turns[0].action_ids
    assert any(r.verifications[0].passed and len(r.episode.turns) > 1 for r in going)


def test_branched_episodes_share_a_verdict_and_count_their_first_answer_once(engine):
    """branch 2: each pair of a task's four episodes shares its first answer (and so its verdict), marked
    `shared` in the second's turn records; the wave's rows count those copies out of the sampled tokens."""
    from ratchet.agent import episode_frame
    from ratchet.stages import sampled_tokens

    results = run_episodes(engine, SPECS, 4, AgentConfig(turns=3, observation_tokens=BUDGET), VERIFY, max_new_tokens=6,
                           temperature=1.0, seed=3, batch_size=16, branch=2)
    records = [turn_records(r) for r in results]
    for a, b in zip(records[::2], records[1::2]):
        assert (a[0]["action"], a[0]["passed"], a[0]["env_error"]) == (b[0]["action"], b[0]["passed"], b[0]["env_error"])
        assert (a[0]["shared"], b[0]["shared"]) == (False, True) and not any(x["shared"] for x in a[1:] + b[1:])
    frame = episode_frame("r", 0, 0, SPECS, results, group_size=4)
    own = sum(x["action_tokens"] for rs in records for x in rs if not x["shared"])
    assert sampled_tokens(frame) == own < sum(x["action_tokens"] for rs in records for x in rs)


def test_a_k_turn_evaluation_counts_turns_and_tokens_as_the_waves_do(engine):
    """evaluate(agent=K turns) reports `episode_metrics` of the same greedy episodes: the tokens too
    (they were 0.0 when the evaluation kept only each answer's verdict)."""
    agent = AgentConfig(turns=3, observation_tokens=BUDGET)
    figures = evaluate(engine, SPECS, VERIFY, max_new_tokens=6, agent=agent).summary()["turns"]
    episodes = run_episodes(engine, SPECS, 1, agent, VERIFY, max_new_tokens=6, greedy=True)
    assert figures == episode_metrics([turn_records(r) for r in episodes], 3)
    assert figures["mean_action_tokens"] > 0 and figures["mean_observation_tokens"] > 0


def test_a_server_engine_is_refused_by_name():
    from ratchet.rollout.client import HTTPEngine
    with pytest.raises(TypeError, match="in-process torch engine.*not HTTPEngine"):
        run_episodes(HTTPEngine("http://127.0.0.1:9"), SPECS, 1, AgentConfig(turns=2), VERIFY, max_new_tokens=4)


def test_observation_cut_keeps_the_reprompt_whole(engine):
    tok = engine.tokenizer
    n = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])   # noqa: E731
    body, again = "".join(f"- f({i}): expected {i + 3}, got {i}\n" for i in range(30)), "Revise your answer.\ndef f(x):\n"
    cut = fit_observation(body, again, tok, 40)
    assert n(cut) <= 40 and cut.endswith(CUT + again) and body.startswith(cut[: -len(CUT + again)])
    assert n(fit_observation(body, again, tok, 41)) >= n(cut)                # the budget is used, not wasted
    assert fit_observation("short\n", again, tok, 40) == "short\n" + again
    assert fit_observation(body, again, tok, 3) == again                     # over budget alone: still whole


def test_observation_budget_counts_tokens_as_the_engine_encodes_them(engine):
    """"<eos>" that an answer printed is five tokens of text to the engine (text_ids), not one special
    token: counted as one, an observation of them ran far past its budget."""
    tok = engine.tokenizer
    cut = fit_observation("got <eos>\n" * 40, "Revise your answer.\n", tok, BUDGET)
    assert len(text_ids(tok, cut)) <= BUDGET and cut.endswith(CUT + "Revise your answer.\n")


def _turn(n_action: int, n_obs: int, text: str) -> Turn:
    return Turn(list(range(n_action)), [-1.0] * n_action, text, True, None,
                "o" if n_obs else None, list(range(n_obs)))


def _result(passes: list[bool | None], end: str, texts: list[str] | None = None) -> EpisodeResult:
    """passes: per turn True/False, None = an env_error; turn k has k+2 action and 5 observation tokens,
    and the answer texts[k] (default: a different one each turn)."""
    texts = texts or [f"answer {k}" for k in range(len(passes))]
    turns = [_turn(k + 2, 5 if k < len(passes) - 1 else 0, texts[k]) for k in range(len(passes))]
    vs = [Verification(metrics={}, env_error=True) if p is None else
          Verification(metrics={"test_pass_rate": 1.0 if p else 0.0}) for p in passes]
    return EpisodeResult(Episode(0, [1, 2], turns, end, 2, 2), vs)


def test_episode_metrics_by_hand():
    results = [_result([True], "done"),                   # passed at turn 1
               _result([False, False, True], "done"),     # fixed at turn 3
               _result([False, True], "done"),            # fixed at turn 2
               _result([False, False, False], "turns",    # never; its second answer repeats the first
                       ["    return x\n", "    return x", "    return -x\n"]),
               _result([False, False], "context"),        # never (out of context after 2)
               _result([True, False, False], "turns"),    # passed at 1 (stop_on_pass off), then regressed: failed
               _result([False, None], "done")]            # env_error at turn 2: left out
    m = episode_metrics([turn_records(r) for r in results], 3)
    assert m["episodes"] == 6 and m["env_errors"] == 1
    assert m["pass_after_turn"] == pytest.approx([2 / 6, 2 / 6, 3 / 6])  # the state after each turn: the regression counts
    assert (m["pass_turn1"], m["pass_last"]) == (m["pass_after_turn"][0], m["pass_after_turn"][2])
    assert m["failed_turn1"] == 4 and m["fix_rate"] == pytest.approx(2 / 4)
    assert m["mean_turns"] == pytest.approx((1 + 3 + 2 + 3 + 2 + 3) / 6)
    # action tokens per episode: 2, 2+3+4, 2+3, 9, 5, 9; observation tokens: 5 per turn but the last
    assert m["mean_action_tokens"] == pytest.approx((2 + 9 + 5 + 9 + 5 + 9) / 6)
    assert m["mean_observation_tokens"] == pytest.approx((0 + 10 + 5 + 10 + 5 + 10) / 6)
    copies = [turn_records(r) for r in results]
    copies[1][0]["shared"] = True           # its first answer a copy of another's (agent.branch): not sampled
    assert episode_metrics(copies, 3)["mean_action_tokens"] == pytest.approx((2 + 7 + 5 + 9 + 5 + 9) / 6)
    assert m["ends"] == {"passed": 3, "turns": 2, "context": 1}
    assert m["repeat_rate"] == pytest.approx(1 / 8)       # 8 revisions (2 + 1 + 2 + 1 + 2), one repeat
    bare = [[{k: v for k, v in t.items() if k != "action"} for t in turn_records(r)] for r in results]
    assert episode_metrics(bare, 3)["repeat_rate"] is None                          # records without actions
    assert episode_metrics([turn_records(_result([True], "done"))], 2)["fix_rate"] is None     # nobody failed turn 1
    with pytest.raises(ValueError, match="more than max_turns=2"):
        episode_metrics([turn_records(r) for r in results], 2)


def test_revision_demos_really_fail_then_pass(engine):
    """Each demo: one or two wrong answers (attempts=2), each really failed by the sandbox and followed by
    the observation of its own run, then the reference; with a context, only the wrong answers that fit."""
    fams = {name: get_family(name) for name in ("python_functions", "arithmetic", "shell")}
    specs = [f.generate(f.config(), 0, i, 2, "train") for f in fams.values() for i in range(2)]
    specs.append(_command_task("no-ref", "true", "Anything.\n"))          # no reference: never a demo
    demos = revision_demos(specs, 1.0, VERIFY, seed=0, tokenizer=engine.tokenizer, observation_tokens=32,
                           attempts=2, max_mutants=3)
    by_prompt = {s.prompt: s for s in specs}
    assert sorted(d[0] for d in demos) == sorted(s.prompt for s in specs[:-1])
    items, wrongs = [], []
    for prompt, segments in demos:
        spec = by_prompt[prompt]
        *tried, (fix, last) = segments
        assert len(tried) in (2, 4) and [t for _, t in tried] == [False] * len(tried) and last
        assert fix == spec.reference_solution and len({w for w, _ in tried[0::2]} | {fix}) == len(tried) // 2 + 1
        items += [(spec, w) for w, _ in tried[0::2]] + [(spec, fix)]
        wrongs.append(len(tried) // 2)
    assert set(wrongs) == {1, 2}                  # how many wrong answers is drawn per task
    verdicts = iter(verify_many(items, VERIFY.sandbox_limits(), 2))
    for (prompt, segments), n in zip(demos, wrongs):
        for k in range(n):
            bad = next(verdicts)
            assert not bad.passed and not bad.env_error
            # each observation is rendered from its wrong answer's real feedback, cut as an episode's
            assert segments[2 * k + 1][0] == render_observation(by_prompt[prompt], bad, engine.tokenizer, 32)
        assert next(verdicts).passed
    found = wrong_attempts(specs, 1.0, VERIFY, seed=0, attempts=2, max_mutants=3)
    assert demos_from(found, engine.tokenizer, 32) == demos
    spec, pair = next((s, w) for s, w in found if len(w) == 2)
    (_, whole), = demos_from([(spec, pair)], engine.tokenizer, 32)
    (_, first), = demos_from([(spec, pair[:1])], engine.tokenizer, 32)
    fits_one = len(demo_sequence(engine.tokenizer, (spec.prompt, first))[0])
    assert len(demo_sequence(engine.tokenizer, (spec.prompt, whole))[0]) > fits_one
    assert demos_from([(spec, pair)], engine.tokenizer, 32, context=fits_one) == [(spec.prompt, first)]
    assert demos_from([(spec, pair)], engine.tokenizer, 32, context=fits_one - 1) == []   # not even one fits
    half = revision_demos(specs, 0.5, VERIFY, seed=1, max_mutants=3)
    assert len(half) == 3 and half == revision_demos(specs, 0.5, VERIFY, seed=1, max_mutants=3)
    assert revision_demos(specs, 0.0, VERIFY, seed=1) == []
    with pytest.raises(ValueError, match="fraction"):
        revision_demos(specs, 1.5, VERIFY, seed=1)


def test_own_attempts_are_the_models_own_failed_answers(engine):
    """own_attempts: per task with a reference, one episode of up to turns - 1 answers sampled from the
    engine; its failed answers before the first pass, as many as drawn per task, with their verdicts.
    A first answer that passes, or an env_error, gives none; a task without a reference is not run."""
    ref = {"reference_solution": "anything\n"}
    specs = [PF.generate(PF.config(), 0, i, 2, "train") for i in range(8)]                 # the tiny model fails these
    specs += [_command_task("passes", "true", "Anything.\n").model_copy(update=ref),
              _command_task("env-err", "no_such_program_here answer.txt", "Anything.\n").model_copy(update=ref),
              _command_task("no-ref", "true", "Anything.\n")]
    agent = AgentConfig(turns=3, observation_tokens=BUDGET, stop_on_pass=False)          # own_attempts stops on a pass
    found = own_attempts(engine, specs, agent, VERIFY, seed=5, max_new_tokens=6, temperature=1.0, batch_size=16)
    assert {s.task_id for s, _ in found} <= {s.task_id for s in specs[:8]} and len(found) >= 6
    same = run_episodes(engine, specs[:10], 1, agent.model_copy(update={"turns": 2, "stop_on_pass": True}), VERIFY,
                        max_new_tokens=6, temperature=1.0, seed=5, batch_size=16)
    episodes = {s.task_id: r for s, r in zip(specs, same)}
    counts = set()
    for spec, wrongs in found:
        r = episodes[spec.task_id]                                      # the same sampling, run again
        assert 1 <= len(wrongs) <= _wanted(5, spec.task_id, 2)
        for (text, v), turn, again in zip(wrongs, r.episode.turns, r.verifications):
            assert text == turn.text_before_stop and text.strip()
            assert not v.passed and not v.env_error and v.feedback == again.feedback
        counts.add(len(wrongs))
    assert counts == {1, 2}                                             # 1 to turns - 1 wrong answers
    demos = demos_from(found, engine.tokenizer, BUDGET)
    assert [d[1][-1] for d in demos] == [(s.reference_solution, True) for s, _ in found]
    assert demos[0][1][1][0] == render_observation(found[0][0], found[0][1][0][1], engine.tokenizer, BUDGET)


def test_the_warm_starts_own_demos_sample_the_revision_demo_tasks_at_the_rollout_temperature(engine):
    specs = [PF.generate(PF.config(), 0, i, 2, "train") for i in range(8)]
    cfg = NightlyConfig(agent={"turns": 3, "revision_demos": 0.5, "own_revision_steps": 5, "observation_tokens": BUDGET},
                        rollout={"temperature": 0.7, "max_new_tokens": 6, "batch_size": 16}, model={"seed": 2},
                        verify=VERIFY.model_dump())
    revisions, own = warm_start_revisions(cfg, specs)
    attempts = wrong_attempts(specs, 0.5, cfg.verify, 2, attempts=2)
    assert revisions(engine.tokenizer) == demos_from(attempts, engine.tokenizer, BUDGET, cfg.model.max_seq_len)
    chosen = [s for s, _ in attempts]
    assert 0 < len(chosen) < len(specs)
    want = own_attempts(engine, chosen, cfg.agent, cfg.verify, 2, max_new_tokens=6, temperature=0.7, batch_size=16)
    assert want
    assert own(engine.model, engine.tokenizer) == demos_from(want, engine.tokenizer, BUDGET, cfg.model.max_seq_len)
    assert warm_start_revisions(cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"own_revision_steps": 0})}),
                                specs)[1] is None
    assert warm_start_revisions(NightlyConfig(), specs) == (None, None)
