"""Any local Hugging Face causal LM: tiny random Llama and Qwen2 models created here (nothing
downloaded), loaded through the Auto classes, sampled by the engine, post-trained by the nightly
flow, and saved back in a layout `AutoModelForCausalLM.from_pretrained` loads as is.

    .venv/bin/python -m pytest tests/model/test_hf_models.py -q

The Llama tokenizer has a BOS, no pad token (EOS stands in) and no chat template; the Qwen2 one
has no BOS, a ChatML chat template, and an end-of-turn token that only its generation config
names as an EOS (a list), like a real instruct model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

from envs.registry import get_family
from ratchet.config import ModelConfig
from ratchet.model import context_length, encode_prompts, eos_ids, load_policy, use_chat_template
from ratchet.rollout import decoders as engine_decoders
from ratchet.rollout.torch_engine import TorchEngine
from tests.model.tiny import preflight_reads_weights

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONTEXT = 512


def _corpus(n: int = 80) -> list[str]:
    fam = get_family("python_functions")
    specs = [fam.generate(fam.config(), 0, i, 1 + i % 3, "train") for i in range(n)]
    return [s.prompt + (s.reference_solution or "") for s in specs]


def _bpe(specials: list[str], vocab_size: int = 320) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def make_llama(path: Path) -> Path:
    """A random 2-layer Llama (grouped-query attention) with a BOS, no pad token and no chat template."""
    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(["<unk>", "<s>", "</s>"]),
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, tie_word_embeddings=False, initializer_range=0.3,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_qwen2(path: Path) -> Path:
    """A random 2-layer Qwen2 (q/k/v biases, tied embeddings) with a ChatML template, no BOS, and
    <|im_end|> an EOS only through generation_config.json's list."""
    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
                                  eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    endoftext, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, tie_word_embeddings=True, initializer_range=0.3,
        bos_token_id=None, eos_token_id=endoftext, pad_token_id=endoftext))
    model.generation_config = GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=endoftext)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


