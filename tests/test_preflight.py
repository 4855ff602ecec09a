"""ratchet.preflight: every setting that would fail later, found before anything starts.

    .venv/bin/python -m pytest tests/test_preflight.py -q
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from ratchet.config import EnvsConfig, ModelConfig, NightlyConfig, StoreConfig, TrainConfig
from ratchet.preflight import SettingsError, check, check_run_id, check_store, require
from tests.model.tiny import preflight_reads_weights, tiny_llama

READS_WEIGHTS = pytest.mark.skipif(not preflight_reads_weights(), reason="transformers' loading internals moved: "
                                   "preflight does not match weight names here (load_policy still refuses)")


def test_defaults_pass(tmp_path):
    assert check(NightlyConfig(store=StoreConfig(uri=str(tmp_path / "new" / "store")))) == []
    assert not (tmp_path / "new").exists()          # checked, not created


@pytest.mark.parametrize("run_id", ["../evil", "a/b", "a..b", "..", ".", "-rf", "é", "a b", "x" * 129, ""])
def test_hostile_run_ids_are_refused_by_the_config_itself(run_id):
    with pytest.raises(ValidationError, match="run_id"):
        NightlyConfig(run_id=run_id)
    assert check_run_id(run_id)


@pytest.mark.parametrize("run_id", ["r1", "nightly-20250101-020000", "A.b_c-9", "x" * 128])
def test_good_run_ids(run_id):
    assert NightlyConfig(run_id=run_id).run_id == run_id and check_run_id(run_id) == []


def test_run_id_pattern_is_in_the_form_schema():
    schema = NightlyConfig.model_json_schema()["properties"]["run_id"]
    assert any("pattern" in s for s in schema.get("anyOf", [schema]))


@pytest.mark.parametrize("uri, needle", [
    ("ftp://x/y", "unsupported scheme 'ftp'"),
    ("s3://", "names no bucket"),
    ("s3:///prefix", "names no bucket"),
    ("s3://UPPER/x", "not a valid S3 bucket name"),
    ("file://", "names no directory"),
])
def test_store_uri_schemes(uri, needle):
    (problem,) = check_store(uri)
    assert needle in problem and repr(uri) in problem


def test_local_store_that_is_a_file_or_under_one(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    assert "is not a directory" in check_store(str(f))[0]
    assert "is not a directory" in check_store(f"file://{f}/deeper/store")[0]
    assert check_store(f"file://{tmp_path}/ok") == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def _copy(tiny: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny, tmp_path / "model"))


def _edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_model_path(tmp_path, tiny):
    assert "no such directory" in check(NightlyConfig(model=ModelConfig(path=str(tmp_path / "nope"))))[0]
    assert "no config.json" in check(NightlyConfig(model=ModelConfig(path=str(tmp_path))))[0]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cfg = NightlyConfig(model=ModelConfig(path=str(tmp_path)), store=StoreConfig(uri=str(tmp_path / "s")))
    assert [p.split(": ")[1][:12] for p in check(cfg)] == ["no weights (", "no tokenizer"]
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert [p.split(": ")[1][:29] for p in check(cfg)] == [      # the right names are not enough
        "model.safetensors is not a re", "the tokenizer does not load ("]
    assert check(cfg.model_copy(update={"model": ModelConfig(path=str(tiny))})) == []


def test_model_dir_that_cannot_be_post_trained(tmp_path, tiny):
    """Each problem of an HF directory is named before the run starts; a non-model dir is one problem."""
    path = _copy(tiny, tmp_path)
    own = json.loads((tiny / "config.json").read_text())   # the weights' config: a case changes only what it tests

    def problems(config, **model):
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        return check(NightlyConfig(model=ModelConfig(path=str(path), **model), store=StoreConfig(uri=str(tmp_path / "s"))))

    assert "not readable JSON" in problems('{"model_type": ')[0]
    assert problems({"architectures": ["LlamaForCausalLM"]}) == [
        f"model.path {str(path)!r}: config.json names no model_type, so not a Hugging Face model directory"]
    assert "name no causal LM" in problems({"model_type": "bert", "architectures": ["BertForMaskedLM"]})[0]
    assert problems(own, chat_template="on") == [
        f"model.chat_template 'on': the tokenizer in {str(path)!r} has no chat template"]
    _edit_json(path / "tokenizer_config.json", chat_template="{{ messages[0]['content'] }}")
    assert problems(own, chat_template="on") == []
    assert problems({**own, "max_position_embeddings": 128}, max_seq_len=256) == [
        f"model.max_seq_len 256 exceeds the model's context of 128 tokens ({path}/config.json)"]
    gpt2 = problems({"model_type": "gpt2", "n_positions": 32}, max_seq_len=32)   # the Llama weights do not fit it
    assert any("leaves no room for a prompt in the model's context of 32" in p for p in gpt2)
    assert not preflight_reads_weights() or "the weights do not fit" in gpt2[0]


def _no_eos(path: Path) -> None:
    shutil.rmtree(path)
    tiny_llama(path, eos=False)


def _too_many_tokens(path: Path) -> None:
    shutil.rmtree(path)
    tiny_llama(path, extra_tokens=500)


def _shard_index(path: Path) -> None:
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    shards = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
              "lm_head.weight": "model-00002-of-00002.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _compiled(path: Path) -> None:
    """A torch.compile'd model's state dict: every name starts with '_orig_mod.'."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    save_file({f"_orig_mod.{k}": v for k, v in weights.items()}, path / "model.safetensors", metadata={"format": "pt"})


