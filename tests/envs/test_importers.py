"""Users' task files: bad lines get one clear error each and are quarantined; good ones are kept.
HumanEval's 164 problems import and pass the audit (canonical solutions pass, trivial answers fail)."""

from __future__ import annotations

import json
import time

from typer.testing import CliRunner

from envs.importers import humaneval_path, parse_lines, read_tasks, write_quarantine
from ratchet.audit import audit
from ratchet.cli import app as ratchet_app
from ratchet.config import AuditConfig
from ratchet.envs_cli import app

GOOD = {"task_id": "t1", "prompt": "def f(x):\n", "reference_solution": "    return x + 1\n",
        "execution_steps": [{"action": "overwrite_file", "path": "/app/solution.py", "content": "def f(x):\n<model_generated_code>"},
                            {"action": "check_calls", "entry_point": "f"}],
        "tests": [{"args": "[1]", "expected": "2"}, {"args": "[5]", "expected": "6"}]}


def lines(*objs) -> list[str]:
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def test_bad_lines_each_get_one_error_naming_line_and_field():
    missing = {k: v for k, v in GOOD.items() if k != "prompt"} | {"task_id": "t2"}
    wrong_type = GOOD | {"task_id": "t3", "difficulty": "hard"}
    bad_step = GOOD | {"task_id": "t4", "execution_steps": [{"action": "teleport"}]}
    res = parse_lines(lines(GOOD, '{"task_id": "t9", ', missing, wrong_type, "", "[1, 2]", GOOD, bad_step,
                            GOOD | {"task_id": "t5"}), source="u.jsonl")
    assert [s.task_id for s in res.specs] == ["t1", "t5"] and res.lines == [1, 9]
    assert [(b.line, b.field) for b in res.bad] == [(2, "(json)"), (3, "prompt"), (4, "difficulty"), (6, "(line)"),
                                                     (7, "task_id"), (8, "execution_steps.0")]
    msgs = [b.message() for b in res.bad]
    assert msgs[0].startswith("u.jsonl:2: field '(json)': malformed JSON")
    assert "Field required" in msgs[1] and "'hard'" in msgs[2] or '"hard"' in msgs[2]
    assert "duplicate task_id 't1' (first on line 1)" in msgs[4]
    assert res.specs[0].family == "imported"


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
    assert [r["line"] for r in rows] == [2, 3] and rows[0]["raw"].startswith("{") and rows[1]["field"] == "entry_point"


def test_cli_import_and_verify(tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("\n".join(lines(GOOD, "not json", GOOD)) + "\n")
    res = CliRunner().invoke(app, ["import", str(tasks), "--store", str(tmp_path / "store"), "--audit"])
    assert res.exit_code == 2, res.output                 # some lines were bad
    summary = json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("{")][0])
    assert summary["tasks"] == 1 and summary["bad_lines"] == 2 and summary["audit"]["weak_tests"] + summary["audit"]["pass"] == 1
    assert "t.jsonl:2: field '(json)'" in res.stderr and "t.jsonl:3: field 'task_id': duplicate" in res.stderr
    assert len((tmp_path / "t.jsonl.quarantine.jsonl").read_text().splitlines()) == 2
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