ARCHS = {"llama": make_llama, "qwen2": make_qwen2}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hf_dir(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, ARCHS[request.param](tmp_path_factory.mktemp(request.param))


def test_auto_classes_load_tokenizer_eos_context_and_chat_template(hf_dir):
    arch, path = hf_dir
    model, tok = load_policy(path, ModelConfig(device="cpu"))
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert context_length(model) == CONTEXT
    if arch == "llama":
        assert tok.pad_token_id == tok.eos_token_id                     # the fallback: none was saved
        assert eos_ids(model, tok) == [tok.eos_token_id]
        assert not use_chat_template("auto", tok)
        with pytest.raises(ValueError, match="no chat template"):
            use_chat_template("on", tok)
    else:
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        assert eos_ids(model, tok) == [tok.eos_token_id, im_end]        # the tokenizer's, then the generation config's
        assert use_chat_template("auto", tok) and not use_chat_template("off", tok)


@pytest.mark.parametrize("breaks", ["compiled", "renamed", "dropped"])
def test_weights_that_do_not_make_the_model_are_refused_by_load_and_preflight_alike(hf_dir, tmp_path, breaks):
    """transformers loads a checkpoint whose names do not match its config with those weights left
    random and only a logged table, so the run would post-train noise. Qwen2's lm_head is tied (not in
    the file) and Llama's is not: neither is a gap."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ratchet.preflight import check_model_dir

    _, good = hf_dir
    assert check_model_dir(str(good)) == []
    path = Path(shutil.copytree(good, tmp_path / "model"))
    weights = load_file(path / "model.safetensors")
    if breaks == "compiled":       # a torch.compile'd model's state dict
        weights = {f"_orig_mod.{k}": v for k, v in weights.items()}
    elif breaks == "renamed":
        weights["model.final_norm.weight"] = weights.pop("model.norm.weight")
    else:
        del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        load_policy(path)
    first = {"compiled": "model.embed_tokens.weight", "renamed": "model.norm.weight",
             "dropped": "model.layers.1.mlp.up_proj.weight"}[breaks]
    assert str(e.value).startswith(f"{path}: the weights do not fit the model config.json describes: ")
    assert first in str(e.value) and "\n" not in str(e.value)
    if preflight_reads_weights():   # the same refusal before the run, from the file headers
        assert check_model_dir(str(path)) == [f"model.path {str(path)!r}: {str(e.value).split(': ', 1)[1]}"]


def test_prompts_through_the_chat_template_get_one_bos_and_the_generation_prompt(hf_dir):
    arch, path = hf_dir
    model, tok = load_policy(path)
    plain = TorchEngine(model, tok).encode_prompts(["def f(x):\n"])[0]
    if arch == "llama":
        assert plain[0] == tok.bos_token_id and plain[1:] == tok("def f(x):\n", add_special_tokens=False)["input_ids"]
        return
    assert plain == tok("def f(x):\n", add_special_tokens=False)["input_ids"]    # no BOS in Qwen2's vocabulary
    chat = TorchEngine(model, tok, chat_template=True).encode_prompts(["def f(x):\n"])[0]
    assert tok.decode(chat) == "<|im_start|>user\ndef f(x):\n<|im_end|>\n<|im_start|>assistant\n"


def _hf_greedy(model, ids: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("chat", [False, True])
def test_greedy_rollouts_equal_hf_generate(hf_dir, chat):
    """The engine's batched, left-padded, prefix-shared greedy decode (the fused decoder for both
    architectures) gives, prompt by prompt, exactly HF `generate`'s tokens, stopping at any EOS id."""
    arch, path = hf_dir
    if chat and arch == "llama":
        pytest.skip("the Llama tokenizer has no chat template")
    model, tok = load_policy(path)
    model.eval()
    engine = TorchEngine(model, tok, chat_template=chat)
    assert engine_decoders.LlamaDecoder.supports(model)
    prompts = ["# add 3\ndef f(x):\n", "# reverse it, then make it lowercase\ndef f(s):\n", "def g(y):\n"]
    out = engine.generate(prompts, n=2, greedy=True, max_new_tokens=24)
    with torch.no_grad():
        ref = [_hf_greedy(model, ids, 24, engine.eos_ids) for ids in engine.encode_prompts(prompts)]
    assert [r.completion_ids for r in out] == [c for c in ref for _ in range(2)]
    for r in out:
        assert r.finished == (r.completion_ids[-1] in engine.eos_ids)


def test_every_eos_id_of_the_generation_config_ends_a_sequence(tmp_path):
    """An id named only in generation_config.json's eos list stops a row: it is the completion's last
    token, the text leaves it out, and HF `generate` stops at the same place."""
    path = make_qwen2(tmp_path)
    model, tok = load_policy(path)
    prompt = ["# add 3\ndef f(x):\n"]
    free = TorchEngine(model.eval(), tok).generate(prompt, greedy=True, max_new_tokens=24)[0].completion_ids
    stop = free[5]                                               # a token the model emits greedily
    gen = GenerationConfig.from_pretrained(path)
    gen.eos_token_id = [*gen.eos_token_id, stop]
    gen.save_pretrained(path)
    model, tok = load_policy(path)
    engine = TorchEngine(model.eval(), tok)
    assert engine.eos_ids[-1] == stop
    r = engine.generate(prompt, greedy=True, max_new_tokens=24)[0]
    cut = free.index(stop) + 1
    assert r.finished and r.completion_ids == free[:cut]
    assert r.text == tok.decode(free[:cut - 1])
    with torch.no_grad():
        assert _hf_greedy(model, engine.encode_prompts(prompt)[0], 24, engine.eos_ids) == free[:cut]


