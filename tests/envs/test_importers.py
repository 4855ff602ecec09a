"""Users' task files: the DESIGN.md task-feedback object imports as written; a bad line gets
every error at once (line and field path) and is quarantined; good ones are kept.
HumanEval's 164 problems import and pass the audit (canonical solutions pass, trivial answers fail)."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from envs.humaneval import humaneval_path
from envs.importers import default_split, parse_lines, read_tasks, write_quarantine
from ratchet.audit import audit
from ratchet.cli import app as ratchet_app
from ratchet.config import AuditConfig, VerifyConfig
from ratchet.envs_cli import app

GOOD = {"task_id": "t1", "prompt": "def f(x):\n", "reference_solution": "    return x + 1\n",
        "execution_steps": [{"action": "overwrite_file", "path": "/app/solution.py", "content": "def f(x):\n<model_generated_code>"},
                            {"action": "check_calls", "entry_point": "f"}],
        "tests": [{"args": "[1]", "expected": "2"}, {"args": "[5]", "expected": "6"}]}


# DESIGN.md, "Task spec", verbatim: the field's task-feedback object (no prompt, no reference).
DESIGN_EXAMPLE = """{
  "task_id": "complex_code_refactor_01",
  "environment_config": {"runtime": "python3.11", "dependencies": ["pytest==9.2.0"]},
  "execution_steps": [
    {"action": "overwrite_file", "path": "/app/main.py", "content": "<model_generated_code>"},
    {"action": "run_command", "command": "pytest /app/tests/ --json-report"}
  ],
  "reward_logic": {
    "type": "composite",
    "rules": [
      {"metric": "test_pass_rate", "weight": 0.7, "aggregation": "max"},
      {"metric": "execution_time_ms", "weight": 0.3, "aggregation": "min", "threshold": 5000}
    ]
  }
}"""
DESIGN_LINE = DESIGN_EXAMPLE.replace("\n", " ")      # one JSONL line, the text otherwise untouched


def lines(*objs) -> list[str]:
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def test_design_md_example_imports_verbatim():
    res = parse_lines([DESIGN_LINE], source="tasks.jsonl")
    assert not res.bad, [b.message() for b in res.bad]
    (spec,) = res.specs
    assert spec.task_id == "complex_code_refactor_01" and res.lines == [1]
    assert spec.prompt == "Write /app/main.py so that `pytest /app/tests/ --json-report` passes."
    assert spec.reference_solution is None and spec.files == {} and spec.test_files == {}
    assert (spec.family, spec.difficulty, spec.split) == ("imported", 1, default_split("complex_code_refactor_01"))
    assert spec.environment_config.dependencies == ("pytest==9.2.0",)
    assert [(r.metric, r.weight, r.threshold) for r in spec.reward_logic.rules] == [
        ("test_pass_rate", 0.7, None), ("execution_time_ms", 0.3, 5000.0)]
    assert spec.with_completion("print(1)\n")[0].content == "print(1)\n"


def test_defaults_the_line_can_override():
    obj = json.loads(DESIGN_EXAMPLE)
    files = {"/app/util.py": "X = 1\n", "/app/tests/test_main.py": "from main import f\n"}
    res = parse_lines(lines(obj | {"task_id": "a", "files": files},
                            obj | {"task_id": "b", "instructions": "Refactor main.py.", "split": "heldout",
                                   "reference_solution": "print(2)\n", "family": "mine", "difficulty": 3},
                            obj | {"task_id": "c", "prompt": "P", "instructions": "I"}))
    a, b = res.specs
    assert a.prompt == ("Write /app/main.py so that `pytest /app/tests/ --json-report` passes.\n\nStarting files:\n\n"
                        "/app/tests/test_main.py:\n```\nfrom main import f\n```\n\n/app/util.py:\n```\nX = 1\n```")
    assert (b.prompt, b.split, b.reference_solution, b.family, b.difficulty) == (
        "Refactor main.py.", "heldout", "print(2)\n", "mine", 3)
    assert [(x.line, x.field) for x in res.bad] == [(3, "instructions")]
    # split: the caller's when the line names none; else a stable hash of the task_id, ~1 in 10 held out
    assert parse_lines(lines(obj), split="heldout").specs[0].split == "heldout"
    held = [default_split(f"task-{i}") for i in range(2000)].count("heldout")
    assert 140 < held < 260 and default_split("task-7") == default_split("task-7")


def test_a_line_missing_three_fields_names_all_three():
    obj = {k: v for k, v in json.loads(DESIGN_EXAMPLE).items() if k not in ("task_id", "execution_steps")}
    obj["reward_logic"]["rules"][1].pop("metric")
    (bad,) = parse_lines(lines(obj), source="tasks.jsonl").bad
    assert [f for f, _ in bad.errors] == ["task_id", "execution_steps", "reward_logic.rules.1.metric"]
    assert bad.message().splitlines() == [f"tasks.jsonl:1: field {f!r}: Field required"
                                          for f in ("task_id", "execution_steps", "reward_logic.rules.1.metric")]
    he = {"prompt": "def g(a):\n", "canonical_solution": "    return a\n"}
    (bad,) = parse_lines(lines(he), fmt="humaneval").bad
    assert [f for f, _ in bad.errors] == ["task_id", "test", "entry_point"]


def test_a_wrong_type_names_the_nested_field_path():
    obj = json.loads(DESIGN_EXAMPLE)
    obj["reward_logic"]["rules"][0]["weight"] = "heavy"
    obj["execution_steps"][1]["command"] = 5            # inside a step: the union's tag is not in the path
    (bad,) = parse_lines(lines(obj), source="tasks.jsonl").bad
    msgs = bad.message().splitlines()
    assert [f for f, _ in bad.errors] == ["execution_steps.1.command", "reward_logic.rules.0.weight"]
    assert msgs[1].startswith("tasks.jsonl:1: field 'reward_logic.rules.0.weight': Input should be a valid number")
    assert '(got "heavy")' in msgs[1] and msgs[0].startswith("tasks.jsonl:1: field 'execution_steps.1.command': ")


def test_good_lines_around_a_bad_line_are_kept_and_the_bad_one_quarantined_whole(tmp_path):
    obj = json.loads(DESIGN_EXAMPLE)
    bad = {k: v for k, v in obj.items() if k != "execution_steps"} | {"task_id": "x", "difficulty": 0}
    res = parse_lines([DESIGN_LINE, "", json.dumps(bad), json.dumps(obj | {"task_id": "y"})], source="t.jsonl")
    assert [s.task_id for s in res.specs] == ["complex_code_refactor_01", "y"] and res.lines == [1, 4]
    assert [(b.line, [f for f, _ in b.errors]) for b in res.bad] == [(3, ["difficulty", "execution_steps"])]
    q = tmp_path / "q.jsonl"
    write_quarantine(q, res.bad)
    (row,) = [json.loads(x) for x in q.read_text().splitlines()]
    assert row["line"] == 3 and json.loads(row["raw"]) == bad
    assert [e["field"] for e in row["errors"]] == ["difficulty", "execution_steps"]
    assert row["message"].splitlines()[1] == "t.jsonl:3: field 'execution_steps': Field required"


def test_bad_lines_each_get_an_error_naming_line_and_field():
    missing = {k: v for k, v in GOOD.items() if k != "execution_steps"} | {"task_id": "t2"}
    wrong_type = GOOD | {"task_id": "t3", "difficulty": "hard"}
    bad_step = GOOD | {"task_id": "t4", "execution_steps": [{"action": "teleport"}]}
    res = parse_lines(lines(GOOD, '{"task_id": "t9", ', missing, wrong_type, "", "[1, 2]", GOOD, bad_step,
                            GOOD | {"task_id": "t5"}), source="u.jsonl")
    assert [s.task_id for s in res.specs] == ["t1", "t5"] and res.lines == [1, 9]
    assert [(b.line, b.field) for b in res.bad] == [(2, "(json)"), (3, "execution_steps"), (4, "difficulty"), (6, "(line)"),
                                                     (7, "task_id"), (8, "execution_steps.0")]
    msgs = [b.message() for b in res.bad]
    assert msgs[0].startswith("u.jsonl:2: field '(json)': malformed JSON")
    assert "Field required" in msgs[1] and "'hard'" in msgs[2] or '"hard"' in msgs[2]
    assert "duplicate task_id 't1' (first on line 1)" in msgs[4]
    assert res.specs[0].family == "imported"


def test_a_task_the_verifier_cannot_run_is_a_bad_line_at_import():
    """The verifier's rules (one judging step, metadata.float_tolerance, metadata.visible_tests) are the
    schema's: each such line is quarantined with the field and why, not an env_error or an aborted audit."""
    from ratchet.verify.guards import hidden_test_leaks, visible_tests
    from ratchet.verify.verifier import float_tolerance

    overwrite, judge = GOOD["execution_steps"]
    res = parse_lines(lines(
        GOOD | {"task_id": "none", "execution_steps": [overwrite]},
        GOOD | {"task_id": "two", "execution_steps": [overwrite, {"action": "run_command", "command": "true"}, judge]},
        GOOD | {"task_id": "tol", "metadata": {"float_tolerance": "x"}},
        GOOD | {"task_id": "vis", "metadata": {"visible_tests": [{"args": 1}, 3]}},
        GOOD | {"task_id": "vis2", "metadata": {"visible_tests": 5, "float_tolerance": 1}},
        GOOD | {"task_id": "ok", "metadata": {"visible_tests": [{"args": "[0]", "expected": "1"}], "float_tolerance": 1e-6}},
    ), source="t.jsonl")
    assert [s.task_id for s in res.specs] == ["ok"]
    assert [m for b in res.bad for m in b.messages()] == [
        "t.jsonl:1: field 'execution_steps': expected exactly one check_calls or run_command step, found 0",
        "t.jsonl:2: field 'execution_steps': expected exactly one check_calls or run_command step, found 2",
        "t.jsonl:3: field 'metadata.float_tolerance': must be a number in [0, 1), got 'x'",
        "t.jsonl:4: field 'metadata.visible_tests.0.args': Input should be a valid string (got 1)",
        "t.jsonl:4: field 'metadata.visible_tests.0.expected': Field required",
        "t.jsonl:4: field 'metadata.visible_tests.1': must be an {'args', 'expected'} object, got int",
        "t.jsonl:5: field 'metadata.float_tolerance': must be a number in [0, 1), got 1",
        "t.jsonl:5: field 'metadata.visible_tests': must be a list of {'args', 'expected'} objects, got int"]
    (ok,) = res.specs        # what passes the schema, the verifier reads; a spec that skipped it still fails there
    assert float_tolerance(ok) == 1e-6 and len(visible_tests(ok)) == 1 and hidden_test_leaks(ok) == []
    bad = ok.model_copy(update={"metadata": {"float_tolerance": "x", "visible_tests": 5}})
    with pytest.raises(ValueError, match="task ok: metadata.float_tolerance: must be a number"):
        float_tolerance(bad)
    with pytest.raises(ValueError, match="task ok: metadata.visible_tests: must be a list"):
        visible_tests(bad)