# (case, how the good directory is broken, what the one line says after "model.path '<dir>': ")
BROKEN = [
    ("no-eos", _no_eos, "no end-of-sequence token: neither the tokenizer nor generation_config.json nor config.json"),
    ("corrupt-weights", lambda p: (p / "model.safetensors").write_bytes(b"garbage"),
     "model.safetensors is not a readable safetensors file (SafetensorError: Error while deserializing header"),
    ("truncated-weights", _truncate, "model.safetensors is not a readable safetensors file (SafetensorError: "),
    ("missing-shard", _shard_index, "model.safetensors.index.json names 1 shard(s) not in the directory: "
                                    "model-00002-of-00002.safetensors"),
    ("unknown-model-type", lambda p: _edit_json(p / "config.json", model_type="nosuchmodel"),
     "transformers cannot load config.json (ValueError: The checkpoint you are trying to load has model type "
     "`nosuchmodel` but Transformers does not recognize this architecture)"),
    ("tokenizer-config-only", lambda p: (p / "tokenizer.json").unlink(),
     "the tokenizer does not load (ValueError: Couldn't instantiate the backend tokenizer"),
    ("chat-template-syntax", lambda p: _edit_json(p / "tokenizer_config.json", chat_template="{% for m in messages %}"),
     "the chat template does not render a user turn (TemplateSyntaxError: Unexpected end of template"),
    ("chat-template-raises", lambda p: _edit_json(p / "tokenizer_config.json",
                                                  chat_template="{{ raise_exception('system turns only') }}"),
     "the chat template does not render a user turn (TemplateError: system turns only; fix it, or set "
     "model.chat_template 'off')"),
    ("compiled-state-dict", _compiled, "the weights do not fit the model config.json describes: 12 of the model's "
     "weights are not in the files (first: lm_head.weight, model.embed_tokens.weight, model.layers.0.input_layernorm"
     ".weight); the files hold 12 weights the model has no place for (first: _orig_mod.lm_head.weight, ", READS_WEIGHTS),
    ("config-of-another-width", lambda p: _edit_json(p / "config.json", hidden_size=64, intermediate_size=128),
     "the weights do not fit the model config.json describes: 12 have another shape in the files (first: "
     "lm_head.weight, [292, 32] in the files, [292, 64] in the model)", READS_WEIGHTS),
    ("vocab-past-embeddings", _too_many_tokens,
     "the tokenizer has 759 tokens, more than the model's 292 embedding rows (config.json vocab_size)"),
]


@pytest.mark.parametrize("breaks, says", [pytest.param(*c[1:3], id=c[0], marks=c[3:]) for c in BROKEN])
def test_a_model_dir_that_would_fail_mid_run_stops_run_with_one_line(tmp_path, tiny, monkeypatch, breaks, says):
    """Each passed the file-name checks and then failed the run with a traceback (loading, rendering
    the first prompt, or the first forward pass); now `ratchet run` exits 2 with one line for it."""
    from typer.testing import CliRunner

    from ratchet.cli import app

    path = _copy(tiny, tmp_path)
    breaks(path)
    monkeypatch.setitem(sys.modules, "flows.nightly", None)     # a run that got past preflight fails loudly
    res = CliRunner().invoke(app, ["run", "--model", str(path), "--store", str(tmp_path / "s")])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.output
    assert res.stderr.startswith(f"error: model.path {str(path)!r}: {says}"), res.stderr