def test_qwen2_fused_decoder_matches_hf_forward_with_a_cache(tmp_path, monkeypatch):
    """Sampling with the fused decoder and with the model's own forward (DynamicCache) gives the same
    tokens and log-probs; rows finish at either EOS id and leave the batch early."""
    model, tok = load_policy(make_qwen2(tmp_path))
    engine = TorchEngine(model.eval(), tok, chat_template=True)
    kwargs = dict(n=4, max_new_tokens=20, temperature=1.5, batch_size=6, seed=3)
    prompts = ["# add 3\ndef f(x):\n", "# reverse it\ndef f(s):\n"]
    fast = engine.generate(prompts, **kwargs)
    monkeypatch.setattr(engine_decoders.LlamaDecoder, "supports", staticmethod(lambda model: False))
    slow = engine.generate(prompts, **kwargs)
    assert [r.completion_ids for r in fast] == [r.completion_ids for r in slow]
    for f, s in zip(fast, slow):
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=1e-4)


def test_a_prompt_past_the_models_context_is_one_clear_error(hf_dir):
    """The run's engines check the context; a probe past it (check_context off) decodes on."""
    _, path = hf_dir
    model, tok = load_policy(path)
    prompts = ["def f(x):\n", "x = 1\n" * 200]
    with pytest.raises(ValueError, match=f"prompt 1: .* exceed the model's context of {CONTEXT} tokens"):
        TorchEngine(model, tok, check_context=True).generate(prompts, max_new_tokens=16)
    assert len(TorchEngine(model, tok).generate(prompts, max_new_tokens=2, greedy=True)) == 2


def _fn_spec(task_id: str, prompt: str):
    from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, TaskSpec

    return TaskSpec(task_id=task_id, family="handmade", prompt=prompt, reference_solution="    return x + 1\n",
                    execution_steps=(OverwriteFile(path="/app/solution.py", content="def f(x):\n" + COMPLETION),
                                     CheckCalls(entry_point="f")),
                    tests=(CallTest(args="[1]", expected="2"), CallTest(args="[5]", expected="6")))


def test_the_runs_prompt_room_is_the_run_engines_own_count(hf_dir):
    """ratchet.model.prompt_room (what the nightly's fit_to_context checks) counts a prompt as the run's engine
    encodes it, chat template included: a prompt whose plain tokens fill the room exactly fits the
    Llama (no template), and is too long for the Qwen2 once its ChatML turn is around it, where the
    engine refuses it too."""
    from ratchet.config import NightlyConfig
    from ratchet.model import prompt_room
    from ratchet.train.session import load_engine

    arch, path = hf_dir
    cfg = ModelConfig(path=str(path), max_seq_len=CONTEXT, device="cpu")
    engine = load_engine(path, NightlyConfig(model=cfg))
    assert engine.chat_template == (arch == "qwen2")
    prompt = "def f(x):\n"
    while len(encode_prompts(engine.tokenizer, [prompt + "x = 1\n"])[0]) <= CONTEXT - 4:
        prompt += "x = 1\n"
    max_new = CONTEXT - len(encode_prompts(engine.tokenizer, [prompt])[0])   # the plain prompt fills the rest
    (why,) = prompt_room(cfg, max_new)([prompt])
    chat_tokens = len(engine.encode_prompts([prompt])[0])
    if arch == "llama":
        assert why is None
        assert len(engine.generate([prompt], max_new_tokens=max_new, greedy=True)) == 1
    else:
        assert why == f"prompt is {chat_tokens} tokens + max_new_tokens {max_new}, over the model's context of {CONTEXT} tokens"
        with pytest.raises(ValueError, match=f"prompt 0: {chat_tokens} tokens"):
            engine.generate([prompt], max_new_tokens=max_new, greedy=True)
    assert prompt_room(ModelConfig(), 16) is None          # the embedded model: no tokenizer before its warm start