def test_a_task_that_would_discard_the_answer_is_a_bad_line_at_import():
    """Found by review: with `<model_generated_code >` the verifier imported solution.py as written and
    threw every answer away, and the audit passed the task. The answer must reach the judge: an
    overwrite_file holds the placeholder, or a check_calls task writes no .py file (the answer is the module)."""
    write = GOOD["execution_steps"][0]
    typo = write | {"content": "def f(x):\n<model_generated_code >\n"}
    res = parse_lines(lines(
        GOOD | {"task_id": "typo", "execution_steps": [typo, {"action": "check_calls", "entry_point": "f"}]},
        GOOD | {"task_id": "cmd", "execution_steps": [{"action": "run_command", "command": "pytest"}]},
        GOOD | {"task_id": "cmd2", "execution_steps": [write | {"path": "main.py", "content": "x = 1\n"},
                                                        {"action": "run_command", "command": "pytest"}]},
        GOOD | {"task_id": "module", "execution_steps": [{"action": "check_calls", "entry_point": "f"}]},
        GOOD | {"task_id": "data", "execution_steps": [write | {"path": "data.txt", "content": "1\n"},
                                                        {"action": "check_calls", "entry_point": "f"}]},
        GOOD | {"task_id": "checker", "execution_steps": [write | {"path": "answer.txt", "content": "<model_generated_code>"},
                                                           write | {"content": "def f(x):\n    return 1\n"},
                                                           {"action": "check_calls", "entry_point": "f"}]},
    ), source="t.jsonl")
    assert [s.task_id for s in res.specs] == ["module", "data", "checker"]
    why = "no overwrite_file step's content holds <model_generated_code> (spelled exactly), so the model's answer would go nowhere"
    assert [m for b in res.bad for m in b.messages()] == [f"t.jsonl:{n}: field 'execution_steps': {why}" for n in (1, 2, 3)]


