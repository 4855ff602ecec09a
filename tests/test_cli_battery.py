"""Bad input to every command: one clean `error:` line, the right exit code, the store untouched.

    .venv/bin/python -m pytest tests/test_cli_battery.py -q

Each case feeds one command (run, verify, envs import, gate check, sandbox run, sandbox doctor,
trace show, trace replay)
a malformed file, a wrong type, a missing path, a directory, a binary file, a hostile run id or
a bad store URI through typer's CliRunner, and checks: no traceback (nor a rich error box),
stderr ends in `error: ...` naming the problem, exit 2 for bad input (1 for a check that ran
and failed), and the local store's files are byte-for-byte what they were. `ratchet run` gets
a stand-in flow that fails the test if called; one subprocess shows that `run` exits on bad
settings without importing Prefect. The S3 cases run against the moto server (tests/fixtures/s3.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from ratchet.cli import app
from ratchet.store import open_store
from tests.data.waves import clean_wave
from tests.model.tiny import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)

TASK = {"task_id": "t1", "prompt": "def f(x):\n", "reference_solution": "    return x + 1\n",
        "execution_steps": [{"action": "overwrite_file", "path": "/app/solution.py",
                             "content": "def f(x):\n<model_generated_code>"},
                            {"action": "check_calls", "entry_point": "f"}],
        "tests": [{"args": "[1]", "expected": "2"}]}
GOOD_COMPLETION = {"task_id": "t1", "completion": "    return x + 1\n", "id": "a"}


def _jsonl(*objs) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    """Every kind of bad (and a few good) input, by name; `{store}` is a populated local store."""
    d = tmp_path / "in"
    d.mkdir()
    texts = {
        "tasks": _jsonl(TASK),
        "config_malformed": '{"steps": 3,\n',
        "config_list": "[1, 2]\n",
        "config_wrong_type": json.dumps({"steps": "many"}),
        "config_bool_number": json.dumps({"rollout": {"group_size": True}}),
        "config_unknown_key": json.dumps({"stepz": 1}),
        "config_no_model": json.dumps({"model": {"path": str(d / "no-model")}}),
        "config_not_hf": json.dumps({"model": {"path": str(d)}}),
        "config_family": json.dumps({"envs": {"families": ["no_such_family"]}}),
        "config_heads": json.dumps({"model": {"hidden_size": 100, "num_heads": 3}}),
        "comp_malformed": _jsonl('{"task_id": "t1", "completion": '),
        "comp_not_object": _jsonl("[1, 2]"),
        "comp_no_completion": _jsonl({"task_id": "t1"}),
        "comp_wrong_type": _jsonl({"task_id": "t1", "completion": 7}),
        "comp_unknown_task": _jsonl({"task_id": "zz", "completion": ""}),
        "comp_duplicate_id": _jsonl(GOOD_COMPLETION, GOOD_COMPLETION),
        "comp_empty": "\n\n",
        "tasks_all_bad": _jsonl("not json", "[1]"),
        "a_file": "not a directory\n",
    }
    out = {}
    for name, text in texts.items():
        (d / name).write_text(text)
        out[name] = str(d / name)
    (d / "binary").write_bytes(b"\x7fELF\x00\x01\x02\xff\xfe")
    (d / "latin1").write_bytes(b'print("caf\xe9")\n')
    pl.DataFrame({"x": [1, 2]}).write_parquet(d / "unrelated.parquet")
    pl.DataFrame({"reward": [1.0]}).write_parquet(d / "reward_only.parquet")
    (d / "all_bad.jsonl").write_text(texts["tasks_all_bad"])
    (d / "good.jsonl").write_text(_jsonl(TASK, {**TASK, "task_id": "t2", "split": "heldout",   # both splits, and a
                                               "prompt": "def g(y):\n"}))        # prompt of its own: one prompt is contaminated
    (d / "train_only.jsonl").write_text(texts["tasks"])      # t1: the task-id hash puts it in train
    out.update(all_bad_jsonl=str(d / "all_bad.jsonl"), good_jsonl=str(d / "good.jsonl"),
               train_only_jsonl=str(d / "train_only.jsonl"))
    out.update(binary=str(d / "binary"), latin1=str(d / "latin1"), dir=str(d), missing=str(d / "missing"),
               unrelated=str(d / "unrelated.parquet"), reward_only=str(d / "reward_only.parquet"))
    store = open_store(str(tmp_path / "store"))
    store.put_json("runs/existing/summary.json", {"kept": True})
    store.write_table("runs/existing/waves/000000/scored.parquet", clean_wave(groups=1))   # no scoring record
    out["store"] = str(tmp_path / "store")
    bert = tmp_path / "bert"      # a Hugging Face directory, but not of a causal LM
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    out["not_causal_lm"] = str(bert)
    return out


def _snapshot(root: str) -> dict[str, str]:
    """Every file and folder under root, with the sha256 of each file."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, name), root) + "/"] = ""
        for name in filenames:
            path = os.path.join(dirpath, name)
            snap[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return snap


@pytest.fixture
def no_flow(monkeypatch):
    """A stand-in for flows.nightly: calling it records the call (and fails bad-input cases)."""
    calls = []
    fake = types.ModuleType("flows.nightly")

    def nightly(cfg):
        calls.append(cfg)
        return {"run_id": cfg.run_id, "summary": "s", "base_pass_rate": 0.0, "final_pass_rate": 0.0,
                "promoted": False, "steps": cfg.steps, "wall_s": 0.0}

    fake.nightly = nightly
    monkeypatch.setitem(sys.modules, "flows.nightly", fake)
    return calls


def _assert_clean_failure(res, code: int, needle: str) -> None:
    out = res.output + (res.stderr or "")
    assert res.exit_code == code, (res.exit_code, out)
    assert "Traceback" not in out and "╭" not in out, out
    last = [ln for ln in res.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("error: "), res.stderr
    assert needle in res.stderr, (needle, res.stderr)


# (case id, argv with {placeholders} from `files`, exit code, text the error must contain)
CASES = [
    # ratchet run: config files, options, hostile run ids, store URIs, settings that fail only later
    ("run-config-missing", "run --config {missing}", 2, "no such config file"),
    ("run-config-dir", "run --config {dir}", 2, "is a directory"),
    ("run-config-binary", "run --config {binary}", 2, "binary file"),
    ("run-config-not-utf8", "run --config {latin1}", 2, "not UTF-8 text: byte 0xe9 at line 1"),
    ("run-config-malformed", "run --config {config_malformed}", 2, "config_malformed:2:1"),
    ("run-config-list", "run --config {config_list}", 2, "must be a JSON object"),
    ("run-config-wrong-type", "run --config {config_wrong_type}", 2, "field 'steps'"),
    ("run-config-bool-number", "run --config {config_bool_number}", 2, "field 'rollout.group_size': expected a number, not true or false (got true)"),
    ("run-config-unknown-key", "run --config {config_unknown_key}", 2, "field 'stepz'"),
    ("run-steps-not-int", "run --steps abc", 2, "'--steps'"),
    ("run-id-parent", "run --run-id ../evil", 2, "field 'run_id'"),
    ("run-id-dotdot", "run --run-id a..b", 2, "may not contain '..'"),
    ("run-id-slash", "run --run-id a/b", 2, "field 'run_id'"),
    ("run-id-too-long", "run --run-id " + "x" * 129, 2, "at most 128 characters"),
    ("run-id-dash", "run --run-id=-rf", 2, "field 'run_id'"),
    ("run-store-ftp", "run --store ftp://x/y", 2, "unsupported scheme 'ftp'"),
    ("run-store-s3-no-bucket", "run --store s3://", 2, "names no bucket"),
    ("run-store-is-a-file", "run --store {a_file}", 2, "is not a directory"),
    ("run-store-under-a-file", "run --store {a_file}/store", 2, "is not a directory"),
    ("run-store-file-uri-under-a-file", "run --store file://{a_file}/store", 2, "is not a directory"),
    ("run-model-missing", "run --config {config_no_model}", 2, "model.path"),
    ("run-model-not-hf", "run --config {config_not_hf}", 2, "no config.json"),
    ("run-unknown-family", "run --config {config_family}", 2, "unknown environment family"),
    ("run-heads", "run --config {config_heads}", 2, "model.num_heads"),
    ("run-tasks-missing", "run --tasks {missing}.jsonl", 2, "no such file"),
    ("run-tasks-not-jsonl", "run --tasks {tasks}", 2, "expected a .jsonl.gz, .jsonl, .parquet file"),
    ("run-tasks-no-good-line", "run --tasks {all_bad_jsonl}", 2, "no good task line (2 bad; first: "),
    ("run-tasks-no-held-out", "run --tasks {train_only_jsonl}", 2, "has no held-out tasks (every task's split is train"),
    ("run-tasks-a-directory", "run --tasks {dir}/", 2, "expected a .jsonl.gz"),
    ("run-tasks-same-name", "run --tasks {good_jsonl} --tasks {dir}/../good.jsonl", 2, "would both be named"),
    ("run-model-option-missing", "run --model {missing}", 2, "model.path"),
    ("run-model-option-not-hf", "run --model {dir}", 2, "no config.json, so not a Hugging Face model directory"),
    ("run-model-option-a-file", "run --model {a_file}", 2, "not a directory (a Hugging Face model directory"),
    ("run-model-option-not-causal", "run --model {not_causal_lm}", 2, "name no causal LM"),
    ("run-model-option-no-value", "run --model", 2, "'--model' requires an argument"),
    # ratchet verify
    ("verify-tasks-missing", "verify --tasks {missing} --completions {comp_no_completion}", 2, "no such tasks file"),
    ("verify-completions-missing", "verify --tasks {tasks} --completions {missing}", 2, "no such completions file"),
    ("verify-completions-dir", "verify --tasks {tasks} --completions {dir}", 2, "is a directory"),
    ("verify-completions-binary", "verify --tasks {tasks} --completions {binary}", 2, "binary file"),
    ("verify-tasks-binary", "verify --tasks {binary} --completions {comp_no_completion}", 2, "binary file"),
    ("verify-completions-not-utf8", "verify --tasks {tasks} --completions {latin1}", 2, "byte 0xe9 at line 1"),
    ("verify-malformed-line", "verify --tasks {tasks} --completions {comp_malformed}", 2,
     "comp_malformed:1: field '(json)': malformed JSON: Expecting value at column 33"),
    ("verify-not-object", "verify --tasks {tasks} --completions {comp_not_object}", 2, "expected a JSON object"),
    ("verify-no-completion", "verify --tasks {tasks} --completions {comp_no_completion}", 2,
     "comp_no_completion:1: field 'completion': Field required"),
    ("verify-wrong-type", "verify --tasks {tasks} --completions {comp_wrong_type}", 2, "field 'completion': expected a string"),
    ("verify-unknown-task", "verify --tasks {tasks} --completions {comp_unknown_task}", 2, "unknown task 'zz'"),
    ("verify-duplicate-id", "verify --tasks {tasks} --completions {comp_duplicate_id}", 2,
     "comp_duplicate_id:2: field 'id': duplicate completion id 'a' for task 't1' (first on line 1)"),
    ("verify-empty", "verify --tasks {tasks} --completions {comp_empty}", 2, "no completion lines"),
    ("verify-bad-format", "verify --tasks {tasks} --completions {comp_empty} --format nope", 2, "unknown format"),
    ("verify-bad-timeout", "verify --tasks {tasks} --completions {comp_empty} --timeout-s 0", 2, "--timeout-s"),
    # ratchet envs import (every one with --store: the store must not change)
    ("import-missing", "envs import {missing} --store {store}", 2, "no such task file"),
    ("import-dir", "envs import {dir} --store {store}", 2, "is a directory"),
    ("import-binary", "envs import {binary} --store {store}", 2, "binary file"),
    ("import-not-utf8", "envs import {latin1} --store {store}", 2, "not UTF-8 text"),
    ("import-all-bad", "envs import {tasks_all_bad} --store {store}", 2, "no good task line"),
    ("import-no-file", "envs import --store {store}", 2, "give a FILE"),
    ("import-bad-format", "envs import {tasks} --format nope --store {store}", 2, "unknown format"),
    ("import-bad-split", "envs import {tasks} --split test --store {store}", 2, "unknown split"),
    ("import-bad-version", "envs import {tasks} --version ../x --store {store}", 2, "cannot name a store folder"),
    ("import-file-and-humaneval", "envs import {tasks} --humaneval --store {store}", 2, "not both"),
    ("import-store-ftp", "envs import {tasks} --store ftp://x/y", 2, "unsupported scheme"),
    ("import-store-file", "envs import {tasks} --store {a_file}", 2, "is not a directory"),
    # ratchet gate check
    ("gate-no-shared-column", "gate check {unrelated}", 2, "shares no column with a wave table"),
    ("gate-tasks-no-shared-column", "gate check {unrelated} --kind tasks", 2, "shares no column with a task table"),
    ("gate-missing", "gate check {missing}", 2, "no such file"),
    ("gate-dir", "gate check {dir}", 2, "a directory"),
    ("gate-binary", "gate check {binary}", 2, "cannot read as Parquet"),
    ("gate-half-bounds", "gate check {unrelated} --reward-min 0", 2, "--reward-max"),
    ("gate-bad-kind", "gate check {unrelated} --kind nope", 2, "'--kind'"),
    ("gate-fails", "gate check {reward_only}", 1, ""),          # a check that ran and failed: exit 1
    # ratchet sandbox run / doctor
    ("sandbox-binary", "sandbox run {binary}", 2, "binary file"),
    ("sandbox-binary-json", "sandbox run {binary} --json", 2, "binary file"),
    ("sandbox-not-utf8", "sandbox run {latin1} --json", 2, "byte 0xe9 at line 1"),
    ("sandbox-missing", "sandbox run {missing}", 2, "no such Python file"),
    ("sandbox-dir", "sandbox run {dir}", 2, "is a directory"),
    ("sandbox-bad-timeout", "sandbox run {tasks} --timeout -1", 2, "--timeout"),
    ("sandbox-bad-memory", "sandbox run {tasks} --memory-mb many", 2, "'--memory-mb'"),
    ("sandbox-bad-backend", "sandbox run {tasks} --backend nope", 2, "unknown sandbox backend"),
    ("doctor-extra-arg", "sandbox doctor extra", 2, "unexpected extra argument"),
    ("doctor-bad-option", "sandbox doctor --bogus", 2, "No such option: --bogus"),
    ("unknown-command", "nope", 2, "No such command"),
    # ratchet serve: what it is asked to serve
    ("serve-model-missing", "serve --model {missing}", 2, "does not exist"),
    ("serve-model-not-hf", "serve --model {dir}", 2, "no config.json"),
    ("serve-model-a-file", "serve --model {tasks}", 2, "is a file"),
    ("serve-bad-port", "serve --model {dir} --port 70000", 2, "'--port'"),
    # ratchet trace show / replay: a run, wave or task that is not there; a run id or store that cannot be
    ("trace-unknown-run", "trace show nope --step 0 --store {store}", 2, "no run 'nope' in the store"),
    ("trace-unknown-step", "trace show existing --step 4 --store {store}", 2, "run 'existing' has no wave 4; its waves: 0"),
    ("trace-unknown-task", "trace show existing --step 0 --task zz --store {store}", 2,
     "task 'zz' is not in wave 0 of run 'existing'; its tasks: task0"),
    ("trace-negative-step", "trace show existing --step -1 --store {store}", 2, "'--step'"),
    ("trace-no-step", "trace show existing --store {store}", 2, "Missing option '--step'"),
    ("trace-bad-run-id", "trace show ../evil --step 0 --store {store}", 2, "run_id '../evil'"),
    ("trace-store-missing", "trace show existing --step 0 --store {missing}", 2, "no store here"),
    ("trace-store-ftp", "trace show existing --step 0 --store ftp://x/y", 2, "unsupported scheme 'ftp'"),
    ("trace-replay-no-task", "trace replay existing --step 0 --store {store}", 2, "Missing option '--task'"),
    ("trace-replay-unknown-run", "trace replay nope --step 0 --task t --store {store}", 2, "no run 'nope'"),
    ("trace-replay-unknown-task", "trace replay existing --step 0 --task zz --store {store}", 2, "task 'zz' is not in wave 0"),
    ("trace-replay-no-record", "trace replay existing --step 0 --task task0 --store {store}", 2,
     "wave 0 of run 'existing' has no scoring record"),
    ("trace-replay-bad-tolerance", "trace replay existing --step 0 --task task0 --tolerance -1 --store {store}", 2,
     "'--tolerance'"),
]


@pytest.mark.parametrize("argv, code, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clean_error(files, no_flow, argv, code, needle):
    before = _snapshot(files["store"])
    args = [a.format(**files) for a in argv.split(" ")]
    res = CliRunner().invoke(app, args)
    if code == 1:                       # the gate ran: its report, not an error line
        assert res.exit_code == 1 and "Traceback" not in res.output and "FAILED" in res.output, res.output
    else:
        _assert_clean_failure(res, code, needle)
    assert no_flow == [], "the flow was started despite bad settings"
    assert _snapshot(files["store"]) == before


def test_good_settings_reach_the_flow(files, no_flow):
    """The control: the stand-in flow is what `run` calls once the settings pass preflight."""
    res = CliRunner().invoke(app, ["run", "--run-id", "ok-1.a_b", "--steps", "1", "--store", files["store"]])
    assert res.exit_code == 0, res.output
    assert [c.run_id for c in no_flow] == ["ok-1.a_b"]
    assert json.loads(res.stdout.strip().splitlines()[-1])["run_id"] == "ok-1.a_b"


def test_a_config_with_a_byte_order_mark_is_read(files, no_flow):
    """Found by review: a config saved by a Windows editor (UTF-8 with BOM) was rejected as malformed JSON."""
    cfg = Path(files["dir"]) / "bom.json"
    cfg.write_bytes(b"\xef\xbb\xbf" + json.dumps({"steps": 2}).encode())
    res = CliRunner().invoke(app, ["run", "--config", str(cfg), "--store", files["store"]])
    assert res.exit_code == 0, res.output
    assert [c.steps for c in no_flow] == [2]


def test_tasks_files_become_sources_of_the_run(files, no_flow, monkeypatch):
    """`--tasks` (repeatable) adds to the config's envs.sources, relative paths made absolute."""
    cfg = Path(files["dir"]) / "with_source.json"
    cfg.write_text(json.dumps({"envs": {"sources": [files["good_jsonl"]]}}))
    (Path(files["dir"]) / "second.jsonl").write_text(Path(files["good_jsonl"]).read_text())
    monkeypatch.chdir(files["dir"])
    res = CliRunner().invoke(app, ["run", "--config", str(cfg), "--tasks", "second.jsonl", "--store", files["store"]])
    assert res.exit_code == 0, res.output
    assert no_flow[0].envs.sources == (files["good_jsonl"], str(Path(files["dir"]) / "second.jsonl"))


def test_model_option_sets_model_path(files, no_flow, tmp_path):
    """`run --model DIR` is model.path; the rest of --config's model section stays."""
    hf = tiny_llama(tmp_path / "hf")      # preflight loads its config and tokenizer: the file names are not enough
    cfg = Path(files["dir"]) / "model.json"
    cfg.write_text(json.dumps({"model": {"path": files["missing"], "chat_template": "off"}}))
    res = CliRunner().invoke(app, ["run", "--model", str(hf), "--config", str(cfg), "--store", files["store"]])
    assert res.exit_code == 0, res.output
    assert [(c.model.path, c.model.chat_template) for c in no_flow] == [(str(hf), "off")]


def test_every_problem_is_reported_at_once(files, no_flow):
    bad = Path(files["dir"]) / "many.json"
    bad.write_text(json.dumps({"store": {"uri": "ftp://x/y"}, "model": {"path": files["missing"]},
                               "envs": {"families": ["nope"]}}))
    res = CliRunner().invoke(app, ["run", "--config", str(bad)])
    assert res.exit_code == 2 and no_flow == []
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 3 and all(ln.startswith("error: ") for ln in lines), res.stderr


def test_run_exits_before_prefect_is_imported(files):
    """In a fresh interpreter: bad settings end `run` with exit 2 and Prefect never imported."""
    probe = (
        "import json, sys\n"
        "from ratchet.cli import app\n"
        "out = []\n"
        "for argv in sys.argv[1:]:\n"
        "    try:\n"
        "        app(json.loads(argv), prog_name='ratchet')\n"
        "    except SystemExit as e:\n"
        "        out.append(e.code)\n"
        "print(json.dumps({'codes': out, 'prefect': 'prefect' in sys.modules, 'flows': 'flows.nightly' in sys.modules}))\n"
    )
    cases = [["run", "--run-id", "../evil"], ["run", "--store", "ftp://x/y"], ["run", "--config", files["config_list"]],
             ["run", "--config", files["config_not_hf"], "--store", files["store"]]]
    out = subprocess.run([sys.executable, "-c", probe, *map(json.dumps, cases)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"codes": [2, 2, 2, 2], "prefect": False, "flows": False}, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 4, out.stderr


# --- S3: endpoint unset, credentials unset, endpoint silent, bucket name bad (moto server) ----

def _s3_objects(env: dict[str, str]) -> set[tuple[str, str]]:
    from minio import Minio

    client = Minio(env["RATCHET_S3_ENDPOINT"], access_key=env["AWS_ACCESS_KEY_ID"],
                   secret_key=env["AWS_SECRET_ACCESS_KEY"], secure=False)
    return {(b.name, o.object_name) for b in client.list_buckets()
            for o in client.list_objects(b.name, recursive=True)} | {(b.name, "") for b in client.list_buckets()}


@pytest.mark.parametrize("unset, uri, needle", [
    (("RATCHET_S3_ENDPOINT",), "s3://ratchet-battery/p", "set RATCHET_S3_ENDPOINT"),
    (("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"), "s3://ratchet-battery/p", "credentials unset: AWS_ACCESS_KEY_ID"),
    ((), "s3://Not_A_Bucket/p", "not a valid S3 bucket name"),
    ((), "s3://ab/p", "not a valid S3 bucket name"),
], ids=["endpoint-unset", "credentials-unset", "bucket-name-bad", "bucket-name-short"])
@pytest.mark.parametrize("command", ["run", "import"])
def test_s3_settings(s3_env, files, no_flow, monkeypatch, unset, uri, needle, command):
    before = _s3_objects(s3_env)
    for name in unset:
        monkeypatch.delenv(name)
    argv = ["run", "--store", uri] if command == "run" else ["envs", "import", files["tasks"], "--store", uri]
    res = CliRunner().invoke(app, argv)
    _assert_clean_failure(res, 2, needle)
    assert no_flow == [] and _s3_objects(s3_env) == before


def test_s3_endpoint_that_does_not_answer(s3_env, files, no_flow, monkeypatch):
    import time

    from ratchet.net import free_port

    port = free_port()                   # a port nobody listens on
    monkeypatch.setenv("RATCHET_S3_ENDPOINT", f"127.0.0.1:{port}")
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["run", "--store", "s3://ratchet-battery/p"])
    assert time.monotonic() - t0 < 15      # short timeout, no retry storm
    _assert_clean_failure(res, 2, "does not answer")
    assert no_flow == []


def test_an_unforeseen_failure_is_one_line_too(files, no_flow, monkeypatch):
    """The last guard (OneLineErrors): an exception nobody caught is one line, exit 1;
    RATCHET_DEBUG=1 lets the traceback through."""
    def boom(cfg):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(sys.modules["flows.nightly"], "nightly", boom)
    argv = ["run", "--steps", "1", "--store", files["store"], "--run-id", "r9"]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 1 and res.stderr.strip().splitlines() == [
        "error: RuntimeError: disk on fire (run r9; resume with: ratchet run --run-id r9)"], res.stderr
    monkeypatch.setenv("RATCHET_DEBUG", "1")
    res = CliRunner().invoke(app, argv)
    assert isinstance(res.exception, RuntimeError)


def test_a_run_id_another_writer_holds_is_not_told_to_resume_now(files, monkeypatch):
    """Found by review: the error of a run id whose lease another live process holds ended with
    "resume with: ratchet run --run-id X", which only meets the same error while that run lives."""
    import time

    from ratchet.store.lease import LeaseHeld

    fake = types.ModuleType("flows.nightly")

    def nightly(cfg):
        raise LeaseHeld(cfg.run_id, {"owner": "o", "host": "h", "pid": 1, "heartbeat_at": time.time(), "ttl_s": 60},
                        time.time())

    fake.nightly = nightly
    monkeypatch.setitem(sys.modules, "flows.nightly", fake)
    res = CliRunner().invoke(app, ["run", "--run-id", "busy", "--store", files["store"]])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert res.stderr.rstrip().endswith("(run busy; resume it once that run has ended or gone stale)"), res.stderr
    assert "resume with" not in res.stderr
