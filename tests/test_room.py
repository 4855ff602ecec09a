"""A run's tasks against its model's context (ratchet/room.py): kept, quarantined, or no task left."""

from __future__ import annotations

import pytest

from envs.spec import CallTest, CheckCalls, OverwriteFile, TaskSpec, COMPLETION
from ratchet.config import ModelConfig
from ratchet.data.schemas import tasks_frame
from ratchet.model import PromptRoom, build_model, build_tokenizer
from ratchet.room import QUARANTINE_SCHEMA, NoTasksLeft, fit_context, require_tasks
from ratchet.rollout.torch_engine import TorchEngine


def _spec(task_id: str, prompt: str, split: str = "heldout") -> TaskSpec:
    return TaskSpec(task_id=task_id, family="fn", difficulty=1, version="v1", split=split, prompt=prompt,
                    reference_solution="    return 3 * x + 1\n",
                    execution_steps=(OverwriteFile(path="/app/solution.py", content="def f(x):\n" + COMPLETION),
                           CheckCalls(entry_point="f")),
                    tests=(CallTest(args="[1]", expected="4"),))


@pytest.fixture(scope="module")
def room_and_engine():
    tok = build_tokenizer(["def f(x):\n    return 3 * x + 1\n"] * 20, 300)
    engine = TorchEngine(build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2, max_seq_len=64), tok).eval(),
                         tok, check_context=True)
    return PromptRoom(tok, chat=False, context=64, max_new_tokens=16), engine


def test_a_prompt_without_room_to_answer_is_quarantined_as_the_engine_counts_it(room_and_engine):
    """A prompt whose tokens (as the rollout engine encodes them) + max_new_tokens exceed the context is
    dropped with its token count; the one that fits exactly is kept. The engine agrees on both: it
    refuses the first and samples the second."""
    room, engine = room_and_engine
    base = len(engine.encode_prompts(["def f(x):\n"])[0])    # BOS + the prompt's tokens
    fits = "#" * (64 - 16 - base) + "def f(x):\n"              # '#' is not in the corpus: one token each
    over = "#" + fits
    assert [len(ids) for ids in engine.encode_prompts([fits, over])] == [48, 49]   # 48 + 16 = the context
    table = tasks_frame([_spec("fn/fits", fits), _spec("fn/over", over)], [("pass", ""), ("pass", "")])
    out = fit_context(table, room)
    assert out.kept["task_id"].to_list() == ["fn/fits"] and out.kept.schema == table.schema
    assert out.quarantined.schema == QUARANTINE_SCHEMA
    assert out.quarantined.rows() == [("fn/over", "fn", "heldout", 49,
                                       "prompt is 49 tokens + max_new_tokens 16, over the model's context of 64 tokens")]
    assert len(engine.generate([fits], max_new_tokens=16, greedy=True)) == 1
    with pytest.raises(ValueError, match="prompt 0: 49 tokens \\+ max_new_tokens 16 exceed the model's context of 64"):
        engine.generate([over], max_new_tokens=16, greedy=True)
    require_tasks(out.kept, "heldout", "fn v1", out.quarantined, room)   # one task left: nothing to say


def test_a_table_left_empty_is_one_error_naming_the_source_and_why(room_and_engine):
    room, _ = room_and_engine
    table = tasks_frame([_spec("fn/a", "#" * 60, "train"), _spec("fn/b", "#" * 70, "train")], [("pass", "")] * 2)
    out = fit_context(table, room)
    assert out.kept.height == 0 and out.quarantined["prompt_tokens"].to_list() == [61, 71]
    with pytest.raises(NoTasksLeft) as e:
        require_tasks(out.kept, "train", "fn v1", out.quarantined, room, "runs/r/context/too_long.parquet")
    assert str(e.value) == (
        "source fn v1: no training task left for this run's model: all 2 of its training task(s) have prompts that "
        "leave no room for rollout.max_new_tokens 16 in the model's context of 64 tokens (the shortest is 61 tokens); "
        "quarantined in runs/r/context/too_long.parquet. Use a model with a longer context, lower "
        "rollout.max_new_tokens, or shorten the prompts.")
    assert isinstance(e.value, ValueError)          # deterministic: no retry
    empty = fit_context(table.head(0), room)         # an empty table is the audit gate's to report, not this
    assert empty.kept.height == 0 and empty.quarantined.height == 0
    require_tasks(empty.kept, "train", "fn v1", empty.quarantined, room)