def test_a_lines_own_family_must_name_a_store_folder():
    """The rule `--family` gets: a line's family is the snapshot's folder (envs/<family>/...)."""
    res = parse_lines(lines(*(GOOD | {"task_id": f"t{i}", "family": f} for i, f in
                              enumerate(["../../escape", "has space/x", "a..b", ".hidden", "mine.v2_x-1"]))), source="f.jsonl")
    assert [s.family for s in res.specs] == ["mine.v2_x-1"]
    assert [(b.line, b.errors) for b in res.bad] == [
        (n, (("family", f"{f!r} cannot name a store folder: letters, digits and '._-' only"),))
        for n, f in [(1, "../../escape"), (2, "has space/x"), (3, "a..b"), (4, ".hidden")]]


def test_one_error_per_problem_and_no_coercion():
    """A bad step or rule is one error (not also "Tuple should have at least 1 item"); `true` and "3"
    are not numbers."""
    res = parse_lines(lines(
        GOOD | {"execution_steps": [GOOD["execution_steps"][0], {"action": "check_calls", "entry_point": ""}]},
        GOOD | {"reward_logic": {"rules": [{"metric": "test_pass_rate", "weight": "x"}]}},
        GOOD | {"difficulty": True}, GOOD | {"difficulty": "3"}, GOOD | {"difficulty": 2.5},
        GOOD | {"reward_logic": {"rules": [{"metric": "test_pass_rate", "weight": True, "threshold": "5"}]}},
        GOOD | {"execution_steps": []},
        GOOD | {"difficulty": 3, "reward_logic": {"rules": [{"metric": "test_pass_rate", "weight": 1}]}},
    ))
    assert [[f for f, _ in b.errors] for b in res.bad] == [
        ["execution_steps.1.entry_point"], ["reward_logic.rules.0.weight"], ["difficulty"], ["difficulty"], ["difficulty"],
        ["reward_logic.rules.0.weight", "reward_logic.rules.0.threshold"], ["execution_steps"]]
    (ok,) = res.specs
    assert ok.difficulty == 3 and ok.reward_logic.rules[0].weight == 1.0     # a JSON integer is a number
    (whole,) = parse_lines(lines(GOOD | {"difficulty": 2.0})).specs           # a Float64 Parquet column's 2.0 is 2
    assert whole.difficulty == 2 and type(whole.difficulty) is int


def test_reward_logic_the_scorer_refuses_is_a_bad_line_at_import():
    """The metric registry's rules are the schema's (found by review: a typo'd metric imported cleanly and
    `ratchet verify` then died scoring the whole batch); weights and thresholds must be finite."""
    def logic(task_id, *rules):
        return GOOD | {"task_id": task_id, "reward_logic": {"rules": list(rules)}}

    ok = {"metric": "test_pass_rate", "weight": 1}
    res = parse_lines(lines(
        logic("typo", {"metric": "test_pass_rat", "weight": 1}),
        logic("no_threshold", ok, {"metric": "execution_time_ms", "weight": 1}),
        logic("extra_threshold", {"metric": "test_pass_rate", "weight": 1, "threshold": 5}),
        '{"task_id": "inf", "prompt": "p", "execution_steps": [{"action": "check_calls", "entry_point": "f"}], '
        '"tests": [{"args": "[1]", "expected": "2"}], '
        '"reward_logic": {"rules": [{"metric": "execution_time_ms", "weight": Infinity, "threshold": NaN}]}}',
        logic("ok", ok, {"metric": "execution_time_ms", "weight": 0.5, "threshold": 5000}),
    ), source="t.jsonl")
    assert [s.task_id for s in res.specs] == ["ok"] and res.lines == [5]
    assert [m for b in res.bad for m in b.messages()] == [
        "t.jsonl:1: field 'reward_logic.rules.0.metric': unknown metric 'test_pass_rat'; known metrics: "
        "['execution_time_ms', 'format_ok', 'output_bytes', 'peak_memory_mb', 'security_flags', 'syntax_ok', "
        "'test_pass_rate', 'tests_passed', 'timed_out']",
        "t.jsonl:2: field 'reward_logic.rules.1.threshold': metric 'execution_time_ms' (cost) needs a threshold, "
        'e.g. {"metric": "execution_time_ms", "threshold": 5000}',
        "t.jsonl:3: field 'reward_logic.rules.0.threshold': metric 'test_pass_rate' (fraction) takes no threshold, got 5.0",
        "t.jsonl:4: field 'reward_logic.rules.0.weight': Input should be a finite number (got Infinity)",
        "t.jsonl:4: field 'reward_logic.rules.0.threshold': Input should be a finite number (got NaN)"]


