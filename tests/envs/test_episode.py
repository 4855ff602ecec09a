"""The episode protocol: what the model sees after an answer. Hand-built feedback gives exact
texts; real sandbox runs show that every family, an imported pytest task and a HumanEval
problem render an observation with the defaults, and that the families' hooks do what they say."""

from __future__ import annotations

import json
import re

import pytest

from envs.episode import (REVISE, continued_header, default_reprompt, feedback_text, observation,
                          observation_parts)
from envs.humaneval import from_humaneval, humaneval_problems
from envs.importers import from_taskspec
from envs.registry import all_family_names, get_family
from envs.spec import COMPLETION, NEVER_RAN, CallTest, CheckCalls, OverwriteFile, RunCommand, TaskSpec
from ratchet.audit import task_mutants
from ratchet.config import VerifyConfig
from ratchet.verify import verify_many

FEEDBACK = {"exit_code": 0, "killed_by": None, "timed_out": False, "stdout_tail": "", "stderr_tail": "",
            "failed_tests": []}


def _fn_spec(prefix: str = "# add 3\ndef f(x):\n", n_tests: int = 10) -> TaskSpec:
    return TaskSpec(task_id="t", family="imported", prompt=prefix,
                    execution_steps=(OverwriteFile(path="/app/solution.py", content=prefix + COMPLETION),
                                     CheckCalls(entry_point="f")),
                    tests=tuple(CallTest(args=f"[{i}]", expected=str(i + 3)) for i in range(n_tests)),
                    reference_solution="    return x + 3\n")


def test_call_failures_then_the_error_tail_then_the_other_failures():
    fb = FEEDBACK | {"stderr_tail": "Traceback (most recent call last):\n  File \"solution.py\", line 3\n    ^^^^\n"
                                    "ZeroDivisionError: integer division or modulo by zero\n",
                     "failed_tests": [{"name": "call 0", "detail": "args [3]: expected 6, got 5"},
                                      {"name": "call 1", "detail": "args [4]: expected 7, got 6"}]}
    text = observation(_fn_spec(), fb, {"tests_passed": 8, "tests_total": 10})
    assert text == ("Tests: 8 of 10 passed.\n- f(3): expected 6, got 5\nTraceback (most recent call last):\n"
                    "File \"solution.py\", line 3\nZeroDivisionError: integer division or modulo by zero\n"
                    "- f(4): expected 7, got 6\nRevise your answer.\ndef f(x):\n")


def test_an_answer_that_never_ran_is_told_why_first():
    """No call got a result: the failed calls say nothing, so the exception and the line it points at
    come first, where a cut at the observation budget leaves them."""
    fb = FEEDBACK | {"exit_code": 1, "stderr_tail": "Traceback (most recent call last):\n  File \"solution.py\", line 5\n"
                                                    "    s = s // 2:]\n               ^\nSyntaxError: unmatched ']'\n",
                     "failed_tests": [{"name": f"call {i}", "detail": f"args [{i}]: expected 1, got {NEVER_RAN}"}
                                      for i in range(2)]}
    want = ("Tests: 0 of 6 passed.\nSyntaxError: unmatched ']'\ns = s // 2:]\nFile \"solution.py\", line 5\n"
            f"- f(0): expected 1, got {NEVER_RAN}\n- f(1): expected 1, got {NEVER_RAN}\n")
    spec = _fn_spec(n_tests=6)
    assert feedback_text(spec, fb, {"tests_passed": 0, "tests_total": 6, "syntax_ok": False}) == want
    assert feedback_text(spec, fb, {"tests_passed": 0, "tests_total": 6}) == want     # parses, but the module did not load
    ran = fb | {"failed_tests": fb["failed_tests"][:1] + [{"name": "call 1", "detail": "args [1]: expected 1, got 0"}]}
    assert feedback_text(spec, ran, {"tests_passed": 0, "tests_total": 6}).splitlines()[1].startswith("- f(0)")
    # syntax_ok is about Python: a Python answer that does not parse is told why first whatever its tests say,
    # a shell script that fails it did run, so its failed command comes first
    failed_cmd = FEEDBACK | {"exit_code": 3, "stderr_tail": "first\nlast\n",
                             "failed_tests": [{"name": "sh run.sh", "detail": "exit 3: last"}]}
    metrics = {"tests_passed": 0, "tests_total": 1, "syntax_ok": False}
    assert feedback_text(spec, failed_cmd, metrics) == "Tests: 0 of 1 passed.\nfirst\n- sh run.sh: exit 3: last\n"
    script = TaskSpec(task_id="sh", family="imported", prompt="Write run.sh.\n", reference_solution="echo 3\n",
                      execution_steps=(OverwriteFile(path="/app/run.sh", content=COMPLETION), RunCommand(command="sh run.sh")))
    assert feedback_text(script, failed_cmd, metrics) == "Tests: 0 of 1 passed.\n- sh run.sh: exit 3: last\nfirst\n"