def test_a_max_seq_len_below_the_models_context_is_the_runs_context(hf_dir):
    """model.max_seq_len is what the wave gate holds prompt + completion to. A model directory with a
    longer context of its own once kept (and sampled) prompts that fit the model but not max_seq_len,
    and episodes grew to the model's context: the first wave that drew one failed the gate. The room,
    and the engine that samples episodes, work within max_seq_len."""
    from ratchet.config import NightlyConfig
    from ratchet.model import prompt_room
    from ratchet.train.session import load_engine

    _, path = hf_dir
    cfg = ModelConfig(path=str(path), max_seq_len=CONTEXT // 2, device="cpu")
    assert load_engine(path, NightlyConfig(model=cfg)).context == CONTEXT // 2
    room = prompt_room(cfg, 12)
    prompt = "def f(x):\n" + "x = 1\n" * 60
    (tokens,) = room.tokens([prompt])
    assert CONTEXT // 2 < tokens + 12 <= CONTEXT
    assert room.why(tokens) == f"prompt is {tokens} tokens + max_new_tokens 12, over model.max_seq_len of {CONTEXT // 2} tokens"
    wide = prompt_room(cfg.model_copy(update={"max_seq_len": CONTEXT}), 12)
    assert wide.context == CONTEXT and wide.why(tokens) is None


@pytest.mark.parametrize("turns", [1, 2])
def test_the_engines_context_error_names_the_task(hf_dir, turns):
    """The engine's check stays as the last guard; evaluation (single- and multi-turn) names the task."""
    from ratchet.config import AgentConfig, NightlyConfig
    from ratchet.eval import evaluate
    from ratchet.train.session import load_engine

    _, path = hf_dir
    engine = load_engine(path, NightlyConfig(model=ModelConfig(path=str(path), max_seq_len=CONTEXT, device="cpu")))
    specs = [_fn_spec("short", "def f(x):\n"), _fn_spec("imported-x/long", "x = 1\n" * 400)]
    with pytest.raises(ValueError, match=r"^task imported-x/long \(prompt 1\): \d+ tokens \+ max_new_tokens 8 exceed "
                                         f"the model's context of {CONTEXT} tokens"):
        evaluate(engine, specs, max_new_tokens=8, agent=AgentConfig(turns=turns))


def _train_a_little(model, tok) -> dict:
    """Sample 4 rollouts and take the torch trainer's steps on them (rewards 0, 1, 0, 1)."""
    from ratchet.config import NightlyConfig, TrainConfig
    from ratchet.train.batching import TrainSample
    from ratchet.train.torch_trainer import TorchTrainer

    rollouts = TorchEngine(model, tok).generate(["def f(x):\n"], n=4, max_new_tokens=8, seed=0)
    cfg = NightlyConfig(train=TrainConfig(bf16=True))
    trainer = TorchTrainer(model, tok.pad_token_id, cfg.train, cfg.rl)
    samples = [TrainSample(r.prompt_ids, r.completion_ids, r.logprobs, None, "g", reward=float(i % 2))
               for i, r in enumerate(rollouts)]
    before = [p.detach().clone() for p in model.parameters()]
    metrics = trainer.train_wave(trainer.assign_advantages(samples))
    assert metrics["optimizer_steps"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"trainer": trainer, **metrics}


def test_bfloat16_weights_sample_train_and_save_as_bfloat16(tmp_path):
    from ratchet.model import save_policy

    model, tok = load_policy(make_qwen2(tmp_path / "src"), ModelConfig(device="cpu", dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    _train_a_little(model, tok)
    save_policy(model, tok, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert again.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_the_model_engine_and_trainer_share_the_device(hf_dir, dtype):
    _, path = hf_dir
    model, tok = load_policy(path, ModelConfig(device="auto", dtype=dtype))
    assert next(model.parameters()).device.type == "cuda" and next(model.parameters()).dtype == getattr(torch, dtype)
    assert TorchEngine(model, tok).device.type == "cuda"
    trainer = _train_a_little(model, tok)["trainer"]
    assert trainer.device.type == "cuda" and trainer._autocast          # train.bf16: autocast fires on CUDA


# -- the nightly flow on each architecture --

def _nightly_cfg(store_uri: str, model_path: Path, run_id: str):
    from ratchet.config import (EnvsConfig, EvalConfig, GateConfig, MonitorConfig, NightlyConfig, RLConfig,
                                RolloutConfig, StoreConfig, TrainConfig, WatchConfig)

    return NightlyConfig(
        run_id=run_id, steps=2, checkpoint_every=2,
        store=StoreConfig(uri=store_uri),
        envs=EnvsConfig(n_train=40, n_heldout=8),
        model=ModelConfig(path=str(model_path), max_seq_len=CONTEXT, device="cpu"),
        rollout=RolloutConfig(prompts_per_wave=3, group_size=3, max_new_tokens=12),
        # a random model solves nothing: every reward is equal, so keep the groups and let the entropy
        # bonus give the loss a gradient; what is tested is that the flow trains and saves this model
        rl=RLConfig(drop_zero_variance=False, entropy_coef=0.05),
        train=TrainConfig(minibatch_prompts=3, updates_per_batch=1, lr=1e-2),
        gate=GateConfig(max_zero_variance_frac=1.0),
        monitor=MonitorConfig(max_zero_variance_frac=None),       # all-equal groups are expected here
        eval=EvalConfig(n_tasks=4, min_gain=1.0),
        watch=WatchConfig(tensorboard=False, plots=False),
    )


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_nightly_post_trains_the_model_and_saves_it_in_hf_layout(arch, prefect_harness, tmp_path):
    from flows.nightly import nightly
    from ratchet.store import open_store
    from ratchet.train import session as sessions

    source = ARCHS[arch](tmp_path / "model")
    store_uri = str(tmp_path / "store")
    summary = nightly(_nightly_cfg(store_uri, source, f"hf-{arch}"))
    assert summary["policy_version"] == 2
    store = open_store(store_uri)
    final = store.get_dir(store.get_pointer(f"runs/hf-{arch}/checkpoints/LATEST"), tmp_path / "final")
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "trainer.pt", "ledger.json"} <= {p.name for p in final.iterdir()}

    loaded = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert loaded.config.model_type == arch and type(loaded).__name__ == type(
        AutoModelForCausalLM.from_pretrained(source)).__name__
    live = sessions._SESSIONS[f"hf-{arch}"].model                       # the trainer's weights, in this process
    ids = torch.tensor([tok("def f(x):\n    return x\n", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, live(ids).logits, atol=0, rtol=0)
        moved = AutoModelForCausalLM.from_pretrained(source)(ids).logits
    assert not torch.allclose(moved, loaded(ids).logits), "the flow did not train the model"
    saved_gen = json.loads((final / "generation_config.json").read_text())
    assert saved_gen["eos_token_id"] == GenerationConfig.from_pretrained(source).eos_token_id
    assert tok.chat_template == AutoTokenizer.from_pretrained(source).chat_template
    wave = store.read_table(f"runs/hf-{arch}/waves/000001/trajectories.parquet")
    chat = arch == "qwen2"       # model.chat_template "auto": the prompts went through Qwen2's template
    assert wave["prompt_tokens"].to_list() == [len(ids) for ids in encode_prompts(tok, wave["prompt"].to_list(), chat)]


def _long_prompt_source(path: Path, heldout: list[tuple[str, str]]) -> Path:
    """A task file: held-out tasks (task id, prompt) and one short training task."""
    def line(task_id: str, prompt: str, k: int, split: str) -> str:
        return json.dumps({"task_id": task_id, "prompt": prompt, "reference_solution": f"    return x + {k}\n", "split": split,
                           "execution_steps": [{"action": "overwrite_file", "path": "/app/solution.py",
                                                "content": "def f(x):\n<model_generated_code>"},
                                               {"action": "check_calls", "entry_point": "f"}],
                           "tests": [{"args": "[1]", "expected": str(1 + k)}, {"args": "[5]", "expected": str(5 + k)}]})

    lines = [line(task_id, prompt, k, "heldout") for k, (task_id, prompt) in enumerate(heldout, start=1)]
    path.write_text("\n".join([*lines, line("train", "def f(x): return two more than x\n", 2, "train")]) + "\n")
    return path


LONG_PROMPT = "".join(f"Note {i}: f must handle the integer {i} correctly. " for i in range(80))   # 4,000 characters
OTHER_LONG_PROMPT = "".join(f"Case {i}: given {i}, f answers {i} plus one, never less. " for i in range(80))


def test_a_held_out_prompt_past_the_context_is_quarantined_and_the_run_goes_on(prefect_harness, tmp_path):
    """A task file with a held-out task whose prompt (4,000 characters) leaves the model no room to answer:
    the nightly drops it for this run (runs/<run_id>/context/too_long.parquet, naming the token count) and
    trains and evaluates on the rest (the engine used to refuse the whole base evaluation). The audit is
    the model's no business: the shared audit table passes the task, with no too_long verdict."""
    from flows.nightly import nightly
    from ratchet.store import open_store

    src = _long_prompt_source(tmp_path / "longp.jsonl", [("longp", LONG_PROMPT),
                                                         ("short", "Write f(x) returning x plus seven, for held-out checking\n")])
    cfg = _nightly_cfg(str(tmp_path / "store"), make_llama(tmp_path / "model"), "longp")
    cfg = cfg.model_copy(update={"steps": 1, "checkpoint_every": 1,
                                 "envs": cfg.envs.model_copy(update={"sources": (str(src),)})})
    summary = nightly(cfg)

    assert summary["policy_version"] == 1
    assert all(not c.get("too_long") for c in summary["audits"])
    store = open_store(str(tmp_path / "store"))
    version = summary["sources"][0]["version"]
    audited = store.read_table(f"envs/imported-longp/{version}/audit.parquet")
    assert "too_long" not in audited["verdict"].to_list()
    assert audited.filter(audited["task_id"] == "imported-longp/longp")["verdict"].to_list() == ["pass"]
    assert not store.exists(f"envs/imported-longp/{version}/quarantine.parquet") or \
        store.read_table(f"envs/imported-longp/{version}/quarantine.parquet").height == 0
    assert summary["too_long"]["tasks"] == 1
    quarantine = store.read_table(summary["too_long"]["quarantine"][len(store.root_uri) + 1:])
    assert summary["too_long"]["quarantine"].endswith("runs/longp/context/too_long.parquet")
    assert quarantine.select("task_id", "family", "split").rows() == [("imported-longp/longp", "imported-longp", "heldout")]
    tokens = quarantine["prompt_tokens"][0]
    assert tokens + 12 > CONTEXT
    assert quarantine["reason"][0] == f"prompt is {tokens} tokens + max_new_tokens 12, over the model's context of {CONTEXT} tokens"
    for stage in ("base", "final"):
        evaluated = set(store.read_table(summary[stage]["eval"][len(store.root_uri) + 1:])["task_id"])
        assert "imported-longp/short" in evaluated and "imported-longp/longp" not in evaluated


def test_a_source_left_without_held_out_tasks_stops_the_run_naming_it(prefect_harness, tmp_path):
    """Every held-out prompt of a source past the context: the run stops before anything samples, with one
    error naming the source and why (not the task-table gate's report on an empty table)."""
    from flows.nightly import nightly
    from ratchet.room import NoTasksLeft
    from ratchet.store import open_store

    src = _long_prompt_source(tmp_path / "allong.jsonl", [("longp", LONG_PROMPT), ("longq", OTHER_LONG_PROMPT)])
    cfg = _nightly_cfg(str(tmp_path / "store"), make_llama(tmp_path / "model"), "allong")
    cfg = cfg.model_copy(update={"envs": cfg.envs.model_copy(update={"sources": (str(src),)})})
    with pytest.raises(NoTasksLeft, match=r"source imported-allong \S+: no held-out task left for this run's model: "
                                          r"all 2 of its held-out task\(s\) have prompts that leave no room for "
                                          rf"rollout.max_new_tokens 12 in the model's context of {CONTEXT} tokens"):
        nightly(cfg)
    store = open_store(str(tmp_path / "store"))
    assert store.read_table("runs/allong/context/too_long.parquet").height == 2
    assert not store.list("runs/allong/eval/")