def test_cli_quarantines_a_bad_family_and_imports_parquet(tmp_path):
    """A line's family never reaches the store's paths; a Parquet task table imports as `run --tasks` reads it."""
    import polars as pl

    tasks, store = tmp_path / "f.jsonl", tmp_path / "store"
    tasks.write_text("\n".join(lines(GOOD | {"family": "../../escape"}, GOOD | {"task_id": "t2", "family": "has space/x"},
                                      GOOD | {"task_id": "t3"})) + "\n")
    res = CliRunner().invoke(app, ["import", str(tasks), "--store", str(store)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "f.jsonl:1: field 'family': '../../escape' cannot name a store folder" in res.stderr
    assert len((tmp_path / "f.quarantine.jsonl").read_text().splitlines()) == 2
    assert sorted(p.name for p in (store / "envs").iterdir()) == ["imported"] and not (tmp_path / "escape").exists()
    pl.DataFrame([GOOD, GOOD | {"task_id": "t2", "difficulty": 2}, GOOD | {"task_id": "t3", "difficulty": 9}]) \
        .write_parquet(tmp_path / "p.parquet")
    res = CliRunner().invoke(app, ["import", str(tmp_path / "p.parquet"), "--store", str(store)])
    assert res.exit_code == 2 and json.loads(res.stdout.splitlines()[-1])["tasks"] == 2, res.output
    assert "p.parquet:3: field 'difficulty'" in res.stderr and (tmp_path / "p.quarantine.jsonl").exists()
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 nope")
    res = CliRunner().invoke(app, ["import", str(tmp_path / "bad.parquet"), "--store", str(store)])
    assert res.exit_code == 2 and res.stderr.startswith("error: task file is not a readable Parquet file"), res.output


def test_a_byte_order_mark_is_not_part_of_line_one(tmp_path):
    """Found by review: a BOM (Windows editors write one) made line 1 "Unexpected UTF-8 BOM", in
    `read_tasks` and in `ratchet envs import` / `ratchet verify`, which read the file whole."""
    text = "\ufeff" + "\n".join(lines(GOOD, GOOD | {"task_id": "t2"})) + "\n"
    (tmp_path / "t.jsonl").write_text(text, encoding="utf-8")
    assert [s.task_id for s in read_tasks(tmp_path / "t.jsonl").specs] == ["t1", "t2"]
    res = CliRunner().invoke(app, ["import", str(tmp_path / "t.jsonl"), "--store", str(tmp_path / "store")])
    assert res.exit_code == 0 and json.loads(res.stdout.splitlines()[-1])["tasks"] == 2, res.output


def test_humaneval_fields_and_quarantine_file(tmp_path):
    he = {"task_id": "H/1", "prompt": "def g(a):\n", "canonical_solution": "    return a\n",
          "test": "def check(c):\n    assert c(2) == 2\n", "entry_point": "g"}
    res = parse_lines(lines(he, {k: v for k, v in he.items() if k != "test"} | {"task_id": "H/2"},
                            he | {"task_id": "H/3", "entry_point": 7}), fmt="humaneval")
    assert [s.task_id for s in res.specs] == ["H/1"] and res.specs[0].split == "heldout"
    assert [(b.line, b.field) for b in res.bad] == [(2, "test"), (3, "entry_point")]
    q = tmp_path / "q.jsonl"
    write_quarantine(q, res.bad)
    rows = [json.loads(x) for x in q.read_text().splitlines()]
    assert [r["line"] for r in rows] == [2, 3] and rows[0]["raw"].startswith("{") and rows[1]["errors"][0]["field"] == "entry_point"


def test_source_deeper_than_the_parser_is_judged_not_a_crash():
    """Text nested deeper than Python's parser (3,000 unary minuses: RecursionError, not SyntaxError)
    in a HumanEval prompt, in its check, or in a task's reference: the import keeps every line and
    the audit rejects the tasks it cannot run, by name; one such line once stopped the whole import."""
    deep = "-" * 3000 + "1"
    he = {"task_id": "H/1", "prompt": "def g(a):\n", "canonical_solution": "    return a\n",
          "test": "def check(c):\n    assert c(2) == 2\n", "entry_point": "g"}
    res = parse_lines(lines(he, he | {"task_id": "H/2", "prompt": f"X = {deep}\n" + he["prompt"]},
                            he | {"task_id": "H/3", "test": he["test"] + f"Y = {deep}\n"},
                            GOOD | {"task_id": "t4", "reference_solution": f"    return x + {deep}\n"}), fmt="humaneval")
    assert [s.task_id for s in res.specs] == ["H/1", "H/2", "H/3"] and [b.line for b in res.bad] == [4]
    taskspec = parse_lines(lines(GOOD | {"task_id": "t4", "reference_solution": f"    return x + {deep}\n"}))
    report = audit([*res.specs, *taskspec.specs], AuditConfig(), VerifyConfig(concurrency=2))
    verdicts = {a.task_id: a.reason for a in report}
    assert verdicts["H/1"] == "" and all(verdicts[t].startswith("reference fails") for t in ("H/2", "H/3", "t4"))


def test_cli_import_and_verify(tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("\n".join(lines(GOOD, "not json", GOOD)) + "\n")
    res = CliRunner().invoke(app, ["import", str(tasks), "--store", str(tmp_path / "store"), "--audit"])
    assert res.exit_code == 2, res.output                 # some lines were bad
    summary = json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("{")][0])
    assert summary["tasks"] == 1 and summary["bad_lines"] == 2 and summary["audit"]["weak_tests"] + summary["audit"]["pass"] == 1
    assert "t.jsonl:2: field '(json)'" in res.stderr and "t.jsonl:3: field 'task_id': duplicate" in res.stderr
    assert len((tmp_path / "t.quarantine.jsonl").read_text().splitlines()) == 2     # README's mytasks.quarantine.jsonl
    comps = tmp_path / "c.jsonl"
    comps.write_text("\n".join(lines({"task_id": "t1", "completion": "    return x + 1\n"},
                                     {"task_id": "t1", "completion": "    return x\n"},
                                     {"task_id": "zz", "completion": ""})) + "\n")
    res = CliRunner().invoke(ratchet_app, ["verify", "--tasks", str(tasks), "--completions", str(comps)])
    out = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert [(o["task_id"], o["reward"], o["env_error"]) for o in out] == [("t1", 1.0, False), ("t1", 0.0, False), ("zz", None, None)]
    assert out[0]["metrics"]["tests_total"] == 2 and out[2]["error"] == "unknown task_id"


def test_humaneval_164_import_and_audit():
    res = read_tasks(humaneval_path(), "humaneval")
    assert len(res.specs) == 164 and not res.bad
    t0 = time.monotonic()
    verdicts = audit(res.specs, cfg=AuditConfig(max_mutants=4, max_reference_ms=60_000))
    wall = time.monotonic() - t0
    bad = [(v.task_id, v.verdict, v.reason) for v in verdicts if v.verdict not in ("pass", "weak_tests")]
    assert not bad, bad        # every canonical solution passes (3 runs), every trivial answer fails
    print(f"HumanEval 164: audit {wall:.1f} s; weak tests: {sum(v.verdict == 'weak_tests' for v in verdicts)}")


def test_a_line_nested_past_the_parser_is_quarantined_and_a_bad_byte_is_named(tmp_path):
    """Found by review: a line of 100,000 '[' stopped the whole import with a RecursionError naming no
    line; `read_tasks` on a file with one non-UTF-8 byte raised a bare UnicodeDecodeError."""
    res = parse_lines(lines(GOOD) + ["[" * 100_000, lines(GOOD | {"task_id": "t2"})[0]], source="d.jsonl")
    assert [s.task_id for s in res.specs] == ["t1", "t2"]
    assert [m for b in res.bad for m in b.messages()] == ["d.jsonl:2: field '(json)': JSON nested deeper than the parser goes"]
    (tmp_path / "n.jsonl").write_bytes(("\n".join(lines(GOOD, GOOD | {"task_id": "t2"})) + "\n").encode() + b"\xff\n")
    with pytest.raises(ValueError, match=r"n.jsonl:3: not UTF-8 text: byte b'\\xff' at offset \d+ \(invalid start byte\)"):
        read_tasks(tmp_path / "n.jsonl")


def test_cli_never_writes_the_quarantine_over_its_input_and_versions_the_options(tmp_path):
    """Found by review: `--quarantine` naming the task file overwrote it with the bad lines (the good
    ones lost from disk), and the snapshot's version hashed the file alone, so the same file imported
    with another --split reused the first import's snapshot, splits and all."""
    tasks, store = tmp_path / "m.jsonl", tmp_path / "store"
    text = "\n".join(lines(GOOD, GOOD | {"task_id": "t2", "difficulty": 9})) + "\n"
    tasks.write_text(text)
    res = CliRunner().invoke(app, ["import", str(tasks), "--store", str(store), "--quarantine", str(tasks)])
    assert res.exit_code == 2 and "would overwrite the task file" in res.stderr and tasks.read_text() == text, res.output
    versions = set()
    for split in ("train", "heldout"):
        res = CliRunner().invoke(app, ["import", str(tasks), "--store", str(store), "--split", split])
        assert res.exit_code == 2 and json.loads(res.stdout.splitlines()[-1])["tasks"] == 1, res.output
        versions.add(json.loads(res.stdout.splitlines()[-1])["version"])
    assert len(versions) == 2


def test_a_parquet_table_of_bytes_is_refused_by_column_and_a_decimal_is_its_number(tmp_path):
    """Found by review: a Binary `prompt` column was imported as the text "b'def f(x):...'" (exit 0), and
    a Decimal difficulty of 2 was quarantined as `got "2"`."""
    import decimal

    import polars as pl

    store = tmp_path / "store"
    pl.DataFrame([GOOD]).with_columns(pl.col("prompt").cast(pl.Binary)).write_parquet(tmp_path / "b.parquet")
    res = CliRunner().invoke(app, ["import", str(tmp_path / "b.parquet"), "--store", str(store)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.stderr.startswith("error: task file is a table with bytes (Binary) in column(s) ['prompt']: task fields "
                                 "are text"), res.stderr
    pl.DataFrame([GOOD]).with_columns(pl.lit(decimal.Decimal(2)).cast(pl.Decimal(5, 0)).alias("difficulty")) \
        .write_parquet(tmp_path / "d.parquet")
    res = CliRunner().invoke(app, ["import", str(tmp_path / "d.parquet"), "--store", str(store)])
    assert res.exit_code == 0 and json.loads(res.stdout.splitlines()[-1])["tasks"] == 1, res.output


def test_metadata_nested_past_what_the_store_saves_is_a_bad_line():
    """Found by review: metadata 300 levels deep passed validation, and the import then failed where
    the spec was saved (pydantic's serialisation stops near 255 levels), naming no line."""
    deep = {"x": json.loads('{"a": ' * 300 + "1" + "}" * 300)}
    ok = {"x": json.loads('{"a": ' * 60 + "1" + "}" * 60)}
    res = parse_lines(lines(GOOD | {"metadata": deep}, GOOD | {"task_id": "t2", "metadata": ok}), source="m.jsonl")
    assert [s.task_id for s in res.specs] == ["t2"]
    res.specs[0].model_dump_json()       # what is kept, saves
    assert [m for b in res.bad for m in b.messages()] == [
        "m.jsonl:1: field 'metadata.x.a.a': nests deeper than 64 levels (dicts and lists)"]


def test_a_line_the_reader_or_the_store_cannot_take_is_quarantined_not_the_import(monkeypatch):
    """Found by review: a number of 5,000 digits (Python's int digit limit: ValueError), a test's expected
    value nested 100,000 deep (a RecursionError pydantic lets through), a HumanEval line nested past the
    parser, and a lone surrogate in metadata (imported, then the save failed) each stopped the whole
    import, or the save, naming no line. A spec that cannot be saved is a bad line too."""
    he = {"task_id": "H/1", "prompt": "def g(a):\n", "canonical_solution": "    return a\n",
          "test": "def check(c):\n    assert c(2) == 2\n", "entry_point": "g"}
    deep = "[" * 100_000 + "]" * 100_000
    res = parse_lines(lines(GOOD, '{"task_id": "big", "difficulty": ' + "1" * 5000 + "}",
                            GOOD | {"task_id": "deep", "tests": [{"args": "[1]", "expected": deep}]},
                            GOOD | {"task_id": "sur", "metadata": {"note": ["caf\udce9"]}},
                            GOOD | {"task_id": "key", "metadata": {"\ud800": 1}},
                            {k: v for k, v in GOOD.items() if k != "prompt"} | {"task_id": "file", "files": {"a\ud800.py": "x"}},
                            GOOD | {"task_id": "t2"}), source="b.jsonl")
    assert [s.task_id for s in res.specs] == ["t1", "t2"]
    assert [(b.line, b.field) for b in res.bad] == [(2, "(json)"), (3, "tests.0.expected"), (4, "metadata.note.0"),
                                                     (5, "metadata"), (6, "files")]
    msgs = [b.message() for b in res.bad]
    assert msgs[0] == ("b.jsonl:2: field '(json)': unreadable JSON: Exceeds the limit (4300 digits) for integer "
                       "string conversion: value has 5000 digits")
    assert "JSON nested deeper than the parser goes" in msgs[1]
    assert msgs[2] == "b.jsonl:4: field 'metadata.note.0': is not UTF-8 text (a lone surrogate): 'caf\\udce9'"
    assert msgs[3] == "b.jsonl:5: field 'metadata': has a key that is not UTF-8 text (a lone surrogate): '\\ud800'"
    assert msgs[4] == "b.jsonl:6: field 'files': has a file name that is not UTF-8 text (a lone surrogate): 'a\\ud800.py'"
    for s in res.specs:
        s.model_dump_json()       # what is kept, saves
    import envs.importers as importers      # whatever else slips past validation: parse_lines saves each spec once

    convert = importers.from_taskspec
    monkeypatch.setattr(importers, "from_taskspec", lambda obj, **kw: convert(obj, **kw).model_copy(update={"prompt": "\ud800"}))
    [unsaved] = parse_lines(lines(GOOD), source="u.jsonl").bad
    assert unsaved.message().startswith("u.jsonl:1: field '(line)': PydanticSerializationError: Error serializing to JSON")
    he_res = parse_lines(lines(he, "[" * 100_000), fmt="humaneval", source="h.jsonl")
    assert [s.task_id for s in he_res.specs] == ["H/1"]
    assert [m for b in he_res.bad for m in b.messages()] == ["h.jsonl:2: field '(json)': JSON nested deeper than the parser goes"]


def test_args_that_are_not_an_array_and_malformed_trivial_answers_are_bad_lines():
    """Found by review: `"args": "5"` (or '"abc"') and `metadata.trivial_answers` of [1], null or "pass"
    imported cleanly, then crashed the whole audit (f(*5); replace() of an int; list(None)) or were read
    letter by letter."""
    array = "must be a JSON array of the positional arguments (f(5): \"[5]\")"
    res = parse_lines(lines(
        GOOD | {"tests": [{"args": "5", "expected": "6"}, {"args": "[1]", "expected": "2"}]},
        GOOD | {"task_id": "s", "tests": [{"args": '"abc"', "expected": '"ABC"'}]},
        GOOD | {"task_id": "v", "metadata": {"visible_tests": [{"args": "0", "expected": "1"}]}},
        *(GOOD | {"task_id": f"ta{i}", "metadata": {"trivial_answers": ta}} for i, ta in enumerate(([1], None, "pass"))),
        GOOD | {"task_id": "ok", "metadata": {"trivial_answers": ["", "    return 0\n"]}},
    ), source="a.jsonl")
    assert [m for b in res.bad for m in b.messages()] == [
        f"a.jsonl:1: field 'tests.0.args': Value error, {array} (got \"5\")",
        f"a.jsonl:2: field 'tests.0.args': Value error, {array} (got \"\\\"abc\\\"\")",
        f"a.jsonl:3: field 'metadata.visible_tests.0.args': Value error, {array} (got '0')",
        "a.jsonl:4: field 'metadata.trivial_answers': must be a list of strings (answers that must fail), got [1]",
        "a.jsonl:5: field 'metadata.trivial_answers': must be a list of strings (answers that must fail), got null",
        "a.jsonl:6: field 'metadata.trivial_answers': must be a list of strings (answers that must fail), got \"pass\""]
    [v] = audit(res.specs, AuditConfig(max_mutants=2, max_reference_ms=60_000), VerifyConfig(concurrency=2))
    assert (v.task_id, v.verdict) == ("ok", "pass"), v


def test_a_blank_prompt_is_a_bad_line():
    """Found by review: a whitespace-only prompt passed import and audit, then the task gate's
    prompt_not_empty failed and stopped the whole run."""
    res = parse_lines(lines(GOOD | {"prompt": "   \n"}, {k: v for k, v in GOOD.items() if k != "prompt"} | {"task_id": "t2", "instructions": "\t"},
                            GOOD | {"task_id": "ok", "prompt": " f \n"}), source="p.jsonl")
    assert [s.task_id for s in res.specs] == ["ok"]
    why = "is blank (whitespace only): the model would be asked nothing"
    assert [m for b in res.bad for m in b.messages()] == [f"p.jsonl:1: field 'prompt': {why}",
                                                         f"p.jsonl:2: field 'instructions': {why}"]


def test_a_check_calls_task_without_tests_is_a_bad_line():
    """Found by review: a check_calls task with no tests and no reference passed the audit and could never
    be solved (tests_total 0: test_pass_rate 0 for every answer); visible examples are not scored."""
    no_ref = {k: v for k, v in GOOD.items() if k not in ("tests", "reference_solution")}
    res = parse_lines(lines(no_ref, GOOD | {"task_id": "t2", "tests": []},
                            no_ref | {"task_id": "t3", "metadata": {"visible_tests": [{"args": "[1]", "expected": "2"}]}},
                            no_ref | {"task_id": "cmd", "execution_steps": [GOOD["execution_steps"][0],
                                                                            {"action": "run_command", "command": "pytest"}]}),
                      source="n.jsonl")
    assert [s.task_id for s in res.specs] == ["cmd"]      # a run_command task is scored by its command
    why = "a check_calls task needs at least one test (metadata.visible_tests are shown, not scored)"
    assert [m for b in res.bad for m in b.messages()] == [f"n.jsonl:{n}: field 'tests': {why}" for n in (1, 2, 3)]


def test_file_names_and_paths_the_sandbox_refuses_are_bad_lines_and_app_is_the_workdir():
    """Found by review: `test_files` {"/app/tests/test_a.py": ...}, `files` {"../evil.py": ...} and an
    overwrite_file path "/app/" imported cleanly and each failed in the audit as an env_error (the sandbox
    takes relative names inside the workdir). Names are read as step paths are: /app/x is x (the audit
    passes the first line)."""
    cmd = {"task_id": "c1", "prompt": "Write main.py", "reference_solution": "def f(x):\n    return x + 1\n",
           "execution_steps": [{"action": "overwrite_file", "path": "/app/main.py", "content": "<model_generated_code>"},
                               {"action": "run_command", "command": "pytest -q tests/"}],
           "test_files": {"/app/tests/test_a.py": "from main import f\ndef test_a():\n    assert f(1) == 2\n"}}
    res = parse_lines(lines(cmd, cmd | {"task_id": "c2", "files": {"../evil.py": "x = 1\n", "/app/../x.py": ""}},
                            cmd | {"task_id": "c3", "execution_steps": [cmd["execution_steps"][0] | {"path": "/app/"},
                                                                        cmd["execution_steps"][1]]},
                            cmd | {"task_id": "c4", "test_files": {"/app/t.py": "", "t.py": ""}}), source="p.jsonl")
    assert [s.task_id for s in res.specs] == ["c1"]
    why = "is not a file in the workdir: give a relative path or /app/<path>, with no '..' out of it"
    assert [m for b in res.bad for m in b.messages()] == [
        f"p.jsonl:2: field 'files.../evil.py': '../evil.py' {why}",
        f"p.jsonl:2: field 'files./app/../x.py': '/app/../x.py' {why}",
        f"p.jsonl:3: field 'execution_steps.0.path': '/app/' {why}",
        "p.jsonl:4: field 'test_files.t.py': names the same file ('t.py') as an earlier name"]
    [v] = audit(res.specs, AuditConfig(max_mutants=2, max_reference_ms=60_000), VerifyConfig(concurrency=2))
    assert v.verdict == "pass", v


def test_a_generated_familys_name_is_refused_on_imported_lines(tmp_path):
    """Found by review: a line with "family": "bugfix" imported as family bugfix, and the multi-turn
    observation then used bugfix's re-prompt on it (KeyError 'target'); the audit its trivial answers."""
    from envs.episode import observation_parts

    res = parse_lines(lines(GOOD | {"family": "bugfix"}, GOOD | {"task_id": "t2", "family": "arithmetic"},
                            GOOD | {"task_id": "t3", "family": "mine"}), source="g.jsonl")
    assert [(s.task_id, s.family) for s in res.specs] == [("t3", "mine")]
    assert [m for b in res.bad for m in b.messages()] == [
        f"g.jsonl:{n}: field 'family': '{f}' is the name of a generated family; name your task set's own"
        for n, f in ((1, "bugfix"), (2, "arithmetic"))]
    assert observation_parts(res.specs[0], {"failed_tests": []}, {"tests_passed": 0, "tests_total": 2})
    tasks = tmp_path / "g.jsonl"
    tasks.write_text("\n".join(lines(GOOD)) + "\n")
    out = CliRunner().invoke(app, ["import", str(tasks), "--store", str(tmp_path / "store"), "--family", "bugfix"])
    assert out.exit_code == 2 and out.stderr.startswith("error: 'bugfix' is the name of a generated family"), out.output


def test_a_clean_reimport_removes_the_stale_quarantine_file(tmp_path):
    """Found by review: after the bad lines were fixed, a clean re-import left the old
    tasks.quarantine.jsonl in place, still reporting lines the file no longer has."""
    tasks, store, q = tmp_path / "m.jsonl", tmp_path / "store", tmp_path / "m.quarantine.jsonl"
    tasks.write_text("\n".join(lines(GOOD, GOOD | {"task_id": "t2", "difficulty": 9})) + "\n")
    res = CliRunner().invoke(app, ["import", str(tasks), "--store", str(store)])
    assert res.exit_code == 2 and len(q.read_text().splitlines()) == 1, res.output
    tasks.write_text("\n".join(lines(GOOD, GOOD | {"task_id": "t2", "difficulty": 2})) + "\n")
    res = CliRunner().invoke(app, ["import", str(tasks), "--store", str(store)])
    assert res.exit_code == 0 and not q.exists(), res.output
    assert f"no bad lines: removed the earlier quarantine file {q}" in res.stderr


def test_the_snapshot_version_hashes_the_importers_code(tmp_path, monkeypatch):
    """Found by review: `ratchet envs import` hashed the file and its options only, so after an upgrade
    that imports the same file differently the old snapshot was reused (the run path hashes the code)."""
    import envs.sources

    tasks, store = tmp_path / "v.jsonl", tmp_path / "store"
    tasks.write_text("\n".join(lines(GOOD)) + "\n")

    def version() -> str:
        res = CliRunner().invoke(app, ["import", str(tasks), "--store", str(store)])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout.splitlines()[-1])["version"]

    first = version()
    assert version() == first              # the same file, options and code: the same snapshot
    monkeypatch.setattr(envs.sources, "_code_hash", lambda: "another importer")
    assert version() != first


def test_envs_import_quarantines_the_ids_run_would_find_too_long(tmp_path):
    """Found by review: a task id of 250 characters passed `ratchet envs import` (ids up to 256) while
    `ratchet run --tasks` quarantined it (its id gets the source's name in front)."""
    tasks, store = tmp_path / "m.jsonl", tmp_path / "store"
    tasks.write_text("\n".join(lines(GOOD | {"task_id": "x" * 250}, GOOD | {"task_id": "y" * 245})) + "\n")
    res = CliRunner().invoke(app, ["import", str(tasks), "--store", str(store)])
    assert res.exit_code == 2 and json.loads(res.stdout.splitlines()[-1])["tasks"] == 1, res.output
    assert (f"{tasks}:1: field 'task_id': longer than 245 characters, the most that fits after the source's name "
            "'imported-m'/") in res.stderr
    assert [json.loads(x)["line"] for x in (tmp_path / "m.quarantine.jsonl").read_text().splitlines()] == [1]


def test_an_upper_case_gz_name_is_read_as_gzip(tmp_path):
    """Found by review: source_suffix lowercases a name (UP.JSONL.GZ is a .jsonl.gz source for `run --tasks`)
    while `ratchet envs import` and read_tasks compared '.gz' exactly: 'task file is a binary file'."""
    import gzip

    up = tmp_path / "UP.JSONL.GZ"
    up.write_bytes(gzip.compress(("\n".join(lines(GOOD)) + "\n").encode()))
    res = CliRunner().invoke(app, ["import", str(up), "--store", str(tmp_path / "store")])
    assert res.exit_code == 0 and json.loads(res.stdout.splitlines()[-1])["tasks"] == 1, res.output
    assert [s.task_id for s in read_tasks(up).specs] == ["t1"]


def test_a_non_finite_number_in_metadata_is_a_bad_line():
    """Found by review: NaN and Infinity in metadata were imported and silently saved as null."""
    res = parse_lines(['{"task_id": "n", "prompt": "p", "execution_steps": [{"action": "check_calls", "entry_point": "f"}], '
                       '"tests": [{"args": "[1]", "expected": "2"}], "metadata": {"score": NaN, "more": [1.5, -Infinity]}}',
                       *lines(GOOD | {"metadata": {"score": 0.5}})], source="f.jsonl")
    assert [s.task_id for s in res.specs] == ["t1"]
    assert [m for b in res.bad for m in b.messages()] == [
        "f.jsonl:1: field 'metadata.more.1': must be a finite number, got -Infinity (saved, it would be null)"]
