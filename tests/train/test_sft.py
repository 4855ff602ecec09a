"""SFT warm start with revision demonstrations: the layout of an episode, the loss on the fix only.

    pytest tests/train/test_sft.py -q
"""

from __future__ import annotations

import pytest
import torch

from envs.registry import get_family
from ratchet.config import ModelConfig
from ratchet.model import load_policy
from ratchet.train.sft import demo_sequence, own_phase, sft, sft_batch, warm_start
from tests.train import tiny

PROMPT = "# add 3, then negate it\ndef f(x):\n"
WRONG = "    x = x + 4\n    return x\n"
OBSERVATION = "1 of 3 tests passed: f(1) expected -4, got 5\ndef f(x):\n"
FIX = "    x = x + 3\n    x = -x\n    return x\n"


def toks(text: str) -> list[int]:
    return tiny.tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_a_pair_is_the_single_turn_layout():
    tok = tiny.tokenizer()
    ids, mask = demo_sequence(tok, (PROMPT, FIX))
    assert ids == [tok.bos_token_id] + toks(PROMPT) + toks(FIX) + [tok.eos_token_id]
    assert mask == [0] * (1 + len(toks(PROMPT))) + [1] * (len(toks(FIX)) + 1)


def test_a_revision_demo_has_the_episode_layout_and_trains_on_the_fix_only():
    """<bos> prompt | wrong <eos> | observation | fix <eos>: the wrong attempt ends with EOS like a
    sampled answer, and it, the observation and the prompt are context; the fix and its EOS are trained."""
    tok = tiny.tokenizer()
    eos = tok.eos_token_id
    ids, mask = demo_sequence(tok, (PROMPT, [(WRONG, False), (OBSERVATION, False), (FIX, True)]))
    context = [tok.bos_token_id] + toks(PROMPT) + toks(WRONG) + [eos] + toks(OBSERVATION)
    assert ids == context + toks(FIX) + [eos]
    assert mask == [0] * len(context) + [1] * (len(toks(FIX)) + 1)
    # a trainable answer followed by an observation is trained with its EOS (an episode's answer ends there)
    ids, mask = demo_sequence(tok, (PROMPT, [(WRONG, True), (OBSERVATION, False), (FIX, True)]))
    head = 1 + len(toks(PROMPT))
    assert mask == [0] * head + [1] * (len(toks(WRONG)) + 1) + [0] * len(toks(OBSERVATION)) + [1] * (len(toks(FIX)) + 1)
    assert ids[head + len(toks(WRONG))] == eos


def test_a_demos_observation_is_text_as_an_episodes_is():
    """An observation holding "<eos>" (an answer printed it) is text in an episode (ratchet.model.text_ids), so
    in a revision demo too: not an end of sequence the warm start trains past and no episode ever shows."""
    tok = tiny.tokenizer()
    observation = f"got {tok.eos_token}\n" + OBSERVATION
    ids, _ = demo_sequence(tok, (PROMPT, [(WRONG, False), (observation, False), (FIX, True)]))
    assert ids.count(tok.eos_token_id) == 2                        # the wrong attempt's and the fix's


@pytest.mark.parametrize("segments, message", [
    ([(WRONG, False), (OBSERVATION, False)], "an odd number of segments"),
    ([(WRONG, False), (OBSERVATION, True), (FIX, True)], "segment 1 is an observation"),
    ([(WRONG, False), (OBSERVATION, False), (FIX, False)], "no trainable answer"),
    ([(WRONG, "yes")], r"segment 0 is \("),
    ([], "got 0 segment"),
])
def test_a_malformed_demo_is_named(segments, message):
    with pytest.raises(ValueError, match=f"revision demo 3: .*{message}"):
        demo_sequence(tiny.tokenizer(), (PROMPT, segments), where="revision demo 3")


def test_sft_loss_is_the_cross_entropy_of_the_trainable_tokens_only():
    """One SFT step's reported loss (before its update) equals the mean cross-entropy over the fix and
    its EOS, computed by hand from the same model's forward of the whole sequence."""
    tok = tiny.tokenizer()
    demo = (PROMPT, [(WRONG, False), (OBSERVATION, False), (FIX, True)])
    ids, mask = demo_sequence(tok, demo)
    with torch.no_grad():
        logits = tiny.model()(torch.tensor([ids])).logits[0]                         # [T, V]
    nll = -torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]  # [T-1]
    trained = torch.tensor(mask[1:], dtype=torch.bool)                                # token t predicted at t - 1
    by_hand = float(nll[trained].mean())
    everything_after_prompt = float(nll[1 + len(toks(PROMPT)) - 1:].mean())
    losses = sft(tiny.model(), tok, [demo], steps=1, batch_size=1, lr=1e-3)
    assert losses[0] == pytest.approx(by_hand, rel=1e-5)
    assert abs(by_hand - everything_after_prompt) > 1e-3                              # the mask matters here

    _, attn, labels = sft_batch([(ids, mask), demo_sequence(tok, (PROMPT, FIX))], tok.pad_token_id)
    assert attn[0].tolist() == [1] * len(ids)                                         # the context is attended to
    assert (labels[0] != -100).tolist() == [bool(m) for m in mask]
    assert (labels[attn == 0] == -100).all()