def test_pytest_report_gives_its_failed_tests_and_new_e_lines_only():
    stdout = ("===== FAILURES =====\n____ test_a ____\n>   assert clamp(5) == 3\nE   assert 4 == 3\n"
              "E    +  where 4 = clamp(5)\n____ test_b ____\nE   NameError: name 'y' is not defined\n"
              "===== short test summary info =====\nFAILED t.py::test_a - assert 4 == 3\nFAILED t.py::test_b\n")
    fb = FEEDBACK | {"exit_code": 1, "stdout_tail": stdout,
                     "failed_tests": [{"name": "t.py::test_a", "detail": "FAILED: assert 4 == 3"},
                                      {"name": "t.py::test_b", "detail": "FAILED"}]}
    spec = _fn_spec().model_copy(update={"execution_steps": (OverwriteFile(path="/app/m.py", content=COMPLETION),)})
    assert feedback_text(spec, fb, {"tests_passed": 1, "tests_total": 3}) == (
        "Tests: 1 of 3 passed.\n- test_a: assert 4 == 3\nNameError: name 'y' is not defined\n- test_b: failed\n")
    assert default_reprompt(spec) == REVISE       # a whole file, not a function body: no header


def test_limits_and_an_empty_answer():
    spec = _fn_spec()
    assert feedback_text(spec, FEEDBACK | {"timed_out": True, "killed_by": "wall", "exit_code": None},
                         {"tests_passed": 0, "tests_total": 3, "timed_out": True}) == "Tests: 0 of 3 passed. Timed out.\n"
    assert feedback_text(spec, FEEDBACK | {"killed_by": "memory", "exit_code": None}, None) == "Killed by the memory limit.\n"
    assert feedback_text(spec, FEEDBACK | {"exit_code": 2}, None) == "Exit code 2.\n"
    assert observation(spec, None, {"tests_passed": 0, "tests_total": 3}) == "Nothing ran (empty answer).\n" + REVISE + "def f(x):\n"


def test_more_failures_than_shown_are_counted():
    fb = FEEDBACK | {"failed_tests": [{"name": f"call {i}", "detail": f"args [{i}]: expected 1, got 0"} for i in range(8)]}
    lines = feedback_text(_fn_spec(n_tests=8), fb, {"tests_passed": 0, "tests_total": 8}).splitlines()
    assert lines[1:] == ([f"- f({i}): expected 1, got 0" for i in range(2)] + [f"- f({i}): got 0, wrong" for i in range(2, 5)]
                         + ["- ... 3 more failed"])


def test_calls_that_read_alike_are_one_line():
    """A task that calls f(3) twice (names differ, texts do not) spends its observation budget on one line."""
    fb = FEEDBACK | {"failed_tests": [{"name": f"call {i}", "detail": "args [3]: expected 6, got 5"} for i in range(6)]
                     + [{"name": "call 6", "detail": "args [4]: expected 7, got 6"}]}
    lines = feedback_text(_fn_spec(n_tests=7), fb, {"tests_passed": 0, "tests_total": 7}).splitlines()
    assert lines[1:] == ["- f(3): expected 6, got 5", "- f(3): got 5, wrong", "- f(4): got 6, wrong"]


@pytest.mark.parametrize("n_tests, shown", [(1, 0), (2, 0), (3, 1), (6, 2), (10, 3)])
def test_an_observation_is_not_an_answer_key(n_tests, shown):
    """Expected values of the first third of the hidden calls at most: an answer special-casing what it
    was shown still fails the rest."""
    fb = FEEDBACK | {"failed_tests": [{"name": f"call {i}", "detail": f"args [{i}]: expected {i + 3}, got 0"}
                                      for i in range(n_tests)]}
    body = feedback_text(_fn_spec(n_tests=n_tests), fb, {"tests_passed": 0, "tests_total": n_tests})
    assert [i for i in range(n_tests) if f"f({i}): expected {i + 3}, got 0" in body] == list(range(min(shown, 5)))
    assert all(f"f({i}): got 0, wrong" in body for i in range(shown, min(n_tests, 5)))


