"""The needle-in-a-haystack probe and the context extension of the embedded model."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from envs.registry import get_family
from ratchet.config import ContextPhase, ModelConfig, NiahConfig
from ratchet.eval.niah import QUESTION, build_haystack, probe, recalled, retrieval_examples
from ratchet.model import build_model, build_tokenizer, load_policy, save_policy, set_context
from ratchet.rollout.engine import Rollout
from ratchet.train.sft import extend_context, warm_start

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=256, max_seq_len=128, sft_steps=2, sft_batch=4)


@pytest.fixture(scope="module")
def specs():
    fam = get_family("python_functions")
    return [fam.generate(fam.config(), 0, i, 1 + i % 3, "train") for i in range(60)]


@pytest.fixture(scope="module")
def tok(specs):
    return build_tokenizer([s.prompt + s.reference_solution for s in specs], TINY.vocab_size)


def _tokens(tok, text):
    return 1 + len(tok(text, add_special_tokens=False)["input_ids"])   # + BOS, as the engine feeds it


@pytest.mark.parametrize("length", [160, 600])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_haystack_has_the_needle_at_its_depth_within_the_length(tok, length, depth):
    h = build_haystack(tok, length, depth, "40213", seed=3)
    needle = "The key is 40213."
    assert h.prompt.count(needle) == 1 and h.prompt.endswith(QUESTION)
    assert re.findall(r"\d+", h.prompt) == ["40213"] and h.prompt.lower().count("key") == 3   # needle + question
    assert h.length == _tokens(tok, h.prompt) <= length
    sentence = max(_tokens(tok, " A tall tree drifts under the bridge."), _tokens(tok, " The small boat shines without a sound."))
    assert h.length > length - sentence                       # filled to within one sentence of the budget
    head, tail = h.prompt[:-len(QUESTION)].split(needle)
    n_head, n_tail = (_tokens(tok, t.strip()) - 1 if t.strip() else 0 for t in (head, tail))
    assert abs(n_head / (n_head + n_tail) - depth) <= sentence / (n_head + n_tail)   # the boundary nearest depth
    assert h.needle_at == pytest.approx(n_head / (n_head + n_tail))
    if depth == 0.0:
        assert h.prompt.startswith(needle)
    if depth == 1.0:
        assert h.prompt.endswith(needle + QUESTION)


def test_haystacks_are_deterministic_by_seed(tok):
    assert build_haystack(tok, 200, 0.5, "123", seed=1) == build_haystack(tok, 200, 0.5, "123", seed=1)
    assert build_haystack(tok, 200, 0.5, "123", seed=1).prompt != build_haystack(tok, 200, 0.5, "123", seed=2).prompt
    with pytest.raises(ValueError, match="no room"):
        build_haystack(tok, 20, 0.5, "123")
    with pytest.raises(ValueError, match="depth"):
        build_haystack(tok, 200, 1.5, "123")


def test_recall_is_the_first_digit_run_exactly():
    assert recalled(" 40213.", "40213") and recalled(" is 40213\n", "40213")
    assert not recalled(" 402130.", "40213")          # longer
    assert not recalled(" 4021.", "40213")            # shorter
    assert not recalled(" 4 0213.", "40213")          # split
    assert not recalled(" 11, then 40213", "40213")   # the first number is the answer
    assert not recalled("", "40213")


class LastTokensEngine:
    """A reader that sees only the last `window` tokens of each prompt: it answers the key when the
    needle lies in them, else nothing. Recall must then be 1 exactly where the needle is near the end."""

    def __init__(self, tok, window):
        self.tok, self.window = tok, window

    def generate(self, prompts, n=1, max_new_tokens=8, greedy=True, batch_size=16, **_):
        out = []
        for i, p in enumerate(prompts):
            seen = self.tok.decode(self.tok(p, add_special_tokens=False)["input_ids"][-self.window:])
            key = re.search(r"The key is (\d+)\.", seen)
            text = f" {key.group(1)}." if key else " ."
            out.append(Rollout(i, [], [], [], text, True, None))
        return out


def test_probe_table_puts_each_cell_where_it_belongs(tok):
    model = build_model(TINY.model_copy(update={"max_seq_len": 512}), tok)
    cfg = NiahConfig(lengths=(160, 480), depths=(0.0, 1.0), trials=2)
    seen = []
    result = probe(model, tok, cfg, engine=LastTokensEngine(tok, window=100), progress=lambda d, t: seen.append((d, t)))
    assert seen == [(4, 8), (8, 8)]                          # the progress bar's callback, once per length
    table = result.table()
    assert table.columns == ["depth", "160", "480"] and table["depth"].to_list() == [0.0, 1.0]
    assert table.row(1) == (1.0, 1.0, 1.0)                   # needle last: always within reach
    assert table.row(0) == (0.0, 0.0, 0.0)                   # needle first: 100 tokens cannot reach it
    assert result.rows.height == 8 and (result.rows["tokens"] <= result.rows["length"]).all()
    assert "480" in result.text() and result.summary()["recall"] == 0.5


def test_probe_on_a_real_tiny_model_and_its_limits(tok):
    model = build_model(TINY, tok).eval()
    result = probe(model, tok, NiahConfig(depths=(0.5,), trials=1))
    assert result.limit == 128 and result.rows["length"].max() <= 128 - 8      # default lengths leave answer room
    assert result.rows.height == result.rows["length"].n_unique() >= 2
    assert result.rows["answer"].str.len_chars().min() > 0                   # the model's own greedy tokens
    with pytest.raises(ValueError, match="length 200.*exceeds the model's context of 128"):
        probe(model, tok, NiahConfig(lengths=(200,)))
    beyond = probe(model, tok, NiahConfig(lengths=(124, 200), depths=(1.0,), trials=1, beyond_limit=True))
    assert beyond.table().columns == ["depth", "124*", "200*"]   # 124 fits, its 8 answer tokens do not


def test_linear_rope_divides_the_frequencies(tok):
    model = build_model(TINY, tok)
    before = model.model.rotary_emb.inv_freq.clone()
    set_context(model, 512, "linear", 4.0)
    assert model.config.max_position_embeddings == 512
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, before / 4)
    set_context(model, 512, "yarn", 4.0, original=128)
    assert model.config.rope_parameters["original_max_position_embeddings"] == 128


def test_context_phase_trains_at_the_longer_length(tok, specs):
    model = build_model(TINY, tok)
    batches = []
    model.register_forward_pre_hook(lambda _m, _a, kw: batches.append(kw["input_ids"]), with_kwargs=True)
    phase = ContextPhase(seq_len=256, steps=3, batch=4, rope_type="linear", factor=2.0, retrieval_share=1.0, key_digits=2)
    losses = extend_context(model, tok, phase, [], TINY, seed=1)
    assert len(losses) == 3 and all(l > 0 for l in losses)
    assert model.config.max_position_embeddings == 256 and model.config.rope_parameters["rope_type"] == "linear"
    assert 128 < max(b.shape[1] for b in batches) <= 256     # past the short context, within the new one
    keys = [re.findall(r"The key is (\d+)\.", tok.decode(row)) for b in batches for row in b]
    assert all(len(k) == 2 and len(set(k)) == 1 and len(k[0]) == 2 for k in keys)   # needle + answer, 2 digits
    examples = retrieval_examples(tok, 20, 256, seed=1)
    assert all(recalled(c, re.search(r"key is (\d+)", p).group(1)) for p, c in examples)


def test_warm_start_with_phases_saves_a_loadable_extended_model(tmp_path, specs):
    cfg = TINY.model_copy(update={"context_phases": (
        ContextPhase(seq_len=128, steps=1, batch=2),
        ContextPhase(seq_len=256, steps=1, batch=2, rope_type="linear", factor=2.0))})
    losses = warm_start(cfg, specs, tmp_path)
    assert len(losses) == 2 + 1 + 1
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["max_position_embeddings"] == 256
    assert saved["rope_parameters"]["rope_type"] == "linear" and saved["rope_parameters"]["factor"] == 2.0
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config.max_position_embeddings == 256
    model, tok = load_policy(tmp_path)
    ids = torch.tensor([[tok.bos_token_id] + list(range(5, 205))])   # 201 positions: past the short 128
    torch.testing.assert_close(again(ids).logits, model(ids).logits)


def test_phases_must_grow_and_default_rope_takes_no_factor():
    with pytest.raises(ValueError, match="phase 1: seq_len 128 is shorter"):
        ModelConfig(context_phases=[{"seq_len": 256, "steps": 1}, {"seq_len": 128, "steps": 1}], max_seq_len=64)
    with pytest.raises(ValueError, match="takes no factor"):
        ModelConfig(context_phases=[{"seq_len": 512, "steps": 1, "factor": 2}])
    assert ModelConfig().context_phases == ()


def test_cli_prints_the_table_and_rejects_bad_input(tmp_path, tok):
    from ratchet.cli import app

    save_policy(build_model(TINY, tok), tok, tmp_path)
    runner = CliRunner()
    ok = runner.invoke(app, ["eval", "niah", "--model", str(tmp_path), "--lengths", "60,120", "--depths", "0,1",
                             "--trials", "1", "--json"])
    assert ok.exit_code == 0, ok.output
    assert "depth \\ length" in ok.output and json.loads(ok.output.strip().splitlines()[-1])["limit"] == 128
    long = runner.invoke(app, ["eval", "niah", "--model", str(tmp_path), "--lengths", "300"])
    assert long.exit_code == 2 and "error: length 300" in long.output and "(--lengths)" in long.output
    bad = runner.invoke(app, ["eval", "niah", "--model", str(tmp_path), "--depths", "0,2"])
    assert bad.exit_code == 2 and "error:" in bad.output and "--depths" in bad.output
    missing = runner.invoke(app, ["eval", "niah", "--model", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and missing.stderr == f"error: no such directory ({tmp_path / 'nope'})\n"


def test_cli_names_what_is_wrong_with_a_model_directory_in_one_line(tmp_path, tok):
    """A config of another width than the weights: transformers printed a 20-line table, then
    the probe died with a RuntimeError pointing at it (exit 1)."""
    from ratchet.cli import app

    save_policy(build_model(TINY, tok), tok, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "intermediate_size": 160}))
    res = CliRunner().invoke(app, ["eval", "niah", "--model", str(tmp_path)])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.output
    assert res.stderr.startswith("error: the weights do not fit the model config.json describes: "), res.stderr
    assert res.stderr.endswith(f" in the model) ({tmp_path})\n"), res.stderr