def test_micro_batches_give_the_whole_batch_step():
    """A batch of plain and revision demos (lengths ~2x apart), trained as one padded batch, in
    micro-batches of like length (the default), or a row at a time: the same losses and weights, to
    float rounding."""
    tok = tiny.tokenizer()
    demos = [(PROMPT, FIX), (PROMPT, WRONG), (PROMPT, [(WRONG, False), (OBSERVATION, False), (FIX, True)])]
    packings = {"one_batch": dict(pack=lambda lengths, budget: [list(range(len(lengths)))]),
                "like_length": {}, "row_by_row": dict(token_budget=1)}
    models = {name: tiny.model() for name in packings}
    losses = {name: sft(models[name], tok, demos, steps=3, batch_size=6, lr=1e-2, **kw) for name, kw in packings.items()}
    for name in ("like_length", "row_by_row"):
        assert losses[name] == pytest.approx(losses["one_batch"], rel=1e-5)
        for a, b in zip(models["one_batch"].parameters(), models[name].parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _warm_start_setup():
    """20 python_functions tasks, the first one's wrong answer and its revision demo, a tiny model's config."""
    fam = get_family("python_functions")
    specs = [fam.generate(fam.config(), 0, i, 1 + i % 3, "train") for i in range(20)]
    s = specs[0]
    wrong = s.reference_solution.replace("return", "return 1 +", 1)
    revisions = [(s.prompt, [(wrong, False), ("FAILED test_0: expected 3, got 4\n", False), (s.reference_solution, True)])]
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=256, max_seq_len=256, sft_steps=2,
                      sft_batch=4)
    return specs, s, wrong, revisions, cfg


def test_warm_start_mixes_revision_demos_in(tmp_path):
    specs, s, wrong, revisions, cfg = _warm_start_setup()
    losses = warm_start(cfg, specs, tmp_path, revisions=revisions)
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    model, tok = load_policy(tmp_path)
    ids, mask = demo_sequence(tok, revisions[0])                      # the saved tokenizer lays the demo out
    assert sum(mask) == len(tok(s.reference_solution, add_special_tokens=False)["input_ids"]) + 1
    with pytest.raises(ValueError, match="revision demo 1: segment 1 is an observation"):
        warm_start(cfg, specs, tmp_path / "bad", revisions=revisions + [(s.prompt, [(wrong, False), ("x", True), ("y", True)])])


def test_warm_start_then_trains_on_revision_demos_from_its_own_answers(tmp_path, monkeypatch):
    """own_revisions(model, tokenizer) is called with the model the first SFT left (in eval mode, as a
    rollout samples it), and own_steps more steps train on what it returns with the demonstrations
    (`own_phase`, not the mutant demos); without it, the same first SFT."""
    from ratchet.train import sft as sft_module

    calls = []

    def recording(model, tok, examples, steps, *args, **kwargs):
        calls.append((list(examples), steps, kwargs["seed"]))
        return sft(model, tok, examples, steps, *args, **kwargs)

    monkeypatch.setattr(sft_module, "sft", recording)
    specs, s, wrong, revisions, cfg = _warm_start_setup()
    seen = {}

    def own(model, tok):
        if model is not None:
            seen.update(training=model.training, weights={k: v.clone() for k, v in model.state_dict().items()})
        mine = s.reference_solution.replace("return", "return 2 *", 1)
        return [(s.prompt, [(mine, False), ("FAILED test_1: expected 6, got 12\n", False), (s.reference_solution, True)])]

    losses = warm_start(cfg, specs, tmp_path / "own", revisions=revisions, own_revisions=own, own_steps=3)
    assert len(losses) == 5 and seen["training"] is False
    (first_mix, first_steps, first_seed), (mix, steps, seed) = calls
    plain = sft_module.demonstrations(specs, cfg.sft_fraction, cfg.seed)
    assert first_mix == plain + revisions and (first_steps, steps) == (2, 3) and seed != first_seed
    assert mix == own_phase(plain, 1, own(None, None), cfg.seed) and revisions[0] not in mix
    warm_start(cfg, specs, tmp_path / "first", revisions=revisions)
    first, _ = load_policy(tmp_path / "first")
    trained, _ = load_policy(tmp_path / "own")
    assert all(torch.equal(seen["weights"][k], v) for k, v in first.state_dict().items())     # the first SFT's model
    assert any(not torch.equal(seen["weights"][k], v) for k, v in trained.state_dict().items())   # then trained on
    with pytest.raises(ValueError, match="own-mistake revision demos: none were built"):
        warm_start(cfg, specs, tmp_path / "none", revisions=revisions, own_revisions=lambda m, t: [], own_steps=3)


def test_the_own_phase_keeps_the_first_sfts_mix():
    plain = [(f"p{i}", "c\n") for i in range(100)]
    own = [(f"o{i}", [("w\n", False), ("obs\n", False), ("fix\n", True)]) for i in range(10)]
    mix = own_phase(plain, 50, own, seed=0)                  # the first SFT: 100 demonstrations to 50 revision demos
    assert mix[-10:] == own and len(mix) == 30 and len({p for p, _ in mix[:20]}) == 20 and set(mix[:20]) <= set(plain)
    assert mix == own_phase(plain, 50, own, seed=0) and mix != own_phase(plain, 50, own, seed=1)
    capped = own_phase(plain, 5, own)                        # 10 own to 5: 200 asked, every demonstration once
    assert len(capped) == 110 and set(capped[:100]) == set(plain)