def test_a_chat_template_that_does_not_render_is_no_problem_when_off(tmp_path, tiny):
    path = _copy(tiny, tmp_path)
    _edit_json(path / "tokenizer_config.json", chat_template="{% for m in messages %}")
    store = StoreConfig(uri=str(tmp_path / "s"))
    assert check(NightlyConfig(model=ModelConfig(path=str(path), chat_template="off"), store=store)) == []
    assert len(check(NightlyConfig(model=ModelConfig(path=str(path)), store=store))) == 1


def test_a_chat_template_that_cannot_add_a_turn_is_a_problem_for_multi_turn_runs(tmp_path, tiny):
    """This template renders the last message only: a user turn renders, but the conversation with
    the feedback added does not extend it, which the first multi-turn wave found (observation_ids)."""
    path = _copy(tiny, tmp_path)
    _edit_json(path / "tokenizer_config.json", chat_template=(
        "{% for m in messages %}{% if loop.last %}<|{{ m.role }}|>{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"))

    def problems(turns, chat_template="auto"):
        return check(NightlyConfig.model_validate({
            "model": {"path": str(path), "chat_template": chat_template}, "agent": {"turns": turns},
            "store": {"uri": str(tmp_path / "s")}}))

    assert problems(1) == [] and problems(2, chat_template="off") == []
    assert problems(2) == [
        f"model.path {str(path)!r}: agent.turns 2: the chat template cannot add a user turn after an answer "
        "(ValueError: chat template: rendering the conversation with a new user message does not extend its "
        "rendering without it, so an observation cannot be appended over the KV cache; fix it, set "
        "model.chat_template 'off' or agent.turns 1)"]


def test_chat_template_on_needs_a_model_path(tmp_path):
    """The embedded model's tokenizer (trained in the warm start) has no chat template: 'on' failed
    the run at its first engine, after env production, audit and the warm start."""
    store = StoreConfig(uri=str(tmp_path / "s"))
    assert check(NightlyConfig(model=ModelConfig(chat_template="on"), store=store)) == [
        "model.chat_template 'on': the embedded model (no model.path) has no chat template (set 'auto' or 'off', "
        "or give a model.path whose tokenizer has one)"]
    assert check(NightlyConfig(model=ModelConfig(chat_template="auto"), store=store)) == []


def test_zero3_is_refused_for_a_run_that_samples_in_process(tmp_path):
    """ZeRO-3 partitions the module the in-process engine samples and evaluates with: generate failed
    with an IndexError on the empty weights (sync) or a size mismatch (async copy), after the run began."""
    store = StoreConfig(uri=str(tmp_path / "store"))
    problems = check(NightlyConfig(train=TrainConfig(backend="deepspeed", zero_stage=3), store=store))
    assert [p for p in problems if "zero_stage" in p] == [
        "train.zero_stage 3: ZeRO-3 partitions the policy's parameters, and the run samples and evaluates with "
        "that same module in this process (its engine would see empty weights); use zero_stage 0-2 for a run "
        "(ZeRO-3 trains a stored wave with `python -m ratchet.train.launch`)"]
    assert not [p for p in check(NightlyConfig(train=TrainConfig(backend="deepspeed", zero_stage=2), store=store))
                if "zero_stage" in p]


def test_require_lists_every_problem(tmp_path):
    cfg = NightlyConfig.model_validate({
        "store": {"uri": "ftp://x/y"}, "envs": {"families": ["nope"], "version": "a/b"},
        "model": {"hidden_size": 100, "num_heads": 3, "max_seq_len": 32}, "rollout": {"max_new_tokens": 48}})
    with pytest.raises(SettingsError) as e:
        require(cfg)
    text = "\n".join(e.value.problems)
    assert len(e.value.problems) == 5, text
    for needle in ("store.uri", "unknown environment family 'nope'", "envs.version", "model.num_heads",
                   "rollout.max_new_tokens"):
        assert needle in text


def test_s3_missing_bucket_is_created_and_nothing_else_written(s3_env):
    from minio import Minio

    client = Minio(s3_env["RATCHET_S3_ENDPOINT"], access_key="testing", secret_key="testing", secure=False)
    assert not client.bucket_exists("preflight-new")
    assert check_store("s3://preflight-new/runs") == []
    assert client.bucket_exists("preflight-new") and list(client.list_objects("preflight-new", recursive=True)) == []
    assert check_store("s3://preflight-new/runs") == []     # and again, now that it exists