def test_continued_header():
    assert continued_header(_fn_spec()) == "def f(x):\n"
    two_lines = "def g(a,\n      b):  # the pair\n    '''Doc.'''\n"
    assert continued_header(_fn_spec(two_lines)) == "def g(a,\n      b):  # the pair\n"
    # the answer follows a finished function at module level: it is not a body
    assert continued_header(_fn_spec("def helper():\n    return 1\n\n")) is None
    assert continued_header(_fn_spec("import os\n")) is None


def _imported_pytest_task() -> TaskSpec:
    return from_taskspec({
        "task_id": "imp-1", "prompt": "Write main.py with add(a, b).\n", "reference_solution": "def add(a, b):\n    return a + b\n",
        "environment_config": {"runtime": "python3.11", "dependencies": ["pytest==9.2.0"]},
        "execution_steps": [{"action": "overwrite_file", "path": "/app/main.py", "content": COMPLETION},
                            {"action": "run_command", "command": "pytest -q tests/ --junitxml=report.xml",
                             "report": {"path": "report.xml", "format": "junit"}}],
        "test_files": {"tests/test_main.py": "from main import add\n\ndef test_add():\n    assert add(2, 3) == 5\n\n"
                                             "def test_zero():\n    assert add(0, 0) == 0\n"}})


SPECS = {name: get_family(name).generate(get_family(name).config(), 0, 1, 2, "train") for name in all_family_names()}
SPECS["imported"] = _imported_pytest_task()
SPECS["humaneval"] = from_humaneval(json.loads(next(iter(humaneval_problems()))))


@pytest.fixture(scope="module")
def runs():
    """Per task: a mutant of its reference and a garbage answer, verified for real in one batch."""
    items = [(s, a) for s in SPECS.values() for a in (task_mutants(s, 1)[0], "syntax error (")]
    vs = verify_many(items, VerifyConfig().sandbox_limits(), concurrency=2)
    assert not any(v.env_error for v in vs), [v.env_error_kind for v in vs if v.env_error]
    return {(s.task_id, a): v for (s, a), v in zip(items, vs)}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_task_kind_renders_real_feedback(runs, name):
    spec = SPECS[name]
    for (task_id, answer), v in runs.items():
        if task_id != spec.task_id:
            continue
        assert not v.passed
        body, again = observation_parts(spec, v.feedback, v.metrics)
        assert observation(spec, v.feedback, v.metrics) == body + again
        assert body.strip() and again.endswith("\n") and body.endswith("\n")
        default = feedback_text(spec, v.feedback, v.metrics)          # the default works for every kind too
        assert default.startswith("Tests: ") and default.endswith("\n")
        assert default_reprompt(spec).startswith(REVISE)
        if v.feedback["failed_tests"]:
            assert default.count("\n") >= 2, "a failed test is shown"
        if answer == "syntax error (" and spec.family in ("python_functions", "humaneval"):
            assert re.match(r"(Syntax|Indentation)Error: ", default.splitlines()[1]), default    # the error first


def test_family_hooks(runs):
    pf, ar, bf, he = SPECS["python_functions"], SPECS["arithmetic"], SPECS["bugfix"], SPECS["humaneval"]
    assert observation_parts(pf, None, None)[1] == REVISE + pf.prompt.splitlines(keepends=True)[-1]   # "def f(x):\n"
    assert observation_parts(he, None, None)[1] == REVISE + "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    assert observation_parts(bf, None, None)[1] == f"Reply with the full corrected content of {bf.metadata['target']} (code only).\n"
    expected_answer = json.loads(ar.tests[0].expected)
    for (task_id, answer), v in runs.items():
        if task_id == ar.task_id:        # never the expected value: it is the answer
            body = observation(ar, v.feedback, v.metrics)
            assert expected_answer not in re.findall(r"-?\d+", body)
            assert body.startswith("Not a bare integer." if answer == "syntax error (" else f"Wrong: {answer} is not the answer.")
            assert expected_answer in json.dumps(v.feedback)     # ... which the raw feedback does carry
        if task_id == bf.task_id and answer != "syntax error (":  # each failed case as the call of its function
            shown = [ln[2:] for ln in observation(bf, v.feedback, v.metrics).splitlines()
                     if ln.startswith("- ") and not ln.startswith("- ... ")]
            assert shown and all(s.split("(")[0] in bf.metadata["tested"] and "call(" not in s for s in shown), shown