def test_s3_without_endpoint_or_credentials(monkeypatch):
    for name in ("RATCHET_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    problems = check_store("s3://bucket/prefix")
    assert len(problems) == 2 and "RATCHET_S3_ENDPOINT" in problems[0] and "AWS_ACCESS_KEY_ID" in problems[1]


TASK = {"task_id": "t1", "prompt": "p", "execution_steps": [{"action": "check_calls", "entry_point": "f"}],
        "tests": [{"args": "[1]", "expected": "2"}]}


def _tasks(*ids_splits, prompt=None) -> str:
    """JSONL of TASK under each (id, split); each prompt its own words (one prompt for all: `prompt`),
    as the run's dedup and decontamination would otherwise leave one task of them."""
    def words(i: str) -> str:
        return " ".join(hashlib.sha256(f"{i}-{k}".encode()).hexdigest()[:8] for k in range(8))

    return "".join(json.dumps({**TASK, "task_id": i, "prompt": prompt or words(i), **({"split": s} if s else {})}) + "\n"
                   for i, s in ids_splits)


def test_task_sources(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(_tasks(("t1", None), ("t2", "heldout")) + "not json\n")
    bad.write_text("not json\n")
    store = StoreConfig(uri=str(tmp_path / "store"))
    assert check(NightlyConfig(store=store, envs=EnvsConfig(sources=(str(good),)))) == []   # a bad line: the run's to quarantine
    problems = check(NightlyConfig(store=store, envs=EnvsConfig(sources=(
        str(bad), str(tmp_path / "gone.jsonl"), "s3://elsewhere/x.jsonl"))))
    assert [p.split(": ", 1)[0] for p in problems] == ["envs.sources"] * 3
    assert "no good task line (1 bad; first: " in problems[0] and f"{bad}:1: field '(json)'" in problems[0]
    assert "no such file" in problems[1] and "must lie in the run's store" in problems[2]


def test_a_task_source_needs_both_splits(tmp_path):
    """The run gates each source's audited train and held-out tables as non-empty: a file whose
    tasks all fall in one split (declared, or by the task-id hash of envs.importers.default_split:
    't3' is held out, 't1' and 't2' are not) is named now, not after auditing every task."""
    store = StoreConfig(uri=str(tmp_path / "store"))

    def problems(text: str) -> list[str]:
        (tmp_path / "t.jsonl").write_text(text)
        return check(NightlyConfig(store=store, envs=EnvsConfig(sources=(str(tmp_path / "t.jsonl"),))))

    assert problems(_tasks(("t1", None), ("t3", None))) == []                      # the hash holds t3 out
    assert problems(_tasks(("t1", "heldout"), ("t2", None))) == []                 # a declared split wins
    (train_only,) = problems(_tasks(("t1", None), ("t2", None), ("t3", "train")))
    assert train_only.startswith(f"envs.sources: task source {str(tmp_path / 't.jsonl')!r} has no held-out tasks "
                                 "(every task's split is train"), train_only
    (held_only,) = problems(_tasks(("t1", "heldout"), ("t3", None)))
    assert "has no training tasks (every task's split is heldout" in held_only


def test_a_task_source_that_cleaning_empties_is_named_with_the_counts(tmp_path):
    """Found by review: tasks that differ only in their tests share one prompt, so dedup and
    decontamination left no training task; preflight passed, and the run failed after auditing
    every source with the task gate's "a task table has at least one task"."""
    store = StoreConfig(uri=str(tmp_path / "store"))
    (tmp_path / "same.jsonl").write_text(_tasks(("t1", "train"), ("t2", "train"), ("t3", "heldout"), ("t4", "heldout"),
                                                prompt="def f(x): return x plus one, for every integer x"))
    (problem,) = check(NightlyConfig(store=store, envs=EnvsConfig(sources=(str(tmp_path / "same.jsonl"),))))
    assert problem == (f"envs.sources: task source {str(tmp_path / 'same.jsonl')!r} has no training task left after "
                       f"cleaning: of 2, 0 exact and 0 near duplicates, 2 sharing their prompts with held-out ones "
                       f"(envs.clean sets the thresholds)"), problem


def test_a_task_file_with_no_held_out_tasks_stops_run_with_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ratchet.cli import app

    monkeypatch.setitem(sys.modules, "flows.nightly", None)     # a run that got past preflight fails loudly
    (tmp_path / "train.jsonl").write_text(_tasks(("t1", None), ("t2", None)))
    res = CliRunner().invoke(app, ["run", "--tasks", str(tmp_path / "train.jsonl"), "--store", str(tmp_path / "s")])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.output
    assert res.stderr.startswith(f"error: envs.sources: task source {str(tmp_path / 'train.jsonl')!r} has no held-out")
